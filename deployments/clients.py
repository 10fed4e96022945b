"""gRPC clients implementing the loop's Drafter and Verifier interfaces.

The first call of a request goes through Serve's gRPC proxy: metadata `application` picks the
pool's app and `session_id` (the request id) keys the consistent-hash request router, which
places the request on a replica. The answer names that replica's own gRPC address; the rest of
the request talks to it directly (a pin), which skips the proxy's cost per call. When the
pinned replica is gone the call falls back to the proxy, whose replica rebuilds the cache from
the committed prefix if it lacks it (the version stamp makes that exact).
"""

from dataclasses import replace

import grpc

from deployments import wire
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from speculative.types import DraftBlock, ProposeCall, ScoreCall, StaleBase, TargetScores

# codes meaning "that replica is not there any more": try Serve's routing instead
GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


class PoolError(RuntimeError):
    """A pool failed a call (unreachable, overloaded, internal error)."""


class PoolClient:
    """Calls one pool's rpcs: through the proxy to place a request, then directly."""

    def __init__(self, proxy_channel: grpc.aio.Channel, stub_class, application: str,
                 timeout_s: float, direct: bool) -> None:
        self.stub_class, self.application = stub_class, application
        self.timeout_s, self.direct = timeout_s, direct
        self.proxy = stub_class(proxy_channel)
        self.pins: dict[str, object] = {}  # request id -> stub of the replica holding it
        self._channels: dict[str, grpc.aio.Channel] = {}

    def metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        return (("application", self.application), ("session_id", request_id))

    async def call(self, method: str, message, request_id: str):
        stub = self.pins.get(request_id)
        if stub is not None:
            try:
                return await getattr(stub, method)(message, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as error:
                if error.code() not in GONE:
                    raise PoolError(f"{self.application}: {error.code().name}: "
                                    f"{error.details()}") from error
                del self.pins[request_id]
        try:
            response = await getattr(self.proxy, method)(
                message, metadata=self.metadata(request_id), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            raise PoolError(f"{self.application}: {error.code().name}: {error.details()}") \
                from error
        if self.direct and getattr(response, "direct_address", ""):
            self.pins[request_id] = self._stub(response.direct_address)
        return response

    async def release(self, request_id: str) -> None:
        """Best effort: a lost release only leaves a cache entry for the LRU to evict."""
        try:
            await self.call("Release", pb.ReleaseRequest(request_id=request_id), request_id)
        except PoolError:
            pass
        self.pins.pop(request_id, None)

    def _stub(self, address: str):
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address)
        return self.stub_class(self._channels[address])


class GrpcDrafter:
    def __init__(self, channel: grpc.aio.Channel, application: str, timeout_s: float,
                 direct: bool = True) -> None:
        self.pool = PoolClient(channel, pb_grpc.DrafterStub, application, timeout_s, direct)

    async def propose(self, call: ProposeCall) -> DraftBlock:
        message = wire.propose_to_proto(call)
        response = await self.pool.call("Propose", message, call.request_id)
        if response.status == pb.REBUILD:
            raise StaleBase(f"drafter replica {response.replica_id} asks for the full prefix")
        return replace(wire.block_from_proto(response),
                       wire_bytes=message.ByteSize() + response.ByteSize())

    async def release(self, request_id: str) -> None:
        await self.pool.release(request_id)


class GrpcVerifier:
    def __init__(self, channel: grpc.aio.Channel, application: str, timeout_s: float,
                 direct: bool = True) -> None:
        self.pool = PoolClient(channel, pb_grpc.VerifierStub, application, timeout_s, direct)

    async def score(self, call: ScoreCall) -> TargetScores:
        message = wire.score_to_proto(call)
        response = await self.pool.call("Score", message, call.request_id)
        if response.status == pb.REBUILD:
            raise StaleBase(f"verifier replica {response.replica_id} asks for the full prefix")
        return replace(wire.scores_from_proto(response),
                       wire_bytes=message.ByteSize() + response.ByteSize())

    async def release(self, request_id: str) -> None:
        await self.pool.release(request_id)
