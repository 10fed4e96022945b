"""A released request leaves nothing on a pool replica: not when the router's release
deadline passed while the worker was busy, not a call of several steps cut short between
two of them."""

import asyncio
import threading

from deployments.pool_args import VerifierArgs
from deployments.pools import VerifierPool
from protos import specserve_pb2 as pb
from speculative.types import prefix_hash
from tests.unit.test_pool_replica import (  # noqa: F401
    greedy_score,
    hold_engine,
    local_drafter,
    local_replica,
    pool_secret,
    propose,
    until,
)


def release(request_id: str):
    return pb.ReleaseRequest(request_id=request_id)


def test_a_release_its_caller_gave_up_on_still_happens():
    """The router waits 2 s for a release; the worker may be busier than that (a long
    prefill). Its handler is then cancelled: the release still runs once the worker is
    free."""
    async def main():
        replica = await local_drafter()
        await replica.Propose(propose("a"))
        gate = await hold_engine(replica)
        handler = asyncio.ensure_future(replica.Release(release("a")))
        await asyncio.sleep(0.05)  # (it waits for the worker, either way)
        handler.cancel()  # the router's deadline
        gate.set()
        await until(lambda: not replica.session_ids())
        await replica.server.stop(None)

    asyncio.run(main())


def test_a_call_of_several_steps_cut_short_leaves_nothing_once_released():
    """A K = 0 call of 4 steps whose caller goes away after its first step: the verifier
    keeps its progress between steps, and the request's release drops it with the
    session."""
    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs())
        replica.runs_inline = lambda calls: False  # every batch on the worker
        gate, inner = threading.Event(), replica.engine_batch

        def engine_batch(run_batch, calls):  # the worker waits after the first step
            answers = inner(run_batch, calls)
            if "s" in replica.engine.steps.running:
                gate.wait()
            return answers

        replica.engine_batch = engine_batch
        await replica.Score(greedy_score("s", 20))
        steps = pb.ScoreRequest(request_id="s", steps=4, sampling=pb.SamplingParams(),
                                sync=pb.PrefixSync(known_len=20,
                                                   known_hash=prefix_hash(range(1, 21)),
                                                   new_token_ids=[7]))
        call = asyncio.ensure_future(replica.Score(steps))
        try:
            await until(lambda: "s" in replica.engine.steps.running)
            call.cancel()  # the caller went away between two steps
        finally:
            gate.set()
        await replica.Release(release("s"))
        await until(lambda: replica.waiting == 0)
        assert not replica.engine.steps.running and replica.session_ids() == []
        await replica.server.stop(None)

    asyncio.run(main())
