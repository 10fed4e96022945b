"""PoolClient: a proxy answer saying the replica is gone is tried again within the deadline;
the first calls of one placement (the choices of a request) cross the proxy once."""

import asyncio
import logging
from types import SimpleNamespace

import grpc
import pytest

from deployments import auth, clients, pool_handles, replica_stream
from deployments.clients import PoolClient, PoolError


class Gone(grpc.aio.AioRpcError):
    def __init__(self, code=grpc.StatusCode.UNAVAILABLE):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "replica gone")


class Proxy:
    """A proxy stub whose first `failures` Propose calls fail with `code`."""

    def __init__(self, failures: int, code=grpc.StatusCode.UNAVAILABLE) -> None:
        self.failures, self.code, self.calls = failures, code, 0

    async def Propose(self, message, metadata, timeout):
        self.calls += 1
        if self.calls <= self.failures:
            raise Gone(self.code)
        return "answer"


def client(proxy: Proxy, timeout_s: float) -> PoolClient:
    return PoolClient(None, lambda channel: proxy, "drafter", timeout_s, direct=False)


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(auth, "_secret", "test-secret")  # no Ray to share one through
    monkeypatch.setattr(clients, "RETRY_PAUSE_S", 0.001)
    monkeypatch.setattr(clients, "MAX_RETRY_PAUSE_S", 0.002)


def test_a_gone_replica_is_tried_again_until_the_replacement_answers():
    proxy = Proxy(failures=3)
    assert asyncio.run(client(proxy, 5.0).call("Propose", None, "r1")) == "answer"
    assert proxy.calls == 4


