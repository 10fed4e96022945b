"""A released request leaves nothing on a pool replica: not when the router's release
deadline passed while the worker was busy, not a call of several steps cut short between
two of them, not a call whose cancel the release overtook (nor the calls of an ended
request still on their way, however many), not a burst of releases beyond the port's
concurrent rpcs."""

import asyncio
import threading

import pytest

from deployments.clients import RELEASE_BUSY_WAIT_S, RELEASE_TIMEOUT_S
from deployments.pool_args import DrafterArgs, VerifierArgs
from deployments.pools import DrafterPool, VerifierPool
from deployments.released import Released
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from speculative.prefixes import prefix_hash
from tests.unit.test_pool_replica import (  # noqa: F401
    KEY,
    direct,
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


def test_a_release_before_the_cancel_of_a_queued_call_leaves_no_session():
    """The router gives a request up: its Release can reach the replica before the cancel
    of its call still queued for the batcher (a pre-draft is cancelled after the release
    is sent). That call, a first one, ran after the release and made the session again,
    held until the TTL sweep; it is answered REBUILD instead and never runs."""
    from tests.unit.test_pool_stream import CALLS

    async def main():
        replica = await local_drafter()
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            gate = await hold_engine(replica)
            stream = stub.ProposeStream(metadata=KEY())
            await stream.write(pb.ProposeBatch(entries=[pb.ProposeEntry(tag=1, call=CALLS[0])]))
            await until(lambda: replica.waiting == 1)  # its batch waits for the worker
            await stream.write(pb.ProposeBatch(entries=[pb.ProposeEntry(tag=2, call=CALLS[1])]))
            await until(lambda: replica.waiting == 2)  # r2 waits in the batcher
            releasing = asyncio.ensure_future(stub.Release(release("r2"), metadata=KEY()))
            answers = {}

            async def answered(tag):
                while tag not in answers:
                    answers.update({a.tag: a for a in (await stream.read()).answers})

            # r2 answered by the release while the worker is held (without it, never: the
            # bound only ends the wait, it decides nothing a correct pool could miss)
            try:
                await asyncio.wait_for(answered(2), 60)
            finally:  # a failed wait leaves no worker held (the run would not end)
                gate.set()
            await releasing
            await until(lambda: replica.waiting == 0)
            await stream.write(pb.ProposeBatch(cancel=[2]))  # the cancel, too late
            while len(answers) < 2:
                answers.update({a.tag: a for a in (await stream.read()).answers})
            stream.cancel()
            assert answers[2].response.status == pb.REBUILD
            assert replica.session_ids() == ["r1"]

    asyncio.run(main())


def test_a_release_during_a_cut_prefill_ends_it():
    """A long prompt's prefill cut to the forward's token budget, its request released
    between two chunks (the cancel of its call not there yet): the call went on, from an
    empty session, prefilled the whole prompt again and kept the session made for it."""
    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs(max_batch_tokens=64))
        replica.runs_inline = lambda calls: False  # every batch on the worker
        gate, cut, inner = threading.Event(), threading.Event(), replica.engine_batch

        def engine_batch(run_batch, calls):  # the worker waits after the first chunk
            answers = inner(run_batch, calls)
            if not cut.is_set():
                cut.set()
                gate.wait()
            return answers

        replica.engine_batch = engine_batch
        call = asyncio.ensure_future(replica.Score(greedy_score("p", 200)))
        await until(cut.is_set)
        releasing = asyncio.ensure_future(replica.Release(release("p")))
        await asyncio.sleep(0.05)  # served: its own release waits for the worker
        gate.set()
        answer = await call
        await releasing
        await until(lambda: replica.waiting == 0)
        assert answer.status == pb.REBUILD
        assert replica.session_ids() == []
        # a caller that lives on (its session released by an operator) rebuilds it
        rebuilt = await replica.Score(greedy_score("p", 200))
        assert rebuilt.status == pb.OK and replica.session_ids() == ["p"]
        await replica.server.stop(None)

    asyncio.run(main())


