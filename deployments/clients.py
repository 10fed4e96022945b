"""gRPC clients implementing the loop's Drafter and Verifier interfaces.

Calls go through Serve's gRPC proxy: metadata `application` picks the pool's app and
`session_id` (the request id) keys the consistent-hash request router, so every call of a
request reaches the replica holding its KV cache while the pool's size is unchanged.
"""

import grpc

from deployments import wire
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from speculative.types import DraftBlock, ProposeCall, ScoreCall, StaleBase, TargetScores


class PoolError(RuntimeError):
    """A pool failed a call (unreachable, overloaded, internal error)."""


def metadata(application: str, request_id: str) -> tuple[tuple[str, str], ...]:
    return (("application", application), ("session_id", request_id))


class GrpcDrafter:
    def __init__(self, channel: grpc.aio.Channel, application: str, timeout_s: float) -> None:
        self.stub = pb_grpc.DrafterStub(channel)
        self.application, self.timeout_s = application, timeout_s
        self.replicas: dict[str, str] = {}  # request id -> replica id of the last answer

    async def propose(self, call: ProposeCall) -> DraftBlock:
        response = await invoke(self.stub.Propose, wire.propose_to_proto(call),
                                metadata(self.application, call.request_id), self.timeout_s)
        self.replicas[call.request_id] = response.replica_id
        if response.status == pb.REBUILD:
            raise StaleBase(f"drafter replica {response.replica_id} asks for the full prefix")
        return wire.block_from_proto(response)

    async def release(self, request_id: str) -> None:
        self.replicas.pop(request_id, None)
        await release(self.stub, self.application, request_id, self.timeout_s)


class GrpcVerifier:
    def __init__(self, channel: grpc.aio.Channel, application: str, timeout_s: float) -> None:
        self.stub = pb_grpc.VerifierStub(channel)
        self.application, self.timeout_s = application, timeout_s
        self.replicas: dict[str, str] = {}

    async def score(self, call: ScoreCall) -> TargetScores:
        response = await invoke(self.stub.Score, wire.score_to_proto(call),
                                metadata(self.application, call.request_id), self.timeout_s)
        self.replicas[call.request_id] = response.replica_id
        if response.status == pb.REBUILD:
            raise StaleBase(f"verifier replica {response.replica_id} asks for the full prefix")
        return wire.scores_from_proto(response)

    async def release(self, request_id: str) -> None:
        self.replicas.pop(request_id, None)
        await release(self.stub, self.application, request_id, self.timeout_s)


async def invoke(method, message, call_metadata, timeout_s: float):
    try:
        return await method(message, metadata=call_metadata, timeout=timeout_s)
    except grpc.aio.AioRpcError as error:
        raise PoolError(f"{call_metadata[0][1]}: {error.code().name}: {error.details()}") from error


async def release(stub, application: str, request_id: str, timeout_s: float) -> None:
    """Best effort: a lost release only leaves a cache entry for the LRU to evict."""
    try:
        await stub.Release(pb.ReleaseRequest(request_id=request_id),
                           metadata=metadata(application, request_id), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        pass
