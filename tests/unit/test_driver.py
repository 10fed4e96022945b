"""The request driver: stop ids, stop strings, incremental text, exact output ids. The text
read from ids by real tokenizers (characters split over tokens): test_detokenizer.py."""

import asyncio
from dataclasses import replace
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculative import driver
from speculative.driver import Generation, GrowingText
from speculative.fixed_k import FixedK
from speculative.state import Request
from speculative.sampling import SamplingParams
from tests.tiny import Agreeing, Scripted, traced_peak

ALPHABET = "ab\n"
PROMPT = (0,)


def decode(ids):
    return "".join(ALPHABET[i] for i in ids)


def generate(output, stop=(), stop_ids=(), k=3, max_tokens=None, miss=3, reported=None,
             min_tokens=0, decode=decode, prompt=PROMPT, include=False):
    params = SamplingParams(temperature=0, max_tokens=max_tokens or len(output), stop=stop,
                            min_tokens=min_tokens, include_stop_str_in_output=include)
    generation = Generation(Request("r", prompt, params, tuple(stop_ids)), decode, reported)
    engine = Scripted(output, miss, len(prompt))

    async def collect():
        return [d async for d in generation.stream(engine, engine, FixedK(k))]

    return generation, asyncio.run(collect())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=30),
       st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3),
       st.integers(0, 5), st.integers(2, 4))
def test_stop_strings_cut_text_and_ids_where_the_stop_completes(output, stop, k, miss):
    generation, deltas = generate(output, tuple(stop), k=k, miss=miss)
    ids, text = generation.token_ids, generation.text
    assert "".join(deltas) == text  # streamed == non-streamed
    # the first stop string to complete, token by token, ends the request
    end = next((n for n in range(1, len(output) + 1)
                if any(s in decode(output[:n]) for s in stop)), None)
    if end is None:
        assert ids == output and text == decode(output)
        assert generation.finish_reason == "length" and generation.stop_reason is None
        return
    assert ids == output[:end]
    cut = min(i for i in (decode(ids).find(s) for s in stop) if i >= 0)
    assert text == decode(ids)[:cut]
    assert generation.finish_reason == "stop" and generation.stop_reason in stop
    assert decode(ids)[cut:].startswith(generation.stop_reason)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(ALPHABET, max_size=5), st.integers(0, 12)), max_size=12))
def test_a_text_kept_in_pieces_reads_as_one_string(steps):
    """GrowingText with a tail of 2 characters (so most of it is in pieces): appended,
    read from any point and cut anywhere, it is the string grown by +=."""
    with mock.patch.object(driver, "TAIL_CHARS", 2):
        grown, text = GrowingText(), ""
        for delta, at in steps:
            grown.append(delta)
            text += delta
            assert (len(grown), grown.since(at), str(grown)) == (len(text), text[at:], text)
            if at % 3 == 0:
                grown.cut(at)
                text = text[:at]
        assert str(grown) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=30),
       st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3),
       st.integers(0, 5), st.integers(2, 8), st.booleans())
def test_a_text_mostly_in_pieces_streams_and_stops_as_one_string(output, stop, k, miss,
                                                                 include):
    """The driver over a GrowingText whose tail is 2 characters (a round's text reaches
    into its pieces): the same text, deltas, ids and stop as over one string."""
    whole = generate(output, tuple(stop), k=k, miss=miss, include=include)
    with mock.patch.object(driver, "TAIL_CHARS", 2):
        pieces = generate(output, tuple(stop), k=k, miss=miss, include=include)
    assert [(g.text, deltas, g.token_ids, g.stop_reason) for g, deltas in (whole, pieces)] \
        == [(whole[0].text, whole[1], whole[0].token_ids, whole[0].stop_reason)] * 2


def test_each_token_costs_the_output_text_its_own_length():
    """The text grown by += was copied whole at each token: quadratic (1.3 s of the event
    loop over a 128k-token output). Counted in bytes allocated, a token after 200k characters
    of text, with the longest stop strings searched, copies none of them."""
    def long_decode(ids):
        return "".join("words in a line, fifty characters of text each ok." for _ in ids)

    params = SamplingParams(temperature=0, max_tokens=10_000, stop=("z" * 256, "#"))
    generation = Generation(Request("r", PROMPT, params), long_decode)

    def one_token():
        generation._take(generation.state.commit((1,)))
        return generation._ready()

    text = "".join(one_token() for _ in range(4_000))
    last, peak = traced_peak(one_token)
    assert len(text) > 80_000 and peak < 20_000
    assert text + last == generation.text == long_decode([1] * 4_001)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=20),
       st.lists(st.text(ALPHABET, min_size=1, max_size=3), min_size=1, max_size=3),
       st.integers(0, 6), st.integers(0, 4))