def test_other_errors_are_not_retried():
    proxy = Proxy(failures=3, code=grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(PoolError) as error:
        asyncio.run(client(proxy, 5.0).call("Propose", None, "r1"))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and proxy.calls == 1


def test_retries_stop_at_the_deadline():
    proxy = Proxy(failures=10**9)
    with pytest.raises(PoolError) as error:
        asyncio.run(client(proxy, 0.05).call("Propose", None, "r1"))
    assert error.value.code == grpc.StatusCode.UNAVAILABLE and 1 < proxy.calls < 10**9


def test_whole_prompts_that_start_alike_are_placed_alike():
    """A call carrying a whole prompt is placed by its first 32 tokens (prefix caching's
    replica); a call that builds on a held prefix, or a short prompt, by its request."""
    from deployments.placement import ROUTE_PREFIX_TOKENS, prefix_route_key
    from speculative.types import EMPTY_PREFIX_HASH, PrefixSync

    shared = tuple(range(1, ROUTE_PREFIX_TOKENS + 1))
    first = prefix_route_key("a", PrefixSync(0, EMPTY_PREFIX_HASH, shared + (7, 8)))
    second = prefix_route_key("b", PrefixSync(0, EMPTY_PREFIX_HASH, shared + (9,)))
    other = prefix_route_key("c", PrefixSync(0, EMPTY_PREFIX_HASH, (5,) + shared))
    assert first == second != other and first.startswith("prefix-")
    assert prefix_route_key("d", PrefixSync(0, EMPTY_PREFIX_HASH, shared[:-1])) == "d"
    assert prefix_route_key("e", PrefixSync(40, 123, (1,))) == "e"
    # a short prompt: the placement its request's choices share; a later call: its own id
    assert prefix_route_key("g-0", PrefixSync(0, EMPTY_PREFIX_HASH, (5,)), placement="g") == "g"
    assert prefix_route_key("g-0", PrefixSync(3, 123, (1,)), placement="g") == "g-0"
    whole = PrefixSync(0, EMPTY_PREFIX_HASH, shared + (7,))
    assert prefix_route_key("f", whole, tokens=0) == "f"  # the router's knob: off


def test_only_a_pools_refusal_for_want_of_room_is_busy():
    """RESOURCE_EXHAUSTED from the pool (its KV cache or its calls in flight full) is
    PoolBusy, which the round loop waits out; gRPC's own for an oversized message, and any
    other code, is not."""
    import grpc

    from deployments.replica_stream import pool_error
    from speculative.types import PoolBusy

    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(pool_error("verifier", exhausted, "the KV cache needs 3 more"), PoolBusy)
    assert not isinstance(pool_error("verifier", exhausted,
                                     "Received message larger than max (9 vs. 4)"), PoolBusy)
    assert not isinstance(pool_error("verifier", grpc.StatusCode.UNAVAILABLE, "gone"), PoolBusy)


class Placing:
    """A proxy stub whose Score calls stay in flight a moment, then name replica r:1 (or fail
    with INVALID_ARGUMENT, the first `failures` of them)."""

    def __init__(self, failures: int = 0) -> None:
        self.failures, self.calls = failures, 0

    async def Score(self, message, metadata, timeout):
        self.calls += 1
        await asyncio.sleep(0.01)  # the other choices start meanwhile
        if self.calls <= self.failures:
            raise Gone(grpc.StatusCode.INVALID_ARGUMENT)
        return SimpleNamespace(direct_address="r:1")


def placed(proxy: Placing, monkeypatch, choices: int = 4):
    """Each choice's first call (as the router makes them: one route key, at once) and the
    direct calls made: (results or errors, [(address, message)], client)."""
    pool = PoolClient(None, lambda channel: proxy, "verifier", 5.0, direct=True)
    direct = []

    async def straight(address, method, message, timeout_s):
        direct.append((address, message))
        return "direct"

    monkeypatch.setattr(pool, "_direct", straight)

    async def main():
        return await asyncio.gather(*(pool.call("Score", i, f"x-{i}", route_key="x")
                                      for i in range(choices)), return_exceptions=True)

    return asyncio.run(main()), direct, pool


def test_the_choices_of_a_request_cross_the_proxy_once(monkeypatch):
    """One choice's first call is placed through the proxy; the others wait for its answer
    and go straight to the replica it names, pinned there."""
    proxy = Placing()
    results, direct, pool = placed(proxy, monkeypatch)
    assert proxy.calls == 1 and sorted(message for _, message in direct) == [1, 2, 3]
    assert {address for address, _ in direct} == {"r:1"}
    assert pool.pins == {f"x-{i}": "r:1" for i in range(4)} and not pool.placing
    assert results.count("direct") == 3


def test_when_the_placing_call_fails_the_others_are_placed_by_the_proxy(monkeypatch):
    proxy = Placing(failures=1)
    results, direct, pool = placed(proxy, monkeypatch)
    assert isinstance(results[0], PoolError) and proxy.calls == 4 and not direct
    assert pool.pins == {f"x-{i}": "r:1" for i in range(1, 4)} and not pool.placing


def test_a_call_waiting_for_its_placement_when_its_request_is_cancelled_ends():
    """A request's choices are cancelled together (its client went away): the placing call
    ends, resolving the placement, in the same turn of the loop as the cancellation of a
    call waiting for it. That call ends cancelled; it was going on through the proxy (with
    asyncio.wait_for, which returned the placement), a pre-draft's leaving a session on the
    pool and a pin in the router after the request's release."""
    proxy = Placing()
    pool = PoolClient(None, lambda channel: proxy, "verifier", 5.0, direct=True)

    async def main():
        placing = pool.placing["x"] = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(pool.call("Score", 1, "x-1", route_key="x"))
        await asyncio.sleep(0.01)  # it waits for the placement
        placing.set_result(None)  # the placing call ended (cancelled: no replica named)...
        waiting.cancel()  # ...as this one was cancelled
        await asyncio.gather(waiting, return_exceptions=True)
        del pool.placing["x"]
        return waiting.cancelled()

    assert asyncio.run(main())
    assert proxy.calls == 0 and not pool.pins


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
    from deployments.limits import STREAM_MESSAGE_BYTES, Limits
    from protos import specserve_pb2 as pb

    big = pb.ScoreRequest(request_id="r " + "x" * 900_000)  # the size of a large q
    stub = Recording()

    async def main():
        stream = replica_stream.ReplicaStream(stub, "ScoreStream", pb.ScoreBatch, pb.ScoreEntry,
                                       "verifier")
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
    from deployments.limits import Limits

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
    from protos import specserve_pb2 as pb

    class Answering(Recording):
        def __init__(self) -> None:
            super().__init__()
            self.answers: asyncio.Queue = asyncio.Queue()

        async def write(self, message):
            for entry in message.entries:
                answer = pb.ScoreAnswer(tag=entry.tag)
                if entry.call.request_id == "odd":
                    answer.error.code, answer.error.details = 99, "a code of no gRPC"
                else:
                    answer.response.CopyFrom(pb.ScoreResponse())
                await self.answers.put(pb.ScoreAnswers(answers=[answer]))

        def __aiter__(self):
            return self

        async def __anext__(self):
            return await self.answers.get()

        def cancel(self) -> None:
            pass

    async def main():
        stream = replica_stream.ReplicaStream(Answering(), "ScoreStream", pb.ScoreBatch,
                                       pb.ScoreEntry, "verifier")
        odd = await asyncio.gather(stream.call(pb.ScoreRequest(request_id="odd"), 5.0),
                                   return_exceptions=True)
        fine = await stream.call(pb.ScoreRequest(request_id="fine"), 5.0)
        stream.close()
        return odd[0], fine

    odd, fine = asyncio.run(main())
    assert isinstance(odd, PoolError) and odd.code == grpc.StatusCode.UNKNOWN
    assert isinstance(fine, pb.ScoreResponse)


def test_in_messages_keeps_the_order_and_sends_an_oversized_item_alone():
    from deployments.limits import in_messages
    from protos import specserve_pb2 as pb

    items = [pb.ReleaseRequest(request_id="x" * n) for n in (10, 10, 50, 10, 10)]
    runs = in_messages(items, budget=30)
    assert [item for run in runs for item in run] == items
    assert [len(run) for run in runs] == [2, 1, 2]
    assert in_messages([], budget=30) == [[]]


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.OUT_OF_RANGE,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.UNAUTHENTICATED])
def test_only_a_gone_replica_is_tried_again_through_the_proxy(code):
    """A pool's failure or refusal fails the call at once (the round loop decides: a busy
    pool is waited out there); trying it again here would hold the request to its deadline."""
    proxy = Proxy(failures=10**9, code=code)
    with pytest.raises(PoolError) as error:
        asyncio.run(client(proxy, 5.0).call("Propose", None, "r1"))
    assert error.value.code == code and proxy.calls == 1


