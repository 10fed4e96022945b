"""Logprobs as the API returns them: the completions and chat shapes (a -inf or NaN logprob as
vLLM's floor, tokens named by id), streamed chunk by chunk into the whole choice's, and tokens
that are the text each adds, so they join into the text even where a character is split
over tokens. Their values under speculation: test_logprobs."""

import dataclasses
import json

import pytest
import torch

from deployments.logprobs import (
    LEAST_LOGPROB, TokenTexts, chat_logprobs, completion_logprobs, named_by_id)
from deployments.reasoning import ReasoningSplit
from drafter.model import ModelDrafter
from speculative.sampling import SamplingParams
from speculative.types import PositionLogprobs, TokenLogprob
from tests.tiny import Scripted, byte_fallback_tokenizer, byte_level_tokenizer, noisy_copy
from tests.unit.test_logprobs import PROMPTS, TOP_N, target  # noqa: F401 (a fixture)
from verifier.engine import ModelVerifier


def test_the_two_api_shapes():
    entries = [TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.5))), TokenLogprob(2, -0.25, ())]
    decode = {1: "ab", 2: "c"}.__getitem__

    def text(ids):
        return "".join(decode(i) for i in ids)

    assert completion_logprobs(entries, TokenTexts(text)) == {
        "tokens": ["ab", "c"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"ab": -0.5, "c": -1.5}, {"c": -0.25}], "text_offset": [0, 2]}
    # the chosen token beside the top n, as OpenAI's completions return it (logprobs + 1)
    beside = [TokenLogprob(2, -1.5, ((1, -0.5),))]
    assert completion_logprobs(beside, TokenTexts(text))["top_logprobs"] == \
        [{"ab": -0.5, "c": -1.5}]
    content = chat_logprobs(entries, TokenTexts(text))["content"]
    assert content[0] == {"token": "ab", "logprob": -0.5, "bytes": [97, 98], "top_logprobs": [
        {"token": "ab", "logprob": -0.5, "bytes": [97, 98]},
        {"token": "c", "logprob": -1.5, "bytes": [99]}]}
    assert content[1]["top_logprobs"] == []


def test_a_minus_infinite_logprob_shows_as_vllm_floor_not_as_invalid_json():
    # a masked token's raw logprob is -inf: JSON has no such number (the router's responses
    # refuse NaN and inf), so an answer showed it failed whole; vLLM's floor instead
    entries = [TokenLogprob(1, float("-inf"), ((1, float("-inf")), (2, -1.5)))]
    decode = {1: "ab", 2: "c"}.__getitem__
    texts = lambda: TokenTexts(lambda ids: "".join(decode(i) for i in ids))  # noqa: E731
    completion = completion_logprobs(entries, texts())
    chat = chat_logprobs(entries, texts())["content"][0]
    assert completion["token_logprobs"] == [LEAST_LOGPROB] and \
        completion["top_logprobs"] == [{"ab": LEAST_LOGPROB, "c": -1.5}]
    assert chat["logprob"] == chat["top_logprobs"][0]["logprob"] == LEAST_LOGPROB
    json.dumps([completion, chat], allow_nan=False)


def test_a_nan_logprob_shows_as_the_floor_too_not_as_invalid_json():
    """A greedy row whose logits hold +inf or NaN is served (its argmax) with NaN logprobs:
    max(NaN, floor) is NaN, so a whole answer failed to encode (a 500) and a stream's chunk
    carried NaN, which no strict JSON reader takes."""
    from verifier.engine import greedy_scores, position_logprobs

    logits = torch.zeros(2, 5)
    logits[0, 3], logits[1, 2] = float("inf"), float("nan")
    chosen = list(greedy_scores([logits])[0].target_token_ids)  # [3, 2], as the target's
    entries = position_logprobs(logits, [3], chosen, 2).committed(chosen, 1)
    texts = lambda: TokenTexts(lambda ids: "".join("abcde"[i] for i in ids))  # noqa: E731
    completion, chat = completion_logprobs(entries, texts()), chat_logprobs(entries, texts())
    assert completion["token_logprobs"] == [LEAST_LOGPROB] * 2
    assert {top["logprob"] for c in chat["content"] for top in c["top_logprobs"]} == \
        {LEAST_LOGPROB}
    json.dumps([completion, chat], allow_nan=False)


