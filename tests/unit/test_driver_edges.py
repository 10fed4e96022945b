"""Edges of the round driver that its round tests do not reach: a pool call refused as stale
while the verify beside it commits, the busy wait's pauses and the overlap fit's weights and
bounds. The detokenizer's held bytes: test_detokenizer.py."""

import asyncio

import pytest

from speculative.busy import retried_while_busy
from speculative.overlap import Overlap
from speculative.prefixes import EMPTY_PREFIX_HASH, prefix_hash
from speculative.sampling import SamplingParams
from speculative.state import Request, RequestState
from speculative.stats import SpecStats
from speculative.types import PoolBusy, StaleBase


def test_a_call_refused_as_stale_resends_the_prefix_it_was_made_with():
    """A pre-draft runs beside the verify, whose commit lands while it is out: refused as
    stale, it is resent with the prefix committed when it was made, and the pool is believed
    to know that prefix, not the one committed since (the next call sends the rest)."""
    state = RequestState(Request("r", (5, 6, 7), SamplingParams(temperature=0, max_tokens=8)))
    view, syncs = state.drafter_view, []
    view.confirm(2, prefix_hash([5, 6]))

    async def call(sync):
        syncs.append(sync)
        if len(syncs) == 1:
            state.commit((8, 9))  # the verify beside it commits
            raise StaleBase("evicted")
        return "draft"

    assert asyncio.run(state.call_pool(view, call)) == "draft"
    assert [(s.known_len, s.new_token_ids) for s in syncs] == [(2, (7,)), (0, (5, 6, 7))]
    assert (view.known_len, view.known_hash) == (3, prefix_hash([5, 6, 7]))
    assert state.drafter_view.prefix_sync(state.committed).new_token_ids == (8, 9)
    assert state.stats.cache_misses == 1


def test_a_pool_that_knows_nothing_gets_the_whole_output_not_the_prompt_alone():
    """The prompt's own tuple is shared only while nothing is committed after it."""
    view = RequestState(Request("r", (5, 6), SamplingParams(max_tokens=4))).verifier_view
    assert view.prefix_sync([5, 6], (5, 6)).new_token_ids == (5, 6)
    assert view.prefix_sync([5, 6, 7], (5, 6)) == view.prefix_sync([5, 6, 7])
    assert view.prefix_sync([5, 6, 7], (5, 6)).new_token_ids == (5, 6, 7)
    assert view.prefix_sync([5, 6, 7], (5, 6)).known_hash == EMPTY_PREFIX_HASH


def test_a_busy_wait_doubles_its_pauses_and_ends_before_one_would_pass_it():
    """Refusals that take no time, a wait of 1 s (a clock of the test's): pauses of 0.05,
    0.1, 0.2 and 0.4 s, then none, as a pause of 0.8 s would end past the wait."""
    now, calls = [0.0], []

    async def refused():
        calls.append(now[0])
        raise PoolBusy("verifier: RESOURCE_EXHAUSTED: injected")

    async def pause(seconds):
        now[0] += seconds

    stats = SpecStats()
    with pytest.raises(PoolBusy):
        asyncio.run(retried_while_busy(1.0, stats, refused, lambda: now[0], pause))
    assert calls == pytest.approx([0.0, 0.05, 0.15, 0.35, 0.75]) and stats.busy_retries == 4
    assert stats.busy_seconds == pytest.approx(0.75)


def fitted(rounds):
    overlap = Overlap()
    for kind, shorter, beyond in rounds:
        overlap.add(kind, shorter, beyond)
    return overlap.fit()


def test_the_overlap_fit_weighs_each_kind_by_its_rounds():
    """Kinds at x of 4, 6 and 5 ms (the first ran twice) off one line: the least-squares
    line through their medians weighted 2:1:1 (slope 6/11), not 1:1:1 (slope 1/2)."""
    h, share = fitted([(("carried", 4), 0.004, 0.003)] * 2 +
                      [(("carried", 6), 0.006, 0.004), (("carried", 5), 0.005, 0.004)])
    assert share == pytest.approx(6 / 11) and h == pytest.approx(0.0035 - 6 / 11 * 0.00475)


def test_the_overlap_share_and_the_time_beyond_stay_in_their_bounds():
    """λ is a share (at most 1, however steep the rounds' line) and h a time (at least 0,
    however far below 0 their line crosses x = 0); a fit is redone after an add."""
    assert fitted([(("a",), 0.001, 0.0), (("b",), 0.003, 0.004)])[1] == 1.0
    overlap = Overlap()
    overlap.add(("a",), 0.002, 0.0)
    overlap.add(("b",), 0.004, 0.0018)
    assert overlap.fit() == (0.0, pytest.approx(0.9))
    overlap.add(("c",), 0.006, 0.006)
    assert overlap.fit() == (0.0, 1.0)