def test_a_stop_string_counts_from_min_tokens_on(output, stop, min_tokens, k):
    """As vLLM (V1's detokenizer): no stop string is looked for until the output holds more
    than min_tokens tokens (min_tokens of them come before the one that stops it, as before a
    stop token), and then each is looked for where it ends in a token's new text, so one
    seen earlier does not stop the output later (a token here is one character)."""
    min_tokens = min(min_tokens, len(output))
    generation, deltas = generate(output, tuple(stop), k=k, min_tokens=min_tokens)
    end = next((n for n in range(min_tokens + 1, len(output) + 1)
                if any(decode(output[:n]).endswith(s) for s in stop)), None)
    assert generation.token_ids == output[:end or len(output)]
    assert "".join(deltas) == generation.text
    if end is not None:
        assert generation.text == decode(output[:end])[:end - len(generation.stop_reason)]


def test_a_stop_token_ends_the_output_and_stays_in_its_ids_not_its_text():
    output = [0, 1, 2, 1, 0, 0, 2, 2]
    generation, deltas = generate(output, stop_ids=(2,), k=4)
    assert generation.token_ids == [0, 1, 2]
    assert (generation.finish_reason, generation.stop_reason) == ("stop", 2)
    assert generation.text == "".join(deltas) == "ab"  # as vLLM: not the stop token's "\n"


def test_an_end_token_the_request_did_not_ask_for_is_no_stop_reason():
    """As vLLM: stop_reason names a stop string or one of the request's own stop ids; the
    model's end tokens (stop ids not reported) end the output with none."""
    output = [0, 1, 2, 1, 0, 0, 2, 2]
    assert generate(output, stop_ids=(2,), k=4, reported=())[0].stop_reason is None
    assert generate(output, stop_ids=(2,), k=4, reported=(2,))[0].stop_reason == 2


def test_the_earlier_of_a_stop_string_and_a_stop_token_wins():
    output = [0, 1, 0, 2, 1]  # "aba\nb": the stop string "ba" completes before token 2
    generation, _ = generate(output, stop=("ba",), stop_ids=(2,), k=4)
    assert generation.token_ids == [0, 1, 0] and generation.stop_reason == "ba"
    assert generation.text == "a"


@pytest.mark.parametrize("include", [False, True])
def test_of_two_stop_strings_completed_by_one_token_the_earlier_starting_one_wins(include):
    """"ab" and "b" both end at the token "b": the text is cut where "ab" starts (the
    earliest cut, vLLM's too with "ab" listed first); the one starting later would keep "a"
    (the random stops of the tests above seldom draw such a pair)."""
    generation, deltas = generate([0, 1, 0], stop=("ab", "b"), k=2, include=include)
    assert generation.token_ids == [0, 1] and generation.stop_reason == "ab"
    assert generation.text == "".join(deltas) == ("ab" if include else "")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=30),
       st.lists(st.text(ALPHABET, min_size=1, max_size=3), min_size=1, max_size=3),
       st.integers(0, 5))
def test_an_included_stop_string_ends_the_text(output, stop, k):
    """vLLM's include_stop_str_in_output: the same tokens, the text cut after the stop string
    instead of before it, streamed as it comes (nothing held back: nothing will be cut)."""
    cut, _ = generate(output, tuple(stop), k=k)
    kept, deltas = generate(output, tuple(stop), k=k, include=True)
    assert kept.token_ids == cut.token_ids and "".join(deltas) == kept.text
    assert kept.text == cut.text + (kept.stop_reason or "")
    assert kept.stop_reason == cut.stop_reason


def test_an_included_stop_string_holds_nothing_back():
    """A tail that may grow into the stop string goes out at once (it is not cut): a token a
    round, a delta a round ("b" of "bb" held, without it)."""
    held = generate([0, 1, 0, 1, 1, 0], stop=("bb",), k=0)[1]
    sent = generate([0, 1, 0, 1, 1, 0], stop=("bb",), k=0, include=True)[1]
    assert (held, sent) == (["a", "ba"], ["a", "b", "a", "b", "b"])


