"""The direct data path's stream (ProposeStream, ScoreStream): every call a router has
waiting for a replica goes in one message, the replica's batcher receives them together, and
each call is answered (or refused) by its own tag."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from deployments import clients, pools
from deployments.clients import PoolClient, PoolError, ReplicaStream
from deployments.pool_args import DrafterArgs, VerifierArgs
from deployments.pools import DrafterPool, VerifierPool
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from tests.unit.test_pool_replica import (  # noqa: F401
    KEY,
    direct,
    hold_engine,
    local_replica,
    pool_secret,
    until,
)


def propose(request_id: str, k: int, prompt: list[int]) -> pb.ProposeRequest:
    return pb.ProposeRequest(request_id=request_id, num_speculative_tokens=k,
                             sync=pb.PrefixSync(new_token_ids=prompt),
                             sampling=pb.SamplingParams(temperature=0))


# each call its own prompt and K: an answer given to another call's tag shows
CALLS = [propose(f"r{k}", k, [5 + k, 6, 7 + 2 * k]) for k in (1, 2, 3, 4)]


async def one_message(stub, entries, cancel=()):
    """Write one ProposeBatch and read answers until every entry not cancelled has one."""
    stream = stub.ProposeStream(metadata=KEY())
    await stream.write(pb.ProposeBatch(entries=entries, cancel=cancel))
    answers, messages = {}, 0
    while len(answers) < len(entries) - len(cancel):
        message = await stream.read()
        messages += 1
        answers.update({answer.tag: answer for answer in message.answers})
    stream.cancel()
    return answers, messages


def recording(replica) -> dict:
    """{request id: the future} of every call the replica is submitted from now on."""
    submitted, submit = {}, replica.submit

    def recorded(check, from_proto, call, **options):
        submitted[call.request_id] = submit(check, from_proto, call, **options)
        return submitted[call.request_id]

    replica.submit = recorded
    return submitted


def answers_match(answers: dict, expected: dict) -> bool:
    """Every tag's answer is its own call's: the unary answer of the same call."""
    return all(answers[tag].response.token_ids == expected[tag].token_ids for tag in expected)


async def unary_answers(replica, stub) -> dict:
    """Each call's answer, alone (under another request id: a released one's next call is
    refused, deployments.released)."""
    expected = {}
    for tag, call in enumerate(CALLS, 1):
        alone = pb.ProposeRequest()
        alone.CopyFrom(call)
        alone.request_id += "-alone"
        expected[tag] = await stub.Propose(alone, metadata=KEY())
        await stub.Release(pb.ReleaseRequest(request_id=alone.request_id), metadata=KEY())
    return expected


def run_stream_case(mutant=None):
    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs())
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            expected = await unary_answers(replica, stub)
            assert len({tuple(e.token_ids) for e in expected.values()}) == len(CALLS)
            gate = await hold_engine(replica)  # busy: the message's calls wait together
            entries = [pb.ProposeEntry(tag=tag, call=call) for tag, call in enumerate(CALLS, 1)]
            reply = asyncio.ensure_future(one_message(stub, entries))
            await until(lambda: replica.waiting == len(CALLS))
            gate.set()
            answers, messages = await reply
            return answers, expected, messages, replica

    return asyncio.run(main())


def test_one_message_is_one_batch_answered_by_tag():
    answers, expected, messages, replica = run_stream_case()
    assert answers_match(answers, expected)
    assert messages == 1  # one batch finished them all: one message back
    assert {answer.response.load.batch_size for answer in answers.values()} == {len(CALLS)}
    assert all(a.response.direct_address == replica.address for a in answers.values())
    assert replica.direct_in_flight == 0 and replica.direct_calls_served() == len(CALLS) * 2


def test_a_mutant_that_swaps_two_answers_fails(monkeypatch):
    real = pb.ProposeAnswer

    def swapped(tag, **fields):  # the answers of tags 1 and 2 under each other's tag
        return real(tag={1: 2, 2: 1}.get(tag, tag), **fields)

    monkeypatch.setattr(pools.pb, "ProposeAnswer", swapped)
    answers, expected, _, _ = run_stream_case()
    assert not answers_match(answers, expected)


def test_a_bad_entry_is_refused_alone_and_a_cancelled_one_never_runs():
    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs())
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            bad = propose("bad", 2, [10**6])  # outside the vocabulary
            gate = await hold_engine(replica)
            stream = stub.ProposeStream(metadata=KEY())
            await stream.write(pb.ProposeBatch(entries=[pb.ProposeEntry(tag=1, call=CALLS[0])]))
            await until(lambda: replica.waiting == 1)  # its batch waits for the worker
            await stream.write(pb.ProposeBatch(entries=[  # these queue behind it
                pb.ProposeEntry(tag=2, call=bad), pb.ProposeEntry(tag=3, call=CALLS[1])]))
            await until(lambda: replica.waiting == 2)
            await stream.write(pb.ProposeBatch(cancel=[3]))  # its caller gave up
            await until(lambda: replica.waiting == 1)
            # a call whose cancel shares its message (written right after it) is withdrawn too
            submitted = recording(replica)
            await stream.write(pb.ProposeBatch(entries=[pb.ProposeEntry(tag=4, call=CALLS[2])],
                                               cancel=[4]))
            await until(lambda: "r3" in submitted and submitted["r3"].done())
            gate.set()
            answers = {}
            while len(answers) < 2:
                answers.update({a.tag: a for a in (await stream.read()).answers})
            await until(lambda: replica.waiting == 0)
            stream.cancel()
            assert answers[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "out of range" in answers[2].error.details
            assert len(answers[1].response.token_ids) == 1
            assert replica.session_ids() == ["r1"]  # the cancelled calls never ran
            assert replica.direct_in_flight == 0

    asyncio.run(main())


def test_a_tag_still_running_is_refused_not_answered_twice():
    """Tags are the router's counter; one repeated (a client of the pool's own port) is
    refused, where the first call to finish took the tag's one answer and the other's was
    lost though it ran."""
    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs())
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            gate = await hold_engine(replica)
            stream = stub.ProposeStream(metadata=KEY())
            await stream.write(pb.ProposeBatch(entries=[pb.ProposeEntry(tag=5, call=CALLS[0]),
                                                        pb.ProposeEntry(tag=5, call=CALLS[1])]))
            # the refusal comes at once, while the engine is held (before: no answer until
            # the calls ran; the bound only ends a run that would otherwise hang)
            first = list((await asyncio.wait_for(stream.read(), 60)).answers)
            gate.set()
            second = list((await stream.read()).answers)
            stream.cancel()
            assert [a.tag for a in first + second] == [5, 5]
            assert first[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert len(second[0].response.token_ids) == 1  # r1's: K = 1
            await until(lambda: replica.direct_in_flight == 0)
            assert replica.session_ids() == ["r1"]

    asyncio.run(main())


def test_a_stream_through_serves_proxy_without_the_secret_is_unauthenticated():
    """Serve's proxy hands the replica a RayServegRPCContext, which has no abort: the
    refusal raised AttributeError, which the proxy sent the caller (any host reaching port
    9000) as INTERNAL with the replica's traceback. It is UNAUTHENTICATED, and no call runs."""
    from ray.serve.grpc_util import RayServegRPCContext

    # the caller's side as Serve's proxy reads it: no pool key
    caller = SimpleNamespace(auth_context=dict, code=lambda: None, details=lambda: None,
                             invocation_metadata=lambda: [("application", "verifier")],
                             peer=lambda: "ipv4:10.0.0.9:4242", peer_identities=lambda: None,
                             peer_identity_key=lambda: None, trailing_metadata=list)

    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs())
        context = RayServegRPCContext(caller)

        async def batches():
            yield pb.ScoreBatch(entries=[pb.ScoreEntry(tag=1, call=pb.ScoreRequest(
                request_id="a", sync=pb.PrefixSync(new_token_ids=[1, 2])))])

        answers = [answer async for answer in replica.ScoreStream(batches(), context)]
        await replica.server.stop(None)
        return answers, context, len(replica.engine.sessions)

    answers, context, sessions = asyncio.run(main())
    # one empty message, no answer: the proxy applies the context's status with a message
    # only (test_pool_proxy_refusals)
    assert answers == [pb.ScoreAnswers()] and sessions == 0
    assert context.code() == grpc.StatusCode.UNAUTHENTICATED
    assert context.details() == "this pool serves the router only"


