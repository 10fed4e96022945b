"""What a router reads from a pool at its edges: a release's flag, a prompt's logprobs'
replica, time and top n, a REBUILD as StaleBase, the status a stream's call fails with (its
entry's refusal, the stream's own, its first, a close's), a withdrawn call's cancel after its
entry, a replica's answers within the message bound, a q's negative id; a replica's load as
Serve's autoscaler reads it (its direct calls, not the proxy's), and a release that goes on
when its handler is cancelled."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest
import torch
from ray.serve.grpc_util import RayServegRPCContext

from deployments import pool_handles, pools, wire_tensors
from deployments.autoscaling import DIRECT_IN_FLIGHT
from deployments.limits import STREAM_MESSAGE_BYTES
from deployments.pool_args import VerifierArgs
from deployments.pools import VerifierPool
from deployments.replica_stream import BusyPoolError, PoolError, ReplicaStream
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ProposeCall, ScoreCall, StaleBase
from tests.unit.test_pool_client_streams import Answering, Refusing
from tests.unit.test_pool_replica import (  # noqa: F401
    KEY,
    direct,
    hold_engine,
    local_drafter,
    local_replica,
    pool_secret,
    propose,
    until,
)


def test_a_release_says_whether_the_replica_held_the_request():
    """ReleaseResponse.released: true for a session the replica held, false for a request it
    holds nothing of (never seen, or released already)."""
    async def main():
        replica = await local_drafter()
        await replica.Propose(propose("a"))
        answers = [await replica.Release(pb.ReleaseRequest(request_id=request_id))
                   for request_id in ("a", "a", "never")]
        await replica.server.stop(None)
        return [answer.released for answer in answers], replica.session_ids()

    assert asyncio.run(main()) == ([True, False, False], [])


def test_a_prompts_logprobs_name_their_replica_and_its_compute_time():
    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs())
        answer = await replica.PromptLogprobs(pb.PromptLogprobsRequest(
            request_id="p", token_ids=range(1, 9), top_n=1))
        await replica.server.stop(None)
        return answer

    answer = asyncio.run(main())
    assert answer.replica_id == "local" and answer.compute_us > 0
    assert len(answer.logprobs) == 7 and answer.top_n == 1


def score_stream(stub) -> ReplicaStream:
    """The router's Score stream to a replica over `stub`."""
    return ReplicaStream(stub, "ScoreStream", pb.ScoreBatch, pb.ScoreEntry, "verifier")


class Gated:
    """A Score stream stub whose first write waits for `gate`; it keeps what is written
    and never answers."""

    def __init__(self) -> None:
        self.written, self.gate = [], asyncio.Event()

    def ScoreStream(self, metadata):
        return self

    async def write(self, message):
        if not self.written:
            self.written.append(message)
            await self.gate.wait()
        else:
            self.written.append(message)

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()

    def cancel(self) -> None:
        pass


def test_a_withdrawn_call_is_cancelled_after_its_entry_not_before():
    """Calls made while a message is written go in the next messages, within their bound;
    cancels of those withdrawn meanwhile go in the last of them: a cancel that reached the
    replica before its entry would name nothing, and the withdrawn call would run."""
    stub = Gated()
    big = pb.ScoreRequest(request_id="r " + "x" * 900_000)  # four to a message

    async def main():
        stream = score_stream(stub)
        first = asyncio.ensure_future(stream.call(pb.ScoreRequest(request_id="a"), 5.0))
        while not stub.written:  # the writer waits on the first message
            await asyncio.sleep(0.01)
        calls = [asyncio.ensure_future(stream.call(big, 5.0)) for _ in range(8)]
        await asyncio.sleep(0.01)
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        stub.gate.set()
        while sum(len(message.entries) for message in stub.written) < 9 or \
                not any(message.cancel for message in stub.written):
            await asyncio.sleep(0.01)
        stream.close()
        await asyncio.gather(first, return_exceptions=True)

    asyncio.run(main())
    assert len(stub.written) > 2
    written = set()
    for message in stub.written:
        written |= {entry.tag for entry in message.entries}
        assert set(message.cancel) <= written
    assert sorted(tag for message in stub.written for tag in message.cancel) == list(range(2, 10))


def test_a_streams_first_failure_is_the_one_its_calls_see():
    """A stream refused by a busy replica, then closed: a call still made on it learns the
    refusal (busy: it waits and tries again), not the close's UNAVAILABLE (Serve's routing,
    a new placement)."""
    async def main():
        stream = score_stream(Refusing())
        while stream.broken is None:
            await asyncio.sleep(0.01)
        stream.close()
        with pytest.raises(BusyPoolError) as refused:
            await stream.call(pb.ScoreRequest(request_id="a"), 5.0)
        return refused.value.code

    assert asyncio.run(main()) == grpc.StatusCode.RESOURCE_EXHAUSTED


CODE = grpc.StatusCode