def test_return_tokens_as_token_ids_names_each_token_by_its_id():
    """vLLM's return_tokens_as_token_ids: "token_id:<id>" for the chosen tokens and the top
    ones, in both shapes (two ids of one text keep their own keys); a completion's offsets
    still point into its text, and chat's bytes are still the tokens' own."""
    entries = [TokenLogprob(1, -0.5, ((1, -0.5), (3, -1.5))), TokenLogprob(2, -0.25, ())]
    decode = {1: "ab", 2: "c", 3: "ab"}.__getitem__
    texts = lambda: TokenTexts(lambda ids: "".join(decode(i) for i in ids))  # noqa: E731
    completion = named_by_id(completion_logprobs(entries, texts(), 4), entries, chat=False)
    assert completion == {
        "tokens": ["token_id:1", "token_id:2"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"token_id:1": -0.5, "token_id:3": -1.5}, {"token_id:2": -0.25}],
        "text_offset": [4, 6]}
    content = named_by_id(chat_logprobs(entries, texts()), entries, chat=True)["content"]
    assert content[0] == {"token": "token_id:1", "logprob": -0.5, "bytes": [97, 98],
                          "top_logprobs": [
                              {"token": "token_id:1", "logprob": -0.5, "bytes": [97, 98]},
                              {"token": "token_id:3", "logprob": -1.5, "bytes": [97, 98]}]}
    assert content[1]["token"] == "token_id:2" and content[1]["top_logprobs"] == []


@pytest.mark.parametrize("chat", [True, False])
def test_a_stream_names_tokens_by_id_as_the_whole_choice_does(target, chat):
    """Streamed with return_tokens_as_token_ids, the chunks' logprobs join into the whole
    choice's, whose offsets are those of the texts (not of the names)."""
    import asyncio
    import json

    def by_id(choices):
        choices.tokens_as_ids = True
        return choices

    named = asyncio.run(by_id(choices_of(target, chat)).complete())["choices"][0]["logprobs"]
    texts = asyncio.run(choices_of(target, chat).complete())["choices"][0]["logprobs"]

    async def collect():
        return [e async for e in by_id(choices_of(target, chat)).events()]

    chunks = [json.loads(e[len("data: "):])["choices"][0] for e in asyncio.run(collect())[:-1]]
    carried = [c["logprobs"] for c in chunks if c.get("logprobs")]
    key = "content" if chat else "tokens"
    assert [e for c in carried for e in c[key]] == named[key]
    tokens = [e["token"] for e in named["content"]] if chat else named["tokens"]
    assert len(tokens) == 24 and all(t.startswith("token_id:") for t in tokens)
    if not chat:
        assert [e for c in carried for e in c["text_offset"]] == named["text_offset"] == \
            texts["text_offset"]


def choices_of(target, chat: bool, stop: tuple[str, ...] = ()):
    """A request of the tiny target through the router's fan-out (deployments.choices): one
    choice, logprobs with the top 3, each token decoding to a letter."""
    from deployments.admission import Admission
    from deployments.choices import Choices
    from speculative.frontend import RequestFrontEnd

    params = SamplingParams(temperature=1.0, max_tokens=24, seed=9, logprobs=TOP_N, stop=stop)
    plan = RequestFrontEnd().plan("r", tuple(PROMPTS[1]), params, n=1)
    pools = (ModelDrafter(noisy_copy(target, 0.01, seed=1)), ModelVerifier(target))
    decode = lambda ids: "".join(chr(97 + t % 26) for t in ids)  # noqa: E731
    return Choices(plan, pools, decode, type("M", (), {"record_choice": lambda s, *choice: None})(),
                   Admission(4).admit(1), model="m", chat=chat, return_token_ids=False)


@pytest.mark.parametrize("chat", [True, False])
def test_a_stream_carries_each_chunks_logprobs_and_together_the_whole_choices(target, chat):
    """As OpenAI and vLLM stream them: each chunk the logprobs of the tokens committed since
    the last one (a completion's text offsets running on), together the non-streamed
    choice's, with a stop string cutting the output mid-block."""
    import asyncio
    import json

    whole = asyncio.run(choices_of(target, chat, stop=("q",)).complete())["choices"][0]
    assert whole["finish_reason"] == "stop"

    async def collect():
        return [e async for e in choices_of(target, chat, stop=("q",)).events()]

    chunks = [json.loads(e[len("data: "):])["choices"][0] for e in asyncio.run(collect())[:-1]]
    carried = [c["logprobs"] for c in chunks if c.get("logprobs")]
    assert len(carried) > 1  # not all on the last chunk
    if chat:
        assert [e for c in carried for e in c["content"]] == whole["logprobs"]["content"]
    else:
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [e for c in carried for e in c[field]] == whole["logprobs"][field]