def test_a_stream_without_the_secret_is_refused():
    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs())
        async with direct(replica, pb_grpc.VerifierStub) as stub:
            stream = stub.ScoreStream()
            # the refusal ends the stream at once: it reaches the write when it lands first
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stream.write(pb.ScoreBatch(entries=[pb.ScoreEntry(
                    tag=1, call=pb.ScoreRequest(request_id="a",
                                                sync=pb.PrefixSync(new_token_ids=[1, 2])))]))
                await stream.read()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert len(replica.engine.sessions) == 0

    asyncio.run(main())


def test_a_stream_refused_for_a_full_port_is_busy_and_a_new_one_serves():
    """A replica's port at its concurrent rpcs (here 2, held by two Releases waiting for its
    worker) refuses the router's new stream: its call is busy (the request waits and tries
    again, not a 503), and once the port has room a new stream serves it."""
    from deployments.replica_stream import BusyPoolError
    from deployments.streams import serve_directly

    class Replica(pb_grpc.VerifierServicer):

        async def Release(self, request, context):
            self.holding += 1
            await self.gate.wait()
            return pb.ReleaseResponse()

        async def ScoreStream(self, batches, context):
            async for batch in batches:
                yield pb.ScoreAnswers(answers=[pb.ScoreAnswer(tag=entry.tag,
                                                              response=pb.ScoreResponse())
                                               for entry in batch.entries])

    async def main():
        replica = Replica()
        replica.gate, replica.holding = asyncio.Event(), 0
        server, address = await serve_directly(replica, pb_grpc.add_VerifierServicer_to_server,
                                               max_concurrent_rpcs=2)
        client = PoolClient(None, lambda channel: channel and pb_grpc.VerifierStub(channel),
                            "verifier", 5.0, direct=True)
        stub = client._stub(address)
        releases = [asyncio.ensure_future(stub.Release(pb.ReleaseRequest(request_id=f"r{i}"),
                                                       metadata=KEY())) for i in range(2)]
        client.pins["a"] = client.pins["b"] = address
        try:
            await until(lambda: replica.holding == 2)
            with pytest.raises(BusyPoolError):
                await client.call("Score", pb.ScoreRequest(request_id="a"), "a")
            replica.gate.set()
            await asyncio.gather(*releases)
            answer = await client.call("Score", pb.ScoreRequest(request_id="b"), "b")
            assert isinstance(answer, pb.ScoreResponse)
        finally:
            replica.gate.set()
            await server.stop(None)

    asyncio.run(main())