@pytest.mark.parametrize("ended, failed", [
    (CODE.UNAUTHENTICATED, CODE.UNAUTHENTICATED), (CODE.PERMISSION_DENIED, CODE.PERMISSION_DENIED),
    (CODE.UNIMPLEMENTED, CODE.UNIMPLEMENTED), (CODE.INVALID_ARGUMENT, CODE.INVALID_ARGUMENT),
    (CODE.INTERNAL, CODE.UNAVAILABLE), (CODE.UNKNOWN, CODE.UNAVAILABLE),
    (CODE.CANCELLED, CODE.UNAVAILABLE)])
def test_a_call_on_a_stream_that_ends_fails_with_its_refusal_or_as_gone(ended, failed):
    """A stream's own refusal stands for its waiting call; any other end means its replica
    is gone: UNAVAILABLE (Serve's routing), whatever the code says."""
    async def main():
        stream = score_stream(Refusing(ended))
        with pytest.raises(PoolError) as failure:
            await stream.call(pb.ScoreRequest(request_id="a"), 5.0)
        stream.close()
        return failure.value

    failure = asyncio.run(main())
    assert failure.code == failed and not isinstance(failure, BusyPoolError)


def test_a_refused_entry_fails_its_call_with_the_replicas_status():
    """A call refused in its answer fails with the replica's own status (INVALID_ARGUMENT:
    the router's 400; RESOURCE_EXHAUSTED: busy, waited out), and the calls beside it go on."""
    async def main():
        stream = score_stream(Answering("replica"))
        ids = [str(CODE.INVALID_ARGUMENT.value[0]), "ok", str(CODE.RESOURCE_EXHAUSTED.value[0])]
        results = await asyncio.gather(*(stream.call(pb.ScoreRequest(request_id=request_id),
                                                     5.0) for request_id in ids),
                                       return_exceptions=True)
        stream.close()
        return results

    bad, answered, busy = asyncio.run(main())
    assert type(bad) is PoolError and bad.code == CODE.INVALID_ARGUMENT
    assert answered.replica_id == "replica"
    assert isinstance(busy, BusyPoolError) and busy.code == CODE.RESOURCE_EXHAUSTED


def test_closing_a_stream_fails_its_waiting_calls_at_once_as_unavailable():
    """A closed stream's calls go to Serve's routing now (UNAVAILABLE), not at their
    deadline."""
    async def main():
        stream = score_stream(Gated())
        call = asyncio.ensure_future(stream.call(pb.ScoreRequest(request_id="a"), 5.0))
        await asyncio.sleep(0.01)
        stream.close()
        with pytest.raises(PoolError) as failure:
            await call
        return failure.value.code, failure.value.details

    assert asyncio.run(main()) == (CODE.UNAVAILABLE, "stream closed")


def test_a_q_with_a_negative_id_is_refused():
    """A sparse q's ids lie in [0, vocab_size): a negative one (which a gather would read
    from the vocabulary's end) is a malformed answer, as one past its end is."""
    weights = torch.full((2, 2), 0.5)
    for bad in (-1, 50):
        ids = torch.tensor([[3, 7], [bad, 1]], dtype=torch.int32)
        message = pb.Distributions(probs=wire_tensors.tensor_to_proto(weights),
                                   ids=wire_tensors.tensor_to_proto(ids), vocab_size=50)
        with pytest.raises(ValueError, match="ids out of range"):
            wire_tensors.dists_from_proto(message)
    message.ids.CopyFrom(wire_tensors.tensor_to_proto(ids.clamp(max=49)))
    assert wire_tensors.dists_from_proto(message).ids.tolist() == [[3, 7], [49, 1]]


def test_a_replicas_answers_finished_together_go_back_in_messages_within_the_bound(
        monkeypatch):
    """Many calls' q finished in one batch go back in several messages, each within
    STREAM_MESSAGE_BYTES and all in order (one message of them all could pass what the
    router's channel takes, which broke the stream and failed every call on it)."""
    finished = [pb.ProposeAnswer(tag=tag, response=pb.ProposeResponse(
        replica_id="x" * 900_000)) for tag in range(1, 11)]  # the size of a large q

    class Finished:
        def __init__(self, *args) -> None:
            pass

        async def serve(self, batches):
            yield finished

    monkeypatch.setattr(pools, "CallStream", Finished)

    async def main():
        return [message async for message in pools.PoolReplica.stream(
            None, None, None, None, None, None, pb.ProposeResponse, pb.ProposeAnswer,
            pb.ProposeAnswers)]

    messages = asyncio.run(main())
    assert [answer.tag for message in messages for answer in message.answers] == \
        list(range(1, 11))
    assert len(messages) > 1
    assert max(message.ByteSize() for message in messages) <= STREAM_MESSAGE_BYTES + 1024


