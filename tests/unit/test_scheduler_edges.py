"""engine.scheduler's token budget: calls are prepared shortest feed first, each cut to what
the feeds before it left of the forward's budget, and never below MIN_CHUNK tokens (a feed
cut to nothing would never advance: a long prompt behind decodes would wait forever). A
request of exactly the pool's positions is admitted; one more is KVCacheTooSmall (a 400),
not KVCacheFull (a 429 that no wait would ever admit). A pool short of units takes them from
retired prefixes before it evicts an idle session (whose next call would rebuild)."""

from types import SimpleNamespace

import pytest
import torch

from engine.batch import Segment
from engine.kv import SessionStore
from engine.paged import BlockPool, PagedCache
from engine.scheduler import MIN_CHUNK, KVCacheTooSmall, prepare_within_budget, reserve_blocks
from speculative.prefixes import prefix_hash
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ScoreCall
from tests.tiny import tiny_llama
from verifier.engine import ModelVerifier


def prepared(feeds: list[int], max_tokens: int | None) -> tuple[list, list[tuple]]:
    """(each call's limit in the order prepared, (index, tokens fed) of the ready calls)."""
    calls = [SimpleNamespace(request_id=f"r{i}", feed=feed) for i, feed in enumerate(feeds)]
    limits = []

    def prepare(call, limit):
        limits.append((call.request_id, limit))
        fed = call.feed if limit is None else min(call.feed, limit)
        return Segment(None, [1] * fed, 0, 1), None

    ready = prepare_within_budget(calls, prepare, [None] * len(calls), max_tokens,
                                  lambda call: call.feed)
    return limits, [(index, len(segment.token_ids)) for index, segment, _ in ready]


def test_feeds_are_cut_to_the_budget_left_shortest_first():
    limits, ready = prepared([40, 3, 10], 32)
    assert limits == [("r1", 32), ("r2", 29), ("r0", 19)]
    assert ready == [(1, 3), (2, 10), (0, 19)]


def test_a_feed_past_a_spent_budget_still_gets_min_chunk_tokens():
    limits, ready = prepared([100, 64], 64)
    assert limits == [("r1", 64), ("r0", MIN_CHUNK)]
    assert ready == [(1, 64), (0, MIN_CHUNK)]
    limits, ready = prepared([20, 30, 5], 10)  # below MIN_CHUNK, then overspent
    assert limits == [("r2", MIN_CHUNK), ("r0", MIN_CHUNK), ("r1", MIN_CHUNK)]
    assert ready == [(2, 5), (0, MIN_CHUNK), (1, MIN_CHUNK)]


def test_no_budget_feeds_every_call_whole():
    limits, ready = prepared([40, 3], None)
    assert limits == [("r1", None), ("r0", None)] and ready == [(1, 3), (0, 40)]


def test_a_request_of_the_whole_pool_fits_and_one_position_more_never_does():
    pool = BlockPool(1, 3, 1, 2, torch.float32, "cpu", block_size=4)  # blocks 1, 2: 8 positions
    with pytest.raises(KVCacheTooSmall, match="9 positions"):
        reserve_blocks(SessionStore(2), PagedCache(pool), 9, 0)
    assert pool.free_units == 2
    cache = PagedCache(pool)
    reserve_blocks(SessionStore(2), cache, 8, 0)
    assert cache.units == [1, 2] and pool.free_units == 0


def first_call(request_id: str, length: int, offset: int) -> ScoreCall:
    ids = tuple((offset + 7 * i) % 60 + 1 for i in range(length))
    return ScoreCall(request_id, PrefixSync(0, prefix_hash([]), ids), (3, 4),
                     SamplingParams(temperature=0), prompt_len=length)


def test_a_short_pool_frees_retired_prefixes_before_evicting_an_idle_session():
    verifier = ModelVerifier(tiny_llama(1), engine="paged", kv_cache_tokens=208,
                             max_cached_requests=3)  # 13 usable blocks of 16
    pool = verifier.runner.pool
    verifier.score_batch([first_call("gone", 98, 0)])  # 100 positions: 7 blocks
    verifier.sessions.release("gone")  # its 6 prompt blocks retired, the 7th freed
    verifier.score_batch([first_call("idle", 20, 1)])  # 2 blocks
    assert pool.free_units == 5 and pool.evictable_units == 6
    [served] = verifier.score_batch([first_call("new", 80, 2)])  # 6 blocks: 1 more
    assert not isinstance(served, Exception)
    assert "idle" in verifier.sessions and verifier.sessions.stats.evictions == 0