def test_releases_beyond_the_ports_concurrent_rpcs_are_tried_again():
    """max_concurrent_rpcs bounds the port's rpcs, Releases among them: a burst of them
    waiting for a busy worker (the choices of one request end together, placed on one
    replica) filled it, and the rest were refused RESOURCE_EXHAUSTED and lost, their
    sessions held until the TTL sweep (at the defaults: 64 of a burst of 100 landed)."""
    from deployments.clients import PoolClient

    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs(drafter="ngram",
                                                               max_concurrent_rpcs=2))
        ids = [f"r{i}" for i in range(6)]
        for request_id in ids:
            await replica.Propose(propose(request_id))
        client = PoolClient(None, lambda channel: channel and pb_grpc.DrafterStub(channel),
                            "drafter", 5.0, direct=True)
        gate = await hold_engine(replica)  # a long batch: the releases wait for the worker
        for request_id in ids:
            client.pins[request_id] = replica.address
            client.release(request_id)
        await asyncio.sleep(0.2)  # two hold the port; the others were refused
        gate.set()
        await asyncio.gather(*client._releasing)
        assert replica.session_ids() == []
        await replica.server.stop(None)

    asyncio.run(main())


def test_a_release_that_overtakes_a_first_call_leaves_no_session():
    """The request's Release reaches the replica before its first call on the router's
    stream (a new stream: the call's message is still on its way); the call's cancel comes
    later still. That call ran after the release and made the session again, held until the
    TTL sweep; it is answered REBUILD instead and never runs."""
    from tests.unit.test_pool_stream import CALLS

    async def main():
        replica = await local_drafter()
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            await stub.Release(release("r1"), metadata=KEY())  # r1 held nothing yet
            stream = stub.ProposeStream(metadata=KEY())
            await stream.write(pb.ProposeBatch(entries=[pb.ProposeEntry(tag=1, call=CALLS[0])]))
            answer = (await stream.read()).answers[0]
            stream.cancel()
            assert answer.response.status == pb.REBUILD
            assert replica.session_ids() == [] and len(replica.sampling) == 0

    asyncio.run(main())


@pytest.mark.parametrize("queued", [True, False])
def test_a_request_ended_with_calls_still_on_their_way_leaves_no_session(queued):
    """A request's first draft (the whole prompt) timed out, its cancel on its way; the next
    round's draft, the whole prompt again (no draft of the request was answered), is
    cancelled with the request. The router's release reaches the replica after the first
    call (queued, answered REBUILD) or before both: the tombstone, missing or used up by
    the first, let the next run after the release and make the session again, held until
    the TTL sweep. A request its router released is refused every call that comes later."""
    from deployments.clients import PoolClient

    async def main():
        replica = await local_drafter()
        client = PoolClient(None, lambda channel: channel and pb_grpc.DrafterStub(channel),
                            "drafter", 5.0, direct=True)
        client.pins["r"] = replica.address
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            stream, answers = stub.ProposeStream(metadata=KEY()), {}

            async def answer(tag: int, entry=None, cancel=()):
                if entry is not None or cancel:
                    entries = [] if entry is None else [pb.ProposeEntry(tag=tag, call=entry)]
                    await stream.write(pb.ProposeBatch(entries=entries, cancel=cancel))
                while tag not in answers:
                    answers.update({a.tag: a for a in (await stream.read()).answers})
                return answers[tag].response.status

            if queued:  # behind a call of another request, the worker held
                gate = await hold_engine(replica)
                for tag, call in enumerate((propose("other"), propose("r")), 1):
                    await stream.write(pb.ProposeBatch(entries=[pb.ProposeEntry(tag=tag,
                                                                                call=call)]))
                    await until(lambda: replica.waiting == tag)  # (r's: not in other's batch)
                client.release("r")
                assert await answer(2) == pb.REBUILD  # answered by the release
                gate.set()
            else:
                client.release("r")
            await asyncio.gather(*client._releasing)
            if not queued:  # the first call after the release
                assert await answer(2, propose("r")) == pb.REBUILD
            # the next round's call, after the first's cancel; its own cancel comes late
            assert await answer(3, propose("r", 4), cancel=[2]) == pb.REBUILD
            await stream.write(pb.ProposeBatch(cancel=[3]))
            stream.cancel()
            assert replica.session_ids() == (["other"] if queued else [])

    asyncio.run(main())


