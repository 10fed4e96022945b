"""Edges of the logprobs an answer shows: chat's `bytes` are each token's own where the
router knows them (a character split over tokens: each its part, not its text's bytes); a
reasoning split's stream, whose tokens still join into a text ending inside a character;
vLLM's prompt_logprobs and the echo's logprobs, each with its own top n from one verifier
call; and an echo of no output (max_tokens 0), the prompt alone."""

import asyncio
import json

from deployments.admission import Admission
from deployments.choices import Choices
from deployments.logprobs import TokenTexts, chat_logprobs
from deployments.reasoning import ReasoningSplit
from speculative.driver import text_decoder
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from speculative.types import TokenLogprob
from tests.tiny import byte_level_tokenizer
from tests.unit.test_logprobs_api import LoggedScript
from tests.unit.test_prompt_answers import Scored, served

RAW = {1: b"\xe6\x97", 2: b"\xa5", 3: b"x"}  # 日 (e6 97 a5) over two tokens, then "x"


def raw_decode(ids) -> str:
    return b"".join(RAW[i] for i in ids).decode("utf-8", errors="replace")


def test_chat_bytes_of_a_split_character_are_each_tokens_own_part():
    """The first token adds no text yet its bytes are the character's first two; the
    second carries the character, its bytes the last one alone; a top token's too."""
    entries = [TokenLogprob(1, -0.1, ((1, -0.1), (3, -2.0))), TokenLogprob(2, -0.2, ())]
    content = chat_logprobs(entries, TokenTexts(raw_decode), RAW.get)["content"]
    assert [(c["token"], c["bytes"]) for c in content] == [("", [0xE6, 0x97]),
                                                           ("日", [0xA5])]
    assert content[0]["top_logprobs"][0]["bytes"] == [0xE6, 0x97]
    assert content[0]["top_logprobs"][1] == {"token": "x", "logprob": -2.0, "bytes": [120]}
    # without the tokens' own bytes, each token's text's
    plain = chat_logprobs(entries, TokenTexts(raw_decode))["content"]
    assert [c["bytes"] for c in plain] == [[], list("日".encode())]


def test_prompt_logprobs_keep_their_own_top_n_beside_an_echo_asking_more():
    """One verifier call serves both (asked for the larger n): prompt_logprobs 1 shows its
    position's top 1 and the prompt's token, the echo's logprobs 3 its top 3."""
    verifier = Scored()
    status, body = served(verifier)({"prompt": "hi", "max_tokens": 2, "echo": True,
                                     "logprobs": 3, "prompt_logprobs": 1})
    assert status == 200
    assert verifier.asked == [("cmpl-x-0-prompt-0", [2, 3], 3)]
    [choice] = body["choices"]
    assert choice["prompt_logprobs"] == [None, {
        "9": {"logprob": -0.1, "rank": 1, "decoded_token": "s"},
        "3": {"logprob": -1.0, "rank": 2, "decoded_token": "s"}}]
    assert len(choice["logprobs"]["top_logprobs"][1]) == 1  # every prompt token's text "a"


def test_a_split_streams_logprob_tokens_join_into_a_text_ending_inside_a_character():
    """A reasoning parser sends the last delta with its own logprobs, before the end's chunk
    (which then has none): those tokens take the detokenizer's held U+FFFD there, as the
    text does, so the streamed tokens still join into the output."""
    tokenizer = byte_level_tokenizer([b"\xe6\x97", b" hello"])
    prompt, output = [1 + ord("x")], [258, 257]
    decode = text_decoder(tokenizer)
    assert decode(prompt + output)[len(decode(prompt)):] == " hello\ufffd"

    def choices():
        plan = RequestFrontEnd().plan("r", tuple(prompt), SamplingParams(
            temperature=0, max_tokens=len(output), logprobs=1), n=1, num_speculative_tokens=1)
        engine = LoggedScript(output, output[0], len(prompt))
        return Choices(plan, (engine, engine), decode,
                       type("M", (), {"record_choice": lambda s, *choice: None})(),
                       Admission(4).admit(1), model="m", chat=True, return_token_ids=False,
                       reasoning=ReasoningSplit("deepseek_r1"))

    whole = asyncio.run(choices().complete())["choices"][0]
    assert whole["message"]["reasoning"] == " hello\ufffd"
    assert "".join(e["token"] for e in whole["logprobs"]["content"]) == " hello\ufffd"

    async def collect():
        return [e async for e in choices().events()]

    chunks = [json.loads(e[len("data: "):])["choices"][0] for e in asyncio.run(collect())[:-1]]
    streamed = [e["token"] for c in chunks if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert "".join(streamed) == " hello\ufffd"
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["logprobs"] is None  # no token left for the end's chunk: null


def test_an_echos_logprobs_keep_their_own_top_n_beside_prompt_logprobs_asking_more():
    verifier = Scored()
    _, body = served(verifier)({"prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 1,
                                "prompt_logprobs": 3, "return_tokens_as_token_ids": True})
    [choice] = body["choices"]
    assert choice["logprobs"]["top_logprobs"][:2] == [None, {"token_id:9": -0.1,
                                                             "token_id:3": -1.0}]
    assert len(choice["prompt_logprobs"][1]) == 4  # its top 3 and the prompt's token


def test_an_echo_with_no_output_is_the_prompt_and_its_logprobs():
    """lm-evaluation-harness's loglikelihood: echo, logprobs and max_tokens 0, the answer
    the prompt's text and its tokens' logprobs alone."""
    status, body = served(Scored())({"prompt": "hi", "max_tokens": 0, "echo": True,
                                     "logprobs": 1})
    assert status == 200
    [choice] = body["choices"]
    assert choice["text"] == "hi"
    assert choice["logprobs"]["tokens"] == ["a", "a"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0]
