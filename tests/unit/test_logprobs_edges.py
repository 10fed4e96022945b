"""Edges of the logprobs an answer shows: chat's `bytes` are each token's own where the
router knows them (a character split over tokens: each its part, not its text's bytes);
vLLM's prompt_logprobs and the echo's logprobs, each with its own top n from one verifier
call; and an echo of no output (max_tokens 0), the prompt alone."""

from deployments.logprobs import TokenTexts, chat_logprobs
from speculative.types import TokenLogprob
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
    assert len(choice["logprobs"]["top_logprobs"][1]) == 1  # every prompt token's text "s"


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
    assert choice["logprobs"]["tokens"] == ["s", "s"]  # a text's, special tokens kept
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0]
