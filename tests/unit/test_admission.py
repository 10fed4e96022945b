"""Admission by free KV blocks: a pool replica's paged cache is bounded, and a call that
cannot have the blocks it needs is refused alone (KVCacheFull -> RESOURCE_EXHAUSTED -> 429),
one that never could is refused as bad input (KVCacheTooSmall -> OUT_OF_RANGE -> 400), idle
sessions give their blocks back before anyone is refused (and none is evicted when that
would not be enough), and the calls admitted beside a refusal are answered exactly as
alone.

The pool here: kv_cache_tokens 208 gives 14 blocks of 16 positions, 13 usable (block 0 is
the zeros the padding reads): 208 positions. A request of 100 positions takes 7 blocks: two do not fit together.
"""

import contextlib

import grpc
import pytest

from deployments.replica_stream import pool_error
from deployments.ingress import pool_failure
from drafter.model import ModelDrafter
from engine.scheduler import KVCacheTooSmall
from engine.cache import KVCacheFull
from engine.kv import STALE_S, SessionStore
from speculative.prefixes import prefix_hash
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ProposeCall, ScoreCall, StaleBase
from tests.tiny import tiny_llama
from verifier.engine import ModelVerifier

GREEDY = SamplingParams(temperature=0.0)
USABLE_BLOCKS = 13


def small_verifier(sessions: int = 2) -> ModelVerifier:
    # a model of its own: a block pool belongs to the model it is attached to
    return ModelVerifier(tiny_llama(1), engine="paged", kv_cache_tokens=208,
                         max_cached_requests=sessions)


def prompt(length: int, offset: int = 0) -> tuple[int, ...]:
    return tuple((offset + 7 * i) % 60 + 1 for i in range(length))


def first_call(request_id: str, ids: tuple[int, ...], draft=(3, 4),
               admitted_at: float = 0.0) -> ScoreCall:
    """(admitted_at: the router's stamp; 0, the pool's clock when the session starts)"""
    return ScoreCall(request_id, PrefixSync(0, prefix_hash([]), ids, admitted_at), draft,
                     GREEDY, prompt_len=len(ids))


def free_blocks(engine) -> int:
    """Blocks a new request can have: free, or held only by released requests' prefixes."""
    pool = engine.runner.pool
    return pool.free_units + pool.evictable_units


def test_a_call_the_pool_could_never_hold_is_refused_as_bad_input():
    verifier = small_verifier()
    [result] = verifier.score_batch([first_call("long", prompt(220))])
    assert isinstance(result, KVCacheTooSmall) and "KV cache" in str(result)
    assert free_blocks(verifier) == USABLE_BLOCKS  # nothing held for it
    # the replica answers it OUT_OF_RANGE, which the router answers 400 (not a 503 to retry:
    # it never fits, however long the client waits)
    from deployments.pools import PoolReplica
    from protos import specserve_pb2 as pb

    replica = PoolReplica.__new__(PoolReplica)
    replica.replica_id = "local"
    _, code = replica.respond(result, None, pb.ScoreResponse)
    assert code == grpc.StatusCode.OUT_OF_RANGE
    assert pool_failure(pool_error("verifier", code, str(result))).status == 400


def test_a_call_that_does_not_fit_beside_its_batch_is_refused_alone():
    verifier, alone = small_verifier(), small_verifier()
    calls = [first_call("a", prompt(98)), first_call("b", prompt(98, 1))]  # 98 + 2: 7 blocks each
    first, second = verifier.score_batch(calls)
    assert first.target_token_ids == alone.score_now(calls[0]).target_token_ids
    assert isinstance(second, KVCacheFull)
    assert "b" not in verifier.sessions and free_blocks(verifier) == USABLE_BLOCKS - 7
    verifier.sessions.release("a")
    assert free_blocks(verifier) == USABLE_BLOCKS  # a release gives the blocks back at once
    [retried] = verifier.score_batch([calls[1]])
    assert retried.target_token_ids == small_verifier().score_now(
        first_call("b2", prompt(98, 1))).target_token_ids


def test_a_new_request_waits_for_an_older_ones_blocks_unless_it_has_gone_quiet(monkeypatch):
    """An idle session is a running request between two calls: a newer request is refused
    rather than take its blocks (evicted each round, the older ones rebuilt their prefills
    round after round), as vLLM's new requests wait; one idle past STALE_S has gone quiet,
    and gives its blocks back before anyone is refused."""
    now = [1000.0]
    monkeypatch.setattr("engine.kv.time.monotonic", lambda: now[0])
    verifier = small_verifier()
    assert not isinstance(verifier.score_batch([first_call("idle", prompt(98))])[0], Exception)
    [waits] = verifier.score_batch([first_call("new", prompt(98, 1))])
    assert isinstance(waits, KVCacheFull) and "idle" in verifier.sessions
    now[0] += STALE_S
    [fresh] = verifier.score_batch([first_call("new", prompt(98, 1))])
    assert not isinstance(fresh, Exception)
    assert "idle" not in verifier.sessions
    ids = prompt(98)
    later = ScoreCall("idle", PrefixSync(98, prefix_hash(list(ids)), (5,)), (), GREEDY)
    assert isinstance(verifier.score_batch([later])[0], StaleBase)  # it rebuilds: exact