def test_the_client_pins_then_streams_and_falls_back_when_the_replica_is_gone():
    """PoolClient: the proxy places the request, later calls share the replica's stream
    (concurrent ones in one message), and a stopped replica fails them over to the proxy."""
    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs())

        class Proxy:  # Serve's proxy, standing in: the replica itself, through a unary call
            calls = 0

            async def Propose(self, message, metadata, timeout):
                Proxy.calls += 1
                return await replica.Propose(message)

        client = PoolClient(None, lambda channel: Proxy() if channel is None else
                            pb_grpc.DrafterStub(channel), "drafter", 5.0, direct=True)
        for call in CALLS:
            await client.call("Propose", call, call.request_id)
        assert Proxy.calls == len(CALLS) and set(client.pins.values()) == {replica.address}
        gate = await hold_engine(replica)
        again = [propose(c.request_id, c.num_speculative_tokens, []) for c in CALLS]
        for message, call in zip(again, CALLS):  # builds on the prefix the first call sent
            message.sync.known_len = len(call.sync.new_token_ids)
            message.sync.known_hash = pools.prefix_hash(list(call.sync.new_token_ids))
        calls = [asyncio.ensure_future(client.call("Propose", m, m.request_id)) for m in again]
        await until(lambda: replica.waiting == len(CALLS))
        gate.set()
        answers = await asyncio.gather(*calls)
        assert Proxy.calls == len(CALLS)  # all direct, over the stream
        assert {a.load.batch_size for a in answers} == {len(CALLS)}
        stream = client._streams[replica.address, "Propose"]
        await replica.server.stop(None)
        await until(lambda: stream.broken is not None)
        assert stream.broken.code in clients.GONE
        fallback = await client.call("Propose", CALLS[0], CALLS[0].request_id)
        assert Proxy.calls == len(CALLS) + 1 and len(fallback.token_ids) == 1

    asyncio.run(main())


