"""State a long-running router keeps across requests stays bounded: keyed by what requests
bring (their batches' sizes) or by replicas that come and go, it must not grow by an entry
for every new value (a router serves requests for weeks)."""

import asyncio

import grpc
import pytest

from deployments import auth, clients
from deployments.clients import PoolClient
from speculative.costs import MAX_SIZES, CostModel, RoundCost


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