@pytest.mark.parametrize("pool", ["drafter", "verifier"])
def test_a_replica_asking_for_a_rebuild_makes_the_router_resend_the_prefix(monkeypatch, pool):
    """status REBUILD: the replica lacks the call's base; the call raises StaleBase (the loop
    resends the whole prefix), not a malformed answer that costs the round its draft."""
    monkeypatch.setattr(pool_handles.pb_grpc, f"{pool.capitalize()}Stub", lambda channel: None)
    sync, params = PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3)), SamplingParams(temperature=0)
    if pool == "drafter":
        client = pool_handles.GrpcDrafter(None, "drafter", timeout_s=1.0)
        asked, answer = client.propose(ProposeCall("r", sync, 3, params, seed=0)), \
            pb.ProposeResponse(status=pb.REBUILD, replica_id="replica")
    else:
        client = pool_handles.GrpcVerifier(None, "verifier", timeout_s=1.0)
        asked, answer = client.score(ScoreCall("r", sync, (), params)), \
            pb.ScoreResponse(status=pb.REBUILD, replica_id="replica")

    async def call(method, message, request_id, timeout_s=None, route_key=None, spill_key=None):
        return answer

    monkeypatch.setattr(client.pool, "call", call)
    with pytest.raises(StaleBase, match="replica replica asks for the full prefix"):
        asyncio.run(asked)


def test_a_prompts_logprobs_call_asks_for_the_requests_top_n(monkeypatch):
    monkeypatch.setattr(pool_handles.pb_grpc, "VerifierStub", lambda channel: None)
    verifier = pool_handles.GrpcVerifier(None, "verifier", timeout_s=1.0)
    sent = []

    async def unplaced(method, message, request_id):
        sent.append((method, message, request_id))
        return pb.PromptLogprobsResponse(logprobs=[-1.0, -2.0], ranks=[1, 2], top_n=3,
                                         top_ids=[5, 6, 7, 8, 9, 10],
                                         top_logprobs=[-0.5, -1.0, -1.5, -0.1, -2.0, -3.0])

    monkeypatch.setattr(verifier.pool, "unplaced", unplaced)
    got = asyncio.run(verifier.prompt_logprobs("p", [1, 2, 3], 3))
    [(method, message, request_id)] = sent
    assert (method, request_id, list(message.token_ids), message.top_n) == \
        ("PromptLogprobs", "p", [1, 2, 3], 3)
    assert got.ranks == (1, 2) and [len(entry.top) for entry in got.entries] == [3, 3]


def through_the_proxy():
    """The context Serve's proxy hands a replica for a call of the router's (its pool key)."""
    caller = SimpleNamespace(auth_context=dict, code=lambda: None, details=lambda: None,
                             invocation_metadata=lambda: [("application", "drafter"), *KEY()],
                             peer=lambda: "ipv4:10.0.0.9:4242", peer_identities=lambda: None,
                             peer_identity_key=lambda: None, trailing_metadata=list)
    return RayServegRPCContext(caller)


def test_only_direct_calls_are_reported_as_load_serve_cannot_see():
    """Serve's autoscaler counts the calls its proxy routes itself; the replica reports the
    ones on its own port (DIRECT_IN_FLIGHT), which it adds: a proxied call counted there too
    was counted twice, and one left counted scaled the pool up for good."""
    async def main():
        replica = await local_drafter()
        async with direct(replica, pb_grpc.DrafterStub) as stub:
            gate = await hold_engine(replica)  # the model is busy: every call waits
            calls = [asyncio.ensure_future(replica.Propose(propose(f"p{i}"),
                                                           through_the_proxy()))
                     for i in range(2)]
            calls += [asyncio.ensure_future(stub.Propose(propose(f"d{i}"), metadata=KEY()))
                      for i in range(3)]
            await until(lambda: replica.waiting == 5)
            waiting = await replica.record_autoscaling_stats()
            gate.set()
            answers = await asyncio.gather(*calls)
            done = await replica.record_autoscaling_stats()
            return waiting, answers, done, replica.direct_calls_served()

    waiting, answers, done, served = asyncio.run(main())
    assert all(len(answer.token_ids) == 3 for answer in answers)
    assert waiting[DIRECT_IN_FLIGHT] == 3.0 and done[DIRECT_IN_FLIGHT] == 0.0 and served == 3


def test_a_release_whose_handler_is_cancelled_before_the_worker_is_free_still_happens():
    """The router gives up on a release the busy worker has not reached (its deadline): the
    handler is cancelled, and the session still goes once the worker is free (unshielded, the
    release's job was cancelled with it and the session waited for the TTL)."""
    async def main():
        replica = await local_drafter()
        await replica.Propose(propose("a"))
        gate = await hold_engine(replica)
        queued, submit = asyncio.Event(), replica.worker.submit

        def submitted(*args):
            queued.set()
            return submit(*args)

        replica.worker.submit = submitted
        handler = asyncio.ensure_future(replica.Release(pb.ReleaseRequest(request_id="a")))
        await queued.wait()  # the release's job waits for the worker
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)
        gate.set()
        # the worker runs its jobs in order: the release's, if any, before this one
        await replica.on_worker(lambda: None)
        await replica.server.stop(None)
        return handler.cancelled(), replica.session_ids()

    assert asyncio.run(main()) == (True, [])
