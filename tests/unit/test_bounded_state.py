"""State a long-running router keeps across requests stays bounded: keyed by what requests
bring (their batches' sizes) or by replicas that come and go, it must not grow by an entry
for every new value (a router serves requests for weeks)."""

import asyncio
import random

import grpc
import pytest

from deployments import auth, clients
from deployments.clients import PoolClient
from speculative.costs import MAX_SIZES, CostModel, RoundCost
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import SamplingParams
from speculative.state import Request, RequestState
from speculative.types import PrefixSync, ProposeCall


def verify_seconds(batch_tokens: int) -> float:
    return 0.01 + 0.001 * (batch_tokens - 1)


def observe_verify(costs: CostModel, batch_tokens: int) -> None:
    costs.observe(RoundCost(1, verify_seconds(batch_tokens), 0, 0.0, 0.002,
                            batch_size=4, batch_tokens=batch_tokens))


def test_the_verify_line_keeps_its_common_sizes_and_a_bounded_number_of_others():
    """A verifier batch's fed tokens take any value a prompt's prefill chunk gives them: a
    line that kept every size grew by one per value, and its fit (after every add) walked
    them all. The sizes seen least lately leave; the common ones and the fit stay."""
    costs = CostModel()
    for i in range(3000):
        observe_verify(costs, 1)
        observe_verify(costs, 8)
        observe_verify(costs, 100 + i)  # a one-off: a decode batch beside a prefill chunk
    assert len(costs.verify.points) <= MAX_SIZES
    assert {1, 8} <= set(costs.verify.points)
    assert costs.forward_seconds(8) == pytest.approx(verify_seconds(8), rel=1e-6)


class GoneReleases:
    """A stub class whose Release calls all find the replica gone."""

    def __call__(self, channel):
        class Stub:
            async def Release(self, message, metadata=None, timeout=None):
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "replica gone")

        return Stub()


def test_releases_to_replicas_that_went_away_leave_no_channel_behind(monkeypatch):
    """Requests that end pinned to a replica gone meanwhile (scaled down, replaced): the
    release opened a channel to it (its streams had ended, and their channel with them),
    which stayed, one per replica gone, for the router's life. A channel a stream still
    uses stays."""
    monkeypatch.setattr(auth, "_secret", "test-secret")
    monkeypatch.setattr(clients.grpc.aio, "insecure_channel", lambda address, options: address)
    pool = PoolClient("proxy", GoneReleases(), "verifier", 5.0, direct=True)
    pool._streams[("live:1", "Score")] = object()  # a stream to a live replica, on its channel
    pool._channels["live:1"] = "live:1"

    async def main():
        for i in range(100):
            pool.pins[f"r{i}"] = f"gone:{i}"
            pool.release(f"r{i}")
        pool.pins["on-live"] = "live:1"
        pool.release("on-live")
        await asyncio.gather(*pool._releasing)

    asyncio.run(main())
    assert pool._channels == {"live:1": "live:1"} and not pool.pins and not pool.routes


@pytest.fixture(scope="module")
def router_drafters():
    """The router's own drafters built twice: within a small token bound, and without one
    in effect (a million tokens)."""
    from deployments.router import local_drafters
    from engine.checkpoint import Checkpoint
    from engine.models import DEMO_TARGET

    target = Checkpoint.load(DEMO_TARGET)
    return {bound: local_drafters(DEMO_TARGET, target, 1, bound) for bound in (150, 10**6)}


def greedy_call(request_id: str, sync: PrefixSync, prompt_len: int) -> ProposeCall:
    return ProposeCall(request_id, sync, 4, SamplingParams(temperature=0), 0,
                       prompt_len=prompt_len)


def test_the_routers_drafters_evict_by_tokens(router_drafters):
    """Bounded in sessions only (2 x max_running_requests, at least 256), a few requests of
    long contexts held whatever they brought (a suffix drafter's tries: about 6 KB a
    token); past the token bound, the least recently used session leaves."""
    for routed in router_drafters[150].values():
        sessions = routed.drafter.sessions
        for request_id in ("a", "b"):
            asyncio.run(routed.propose(greedy_call(request_id, PrefixSync(
                0, EMPTY_PREFIX_HASH, tuple(range(1, 81))), 80)))
        assert list(sessions) == ["b"] and sessions.tokens == 80
        assert sessions.stats.evictions == 1
        routed.drafter.sessions.release("b")


def test_a_session_evicted_by_tokens_drafts_as_one_never_evicted(router_drafters):
    """Two requests that take turns over a bound that holds one of them: each call finds
    its session evicted by the other's and rebuilds it (the router resends the whole
    prefix: RequestState.call_pool), and drafts what the drafter that never evicted drafts.
    The suffix drafters' global index is off: an evicted session's output so far joins it
    (SuffixDrafter.remember), which the other drafter's lacks; the sessions are compared."""
    rng = random.Random(0)
    truths = {rid: [rng.randrange(1, 12) for _ in range(200)] for rid in ("a", "b")}

    def run_rounds(routed) -> tuple[list, int]:
        states = {rid: RequestState(Request(rid, tuple(truth[:80]), SamplingParams(
            temperature=0, max_tokens=100))) for rid, truth in truths.items()}
        blocks = []
        while any(state.remaining > 0 for state in states.values()):
            for rid, state in states.items():
                block = asyncio.run(state.call_pool(
                    state.drafter_view, lambda sync: routed.propose(greedy_call(rid, sync, 80))))
                ahead = truths[rid][len(state.committed):]
                accepted = next((i for i, (d, t) in enumerate(zip(block.token_ids, ahead))
                                 if d != t), len(block.token_ids))
                state.commit(tuple(ahead[:accepted + 1]))  # and the bonus
                blocks.append((rid, block.token_ids))
        for rid in states:
            asyncio.run(routed.release(rid))
        return blocks, sum(state.stats.cache_misses for state in states.values())

    for kind in ("ngram", "suffix"):
        bounded, unbounded = (router_drafters[bound][kind] for bound in (150, 10**6))
        if kind == "suffix":
            bounded.drafter.max_global_outputs = unbounded.drafter.max_global_outputs = 0
        evicted, misses = run_rounds(bounded)
        assert misses > 10 and bounded.drafter.sessions.stats.evictions > 10, kind
        kept, none = run_rounds(unbounded)
        assert none == 0 and evicted == kept, kind
        assert sum(len(tokens) for _, tokens in kept) > 100, kind  # it drafted