class Releases:
    """A stub class whose stubs record the Release calls they get, by channel (None: the
    proxy's)."""

    def __init__(self) -> None:
        self.released = []

    def __call__(self, channel):
        outer = self

        class Stub:
            async def Release(self, message, metadata=None, timeout=None):
                outer.released.append((channel, message.request_id))

        return Stub()


def test_a_release_goes_to_the_pinned_replica_and_forgets_the_pin(monkeypatch):
    """The replica that holds the request's cache gets its Release (the proxy's routing may
    pick another, which would leave the cache to the TTL); the pin goes at once (a router
    serves requests for months: a pin kept per request is a leak)."""
    stubs = Releases()
    monkeypatch.setattr(clients.grpc.aio, "insecure_channel", lambda address, options: address)
    pool = PoolClient("proxy", stubs, "verifier", 5.0, direct=True)
    pool.pins.update({"pinned": "r:1"})

    async def main():
        pool.release("pinned")
        pool.release("unpinned")
        await asyncio.gather(*pool._releasing)

    asyncio.run(main())
    assert sorted(stubs.released) == [("proxy", "unpinned"), ("r:1", "pinned")]
    assert not pool.pins and not pool.routes


def test_a_seeded_sampled_draft_waits_as_long_as_a_verify(monkeypatch):
    """Its tokens depend on the drafts it gets: a draft given up on would change them. Other
    drafts wait draft_timeout_s (a round goes on without one)."""
    from speculative.sampling import SamplingParams
    from speculative.types import EMPTY_PREFIX_HASH, PrefixSync, ProposeCall

    monkeypatch.setattr(pool_handles.pb_grpc, "DrafterStub", lambda channel: None)
    drafter = pool_handles.GrpcDrafter(None, "drafter", timeout_s=30.0, draft_timeout_s=0.05)
    deadlines = []

    async def call(method, message, request_id, timeout_s=None, route_key=None, spill_key=None):
        deadlines.append(timeout_s or drafter.pool.timeout_s)  # as PoolClient.call reads it
        raise PoolError("drafter", grpc.StatusCode.UNAVAILABLE, "gone")

    monkeypatch.setattr(drafter.pool, "call", call)
    sync = PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3))
    for sampling in (SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0),
                     SamplingParams(temperature=0.0, seed=7)):
        with pytest.raises(PoolError):
            asyncio.run(drafter.propose(ProposeCall("r", sync, 3, sampling, seed=0)))
    assert deadlines == [30.0, 0.05, 0.05]