def test_an_older_request_takes_a_newer_idle_ones_blocks_and_its_batchs_newest():
    """As vLLM preempts its newest request: a call of an older request evicts a newer idle
    session, and in a batch that cannot hold all its calls the oldest are admitted, the
    newest refused, whatever their order in the batch."""
    verifier, alone = small_verifier(), small_verifier()
    old, new = first_call("old", prompt(20), admitted_at=1), first_call("new", prompt(98, 1),
                                                                       admitted_at=2)
    verifier.score_batch([old])
    verifier.score_batch([new])  # 2 + 7 of the 13 blocks
    grown = ScoreCall("old", PrefixSync(20, prefix_hash(list(prompt(20))), prompt(76, 2), 1),
                      (3, 4), GREEDY)  # 98 positions: 7 blocks, 4 free
    [scores] = verifier.score_batch([grown])
    assert not isinstance(scores, Exception) and "new" not in verifier.sessions
    alone.score_now(old)
    assert scores.target_token_ids == alone.score_now(grown).target_token_ids
    verifier.sessions.release("old")
    first, second = verifier.score_batch([first_call("c", prompt(98, 3), admitted_at=3),
                                          first_call("new", prompt(98, 1), admitted_at=2)])
    # "new", rebuilt with its own stamp, is older than "c": it reserves first
    assert isinstance(first, KVCacheFull) and not isinstance(second, Exception)


def test_a_batchs_newest_calls_are_refused_to_make_room_for_an_older_ones():
    """In a batch that cannot hold all its calls the oldest request's reserves first and the
    newest are refused, newest first, until it fits, whatever the batch's order (here the
    newest first); every block comes back afterwards."""
    verifier, alone = small_verifier(sessions=3), small_verifier()
    shared = prompt(32)  # "new" shares old's first two blocks (a prefix hit)
    ids = {"old": shared + prompt(8, 3), "new": shared + prompt(40, 1), "mid": prompt(20, 9)}
    for stamp, name in enumerate(("old", "mid", "new")):
        verifier.score_batch([first_call(name, ids[name], admitted_at=stamp + 1)])
    grown = ScoreCall("old", PrefixSync(40, prefix_hash(list(ids["old"])), prompt(100, 2), 1),
                      (3, 4), GREEDY)  # 142 positions: 9 blocks
    nexts = [ScoreCall(name, PrefixSync(len(ids[name]), prefix_hash(list(ids[name])), (5,),
                                        stamp), (6,), GREEDY)
             for name, stamp in (("new", 3), ("mid", 2))]
    refused, served, scores = verifier.score_batch([*nexts, grown])
    # refusing "new" (its blocks not shared) makes room: "mid", older, is served
    assert isinstance(refused, KVCacheFull) and not isinstance(served, Exception)
    assert sorted(verifier.sessions) == ["mid", "old"]
    alone.score_now(first_call("old", ids["old"]))
    assert scores.target_token_ids == alone.score_now(grown).target_token_ids
    for name in ("old", "mid"):
        verifier.sessions.release(name)
    assert free_blocks(verifier) == USABLE_BLOCKS


def test_released_requests_that_share_a_prefix_give_it_back_together():
    """A request rebuilt from its own released prefix shares those blocks with it; released
    again, both retired caches hold them (reference counts of 2), neither alone frees one,
    and together they do: a request that needs them is served, not refused for as long as
    it waits (a rebuilt request in a full pool met that refusal). Rebuilt mid-output, its
    chain is longer than the first's (a cache that adds no block to another's chain is not
    kept: engine.cache.PoolCache.retire)."""
    verifier = small_verifier()
    for name, ids in (("a", prompt(98)), ("a rebuilt", prompt(98) + (5,) * 14)):
        [scores] = verifier.score_batch([first_call(name, ids)])
        verifier.sessions.release(name)
    assert scores.cached_tokens == 96  # the second took the first's six full blocks
    pool = verifier.runner.pool
    assert sum(1 for refs in pool.refs if refs == 2) == 6
    assert free_blocks(verifier) == USABLE_BLOCKS
    [served] = verifier.score_batch([first_call("b", prompt(150, 1))])  # 152 positions: 10
    assert not isinstance(served, Exception)


def test_no_idle_session_is_evicted_when_evicting_them_all_would_not_make_room():
    # 304 positions: 20 blocks, 19 usable (three cached requests: no eviction by count)
    verifier = ModelVerifier(tiny_llama(1), engine="paged", kv_cache_tokens=304,
                             max_cached_requests=3)
    assert not isinstance(verifier.score_batch([first_call("idle", prompt(20))])[0], Exception)
    # 'idle' holds 2 blocks, a takes 7 (98 + 2 positions), b needs 13 (200 + 2): 10 free
    # and 2 to evict are not enough
    served, refused = verifier.score_batch([first_call("a", prompt(98)),
                                            first_call("b", prompt(200, 1))])
    assert not isinstance(served, Exception) and isinstance(refused, KVCacheFull)
    assert "idle" in verifier.sessions  # not evicted for nothing


