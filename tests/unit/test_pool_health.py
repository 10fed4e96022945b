"""A pool replica's health check (deployments.health): a stuck worker or a dead engine fails
it, whatever its callers do; a busy or refusing one does not."""

import asyncio
import threading
import weakref
from types import SimpleNamespace

import pytest
import torch

from deployments import health
from deployments.health import FAILED_BATCHES, FAILURES_LOGGED_EVERY_S
from deployments.pool_args import DrafterArgs, VerifierArgs
from deployments.pools import DrafterPool, VerifierPool
from engine.runner import ModelRunner
from protos import specserve_pb2 as pb
from tests.unit.test_ingress import Records
from tests.unit.test_pool_replica import local_replica, pool_secret  # noqa: F401


def propose(request_id: str) -> pb.ProposeRequest:
    return pb.ProposeRequest(request_id=request_id, num_speculative_tokens=3,
                             sync=pb.PrefixSync(new_token_ids=range(5, 8)),
                             sampling=pb.SamplingParams(temperature=0))


def score(request_id: str) -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=request_id, sampling=pb.SamplingParams(),
                           sync=pb.PrefixSync(new_token_ids=range(1, 9)))


def test_a_stuck_worker_fails_the_check_though_each_caller_gives_up_before_the_stall():
    """The router waits 1 s for a draft (30 s for a verify), far less than health_stall_s:
    each call times out and the next finds no call waiting. Before, that next call restarted
    the stall clock, and a replica whose worker hung for good stayed healthy."""
    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs(health_stall_s=0.3))
        gate = threading.Event()
        replica.worker.submit(replica.owning, gate.wait)  # the worker hangs from now on
        while not replica.engine_lock.locked():  # (else a lone call runs on the loop)
            await asyncio.sleep(0.01)
        try:
            for index in range(4):  # callers that give up after 0.1 s, 0.05 s apart
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(replica.Propose(propose(f"r{index}")), 0.1)
                await asyncio.sleep(0.05)
            assert replica.waiting == 0
            call = asyncio.ensure_future(replica.Propose(propose("late")))
            await asyncio.sleep(0.01)
            with pytest.raises(RuntimeError, match="has not finished a batch"):
                await replica.check_health()
            call.cancel()
        finally:
            gate.set()
            await replica.server.stop(None)

    asyncio.run(main())


def test_an_engine_that_fails_every_batch_fails_the_check_and_logs_its_requests(monkeypatch):
    """A sticky device error fails every forward at once: nothing stalls, and a drafter's
    failures only make rounds the target's alone, so nobody saw it. Failing every batch
    for health_stall_s now fails the check, and the failures are logged naming their
    requests: a streak's first with its traceback, later ones at most every
    FAILURES_LOGGED_EVERY_S (a dead engine under load fails a batch every few ms)."""
    now = [1000.0]  # the health's clock, moved by hand: no test of wall-clock time
    monkeypatch.setattr(health, "time", SimpleNamespace(monotonic=lambda: now[0]))

    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs(health_stall_s=0.5))

        def dead(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(ModelRunner, "forward", dead)
        try:
            for index in range(FAILED_BATCHES + 1):
                with pytest.raises(RuntimeError, match="illegal memory access"):
                    await replica.Propose(propose(f"req-{index}"))
                # not before the failures span health_stall_s: a client's retries of a
                # request that fails the engine must not restart the replica
                await replica.check_health()
                now[0] += 0.1
            now[0] += FAILURES_LOGGED_EVERY_S
            with pytest.raises(RuntimeError, match="illegal memory access"):
                await replica.Propose(propose("req-last"))
            with pytest.raises(RuntimeError, match=f"failed the last {FAILED_BATCHES + 2} "):
                await replica.check_health()
        finally:
            await replica.server.stop(None)

    with Records() as records:  # Serve's logger, as the ingress's
        asyncio.run(main())
    failed = [r for r in records if "the engine failed a batch" in r.getMessage()]
    assert [r.getMessage().split("(")[1].split(")")[0] for r in failed] == ["req-0", "req-last"]
    assert f"; {FAILED_BATCHES + 2} in a row" in failed[1].getMessage()
    assert failed[0].exc_info is not None  # the traceback once per streak


def test_an_answered_batch_ends_a_failure_streak_and_refusals_are_not_failures(monkeypatch):
    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs(health_stall_s=0.01))
        forward = ModelRunner.forward
        broken = True

        def flaky(runner, segments):
            if broken:
                raise RuntimeError("out of memory")
            return forward(runner, segments)

        monkeypatch.setattr(ModelRunner, "forward", flaky)
        try:
            for index in range(FAILED_BATCHES - 1):  # failures spanning health_stall_s
                with pytest.raises(RuntimeError):
                    await replica.Score(score(f"a{index}"))
                await asyncio.sleep(0.02)
            broken = False
            await replica.Score(score("ok"))
            broken = True
            for index in range(FAILED_BATCHES - 1):
                with pytest.raises(RuntimeError):
                    await replica.Score(score(f"b{index}"))
                await asyncio.sleep(0.02)
            await replica.check_health()  # never FAILED_BATCHES in a row

            def refusing(runner, segments):  # a batch refused for its input is an answer
                raise ValueError("draft trees need a model without sliding windows")

            monkeypatch.setattr(ModelRunner, "forward", refusing)
            for index in range(2 * FAILED_BATCHES):
                await replica.Score(score(f"bad{index}"))
                await asyncio.sleep(0.02)
            await replica.check_health()
        finally:
            await replica.server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("chained", [False, True], ids=["raised", "raised-from"])
@pytest.mark.parametrize("inline", [False, True])
def test_a_failed_batch_holds_none_of_its_tensors_through_the_next(inline, chained,
                                                                   monkeypatch):
    """An error's traceback holds the frames it was raised through and their tensors (an
    out-of-memory error's: the failed forward's activations). Kept with the error (the
    health's last failure, the callers' futures, the batcher's own), they stayed allocated
    through the next batch, which then ran short of memory too."""
    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs())
        replica.runs_inline = lambda calls: inline  # the loop's frames, or the worker's
        forward, failed, held = ModelRunner.forward, [], []

        def failing_once(runner, segments):
            if not failed:
                activations = torch.empty(1 << 16)
                failed.append(weakref.ref(activations))
                if not chained:
                    raise RuntimeError("CUDA out of memory")
                try:  # an error raised while handling another: both tracebacks hold them
                    raise KeyError("a kernel's")
                except KeyError as cause:
                    raise RuntimeError("CUDA out of memory") from cause
            held.append(failed[0]() is not None)
            return forward(runner, segments)

        monkeypatch.setattr(ModelRunner, "forward", failing_once)
        try:
            with pytest.raises(RuntimeError, match="out of memory"):
                await replica.Score(score("a"))
            await replica.Score(score("b"))
        finally:
            await replica.server.stop(None)
        return held

    assert asyncio.run(main()) == [False]