@pytest.mark.parametrize("rows, tokens", [(2, (1, 2, 3)), (3, (1, 2, 16))])
def test_a_drafters_q_unlike_its_tokens_costs_the_draft_not_the_request(monkeypatch, rows,
                                                                         tokens):
    """q with fewer rows than drafted tokens, or a token outside q's vocabulary: the answer
    is malformed (PoolUnavailable: the round goes on without a draft). Taken, the verifier
    refused the round's q (INVALID_ARGUMENT), or accept() its tokens, and the request failed."""
    import torch

    from deployments import wire
    from speculative.sampling import SamplingParams
    from speculative.types import (
        EMPTY_PREFIX_HASH,
        DraftBlock,
        DraftDists,
        PoolUnavailable,
        PrefixSync,
        ProposeCall,
    )

    monkeypatch.setattr(pool_handles.pb_grpc, "DrafterStub", lambda channel: None)
    drafter = pool_handles.GrpcDrafter(None, "drafter", timeout_s=1.0)
    q = DraftDists.from_dense(torch.full((rows, 16), 1 / 16))
    answer = wire.block_to_proto(DraftBlock(tokens, q))

    async def call(method, message, request_id, timeout_s=None, route_key=None, spill_key=None):
        return answer

    monkeypatch.setattr(drafter.pool, "call", call)
    propose = ProposeCall("r", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3)), 3,
                          SamplingParams(temperature=1.0), seed=0)
    with pytest.raises(PoolUnavailable, match="malformed answer: draft_probs"):
        asyncio.run(drafter.propose(propose))


def test_a_drafter_whose_calls_keep_failing_is_said_in_the_log_at_most_once_a_minute(
        monkeypatch):
    """Each failure turns a round into the target's alone (speculative.loop), which only a
    counter showed: a misnamed or dead drafter app switched speculation off silently."""
    from speculative.sampling import SamplingParams
    from speculative.types import EMPTY_PREFIX_HASH, PrefixSync, ProposeCall

    monkeypatch.setattr(pool_handles.pb_grpc, "DrafterStub", lambda channel: None)
    drafter = pool_handles.GrpcDrafter(None, "drafterr", timeout_s=30.0, draft_timeout_s=0.05)
    now = [100.0]
    drafter.failures.clock = lambda: now[0]

    async def call(method, message, request_id, timeout_s=None, route_key=None, spill_key=None):
        raise PoolError("drafter", grpc.StatusCode.NOT_FOUND, "no application 'drafterr'")

    monkeypatch.setattr(drafter.pool, "call", call)
    propose = ProposeCall("r", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3)), 3,
                          SamplingParams(temperature=0.0), seed=0)
    from tests.unit.test_ingress import Records  # Serve's logger does not propagate

    with Records() as records:
        for seconds in (0, 1, 30, 59, 61, 62):
            now[0] = 100.0 + seconds
            with pytest.raises(PoolError):
                asyncio.run(drafter.propose(propose))
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("'drafterr'" in w for w in warnings)
    assert "1 failed" in warnings[0] and "4 failed" in warnings[1]


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
    """A stream stub refused by its replica (too many calls in flight), no call waiting."""

    async def __anext__(self):
        await asyncio.sleep(0.01)
        raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(), details="busy")


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
    from deployments.replica_stream import BusyPoolError, ReplicaStream
    from protos import specserve_pb2 as pb

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
