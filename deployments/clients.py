"""gRPC clients implementing the loop's Drafter and Verifier interfaces.

The first call of a request goes through Serve's gRPC proxy: metadata `application` picks the
pool's app and `session_id` (the request id) keys the consistent-hash request router, which
places the request on a replica. The answer names that replica's own gRPC address; the rest of
the request talks to it directly (a pin), which skips the proxy's cost per call. When the
pinned replica is gone the call falls back to the proxy, whose replica rebuilds the cache from
the committed prefix if it lacks it (the version stamp makes that exact).

Every call has a deadline: the verifier's is long (a prefill may take seconds); the drafter's
is short, since a round that gives up on its draft goes on without one (speculative.loop),
except for seeded sampled requests, whose tokens depend on the drafts they got: they wait as
long as for the verifier. Releases are sent in the background and never delay an answer.
"""

import asyncio
import logging
from dataclasses import replace

import grpc

from deployments import auth, wire
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pb_grpc
from speculative.types import (
    DraftBlock,
    PoolUnavailable,
    ProposeCall,
    ScoreCall,
    StaleBase,
    TargetScores,
)

log = logging.getLogger(__name__)

# codes meaning "that replica is not there any more": try Serve's routing instead
GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
RELEASE_TIMEOUT_S = 2.0
RETRY_PAUSE_S, MAX_RETRY_PAUSE_S = 0.05, 0.8  # a GONE answer from the proxy, tried again
# the largest answer a pool sends is a q (drafter) or a few ids (verifier): 64 MB covers a
# dense float32 q over 33 positions of a 256k vocabulary
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = wire.message_size_options(MAX_MESSAGE_BYTES)


class PoolError(PoolUnavailable):
    """A pool failed a call; `pool` names it (its app) and `code` is the gRPC status. The
    details (addresses, exception text) are for the log, not for HTTP clients."""

    def __init__(self, pool: str, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__(f"{pool}: {code.name}: {details}")
        self.pool, self.code, self.details = pool, code, details

    @classmethod
    def of(cls, pool: str, error: grpc.aio.AioRpcError) -> "PoolError":
        return cls(pool, error.code(), error.details())


class PoolClient:
    """Calls one pool's rpcs: through the proxy to place a request, then directly."""

    def __init__(self, proxy_channel: grpc.aio.Channel, stub_class, application: str,
                 timeout_s: float, direct: bool) -> None:
        self.stub_class, self.application = stub_class, application
        self.timeout_s, self.direct = timeout_s, direct
        self.proxy = stub_class(proxy_channel)
        # request id -> (address, stub) of the replica holding its cache
        self.pins: dict[str, tuple[str, object]] = {}
        self._releasing: set[asyncio.Task] = set()
        self._channels: dict[str, grpc.aio.Channel] = {}

    def metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        return (("application", self.application), ("session_id", request_id),
                *auth.metadata())

    async def call(self, method: str, message, request_id: str, timeout_s: float | None = None):
        """The pool's answer; PoolError when it fails or the deadline (the whole call's,
        proxy fallback included) passes."""
        timeout_s = timeout_s or self.timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        pin = self.pins.get(request_id)
        if pin is not None:
            address, stub = pin
            try:
                return await getattr(stub, method)(message, timeout=timeout_s,
                                                   metadata=auth.metadata())
            except grpc.aio.AioRpcError as error:
                if error.code() not in GONE:
                    raise PoolError.of(self.application, error) from error
                del self.pins[request_id]
                # a dead replica's channel: new pins get a new one, and this one closes when
                # the last pin to it fails over (garbage collected)
                self._channels.pop(address, None)
                timeout_s = deadline - asyncio.get_running_loop().time()
                if timeout_s <= 0:
                    raise PoolError.of(self.application, error) from error
        response = await self._through_proxy(method, message, request_id, deadline)
        if self.direct and getattr(response, "direct_address", ""):
            self.pins[request_id] = (response.direct_address,
                                     self._stub(response.direct_address))
        return response

    async def _through_proxy(self, method: str, message, request_id: str, deadline: float):
        """The proxy's answer. Until Serve notices a dead replica its routing may still pick
        it: a GONE answer is tried again (after 50 ms, doubling to 0.8 s) while the deadline
        allows, so a request whose tokens depend on its drafts (seeded sampling) or a verify
        survives the window in which the replacement starts."""
        pause = RETRY_PAUSE_S
        while True:
            timeout_s = deadline - asyncio.get_running_loop().time()
            try:
                return await getattr(self.proxy, method)(
                    message, metadata=self.metadata(request_id), timeout=max(timeout_s, 1e-3))
            except grpc.aio.AioRpcError as error:
                if error.code() not in GONE or \
                        deadline - asyncio.get_running_loop().time() <= pause:
                    raise PoolError.of(self.application, error) from error
                log.debug("%s on %s through the proxy: %s, again in %.2f s", method,
                          self.application, error.code(), pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, MAX_RETRY_PAUSE_S)

    def release(self, request_id: str) -> None:
        """Send a Release in the background (bounded by RELEASE_TIMEOUT_S) and forget the
        pin at once; best effort: a lost release leaves a cache entry for the pool's LRU
        and TTL to evict."""
        pin = self.pins.pop(request_id, None)
        task = asyncio.create_task(self._release(request_id, pin and pin[1]))
        self._releasing.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._releasing.discard)

    async def _release(self, request_id: str, pin) -> None:
        message = pb.ReleaseRequest(request_id=request_id)
        try:
            if pin is not None:
                await pin.Release(message, timeout=RELEASE_TIMEOUT_S, metadata=auth.metadata())
            else:
                await self.proxy.Release(message, metadata=self.metadata(request_id),
                                         timeout=RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            log.debug("release of %s on %s: %s", request_id, self.application, error.code())

    def _stub(self, address: str):
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return self.stub_class(self._channels[address])


class GrpcDrafter:
    """timeout_s: a seeded sampled request's deadline; draft_timeout_s: everyone else's."""

    def __init__(self, channel: grpc.aio.Channel, application: str, timeout_s: float,
                 direct: bool = True, draft_timeout_s: float | None = None) -> None:
        self.pool = PoolClient(channel, pb_grpc.DrafterStub, application, timeout_s, direct)
        self.draft_timeout_s = draft_timeout_s or timeout_s

    async def propose(self, call: ProposeCall) -> DraftBlock:
        message = wire.propose_to_proto(call)
        sampling = call.sampling
        seeded = sampling.seed is not None and not sampling.greedy
        response = await self.pool.call("Propose", message, call.request_id,
                                        None if seeded else self.draft_timeout_s)
        if response.status == pb.REBUILD:
            raise StaleBase(f"drafter replica {response.replica_id} asks for the full prefix")
        try:
            block = wire.block_from_proto(response)
        except ValueError as error:  # a drafter's bad answer costs its draft, not the request
            raise PoolUnavailable(f"drafter: malformed answer: {error}") from None
        return replace(block, wire_bytes=message.ByteSize() + response.ByteSize())

    async def release(self, request_id: str) -> None:
        self.pool.release(request_id)


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
        self.pool.release(request_id)
