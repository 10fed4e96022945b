"""Logprobs under speculation: each output token's log-probability and its position's top n
are the target's own (raw: before temperature and penalties), whichever K, drafter or
pipelining produced the token, and equal K = 0's."""

import dataclasses
import json

import pytest
import torch

from deployments.logprobs import (
    LEAST_LOGPROB, TokenTexts, chat_logprobs, completion_logprobs, named_by_id)
from deployments.wire import scores_from_proto, scores_to_proto
from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from speculative.sampling import SamplingParams
from speculative.types import (
    EMPTY_PREFIX_HASH,
    PositionLogprobs,
    PrefixSync,
    ScoreCall,
    TargetScores,
    TokenLogprob,
)
from tests.tiny import (
    Scripted,
    byte_fallback_tokenizer,
    byte_level_tokenizer,
    noisy_copy,
    run,
    tiny_llama,
)
from verifier.engine import ModelVerifier

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [3, 9, 3], [11]]
TOP_N = 3


@pytest.fixture(scope="module")
def target():
    return tiny_llama(7)


@torch.no_grad()
def reference(model, prompt: list[int], output: list[int]) -> list[TokenLogprob]:
    """Each output token's raw logprob and top n, from one forward over the whole sequence."""
    logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    logprobs = torch.log_softmax(logits.float(), -1)
    values, ids = torch.topk(logprobs, TOP_N, dim=-1)
    return [TokenLogprob(token, float(logprobs[i, token]),
                         tuple(zip(ids[i].tolist(), values[i].tolist())))
            for i, token in enumerate(output)]


def assert_close(got: list[TokenLogprob], expected: list[TokenLogprob], tolerance=1e-4):
    assert [g.token_id for g in got] == [e.token_id for e in expected]
    for g, e in zip(got, expected):
        assert abs(g.logprob - e.logprob) < tolerance, (g, e)
        assert [t for t, _ in g.top] == [t for t, _ in e.top]
        assert all(abs(a - b) < tolerance for (_, a), (_, b) in zip(g.top, e.top))


DRAFTERS = {
    "noisy": lambda target: ModelDrafter(noisy_copy(target, 0.01, seed=1)),
    "far": lambda target: ModelDrafter(noisy_copy(target, 0.3, seed=2)),
    "ngram": lambda target: NgramDrafter(64),
}
CASES = [("noisy", 3, False), ("noisy", "auto", False), ("noisy", 2, True),
         ("far", 4, False), ("ngram", 3, False)]
MODES = {"greedy": SamplingParams(temperature=0, max_tokens=20, logprobs=TOP_N),
         "sampled": SamplingParams(temperature=1.0, max_tokens=20, seed=5, logprobs=TOP_N),
         "penalised": SamplingParams(temperature=0.8, max_tokens=20, seed=6, logprobs=TOP_N,
                                     presence_penalty=1.0, repetition_penalty=1.3)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind, k, pipelined", CASES,
                         ids=[f"{kind}-K{k}-{'pipelined' if p else 'sequential'}"
                              for kind, k, p in CASES])
def test_each_token_carries_the_targets_own_logprobs(target, mode, kind, k, pipelined):
    """Accepted drafted tokens, recovered and bonus tokens all get the target's raw logprob
    at their position (a mutant reading the target's own token's logprob at an accepted
    drafted position fails this in sampled mode, where the two differ)."""
    params = MODES[mode]
    drafter, verifier = DRAFTERS[kind](target), ModelVerifier(target)
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        out, state = run(drafter, verifier, prompt, params, k, request_id=f"r{i}",
                         pipelined=pipelined)
        assert_close(state.logprobs, reference(target, prompt, out))
        accepted += state.stats.num_accepted_tokens
        if mode == "greedy":  # the same tokens and logprobs as the target alone
            alone, alone_state = run(drafter, verifier, prompt, params, 0, request_id=f"a{i}")
            assert alone == out
            assert_close(state.logprobs, alone_state.logprobs, 1e-3)
    # drafted tokens were committed, so their logprobs were checked (sampled tokens seldom
    # repeat an n-gram: there the n-gram drafter's case checks the target's own tokens)
    assert accepted > 0 or kind == "ngram" and mode != "greedy"


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_draft_trees_tokens_carry_the_targets_own_logprobs(target, mode):
    """Tree rounds (width 3, 8 nodes, K = 4): the logprobs are taken along the accepted path,
    each drafted node's at its parent's row, also where the path leaves the main chain."""
    drafter, verifier = ModelDrafter(noisy_copy(target, 0.3, seed=2)), ModelVerifier(target)
    siblings = 0
    for i, prompt in enumerate(PROMPTS):
        out, state = run(drafter, verifier, prompt, MODES[mode], 4, request_id=f"t{i}",
                         tree_width=3, tree_nodes=8)
        assert_close(state.logprobs, reference(target, prompt, out))
        siblings += state.stats.sibling_rounds
    assert siblings > 0  # a path off the main chain was taken, and its logprobs checked