def test_chat_bytes_are_each_tokens_own_so_a_characters_tokens_join_into_it():
    """As OpenAI's `bytes`: a character split over byte tokens decodes to U+FFFD token by
    token, but the tokens' bytes, joined, are the character's (the router reads them from
    llguidance's view of the tokenizer); special tokens have none, as their text."""
    from deployments.logprobs import token_bytes_of
    from specserve.demo import train_tokenizer
    from speculative.driver import text_decoder
    from speculative.grammar import grammar_tokenizer_or_none

    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 20, vocab_size=300)
    token_bytes = token_bytes_of(grammar_tokenizer_or_none(tokenizer, 300))
    ids = tokenizer("x 🐍 日本", add_special_tokens=False)["input_ids"]
    assert len(ids) > 6  # the rare characters are split into byte tokens
    eos = tokenizer.eos_token_id
    entries = [TokenLogprob(i, -0.1, ((i, -0.1), (eos, -3.0))) for i in [*ids, eos]]
    content = chat_logprobs(entries, TokenTexts(text_decoder(tokenizer)), token_bytes)["content"]
    assert bytes(b for c in content for b in c["bytes"]) == "x 🐍 日本".encode()
    assert content[-1]["bytes"] == [] and content[0]["top_logprobs"][1]["bytes"] == []
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)
    assert token_bytes_of(None) is None  # a tokenizer llguidance cannot read: its text's


@pytest.mark.parametrize("chat", [True, False])
def test_a_streams_tokens_without_text_bring_their_logprobs_on_its_last_chunk(target, chat):
    """Tokens that decode to no text (special tokens, a character's first bytes) make no
    delta chunk: their logprobs come with the last chunk, so the stream still carries the
    whole choice's."""
    import asyncio
    import json

    def silent(choices):
        choices.decode = lambda ids: ""
        return choices

    whole = asyncio.run(silent(choices_of(target, chat)).complete())["choices"][0]

    async def collect():
        return [e async for e in silent(choices_of(target, chat)).events()]

    chunks = [json.loads(e[len("data: "):])["choices"][0] for e in asyncio.run(collect())[:-1]]
    carried = [c["logprobs"] for c in chunks if c.get("logprobs")]
    key = "content" if chat else "token_logprobs"
    assert len(whole["logprobs"][key]) == 24
    assert [e for c in carried for e in c[key]] == whole["logprobs"][key]


class LoggedScript(Scripted):
    """Scripted, with each position's logprobs: its token's -0.5 and, beside it in its top,
    `other` at -2.0."""

    def __init__(self, output: list[int], other: int, prompt_len: int) -> None:
        super().__init__(output, miss=3, prompt_len=prompt_len)
        self.other = other

    async def score(self, call):
        scores = await super().score(call)
        ids = scores.target_token_ids
        return dataclasses.replace(scores, logprobs=PositionLogprobs(
            (-0.5,) * len(call.draft_token_ids), (-0.5,) * len(ids),
            tuple(((token, -0.5), (self.other, -2.0)) for token in ids)))


