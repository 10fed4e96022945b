"""Errors of pool calls and the direct data path to one pool replica: one long-lived gRPC
stream per replica and rpc (deployments.clients's PoolClient holds them)."""

import asyncio
import itertools

import grpc

from deployments import auth
from deployments.limits import in_messages
from protos import specserve_pb2 as pb
from speculative.types import PoolBusy, PoolUnavailable


class PoolError(PoolUnavailable):
    """A pool failed a call; `pool` names it (its app) and `code` is the gRPC status. The
    details (addresses, exception text) are for the log, not for HTTP clients."""

    def __init__(self, pool: str, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__(f"{pool}: {code.name}: {details}")
        self.pool, self.code, self.details = pool, code, details

    @classmethod
    def of(cls, pool: str, error: grpc.aio.AioRpcError) -> "PoolError":
        return pool_error(pool, error.code(), error.details())


class BusyPoolError(PoolError, PoolBusy):
    """RESOURCE_EXHAUSTED: the pool had no room for the call now (the loop may retry)."""


def pool_error(pool: str, code: grpc.StatusCode, details: str | None) -> PoolError:
    """A call's failure; a pool's refusal for want of room (RESOURCE_EXHAUSTED, but not
    gRPC's own for a message over its size limit, which waiting does not mend) is busy."""
    busy = code == grpc.StatusCode.RESOURCE_EXHAUSTED and \
        "message larger than max" not in (details or "")
    return (BusyPoolError if busy else PoolError)(pool, code, details)


class ReplicaStream:
    """The direct data path to one pool replica: one long-lived stream (ProposeStream or
    ScoreStream, see specserve.proto) that carries every call this router makes to it.

    Calls made while a message is being written wait and go together in the next, so a
    batch of requests answered together comes back as one message, not one call each.
    Answers come back by tag. A broken stream fails every call waiting on it with
    UNAVAILABLE (the caller falls back to Serve's routing); a caller that gives up (deadline,
    cancellation) withdraws its call from the replica's queue.
    """

    def __init__(self, stub, method: str, batch_type, entry_type, application: str,
                 on_end=None) -> None:
        """on_end(stream): called once the stream has broken (its client drops it)."""
        self.stream = getattr(stub, method)(metadata=auth.metadata())
        self.batch_type, self.entry_type, self.application = batch_type, entry_type, application
        self.on_end = on_end
        self.tags = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.outbox: list = []
        self.cancelled: list[int] = []
        self.broken: PoolError | None = None
        self.wake = asyncio.Event()
        self.tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())]

    async def call(self, message, timeout_s: float):
        """The replica's answer to one call; PoolError when it refuses the call, the stream
        breaks or the deadline passes."""
        if self.broken is not None:
            raise self.broken
        tag = next(self.tags)
        future = asyncio.get_running_loop().create_future()
        self.pending[tag] = future
        self.outbox.append(self.entry_type(tag=tag, call=message))
        self.wake.set()
        # a timer on the future itself, not asyncio.wait_for (a second future and two
        # callbacks: 11.1 -> 7.1 us a call, measured alone)
        deadline = future.get_loop().call_later(timeout_s, self._expire, future, timeout_s)
        try:
            return await future
        finally:
            deadline.cancel()
            if self.pending.pop(tag, None) is not None and self.broken is None:
                self.cancelled.append(tag)  # withdrawn: the replica drops it from its queue
                self.wake.set()

    def _expire(self, future: asyncio.Future, timeout_s: float) -> None:
        if not future.done():
            future.set_exception(PoolError(self.application, grpc.StatusCode.DEADLINE_EXCEEDED,
                                           f"no answer within {timeout_s:.1f} s"))

    async def _write(self) -> None:
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                if self.outbox or self.cancelled:
                    runs, cancelled = in_messages(self.outbox), self.cancelled
                    self.outbox, self.cancelled = [], []
                    for run in runs[:-1]:
                        await self.stream.write(self.batch_type(entries=run))
                    # cancels last: a cancel may name an entry written just before it
                    await self.stream.write(self.batch_type(entries=runs[-1], cancel=cancelled))
        except grpc.aio.AioRpcError as error:
            self._break(self._broken_by(error.code(), error.details()))
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as error:  # closed under us
            if self.stream.done():  # ended before this write (refused, say): as the reader
                # would say (first come, first kept: its status, not the write's error)
                self._break(self._broken_by(await self.stream.code(),
                                            await self.stream.details()))
            else:
                self._break(PoolError(self.application, grpc.StatusCode.UNAVAILABLE,
                                      repr(error)))

    async def _read(self) -> None:
        try:
            async for answers in self.stream:
                for answer in answers.answers:
                    future = self.pending.pop(answer.tag, None)
                    if future is None or future.done():
                        continue  # its caller gave up
                    if answer.WhichOneof("result") == "error":
                        code = STATUS_CODES.get(answer.error.code, grpc.StatusCode.UNKNOWN)
                        future.set_exception(pool_error(self.application, code,
                                                        answer.error.details))
                    else:
                        future.set_result(answer.response)
            error = PoolError(self.application, grpc.StatusCode.UNAVAILABLE, "stream ended")
        except grpc.aio.AioRpcError as failure:
            error = self._broken_by(failure.code(), failure.details())
        self._break(error)
        self.tasks[0].cancel()  # else a stream broken with no call waiting kept its writer
        if self.on_end is not None:
            self.on_end(self)

    def _broken_by(self, failure_code: grpc.StatusCode, details: str | None) -> "PoolError":
        """What a broken stream's calls fail with. A call's own refusal comes in its answer,
        so a stream that ends in an error lost its transport, whatever the code says (a
        killed replica's stream may end UNKNOWN "Stream removed" or INTERNAL, where a unary
        call would end UNAVAILABLE): UNAVAILABLE, which sends the calls to Serve's routing;
        but a refusal of the stream itself (no pool secret, ...) stands. A replica whose
        port is at its concurrent rpcs (RESOURCE_EXHAUSTED: other routers' streams, a burst
        of Releases) is busy: the calls wait and try again (speculative.busy), on a new
        stream."""
        code = failure_code if failure_code in STREAM_REFUSALS else grpc.StatusCode.UNAVAILABLE
        return pool_error(self.application, code, f"stream: {failure_code.name}: {details}")

    def _break(self, error: "PoolError") -> None:
        self.broken = self.broken or error
        for future in self.pending.values():
            if not future.done():
                future.set_exception(self.broken)
        self.pending.clear()

    def close(self) -> None:
        """Fail the calls still waiting (UNAVAILABLE: they go to Serve's routing), then
        end the stream."""
        self._break(PoolError(self.application, grpc.StatusCode.UNAVAILABLE, "stream closed"))
        self.stream.cancel()
        for task in self.tasks:
            task.cancel()


# a stream's own refusal (kept): any other error that ends a stream means its replica is gone
STREAM_REFUSALS = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
                   grpc.StatusCode.INVALID_ARGUMENT}
# a CallError's code back to the grpc.StatusCode it carries
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
# per rpc: the stream that carries it to a pinned replica, and that stream's message types
STREAMS = {"Propose": ("ProposeStream", pb.ProposeBatch, pb.ProposeEntry),
           "Score": ("ScoreStream", pb.ScoreBatch, pb.ScoreEntry)}