def test_an_included_stop_token_keeps_its_text():
    generation, deltas = generate([0, 1, 2, 1, 0], stop_ids=(2,), k=4, include=True)
    assert generation.token_ids == [0, 1, 2] and generation.stop_reason == 2
    assert generation.text == "".join(deltas) == "ab\n"


def test_an_end_token_the_reasoning_ignores_keeps_its_text_and_is_no_stop_reason():
    """Under ignore_eos with a grammar after the reasoning (Request.free_in_reasoning), an
    end token inside the reasoning ends nothing: its text stays in the output's and it is
    not the stop_reason of an output that goes on (one round a token: it ends its round);
    after the end ids ("bb") it is the stop it always was."""
    output = [0, 2, 0, 1, 1, 0, 2, 0]  # "a\nabba\na": the end ids at 3-4
    params = SamplingParams(temperature=0, max_tokens=len(output), grammar="start: /a/",
                            grammar_after=(1, 1))
    request = Request("r", PROMPT, params, (2,), free_in_reasoning=(2,))
    for max_tokens in (7, 4):
        generation = Generation(replace(request, sampling=replace(
            params, max_tokens=max_tokens)), decode)
        engine = Scripted(output, 3, len(PROMPT))
        asyncio.run(generation.run(engine, engine, FixedK(0)))
        if max_tokens == 7:
            assert generation.token_ids == output[:7] and generation.text == "a\nabba"
            assert (generation.finish_reason, generation.stop_reason) == ("stop", 2)
        else:
            assert generation.text == "a\nab" and generation.finish_reason == "length"
            assert generation.stop_reason is None


def test_max_tokens_is_length():
    generation, _ = generate([0, 1, 0, 1, 0, 1], max_tokens=4, k=5)
    assert generation.token_ids == [0, 1, 0, 1] and generation.finish_reason == "length"


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_routers_own_work_after_the_verify_is_its_phase_not_transport(
        monkeypatch, pipelined):
    """spec_decode_round_seconds{phase}: rejection sampling and the commit are the router's;
    only the wait for a pre-draft after the verify is the drafter's. A clock that moves only
    while accept runs (10 ms a round) must book it all as phase router."""
    import speculative.loop as loop
    import speculative.meter as meter

    now = [0.0]
    monkeypatch.setattr(meter.time, "perf_counter", lambda: now[0])
    real_accept = loop.accept

    def accept(*args, **kwargs):
        now[0] += 0.010
        return real_accept(*args, **kwargs)

    monkeypatch.setattr(loop, "accept", accept)
    request = Request("r", (2, 3), SamplingParams(temperature=0.0, max_tokens=40))
    generation = Generation(request)
    asyncio.run(generation.run(Agreeing(), Agreeing(), FixedK(3), pipelined))
    phases = generation.stats.ms_per_round()
    assert phases["router"] == phases["total"] == 10.0
    assert phases["transport"] == phases["draft"] == phases["verify"] == 0.0


class DraftPositions(Scripted):
    """Scripted, recording where each draft call's tokens end in the output (its last
    drafted position + 1, a pre-draft's assumed tokens counted)."""

    def __init__(self, output, miss, prompt_len) -> None:
        super().__init__(output, miss, prompt_len)
        self.ends: list[int] = []

    async def propose(self, call):
        start = call.sync.committed_len - self.prompt_len + len(call.assumed_token_ids)
        self.ends.append(start + call.num_speculative_tokens)
        return await super().propose(call)


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_no_draft_reaches_the_last_token_max_tokens_allows(k, pipelined):
    """A round commits its accepted drafts and one token of the target's: a draft call asks
    for no token at or past the output's last position (max_tokens - 1), which the target
    makes, sequential or drafted beside a verify."""
    output = [0, 1, 0, 1, 2, 0, 1, 1, 0, 2, 1, 0]
    for max_tokens in range(1, len(output) + 1):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        generation = Generation(Request("r", PROMPT, params), decode)
        engine = DraftPositions(output, 5, len(PROMPT))
        asyncio.run(generation.run(engine, engine, FixedK(k), pipelined))
        assert generation.token_ids == output[:max_tokens]
        assert all(end <= max_tokens - 1 for end in engine.ends), (max_tokens, engine.ends)