def test_a_released_session_whose_caller_lives_on_is_rebuilt():
    """A session released while its request goes on (an operator's Release, as the scaling
    test's): the request learns it from one REBUILD, and its rebuild is served, whether the
    release found a call of it queued (answered REBUILD), running (it ends as it would
    have) or none (its next call is refused)."""
    async def main():
        replica = await local_drafter()
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            for request_id in ("idle", "queued", "running"):
                await stub.Propose(propose(request_id), metadata=KEY())
                later = pb.ProposeRequest(request_id=request_id, num_speculative_tokens=3,
                                          sync=pb.PrefixSync(known_len=3,
                                                             known_hash=prefix_hash(range(5, 8)),
                                                             new_token_ids=[9]))
                if request_id == "idle":
                    await stub.Release(release(request_id), metadata=KEY())
                    answer = await stub.Propose(later, metadata=KEY())
                else:
                    answer = await released_in_flight(replica, stub, later,
                                                      queued=request_id == "queued")
                if answer.status == pb.OK:  # it ran: its next call finds no session
                    answer = await stub.Propose(later, metadata=KEY())
                assert answer.status == pb.REBUILD
                rebuilt = await stub.Propose(propose(request_id, 4), metadata=KEY())
                assert rebuilt.status == pb.OK and len(rebuilt.token_ids) == 3, request_id
            assert sorted(replica.session_ids()) == ["idle", "queued", "running"]

    asyncio.run(main())


async def released_in_flight(replica, stub, call: pb.ProposeRequest, queued: bool):
    """The answer to `call`, its request released while the call runs (the worker held) or
    waits behind a call of another request."""
    gate, ahead = await hold_engine(replica), None
    if queued:  # a call of another request runs (the worker held); this one waits
        ahead = asyncio.ensure_future(stub.Propose(propose("ahead"), metadata=KEY()))
        await until(lambda: replica.waiting == 1)
    answer = asyncio.ensure_future(stub.Propose(call, metadata=KEY()))
    await until(lambda: replica.waiting == 1 + queued)
    held = len(replica.sampling)
    releasing = asyncio.ensure_future(stub.Release(release(call.request_id), metadata=KEY()))
    await until(lambda: len(replica.sampling) < held)  # the release reached its handler
    gate.set()  # (the release itself waits for the worker)
    if ahead is not None:
        await ahead
        await stub.Release(release("ahead"), metadata=KEY())
    await releasing
    return await answer


def test_a_replica_remembers_released_requests_for_a_while_and_a_few():
    """A tombstone refuses one call, within kept_s of its release; at most `capacity` are
    kept, the oldest dropped first (a finished request's is never used)."""
    now = [0.0]
    released = Released(kept_s=10.0, capacity=2, clock=lambda: now[0])
    released.add("a")
    assert released.refuses("a") and not released.refuses("a")  # used up
    for request_id in ("b", "c", "d"):
        released.add(request_id)
    assert len(released) == 2 and not released.refuses("b")  # the oldest went
    now[0] = 10.5
    assert not released.refuses("c")  # too old
    released.add("e")
    assert len(released) == 1 and released.refuses("e")  # "d" expired at the add
    # a request its router ended: every call refused, until the tombstone expires; an
    # operator's release after it leaves it so
    released.add("f", ended=True)
    released.add("f")
    assert released.refuses("f") and released.refuses("f")
    now[0] = 21.0
    assert not released.refuses("f") and len(released) == 0


def test_a_tombstone_refuses_up_to_kept_s_inclusive():
    now = [0.0]
    released = Released(kept_s=10.0, capacity=4, clock=lambda: now[0])
    released.add("a")
    released.add("b", ended=True)
    now[0] = 10.0  # exactly kept_s after the release: still within it
    assert released.refuses("a") and not released.refuses("a")
    assert released.refuses("b") and released.refuses("b") and len(released) == 1
    now[0] = 10.25
    assert not released.refuses("b") and len(released) == 0


def test_the_documented_release_bounds_are_the_defaults():
    """docs/operations.md and docs/wire.md: a release is bounded by 2 s, a refused one tried
    again for up to 30 s, and an ended request's later calls refused for 60 s."""
    assert RELEASE_TIMEOUT_S == 2.0 and RELEASE_BUSY_WAIT_S == 30.0
    now = [0.0]
    released = Released(clock=lambda: now[0])
    released.add("a", ended=True)
    now[0] = 60.0
    assert released.refuses("a") and released.refuses("a")
    now[0] = 60.5
    assert not released.refuses("a")