def test_a_deadline_withdraws_the_call():
    async def main():
        replica = await local_replica(DrafterPool, DrafterArgs())
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            stream = ReplicaStream(stub, "ProposeStream", pb.ProposeBatch, pb.ProposeEntry,
                                   "drafter")
            gate = await hold_engine(replica)
            submitted = recording(replica)
            running = asyncio.ensure_future(stream.call(CALLS[2], 5.0))
            await until(lambda: replica.waiting == 1)  # its batch waits for the worker
            with pytest.raises(PoolError) as late:
                await stream.call(CALLS[0], 0.2)  # queued behind it
            assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            # its entry and then its cancel reached the replica (they may share a message),
            # which withdrew it from the queue
            await until(lambda: "r1" in submitted and submitted["r1"].cancelled())
            await until(lambda: replica.waiting == 1)  # counted out of the queue
            gate.set()
            assert len((await running).token_ids) == 3
            answer = await stream.call(CALLS[1], 5.0)
            assert len(answer.token_ids) == 2
            assert sorted(replica.session_ids()) == ["r2", "r3"]  # r1 never ran
            stream.close()

    asyncio.run(main())


@pytest.mark.parametrize("breaks", ["submit", "stream"])
def test_a_broken_stream_ends_with_its_error_with_no_call_running(breaks):
    """Its reader failing (a bug in a submit, or the incoming stream broken) ends serve()
    with that error: it does not wait on for answers no call will give."""
    from types import SimpleNamespace

    from deployments.streams import CallStream

    class Replica:
        direct_in_flight, max_direct_calls = 0, 8

        def submit(self, *args, **options):
            raise KeyError("a bug")

    async def batches():
        if breaks == "stream":
            raise ConnectionResetError("the router went away")
        yield SimpleNamespace(entries=[SimpleNamespace(tag=1, call=None)], cancel=[])

    async def main():
        stream = CallStream(Replica(), None, None, None, None)
        # a hang would fail at the guard's timeout (the reader fails at once)
        return await asyncio.wait_for(anext(stream.serve(batches()), None), 60)

    with pytest.raises(KeyError if breaks == "submit" else ConnectionResetError):
        asyncio.run(main())


def test_a_port_takes_calls_up_to_its_bound_and_refuses_the_next():
    """max_direct_calls in flight are taken; the next is RESOURCE_EXHAUSTED at once."""
    from types import SimpleNamespace

    from deployments.streams import CallStream

    class Replica:
        direct_in_flight, max_direct_calls = 0, 2

        def submit(self, check, call_from_proto, call, direct):
            self.direct_in_flight += 1
            return asyncio.get_running_loop().create_future()

    async def main():
        stream = CallStream(Replica(), None, None, None, pb.ProposeAnswer)
        stream.take(SimpleNamespace(entries=[SimpleNamespace(tag=tag, call=None)
                                             for tag in range(3)], cancel=[]))
        return stream

    stream = asyncio.run(main())
    assert sorted(stream.running) == [0, 1]
    assert [(answer.tag, answer.error.code) for answer in stream.finished] == \
        [(2, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])]
