"""The router's client of one pool (PoolClient), under the loop's Drafter and Verifier
interfaces (deployments.pool_handles).

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

import grpc

from deployments import auth
from deployments.limits import Limits, message_size_options
from deployments.placement import LoadBound
from deployments.replica_stream import STREAMS, PoolError, ReplicaStream
from protos import specserve_pb2 as pb
from speculative.busy import retried_while_busy
from speculative.stats import SpecStats

log = logging.getLogger(__name__)

# codes meaning "that replica is not there any more": try Serve's routing instead
GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
RELEASE_TIMEOUT_S = 2.0
# a release refused for want of room is tried again for as long as a busy call (busy_wait_s)
RELEASE_BUSY_WAIT_S = 30.0
RETRY_PAUSE_S, MAX_RETRY_PAUSE_S = 0.05, 0.8  # a GONE answer from the proxy, tried again
# how Serve's proxy says UNAVAILABLE of an app that failed to deploy or was deleted
# (ray.serve.exceptions.DeploymentUnavailableError): that lasts until an operator deploys it
# again, so it is not waited out (each verify waited its whole deadline, 30 s, for its 503)
UNDEPLOYED = "is unavailable because it failed to deploy"
# the largest answer a pool sends is a q (drafter) or a few ids (verifier): 64 MB covers a
# dense float32 q over 33 positions of a 256k vocabulary; a router sizes its channels for its
# target's vocabulary (channel_options), as the pools size their ports (Limits)
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = message_size_options(MAX_MESSAGE_BYTES)


def channel_options(vocab_size: int, context: int | None) -> list[tuple[str, int]]:
    """A router's channel options for pools of this vocabulary and context: room for any
    message their ports send or take (Limits.stream_message_bytes: a dense float32 q of
    MAX_SPECULATIVE_TOKENS rows is 64 MiB at a 262,144-token vocabulary)."""
    return message_size_options(max(MAX_MESSAGE_BYTES,
                                    Limits(vocab_size, context).stream_message_bytes()))


class PoolClient:
    """Calls one pool's rpcs: through the proxy to place a request, then directly, over one
    stream per replica (ReplicaStream)."""

    def __init__(self, proxy_channel: grpc.aio.Channel, stub_class, application: str,
                 timeout_s: float, direct: bool, streams: bool = True,
                 options: list | None = None, bound: LoadBound | None = None) -> None:
        """streams: direct calls over one stream per replica (else one unary call each,
        kept for comparison: bench.serve_overhead); options: the direct channels'
        (channel_options; default CHANNEL_OPTIONS); bound: how a prompt's prefix places
        its first call (deployments.placement; default: by the prefix alone)."""
        self.stub_class, self.application = stub_class, application
        self.bound = bound or LoadBound(None)
        self.options = CHANNEL_OPTIONS if options is None else options
        self.timeout_s, self.direct, self.streams = timeout_s, direct, streams
        self.proxy = stub_class(proxy_channel)
        # request id -> address of the replica holding its cache
        self.pins: dict[str, str] = {}
        # request id -> the key its first call was placed by (prefix_route_key), while it lives
        self.routes: dict[str, str] = {}
        # route key -> the replica address a first call of that key now going through the
        # proxy will name (None if it fails): the key's other first calls wait for it
        self.placing: dict[str, asyncio.Future] = {}
        # spill key (a request's choices share it) -> (route key, replica or None) its first
        # choice's first call went by, once that call ends: the others wait for it (_follow)
        self.choices: dict[str, asyncio.Future] = {}
        self._releasing: set[asyncio.Task] = set()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: dict[tuple[str, str], ReplicaStream] = {}

    def metadata(self, route_key: str) -> tuple[tuple[str, str], ...]:
        return (("application", self.application), ("session_id", route_key),
                *auth.metadata())

    async def call(self, method: str, message, request_id: str, timeout_s: float | None = None,
                   route_key: str | None = None, spill_key: str | None = None):
        """The pool's answer; PoolError when it fails or the deadline (the whole call's,
        proxy fallback included) passes. route_key: what the proxy's consistent hash places
        an unpinned call by (default: the request id; prefix_route_key: its prompt's);
        spill_key: what it places a first call by that leaves its prefix's replica, full
        (self.bound; default: the request id), which the choices of one request share: the
        first of them is placed, the others follow it (routes and replica)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self.timeout_s)
        first = None
        if request_id not in self.routes and self.direct and spill_key is not None:
            if spill_key in self.choices:  # another choice of its request is being placed
                await self._follow(request_id, self.choices[spill_key], deadline)
            else:
                first = self.choices[spill_key] = loop.create_future()
        route_key = self.routes.get(request_id) or self.placed_by(request_id, route_key,
                                                                  spill_key)
        try:
            return await self._call(method, message, request_id, deadline, route_key,
                                    spill_key or request_id)
        finally:
            if first is not None:
                del self.choices[spill_key]
                first.set_result((route_key, self.pins.get(request_id)))

    def placed_by(self, request_id: str, route_key: str | None, spill_key: str | None) -> str:
        """The key a request's first call is placed by: its route key, or, when its
        prefix's replica is full, its spill key (and a pin on the replica it goes to when
        the bound names one)."""
        key = route_key or request_id
        if self.direct:
            spilled, address = self.bound.spill(key, self.pins)
            if spilled:
                key = spill_key or request_id
            if address is not None:
                self.pins[request_id] = address
        self.routes[request_id] = key
        return key

    async def _follow(self, request_id: str, first: asyncio.Future, deadline: float) -> None:
        """Place a choice as the first of its request's choices was (its route key, and its
        replica: the prompt is then a prefix hit there, not one prefill a replica) once
        that one's call has ended; on its own when it outlasts the deadline."""
        left = max(0.0, deadline - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait([first], timeout=left)  # not wait_for: _placed_beside
        if done:
            self.routes[request_id], address = first.result()
            if address is not None:
                self.pins[request_id] = address

    async def _call(self, method: str, message, request_id: str, deadline: float,
                    route_key: str, spill_key: str):
        loop = asyncio.get_running_loop()
        address = self.pins.get(request_id)
        if address is None:
            with self.bound.joined(route_key):  # counted until pinned
                if address := await self._placed_beside(route_key, deadline):
                    # where the first call of its key landed, unless that replica is full:
                    # then the least loaded, or one not met yet through the proxy (None)
                    await self.bound.counted(deadline)
                    address = self.bound.beside(route_key, address, self.pins)
                    if address is None:
                        route_key = self.routes[request_id] = spill_key
                    else:
                        self.pins[request_id] = address
        if address is not None:
            try:
                return await self._direct(address, method, message, deadline - loop.time())
            except PoolError as error:
                if error.code not in GONE:
                    raise
                self.pins.pop(request_id, None)
                self._forget(address)  # a dead replica: new pins open a new channel
                if deadline - loop.time() <= 0:
                    raise
        with self.bound.joined(route_key):
            return await self._placed(method, message, request_id, deadline, route_key)

    async def _placed(self, method: str, message, request_id: str, deadline: float,
                      route_key: str):
        """Through the proxy, pinned where it lands; the other first calls of its key wait
        for it (_placed_beside)."""
        placed = None
        if self.direct and route_key not in self.placing:  # the others of its key wait
            placed = self.placing[route_key] = asyncio.get_running_loop().create_future()
        address = None
        try:
            response = await self._through_proxy(method, message, route_key, deadline)
            if self.direct:
                address = getattr(response, "direct_address", "") or None
        finally:
            if placed is not None:
                del self.placing[route_key]
                placed.set_result(address)
        if address is not None:
            self.pins[request_id] = address
            self.bound.landed(route_key, address)
        return response

    async def _placed_beside(self, route_key: str, deadline: float) -> str | None:
        """The replica a call of the same route key now going through the proxy lands on
        (the choices of one request start together: one of them is placed, the others go
        straight to its replica, skipping the proxy's cost per call, and find the prompt
        there); None when no such call is in flight, or it fails or outlasts the deadline."""
        placing = self.placing.get(route_key)
        if placing is None:
            return None
        # asyncio.wait, not wait_for: before Python 3.12, wait_for returns the placement that
        # ends in the same turn as this call's cancellation (the request's choices are
        # cancelled together) and swallows the cancellation; the call then ran on for a
        # request already gone, and a pre-draft's left a session and a pin after the release
        left = max(0.0, deadline - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait([placing], timeout=left)
        return placing.result() if done else None

    async def unplaced(self, method: str, message, route_key: str):
        """The answer to a call that reads no session (any replica serves it): through the
        proxy, within the pool's timeout."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        return await self._through_proxy(method, message, route_key, deadline)

    async def _through_proxy(self, method: str, message, route_key: str, deadline: float):
        """The proxy's answer. Until Serve notices a dead replica its routing may still pick
        it: a GONE answer is tried again (after 50 ms, doubling to 0.8 s) while the deadline
        allows, so a request whose tokens depend on its drafts (seeded sampling) or a verify
        survives the window in which the replacement starts; not an app's that failed to
        deploy (UNDEPLOYED)."""
        pause = RETRY_PAUSE_S
        while True:
            timeout_s = deadline - asyncio.get_running_loop().time()
            try:
                return await getattr(self.proxy, method)(
                    message, metadata=self.metadata(route_key), timeout=max(timeout_s, 1e-3))
            except grpc.aio.AioRpcError as error:
                if error.code() not in GONE or UNDEPLOYED in (error.details() or "") or \
                        deadline - asyncio.get_running_loop().time() <= pause:
                    raise PoolError.of(self.application, error) from error
                log.debug("%s on %s through the proxy: %s, again in %.2f s", method,
                          self.application, error.code(), pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, MAX_RETRY_PAUSE_S)

    def release(self, request_id: str) -> None:
        """Send a Release in the background (bounded by RELEASE_TIMEOUT_S) and forget the
        pin at once; best effort: a lost release leaves a cache entry for the pool's LRU
        and TTL to evict. One the pool refuses for want of room (its port at its concurrent
        rpcs: a burst of Releases waiting for its worker) is tried again, as a busy call is
        (speculative.busy), for up to RELEASE_BUSY_WAIT_S."""
        address = self.pins.pop(request_id, None)
        route_key = self.routes.pop(request_id, request_id)
        task = asyncio.create_task(self._release(request_id, address, route_key))
        self._releasing.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._releasing.discard)

    async def _release(self, request_id: str, address: str | None, route_key: str) -> None:
        message = pb.ReleaseRequest(request_id=request_id, ended=True)  # (Released)

        async def once() -> None:
            try:
                if address is not None:
                    await self._stub(address).Release(message, timeout=RELEASE_TIMEOUT_S,
                                                      metadata=auth.metadata())
                else:
                    await self.proxy.Release(message, metadata=self.metadata(route_key),
                                             timeout=RELEASE_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                log.debug("release of %s on %s: %s", request_id, self.application,
                          error.code())
                if address is not None and error.code() in GONE:
                    self._drop_unused_channel(address)
                raise PoolError.of(self.application, error) from None

        try:  # a refusal for want of room (BusyPoolError) is waited out, as a busy call's
            await retried_while_busy(RELEASE_BUSY_WAIT_S, SpecStats(), once)
        except PoolError:
            pass

    def _drop_unused_channel(self, address: str) -> None:
        """Forget the channel to a replica found gone (its stream ended, a release failed),
        unless a stream still uses it. A release's _stub made a new one after its streams
        had ended: kept, a router held one more channel for every replica that went away
        while a request pinned to it was ending."""
        if not any(key[0] == address for key in self._streams):
            self._channels.pop(address, None)

    def _stub(self, address: str):
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=self.options)
        return self.stub_class(self._channels[address])

    async def _direct(self, address: str, method: str, message, timeout_s: float):
        if self.streams:
            return await self._stream(address, method).call(message, timeout_s)
        try:
            return await getattr(self._stub(address), method)(message, timeout=timeout_s,
                                                              metadata=auth.metadata())
        except grpc.aio.AioRpcError as error:
            raise PoolError.of(self.application, error) from error

    def _stream(self, address: str, method: str) -> ReplicaStream:
        """The open stream to the replica at `address` for `method`'s calls (a broken one is
        replaced: the replica may have only dropped that stream)."""
        stream = self._streams.get((address, method))
        if stream is None or stream.broken is not None:
            if stream is not None:
                stream.close()
            rpc, batch_type, entry_type = STREAMS[method]
            stream = ReplicaStream(self._stub(address), rpc, batch_type, entry_type,
                                   self.application, self._ended)
            self._streams[address, method] = stream
        return stream

    def _ended(self, stream: ReplicaStream) -> None:
        """A stream that broke is dropped (one whose replica was scaled down while no call
        was waiting on it was kept for good), and, when its replica is gone, the replica's
        place in self.bound and its channel once no stream of it is left. A stream only
        refused (busy, say) keeps the channel, and the replica's other stream stays: the
        next call opens a new one."""
        gone = stream.broken is None or stream.broken.code == grpc.StatusCode.UNAVAILABLE
        for key, held in list(self._streams.items()):
            if held is stream:
                del self._streams[key]
                if gone:  # no replica to spill to (the least loaded: it holds none)
                    self.bound.forget(key[0])
                    self._drop_unused_channel(key[0])

    def _forget(self, address: str) -> None:
        """Drop a dead replica's streams and channel (the channel closes when the last
        request pinned to it has failed over: garbage collected)."""
        for key in [key for key in self._streams if key[0] == address]:
            self._streams.pop(key).close()
        self._channels.pop(address, None)
        self.bound.forget(address)
