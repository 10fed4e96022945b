"""One direct stream of a pool replica (ProposeStream, ScoreStream; see specserve.proto):
the calls of each incoming message are queued for the replica's batcher together, and the
answers finished meanwhile go back in one message, each under its call's tag. A cancelled
tag withdraws its call; a call beyond the replica's in-flight bound is refused at once
(RESOURCE_EXHAUSTED); an engine failure fails its call, never the stream. And the replica's
own port those streams come to (serve_directly)."""

import asyncio
import functools

import grpc
from ray.serve.grpc_util import RayServegRPCContext

from deployments.limits import message_size_options
from protos import specserve_pb2 as pb


class CallStream:
    def __init__(self, replica, check, call_from_proto, respond, answer_type) -> None:
        """respond(result) -> (response, None) or (bare response, status code): the
        replica's PoolReplica.respond for this stream's message types."""
        self.replica, self.check, self.call_from_proto = replica, check, call_from_proto
        self.respond, self.answer_type = respond, answer_type
        self.running: dict[int, asyncio.Future] = {}
        self.finished: list = []
        self.wake = asyncio.Event()

    def refused(self, tag: int, code: grpc.StatusCode, details: str):
        return self.answer_type(tag=tag, error=pb.CallError(code=code.value[0], details=details))

    def finish(self, tag: int, future: asyncio.Future) -> None:
        if self.running.pop(tag, None) is None or future.cancelled():
            return
        result = future.exception() or future.result()
        try:
            response, code = self.respond(result)
            self.finished.append(self.answer_type(tag=tag, response=response) if code is None
                                 else self.refused(tag, code, str(result)))
        except Exception as error:  # the engine failed: this call fails, the stream lives
            self.finished.append(self.refused(tag, grpc.StatusCode.INTERNAL, repr(error)))
        self.wake.set()

    async def read(self, batches) -> None:
        try:
            async for batch in batches:
                self.take(batch)
                self.wake.set()
        finally:  # ended or broken: serve() sees it (a broken one ends with its error)
            self.wake.set()

    def take(self, batch) -> None:
        """One incoming message: its calls submitted, then its cancels."""
        replica = self.replica
        for entry in batch.entries:
            if entry.tag in self.running:  # its answer could go to one call only
                self.finished.append(self.refused(
                    entry.tag, grpc.StatusCode.INVALID_ARGUMENT,
                    f"tag {entry.tag} names a call still running on this stream"))
                continue
            if replica.direct_in_flight >= replica.max_direct_calls:
                self.finished.append(self.refused(
                    entry.tag, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{replica.direct_in_flight} calls in flight"))
                continue
            future = replica.submit(self.check, self.call_from_proto, entry.call,
                                    direct=True)
            self.running[entry.tag] = future
            future.add_done_callback(functools.partial(self.finish, entry.tag))
        # after the entries: a cancel written after its entry may share its message
        for tag in batch.cancel:
            future = self.running.pop(tag, None)
            if future is not None:
                future.cancel()

    async def serve(self, batches):
        """Yields lists of answers until the stream ends and every call is answered."""
        reader = asyncio.ensure_future(self.read(batches))
        try:
            while not (reader.done() and not self.running and not self.finished):
                await self.wake.wait()
                self.wake.clear()
                if self.finished:
                    answers = list(self.finished)
                    self.finished.clear()
                    yield answers
            reader.result()  # a broken stream ends with its error
        finally:
            reader.cancel()
            for future in self.running.values():
                future.cancel()


async def serve_directly(servicer, add_to_server, host: str = "loopback",
                         max_concurrent_rpcs: int | None = None,
                         max_message_bytes: int | None = None) -> tuple[grpc.aio.Server, str]:
    """Serve `servicer` on a free port of this node; returns (server, "host:port")."""
    import ray

    host = ray.util.get_node_ip_address() if host == "node" and ray.is_initialized() \
        else "127.0.0.1"
    options = message_size_options(max_message_bytes) if max_message_bytes else []
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=max_concurrent_rpcs)
    add_to_server(servicer, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, f"{host}:{port}"


def is_direct(grpc_context) -> bool:
    """Whether a call came over the replica's own port (not through Serve's proxy)."""
    return grpc_context is not None and not isinstance(grpc_context, RayServegRPCContext)
