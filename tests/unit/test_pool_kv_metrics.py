"""A pool replica's KV cache usage and sessions gauges (deployments.metrics): read with the
engine to itself after each batch and release, set at Serve's health checks from what was
last read, so that a check never waits for the worker. Its direct calls gauge: set where the
autoscaling stats are read."""

import asyncio

import pytest

from deployments.autoscaling import DIRECT_IN_FLIGHT
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
    until,
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


def test_the_direct_calls_gauge_reads_the_calls_in_flight_then_0(monkeypatch):
    """specserve_pool_direct_calls: the calls in flight on the replica's own port, the count
    its autoscaling stats report (an operator sees why the pool scaled), set at each poll and
    health check; 0 from the start and once they are answered."""
    recorded = stood_in_metrics(monkeypatch)

    def gauge() -> int:
        return [value for name, kind, value, _ in recorded
                if kind == "set" and name == "specserve_pool_direct_calls"][-1]

    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs())
        read = {"start": gauge()}
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            gate = await hold_engine(replica)  # the model is busy: the calls wait in flight
            try:
                calls = [asyncio.ensure_future(stub.Propose(propose(f"r{i}"), metadata=KEY()))
                         for i in range(3)]
                await until(lambda: replica.direct_in_flight == 3)
                polled = await replica.record_autoscaling_stats()
                read["poll"] = gauge()
                del recorded[:]
                await replica.check_health()
                read["check"] = gauge()
            finally:
                gate.set()
            await asyncio.gather(*calls)
            await until(lambda: not replica.waiting)
            await replica.check_health()
            read["answered"] = gauge()
        return polled, read

    polled, read = asyncio.run(main())
    assert polled[DIRECT_IN_FLIGHT] == read["poll"] == 3
    assert read == {"start": 0, "poll": 3, "check": 3, "answered": 0}