def split_characters_choices(kind: str, chat: bool):
    """A choice whose output splits characters over tokens, through the router's fan-out,
    and its text decoded as a whole: a byte-level BPE's (a token of 日's first two bytes,
    one of its last and the next's first) or a SentencePiece byte fallback's (an emoji as 4
    byte tokens, words that begin with "▁")."""
    from deployments.admission import Admission
    from deployments.choices import Choices
    from speculative.driver import text_decoder
    from speculative.frontend import RequestFrontEnd

    if kind == "byte-level":
        tokenizer = byte_level_tokenizer([b"\xe6\x97", b"\xa5\xe6", b" hello", b" ok"])
        prompt, output = [1 + ord("x")], [259, 257, 258, 1 + 0x97, 1 + 0xA5, 260]
    else:
        tokenizer = byte_fallback_tokenizer(["▁Say", "▁hello", "▁ok"])
        prompt, output = [259], [260, *(3 + b for b in "🐍".encode()), 261]
    params = SamplingParams(temperature=0, max_tokens=len(output), logprobs=1)
    plan = RequestFrontEnd().plan("r", tuple(prompt), params, n=1, num_speculative_tokens=3)
    engine = LoggedScript(output, output[-1], len(prompt))
    decode = text_decoder(tokenizer)
    choices = Choices(plan, (engine, engine), decode,
                      type("M", (), {"record_choice": lambda s, *choice: None})(),
                      Admission(4).admit(1), model="m", chat=chat, return_token_ids=False)
    whole = decode(prompt + output)[len(decode(prompt)):]
    return choices, whole


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_logprob_tokens_are_the_text_each_adds_so_they_join_into_the_text(kind, chat):
    """A token decoded alone is not the text it adds: SentencePiece drops its leading space
    and each token of a character split over several decodes to U+FFFD. A completion's
    tokens did not join into its text and its text_offset, counted from them, drifted off it
    (a character per word and per byte token); a chat token had no space where its bytes
    did. Now the tokens are the text's pieces, whole or streamed, with chat bytes alike."""
    import asyncio
    import json

    choices, whole = split_characters_choices(kind, chat)
    body = asyncio.run(choices.complete())["choices"][0]
    logprobs = body["logprobs"]
    if chat:
        content = logprobs["content"]
        assert body["message"]["content"] == whole
        assert "".join(entry["token"] for entry in content) == whole
        assert bytes(b for entry in content for b in entry["bytes"]) == whole.encode()
        assert [entry["top_logprobs"][0]["token"] for entry in content] == \
            [entry["token"] for entry in content]
    else:
        tokens = logprobs["tokens"]
        assert body["text"] == "".join(tokens) == whole
        assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
        assert [top[token] for top, token in zip(logprobs["top_logprobs"], tokens)] == \
            logprobs["token_logprobs"]

    async def collect():
        return [e async for e in split_characters_choices(kind, chat)[0].events()]

    chunks = [json.loads(e[len("data: "):])["choices"][0] for e in asyncio.run(collect())[:-1]]
    streamed = [(c["delta"].get("content") if chat else c["text"]) or "" for c in chunks]
    assert "".join(streamed) == whole
    key = "content" if chat else "tokens"
    assert [e for c in chunks if c.get("logprobs") for e in c["logprobs"][key]] == \
        logprobs[key]
    if not chat:
        assert [o for c in chunks if c.get("logprobs") for o in c["logprobs"]["text_offset"]] \
            == logprobs["text_offset"]


@pytest.mark.parametrize("chat, reasoning", [(True, None), (False, None),
                                             (True, "deepseek_r1")])
def test_logprob_tokens_join_into_a_text_that_ends_inside_a_character(chat, reasoning):
    """An output cut by max_tokens inside a character (日's first two bytes) ends its text
    with the U+FFFD the detokenizer flushes at the end; the logprobs' tokens, read by a
    detokenizer of their own that was never flushed, ended without it, so they no longer
    joined into the text, whole or streamed (nor did the last text_offset plus its token's
    length reach the text's end). A reasoning parser sends the last delta with its own
    logprobs before the end's chunk, whose logprobs are then null."""
    import asyncio
    import json

    from deployments.admission import Admission
    from deployments.choices import Choices
    from speculative.driver import text_decoder
    from speculative.frontend import RequestFrontEnd

    tokenizer = byte_level_tokenizer([b"\xe6\x97", b" hello"])
    prompt, output = [1 + ord("x")], [258, 257]
    decode = text_decoder(tokenizer)
    text = decode(prompt + output)[len(decode(prompt)):]
    assert text == " hello\ufffd"

    def choices():
        plan = RequestFrontEnd().plan("r", tuple(prompt), SamplingParams(
            temperature=0, max_tokens=len(output), logprobs=1), n=1, num_speculative_tokens=1)
        engine = LoggedScript(output, output[0], len(prompt))
        return Choices(plan, (engine, engine), decode,
                       type("M", (), {"record_choice": lambda s, *choice: None})(),
                       Admission(4).admit(1), model="m", chat=chat, return_token_ids=False,
                       reasoning=reasoning and ReasoningSplit(reasoning))

    key = "content" if chat else "tokens"

    def tokens(logprobs) -> list[str]:
        return [entry["token"] for entry in logprobs[key]] if chat else logprobs[key]

    body = asyncio.run(choices().complete())["choices"][0]
    said = body["message"]["reasoning" if reasoning else "content"] if chat else body["text"]
    assert said == text
    assert "".join(tokens(body["logprobs"])) == text

    async def collect():
        return [e async for e in choices().events()]

    chunks = [json.loads(e[len("data: "):])["choices"][0] for e in asyncio.run(collect())[:-1]]
    streamed = [t for c in chunks if c.get("logprobs") for t in tokens(c["logprobs"])]
    assert "".join(streamed) == text
    if reasoning:
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["logprobs"] is None