def test_logprobs_travel_the_wire_and_zero_top_is_the_token_only():
    logprobs = PositionLogprobs((-0.5,), (-0.1, -2.0), (((3, -0.1), (4, -0.2)),
                                                         ((1, -0.3), (3, -0.9))))
    scores = TargetScores(target_token_ids=(3, 1), logprobs=logprobs)
    back = scores_from_proto(scores_to_proto(scores)).logprobs
    assert back.drafted == pytest.approx(logprobs.drafted)
    assert back.chosen == pytest.approx(logprobs.chosen)
    assert [[t for t, _ in row] for row in back.top] == [[3, 4], [1, 3]]
    bare = PositionLogprobs((), (-0.25,), ((),))
    assert scores_from_proto(scores_to_proto(TargetScores((7,), logprobs=bare))).logprobs == bare


def test_more_logprobs_than_the_vocabulary_refuse_their_call_not_its_batch():
    verifier = ModelVerifier(tiny_llama(3, vocab_size=16))
    sync = PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3))
    good, bad = (ScoreCall(name, sync, (), SamplingParams(temperature=0, logprobs=n))
                 for name, n in (("good", 16), ("bad", 17)))
    scores, refusal = verifier.score_batch([good, bad])
    assert len(scores.logprobs.top[0]) == 16 and "vocabulary of 16" in str(refusal)
    assert isinstance(refusal, ValueError) and "good" in verifier.sessions


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


def test_stop_tokens_cut_the_logprobs_with_the_tokens(target):
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=0)
    drafter, verifier = DRAFTERS["noisy"](target), ModelVerifier(target)
    full, _ = run(drafter, verifier, PROMPTS[1], params, 3, request_id="full")
    stop = full[5]
    out, state = run(drafter, verifier, PROMPTS[1], params, 3, request_id="cut", stop=(stop,))
    assert out[-1] == stop and len(state.logprobs) == len(out) < len(full)
    assert all(entry.top == () for entry in state.logprobs)


def test_a_cut_round_keeps_the_logprobs_of_the_tokens_it_keeps():
    """A round's output cut by a stop token mid-block or by max_tokens, or later by a stop
    string (stop_after), keeps one logprob per output token, each the token's own (the
    test above leaves where its stop token falls in a round to the run)."""
    from speculative.state import Request, RequestState

    params = SamplingParams(temperature=0, max_tokens=3, logprobs=0)
    block = (4, 7, 5, 6)
    entries = [TokenLogprob(token, -0.5 * (i + 1)) for i, token in enumerate(block)]
    stopped = RequestState(Request("r", (1,), params, stop_token_ids=(7,)))
    assert stopped.commit(block, entries) == [4, 7] and stopped.finish_reason == "stop"
    assert stopped.logprobs == entries[:2]
    full = RequestState(Request("r", (1,), params))
    assert full.commit(block, entries) == [4, 7, 5] and full.logprobs == entries[:3]
    full.stop_after(2)  # a stop string completed by the second token
    assert full.output_token_ids == [4, 7] and full.logprobs == entries[:2]


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


@pytest.mark.parametrize("chat", [True, False])
def test_logprob_tokens_join_into_a_text_that_ends_inside_a_character(chat):
    """An output cut by max_tokens inside a character (日's first two bytes) ends its text
    with the U+FFFD the detokenizer flushes at the end; the logprobs' tokens, read by a
    detokenizer of their own that was never flushed, ended without it, so they no longer
    joined into the text, whole or streamed (nor did the last text_offset plus its token's
    length reach the text's end)."""
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
                       Admission(4).admit(1), model="m", chat=chat, return_token_ids=False)

    key = "content" if chat else "tokens"

    def tokens(logprobs) -> list[str]:
        return [entry["token"] for entry in logprobs[key]] if chat else logprobs[key]

    body = asyncio.run(choices().complete())["choices"][0]
    assert (body["message"]["content"] if chat else body["text"]) == text
    assert "".join(tokens(body["logprobs"])) == text

    async def collect():
        return [e async for e in choices().events()]

    chunks = [json.loads(e[len("data: "):])["choices"][0] for e in asyncio.run(collect())[:-1]]
    streamed = [t for c in chunks if c.get("logprobs") for t in tokens(c["logprobs"])]
    assert "".join(streamed) == text