def test_the_drafter_reserves_its_whole_block_or_is_refused_alone():
    drafter = ModelDrafter(tiny_llama(4), engine="paged", kv_cache_tokens=208,
                           max_cached_requests=2)
    calls = [ProposeCall(name, PrefixSync(0, prefix_hash([]), prompt(length, i)), 8, GREEDY, 0)
             for i, (name, length) in enumerate([("a", 100), ("b", 90)])]
    first, second = drafter.propose_batch(calls)
    assert len(first.token_ids) == 8 and isinstance(second, KVCacheFull)
    assert free_blocks(drafter) == USABLE_BLOCKS - 7  # 100 + 8 - 1 positions: 7 blocks


@pytest.mark.parametrize("code, details, status", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "the reason", 429),
    # gRPC's own for a message over the channel's limit: waiting never mends it
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 4)", 503),
    (grpc.StatusCode.OUT_OF_RANGE, "the reason", 400),
    (grpc.StatusCode.INVALID_ARGUMENT, "the reason", 503),
    (grpc.StatusCode.UNAVAILABLE, "the reason", 503),
    (grpc.StatusCode.INTERNAL, "the reason", 503)])
def test_the_router_answers_a_pool_refusal_with_its_http_status(code, details, status):
    failure = pool_failure(pool_error("verifier", code, details))
    assert failure.status == status
    assert ("the reason" in str(failure)) == (status == 400)
    assert ("Retry-After" in (failure.headers or {})) == (status != 400)


def batch_beyond_the_session_bound_matches_alone(attention: str) -> bool:
    """A replica that keeps two sessions, with a pool of 13 blocks (paged) or 3 regions: a
    and b hold theirs; then one batch runs a's and b's next calls beside two new requests.
    Whether every answer the batch gives equals its request's on a roomy replica."""
    tokens = 208 if attention == "paged" else 1536

    def replica(cached: int, kv_tokens: int) -> ModelVerifier:
        return ModelVerifier(tiny_llama(1), engine="paged", attention=attention,
                             kv_cache_tokens=kv_tokens, max_cached_requests=cached)

    tight, roomy = replica(2, tokens), replica(8, 4096)
    prompts = {name: prompt(60, offset=i) for i, name in enumerate("abcd")}
    for name in "ab":
        for verifier in (tight, roomy):
            verifier.score_now(first_call(name, prompts[name], draft=()))
    calls = [ScoreCall(name, PrefixSync(60, prefix_hash(list(prompts[name])), (5,)), (6, 7),
                       GREEDY) for name in "ab"]
    calls += [first_call(name, prompts[name]) for name in "cd"]
    try:
        answers = tight.score_batch(calls)
    except KVCacheFull:  # the batch's own units went to a batch-mate: the forward failed
        return False
    expected = [roomy.score_now(call) for call in calls]
    answered = [(a, e) for a, e in zip(answers, expected) if not isinstance(a, KVCacheFull)]
    return len(answered) >= 3 and all(a.target_token_ids == e.target_token_ids
                                      for a, e in answered)


@pytest.mark.parametrize("attention", ["paged", "regions"])
def test_a_batch_larger_than_the_session_bound_keeps_every_cache_it_runs(attention):
    """None of a batch is evicted while it runs: its units could go to a batch-mate, which
    would write over the keys it reads (a request that does not fit is refused instead)."""
    assert batch_beyond_the_session_bound_matches_alone(attention)


def test_the_test_sees_a_batch_whose_requests_are_evicted_while_it_runs(monkeypatch):
    """Mutant: the store forgets which requests the running batch holds."""
    monkeypatch.setattr(SessionStore, "batch", lambda self, ids: contextlib.nullcontext())
    assert not batch_beyond_the_session_bound_matches_alone("paged")


class CountedRefs(list):
    """A pool's reference counts that count their reads."""

    reads = 0

    def __getitem__(self, index):
        CountedRefs.reads += 1
        return super().__getitem__(index)


def test_admission_at_a_pool_full_of_retired_prefixes_reads_only_what_it_evicts():
    """A full pool whose units retired prefixes hold is the steady state of prefix caching:
    a call that needs one more block gets the least recently retired cache's. Counting
    every retired cache's units at each such admission took 15 ms on a pool of 28,000
    blocks; counting until enough is found reads a cache or two."""
    import torch

    from engine.paged import BlockPool, PagedCache
    from engine.scheduler import reserve_blocks

    pool = BlockPool(1, 1001, 1, 8, torch.float32, "cpu")
    while pool.free_units:
        retired = PagedCache(pool)
        retired.units, retired.length = pool.allocate(2), 32
        pool.retire(retired)
    pool.refs, CountedRefs.reads = CountedRefs(pool.refs), 0
    live = PagedCache(pool)
    reserve_blocks(SessionStore(8), live, 16, 0)
    assert len(live.units) == 1 and len(pool.retired) == 499  # one cache evicted
    assert CountedRefs.reads < 20  # the whole pool: 1,000 reads and more
