"""What a caller of Serve's gRPC proxy sees when a pool refuses it. The proxy applies the
status a replica sets on its context only with a message the replica yields (a stream that
ends without one ends OK), and it routes every rpc of specserve.proto to the application the
call's metadata names, whichever pool that is."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from ray.serve._private.grpc_util import set_grpc_code_and_details
from ray.serve._private.proxy_request_response import ResponseStatus
from ray.serve.grpc_util import RayServegRPCContext

from deployments import auth
from deployments.pool_args import VerifierArgs
from deployments.pools import DrafterPool, VerifierPool
from protos import specserve_pb2 as pb
from tests.unit.test_pool_replica import local_replica, pool_secret  # noqa: F401 (fixture)


class CallerContext:
    """The proxy's own gRPC context of the caller's call: the status its caller gets."""

    def __init__(self, metadata) -> None:
        self.metadata, self.status = metadata, (None, None)

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code) -> None:
        self.status = (code, self.status[1])

    def set_details(self, details) -> None:
        self.status = (self.status[0], details)

    def code(self):
        return self.status[0]

    def details(self):
        return self.status[1]


def caller(key: bool = True) -> SimpleNamespace:
    """The caller's side as Serve's proxy hands it to a replica."""
    metadata = [("application", "drafter")] + ([(auth.METADATA_KEY, "test-secret")] if key
                                                else [])
    return SimpleNamespace(auth_context=dict, code=lambda: None, details=lambda: None,
                           invocation_metadata=lambda: metadata,
                           peer=lambda: "ipv4:10.0.0.9:4242", peer_identities=lambda: None,
                           peer_identity_key=lambda: None, trailing_metadata=list)


def through_the_proxy(stream_rpc, batch, key: bool = True) -> tuple:
    """(the messages the caller reads, its status) of a stream through Serve's proxy, as its
    stream_stream handler runs one: the replica's context applied with each message, then
    OK unless a status was set (ray.serve._private.proxy)."""
    seen = caller(key)
    real = CallerContext(seen.invocation_metadata())

    async def batches():
        yield batch

    async def main():
        messages = []
        context = RayServegRPCContext(seen)
        async for message in stream_rpc(batches(), context):
            context._set_on_grpc_context(real)
            messages.append(message)
        set_grpc_code_and_details(real, ResponseStatus(code=grpc.StatusCode.OK))
        return messages

    return asyncio.run(main()), real.status


def bare(cls):
    """A pool replica without its engine: these refusals come before a call reaches one."""
    return cls.__new__(cls)


def test_a_stream_without_the_pool_key_is_unauthenticated_for_the_proxys_caller():
    """The replica set UNAUTHENTICATED and yielded nothing: the proxy never applied it, and
    its caller's stream ended OK without an answer, its calls silently lost."""
    batch = pb.ScoreBatch(entries=[pb.ScoreEntry(tag=1, call=pb.ScoreRequest(
        request_id="a", sync=pb.PrefixSync(new_token_ids=[1, 2])))])
    messages, status = through_the_proxy(bare(VerifierPool).ScoreStream, batch, key=False)
    assert all(not message.answers for message in messages)
    assert status == (grpc.StatusCode.UNAUTHENTICATED, "this pool serves the router only")


def router():
    """The router's class as far as these rpcs go (a bare instance of its ingress wrapper
    warns as it is collected): its methods are Unserved's."""
    from deployments.pool_replies import Unserved
    from deployments.router import Router

    assert all(getattr(Router, rpc) is getattr(Unserved, rpc) for rpc in RPCS)
    return type("RouterRpcs", (Unserved,), {"serves": Router.serves})


RPCS = ("Propose", "ProposeStream", "Score", "ScoreStream", "PromptLogprobs", "Release")


@pytest.mark.parametrize("cls, rpc, message, serves", [
    (DrafterPool, "Score", pb.ScoreRequest(request_id="a"), "the drafter pool"),
    (DrafterPool, "PromptLogprobs", pb.PromptLogprobsRequest(request_id="a"),
     "the drafter pool"),
    (VerifierPool, "Propose", pb.ProposeRequest(request_id="a"), "the verifier pool"),
    (router, "Propose", pb.ProposeRequest(request_id="a"), "the router"),
    (router, "Release", pb.ReleaseRequest(request_id="a"), "the router"),
])
def test_the_other_pools_unary_rpc_is_unimplemented(cls, rpc, message, serves):
    """Serve's proxy found no such method on the replica and answered INTERNAL with the
    replica's traceback (its pid and actor id), to callers without the pool key too."""
    cls = cls() if cls is router else cls
    for key in (True, False):
        context = RayServegRPCContext(caller(key))
        asyncio.run(getattr(bare(cls), rpc)(message, context))
        assert context.code() == grpc.StatusCode.UNIMPLEMENTED
        assert context.details().startswith(f"{serves} does not serve {rpc}:")


@pytest.mark.parametrize("cls, rpc, batch", [
    (DrafterPool, "ScoreStream", pb.ScoreBatch(entries=[pb.ScoreEntry(tag=1)])),
    (VerifierPool, "ProposeStream", pb.ProposeBatch(entries=[pb.ProposeEntry(tag=1)])),
])
def test_the_other_pools_stream_is_unimplemented_for_the_proxys_caller(cls, rpc, batch):
    messages, (code, details) = through_the_proxy(getattr(bare(cls), rpc), batch)
    assert all(not message.answers for message in messages)
    assert code == grpc.StatusCode.UNIMPLEMENTED and f"does not serve {rpc}:" in details


@pytest.mark.parametrize("request_id", ["", "x" * 257, "x" * (1 << 20)],
                         ids=["empty", "257 chars", "1 MiB"])
def test_a_release_of_an_id_no_call_could_have_is_invalid(request_id):
    """A call's request_id is 1 to 256 characters; a Release took any, and kept a tombstone
    of each (up to 4,096 of megabytes each)."""
    context = RayServegRPCContext(caller())
    response = asyncio.run(bare(VerifierPool).Release(pb.ReleaseRequest(request_id=request_id),
                                                      context))
    assert response == pb.ReleaseResponse()
    assert context.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details() == "request_id must be 1 to 256 characters"


@pytest.mark.parametrize("gate", [{"grammar_after_ids": [1 << 20]},
                                  {"grammar_after_ids": [3], "grammar_at_ids": [1 << 20]}],
                         ids=["grammar_after_ids", "grammar_at_ids"])
def test_a_grammar_gate_id_past_the_vocabulary_is_invalid(gate):
    """An end of the reasoning no token can be: the verifier answered grammar_gated and its
    grammar never held (every id allowed), where every other id list is checked."""
    async def main():
        replica = await local_replica(VerifierPool, VerifierArgs())
        context = RayServegRPCContext(caller())
        try:
            return await replica.Score(pb.ScoreRequest(
                request_id="g", sync=pb.PrefixSync(new_token_ids=[5, 6, 7]),
                sampling=pb.SamplingParams(grammar='start: "a"', **gate)), context), context
        finally:
            await replica.server.stop(None)

    response, context = asyncio.run(main())
    assert not response.grammar_gated and response.WhichOneof("scores") is None
    assert context.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details().startswith("token ids out of range [0, ")
