"""A pool replica's KV cache usage and sessions gauges (deployments.metrics): read with the
engine to itself after each batch and release, set at Serve's health checks from what was
last read, so that a check never waits for the worker."""

import asyncio

import pytest

from deployments.pool_args import DrafterArgs, VerifierArgs
from deployments.pools import DrafterPool, VerifierPool
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from tests.unit.test_metrics import stood_in_metrics
from tests.unit.test_pool_replica import (  # noqa: F401 (pool_secret: a fixture)
    KEY,
    direct,
    greedy_score,
    hold_engine,
    local_replica,
    pool_secret,
    propose,
)

GAUGES = ("kv_cache_usage_perc", "specserve_pool_sessions")
POOLS = {"drafter": (DrafterPool, DrafterArgs, pb_grpc.DrafterStub, "Propose",
                     lambda request_id: propose(request_id, 40)),
         "verifier": (VerifierPool, VerifierArgs, pb_grpc.VerifierStub, "Score", greedy_score)}


def last_set(recorded: list) -> dict:
    """Each KV gauge's last value set."""
    return {name: value for name, kind, value, _ in recorded if kind == "set" and name in GAUGES}


@pytest.mark.parametrize("pool", ["drafter", "verifier"])
def test_a_replicas_sessions_hold_kv_until_their_release(monkeypatch, pool):
    """Three requests' sessions hold part of the KV pool; released, their prompt blocks stay
    for prefix hits (as the warm-up's did) and count free, as vLLM's cached blocks."""
    recorded = stood_in_metrics(monkeypatch)
    cls, args, stub_class, method, call = POOLS[pool]

    async def main():
        replica = await local_replica(cls, args())
        await replica.check_health()
        started = last_set(recorded)
        async with direct(replica, stub_class) as stub:
            await asyncio.gather(*(getattr(stub, method)(call(f"r{i}"), metadata=KEY())
                                   for i in range(3)))
            await replica.check_health()
            held = last_set(recorded)
            for i in range(3):
                await stub.Release(pb.ReleaseRequest(request_id=f"r{i}", ended=True),
                                   metadata=KEY())
            await replica.check_health()
            return started, held, last_set(recorded), replica.engine.runner.pool

    started, held, released, kv_pool = asyncio.run(main())
    assert started == released == {"kv_cache_usage_perc": 0.0, "specserve_pool_sessions": 0}
    assert held["specserve_pool_sessions"] == 3 and 0 < held["kv_cache_usage_perc"] < 1
    assert kv_pool.free_units < kv_pool.count - 1  # the retired prefixes kept


def test_a_health_check_sets_the_gauges_without_waiting_for_a_busy_worker(monkeypatch):
    """While the worker runs a long batch, a health check sets the gauges to what was read
    after the last batch, and finishes without yielding to the event loop."""
    recorded = stood_in_metrics(monkeypatch)

    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs())
        await replica.Propose(propose("r", 40))
        gate = await hold_engine(replica)
        del recorded[:]
        check = replica.check_health()
        try:
            with pytest.raises(StopIteration):  # done at its first step
                check.send(None)
        finally:
            gate.set()
        await replica.server.stop(None)

    asyncio.run(main())
    gauges = last_set(recorded)
    assert gauges["specserve_pool_sessions"] == 1 and gauges["kv_cache_usage_perc"] > 0
