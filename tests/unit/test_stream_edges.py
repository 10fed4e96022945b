"""deployments.streams' CallStream at its edges, with a stand-in replica: an engine failure
fails its call alone, an answer finished while the stream is open goes back without waiting
for the next message, and the stream's end waits for its calls (or, closed, withdraws them)."""

import asyncio
from types import SimpleNamespace

import grpc

from deployments.streams import CallStream
from protos import specserve_pb2 as pb
from tests.unit.test_pool_replica import until


class Replica:
    """Each submitted call's future, for the test to finish."""

    direct_in_flight, max_direct_calls = 0, 8

    def __init__(self) -> None:
        self.futures = []

    def submit(self, check, call_from_proto, call, direct):
        self.futures.append(asyncio.get_running_loop().create_future())
        return self.futures[-1]


def respond(result):
    """PoolReplica.respond's shape: an exception it does not know is raised."""
    if isinstance(result, BaseException):
        raise result
    return pb.ProposeResponse(token_ids=[result]), None


def batch(*tags, cancel=()):
    return SimpleNamespace(entries=[SimpleNamespace(tag=tag, call=None) for tag in tags],
                           cancel=list(cancel))


def stream_of(replica) -> CallStream:
    return CallStream(replica, None, None, respond, pb.ProposeAnswer)


def test_an_engine_failure_fails_its_call_as_internal_and_the_next_call_is_answered():
    async def main():
        replica, more = Replica(), asyncio.Event()

        async def batches():
            yield batch(1)
            await more.wait()
            yield batch(2)

        stream = stream_of(replica)
        answers = stream.serve(batches())
        first = asyncio.ensure_future(anext(answers))
        await until(lambda: len(replica.futures) == 1)
        replica.futures[0].set_exception(RuntimeError("CUDA error"))
        failed = await asyncio.wait_for(first, 60)  # a hang fails at the guard
        more.set()
        second = asyncio.ensure_future(anext(answers))
        await until(lambda: len(replica.futures) == 2)
        replica.futures[1].set_result(7)
        answered = await asyncio.wait_for(second, 60)
        rest = [a async for a in answers]
        return failed, answered, rest

    failed, answered, rest = asyncio.run(main())
    assert [(a.tag, a.error.code) for a in failed] == [(1, grpc.StatusCode.INTERNAL.value[0])]
    assert "CUDA error" in failed[0].error.details
    assert [(a.tag, list(a.response.token_ids)) for a in answered] == [(2, [7])]
    assert rest == []


def test_an_ended_stream_still_answers_its_running_calls():
    """The router half-closed its side: the calls it sent are still answered, then serve
    ends."""
    async def main():
        replica = Replica()

        async def batches():
            yield batch(1, 2)

        stream = stream_of(replica)
        answers = stream.serve(batches())
        first = asyncio.ensure_future(anext(answers))
        await until(lambda: len(replica.futures) == 2)
        for _ in range(10):  # the reader reaches the stream's end
            await asyncio.sleep(0)
        replica.futures[0].set_result(3)
        replica.futures[1].set_result(4)
        got = await asyncio.wait_for(first, 60)
        return got + [a for more in [m async for m in answers] for a in more], replica

    answers, replica = asyncio.run(main())
    assert sorted((a.tag, list(a.response.token_ids)) for a in answers) == [(1, [3]), (2, [4])]
    assert not any(future.cancelled() for future in replica.futures)


def test_a_closed_stream_withdraws_its_running_calls():
    """The router's side went away mid-call (serve() closed): its calls are cancelled, not
    left to run for no one."""
    async def main():
        replica, never, errors = Replica(), asyncio.Event(), []
        asyncio.get_running_loop().set_exception_handler(lambda loop, error: errors.append(error))

        async def batches():
            yield batch(1, 2)
            await never.wait()

        stream = stream_of(replica)
        answers = stream.serve(batches())
        first = asyncio.ensure_future(anext(answers))
        await until(lambda: len(replica.futures) == 2)
        replica.futures[0].set_result(3)
        got = await asyncio.wait_for(first, 60)
        await answers.aclose()
        await asyncio.sleep(0)  # the cancelled call's done callback runs
        return got, replica, errors

    got, replica, errors = asyncio.run(main())
    assert [a.tag for a in got] == [1]
    assert replica.futures[1].cancelled()
    assert errors == []  # its callback saw it cancelled (no error logged by the loop)


def test_a_cancel_withdraws_its_call_and_no_answer_comes_for_it():
    async def main():
        replica = Replica()
        stream = stream_of(replica)
        stream.take(batch(1, 2, cancel=[2, 9]))  # 9: no call of that tag (already answered)
        replica.futures[0].set_result(5)
        await until(lambda: stream.finished)
        return stream, replica

    stream, replica = asyncio.run(main())
    assert replica.futures[1].cancelled() and not stream.running
    assert [(a.tag, list(a.response.token_ids)) for a in stream.finished] == [(1, [5])]
