"""PoolClient's streams to replicas: calls that wait together go in messages within the pools'
bound over channels sized for them, an answer's unknown status fails only its call, and a
stream that ends or is refused leaves behind only what the replica still serves (the next
call opens a new one)."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from deployments import clients
from deployments.clients import PoolClient, PoolError
from deployments.limits import STREAM_MESSAGE_BYTES, Limits, in_messages
from deployments.replica_stream import BusyPoolError, ReplicaStream
from protos import specserve_pb2 as pb
from tests.unit.test_pool_client import fast_retries  # noqa: F401 (autouse)


class Recording:
    """A stream stub that keeps what is written to it and never answers."""

    def __init__(self) -> None:
        self.written = []

    def ScoreStream(self, metadata):
        return self

    async def write(self, message):
        self.written.append(message)

    async def read(self):
        await asyncio.sleep(60)


def test_calls_that_wait_together_go_in_messages_within_the_pools_bound():
    """Twenty sampled calls of 900 KB of q each (a large vocabulary at K = 8) wait together:
    they go in messages of at most STREAM_MESSAGE_BYTES, which a pool's port takes (one
    message of them all was refused and broke the stream, failing every call on it)."""
    big = pb.ScoreRequest(request_id="r " + "x" * 900_000)  # the size of a large q
    stub = Recording()

    async def main():
        stream = ReplicaStream(stub, "ScoreStream", pb.ScoreBatch, pb.ScoreEntry, "verifier")
        calls = [asyncio.ensure_future(stream.call(big, 0.5)) for _ in range(20)]
        await asyncio.sleep(0.05)
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        for task in stream.tasks:
            task.cancel()

    asyncio.run(main())
    sizes = [message.ByteSize() for message in stub.written]
    assert sum(len(message.entries) for message in stub.written) == 20
    assert len(sizes) > 1 and max(sizes) <= STREAM_MESSAGE_BYTES + 1024
    limits = Limits(vocab_size=4096, context=2048)
    assert limits.stream_message_bytes() >= max(sizes + [limits.message_bytes()])


@pytest.mark.parametrize("vocab_size", [4096, 151_936, 262_144])
def test_a_routers_channels_take_every_message_its_pools_may_send(vocab_size):
    """A dense float32 q of 64 rows over a 262,144-token vocabulary (Gemma 3's; HTTP allows
    K = 64, the drafter's default q is dense float32) is 64 MiB and more with its framing: a
    pool's port sends what Limits allows, so the router's channels are sized for its target
    (a fixed 64 MiB broke the drafter stream, failing every call on it)."""
    limits = Limits(vocab_size, 131_072)
    options = dict(clients.channel_options(vocab_size, 131_072))
    assert options["grpc.max_receive_message_length"] >= limits.stream_message_bytes()
    assert options["grpc.max_send_message_length"] >= limits.stream_message_bytes()
    assert dict(clients.CHANNEL_OPTIONS)["grpc.max_receive_message_length"] \
        <= options["grpc.max_receive_message_length"]


def test_an_answer_with_a_status_code_grpc_lacks_fails_its_call_not_the_reader():
    """A refusal whose code is none of gRPC's fails its call with UNKNOWN; the stream's reader
    goes on, so the next call is answered (a KeyError there left every later call on the
    stream waiting for its deadline)."""
    async def main():
        stream = ReplicaStream(Answering(), "ScoreStream", pb.ScoreBatch, pb.ScoreEntry,
                               "verifier")
        odd = await asyncio.gather(stream.call(pb.ScoreRequest(request_id="99"), 5.0),
                                   return_exceptions=True)
        fine = await stream.call(pb.ScoreRequest(request_id="fine"), 5.0)
        stream.close()
        return odd[0], fine

    odd, fine = asyncio.run(main())
    assert isinstance(odd, PoolError) and odd.code == grpc.StatusCode.UNKNOWN
    assert isinstance(fine, pb.ScoreResponse)


def test_in_messages_keeps_the_order_and_sends_an_oversized_item_alone():
    items = [pb.ReleaseRequest(request_id="x" * n) for n in (10, 10, 50, 10, 10)]
    runs = in_messages(items, budget=30)
    assert [item for run in runs for item in run] == items
    assert [len(run) for run in runs] == [2, 1, 2]
    assert in_messages([], budget=30) == [[]]


class Ending:
    """A stream stub whose stream ends (its replica went away) with no call waiting."""

    def ScoreStream(self, metadata):
        return self

    async def write(self, message):
        pass

    def cancel(self):
        pass

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0.01)
        raise StopAsyncIteration


class Answering(Ending):
    """A stream stub answering each call at once, in a message of its own: a request id of
    digits refused with that status code (a code of none of gRPC's too), any other answered
    by replica `replica_id`."""

    def __init__(self, replica_id: str = "r:1") -> None:
        self.replica_id, self.answers = replica_id, asyncio.Queue()

    async def write(self, message):
        for entry in message.entries:
            answer = pb.ScoreAnswer(tag=entry.tag)
            if entry.call.request_id.isdigit():
                answer.error.code, answer.error.details = int(entry.call.request_id), "no"
            else:
                answer.response.CopyFrom(pb.ScoreResponse(replica_id=self.replica_id))
            self.answers.put_nowait(pb.ScoreAnswers(answers=[answer]))

    async def __anext__(self):
        return await self.answers.get()


def ended_stream(stub) -> tuple:
    """(the client, its Score stream to one replica, whether each of the stream's tasks had
    ended while the loop ran) once the stream has ended by itself and the client has seen
    it end (asyncio.run cancels whatever is left when it returns)."""
    pool = PoolClient(None, lambda channel: stub, "verifier", 5.0, direct=True)

    async def main():
        stream = pool._stream("127.0.0.1:1", "Score")
        while stream.broken is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        return stream, [task.done() for task in stream.tasks]

    return pool, *asyncio.run(main())


def test_a_stream_that_ends_with_no_call_waiting_leaves_nothing_behind():
    """A replica scaled down while no call of this router waits on it: its stream ends, and
    the client drops it, its channel and its writer (kept for good before: no call came to
    fail over and forget the replica)."""
    pool, stream, done = ended_stream(Ending())
    assert stream.broken.code == grpc.StatusCode.UNAVAILABLE and done == [True, True]
    assert not pool._streams and not pool._channels


class Lasting(Ending):
    """As Ending, but its Propose stream stays open."""

    def ProposeStream(self, metadata):
        return Open()


class Open(Ending):
    async def __anext__(self):
        await asyncio.Event().wait()


def test_a_stream_that_ends_leaves_the_replicas_other_stream_and_channel():
    """Only the stream that ended goes (it may only have been refused, busy): the replica's
    other stream keeps its calls, and the channel they share stays."""
    pool = PoolClient(None, lambda channel: Lasting(), "verifier", 5.0, direct=True)

    async def main():
        proposing = pool._stream("127.0.0.1:1", "Propose")
        scoring = pool._stream("127.0.0.1:1", "Score")
        while scoring.broken is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        kept = dict(pool._streams), dict(pool._channels)
        proposing.close()
        return proposing, kept

    proposing, (streams, channels) = asyncio.run(main())
    assert streams == {("127.0.0.1:1", "Propose"): proposing} and list(channels) == ["127.0.0.1:1"]


class Refusing(Ending):
    """A stream stub its replica ends with `code`: by default refused (too many calls in
    flight)."""

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED) -> None:
        self.code = code

    async def __anext__(self):
        await asyncio.sleep(0.01)
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="busy")


def test_a_stream_refused_by_a_live_replica_keeps_its_channel():
    """The replica is there, only busy: the stream goes (the next call opens another) and
    the channel stays, with its connection."""
    pool, stream, _ = ended_stream(Refusing())
    assert stream.broken.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not pool._streams and list(pool._channels) == ["127.0.0.1:1"]


class RefusedBeforeTheWrite(Ending):
    """A stream the replica refused (its port full) before the client's first write, whose
    reader has not yet read that status: grpc's write then raises InvalidStateError."""

    async def write(self, message):
        raise asyncio.InvalidStateError("RPC already finished.")

    def done(self):
        return True

    async def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    async def details(self):
        return "Concurrent RPC limit exceeded!"

    async def __anext__(self):
        await asyncio.Event().wait()  # the reader comes second


def test_a_stream_refused_before_its_first_write_is_busy_not_gone():
    """Whichever task sees the refusal first, the call learns the replica's status: busy
    (it waits and tries again), not UNAVAILABLE (which sent it to Serve's routing, a new
    placement, while its replica was only full: a test flaked on it under load)."""
    async def main():
        stream = ReplicaStream(RefusedBeforeTheWrite(), "ScoreStream", pb.ScoreBatch,
                               pb.ScoreEntry, "verifier")
        try:
            await stream.call(pb.ScoreRequest(request_id="a"), 5.0)
        except BusyPoolError as error:
            return error.code
        finally:
            stream.close()

    assert asyncio.run(main()) == grpc.StatusCode.RESOURCE_EXHAUSTED


class Refused(RefusedBeforeTheWrite):
    """As RefusedBeforeTheWrite, saying whether the client cancelled it."""

    cancelled = False

    def cancel(self):
        self.cancelled = True


def test_the_call_after_a_stream_refused_on_its_write_opens_a_new_one(monkeypatch):
    """A replica's port full when the stream's first message went (its reader not yet
    told): that call is busy, and the next one goes on a new stream, the refused one closed
    (kept, every later call to the replica was refused by it to its deadline)."""
    monkeypatch.setattr(clients.grpc.aio, "insecure_channel", lambda address, options: address)
    streams = [Refused(), Answering()]
    opened = iter(streams)
    stub = SimpleNamespace(ScoreStream=lambda metadata: next(opened))
    pool = PoolClient(None, lambda channel: stub, "verifier", 5.0, direct=True)
    pool.pins["r"] = "r:1"

    async def main():
        with pytest.raises(BusyPoolError):
            await pool.call("Score", pb.ScoreRequest(request_id="r"), "r")
        return await pool.call("Score", pb.ScoreRequest(request_id="r"), "r")

    assert asyncio.run(main()).replica_id == "r:1"
    assert streams[0].cancelled and pool.pins == {"r": "r:1"}
