"""The pool replica's continuous batcher: the next batch forms when the model frees up."""

import asyncio

import pytest

from deployments import batcher as batcher_module
from deployments.batcher import ContinuousBatcher


class Model:
    """Records each batch; a run holds until `release` is set."""

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.release = asyncio.Event()
        self.release.set()

    async def run(self, calls: list) -> list:
        self.batches.append(list(calls))
        await self.release.wait()
        if "boom" in calls:
            raise RuntimeError("the forward failed")
        return [f"answer {c}" for c in calls]


def test_a_lone_call_runs_at_once_and_gets_its_own_answer():
    async def main():
        model = Model()
        batcher = ContinuousBatcher(model.run, max_batch_size=8)
        assert await batcher.submit(1) == "answer 1"
        assert model.batches == [[1]]

    asyncio.run(main())


def test_calls_arriving_while_the_model_is_busy_run_as_the_next_batch():
    async def main():
        model = Model()
        batcher = ContinuousBatcher(model.run, max_batch_size=3)
        model.release.clear()
        first = asyncio.ensure_future(batcher.submit(0))
        await asyncio.sleep(0.01)  # 0 is running
        rest = [asyncio.ensure_future(batcher.submit(i)) for i in range(1, 6)]
        await asyncio.sleep(0.01)
        model.release.set()
        answers = await asyncio.gather(first, *rest)
        assert answers == [f"answer {i}" for i in range(6)]
        assert model.batches == [[0], [1, 2, 3], [4, 5]]  # arrival order, at most 3 a batch

    asyncio.run(main())


def test_a_cancelled_caller_is_left_out_and_a_failed_batch_fails_its_callers_only():
    async def main():
        model = Model()
        batcher = ContinuousBatcher(model.run, max_batch_size=8)
        model.release.clear()
        busy = asyncio.ensure_future(batcher.submit(0))
        await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(batcher.submit("gone"))
        doomed = [asyncio.ensure_future(batcher.submit(c)) for c in ("boom", 7)]
        await asyncio.sleep(0.01)
        gone.cancel()
        model.release.set()
        assert await busy == "answer 0"
        for call in doomed:
            with pytest.raises(RuntimeError, match="forward failed"):
                await call
        assert model.batches == [[0], ["boom", 7]]
        assert await batcher.submit(8) == "answer 8"  # the loop goes on

    asyncio.run(main())


def test_max_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="max_batch_size"):
        ContinuousBatcher(None, 0)


def request_of(call: str) -> str:
    return call[0]  # "a1" is request a's first call


async def first_batch(batcher, model, calls) -> None:
    """Run `calls` as one batch (the model held until all have arrived)."""
    model.release.clear()
    started = [asyncio.ensure_future(batcher.submit(c)) for c in calls]
    await asyncio.sleep(0)
    model.release.set()
    await asyncio.gather(*started)


@pytest.mark.parametrize("linger", [0.0, 1e9])
def test_a_batch_waits_for_the_requests_of_the_previous_one_only_when_lingering(
        linger, monkeypatch):
    """a and b were answered together; c arrives first: with a linger the next batch waits
    until a and b are back (one forward for all three), without one c runs alone."""
    monkeypatch.setattr(batcher_module, "MAX_LINGER_S", 60.0)  # only their return ends it

    async def main():
        model = Model()
        batcher = ContinuousBatcher(model.run, 8, key=request_of, linger=linger)
        await first_batch(batcher, model, ["a1", "b1"])
        c = asyncio.ensure_future(batcher.submit("c1"))
        for _ in range(3):
            await asyncio.sleep(0)
        back = [asyncio.ensure_future(batcher.submit(x)) for x in ("a2", "b2")]
        await asyncio.gather(c, *back)
        return model.batches[1:]

    together = [["c1", "a2", "b2"]]
    assert asyncio.run(main()) == (together if linger else [["c1"], ["a2", "b2"]])


def test_the_linger_ends_at_its_deadline_and_a_released_request_is_not_waited_for(
        monkeypatch):
    monkeypatch.setattr(batcher_module, "MAX_LINGER_S", 0.05)

    async def main():
        model = Model()
        batcher = ContinuousBatcher(model.run, 8, key=request_of, linger=1e9)
        await first_batch(batcher, model, ["a1", "b1"])
        # a and b never come back (a broken deadline would hold c1 past the 30 s below)
        assert await asyncio.wait_for(batcher.submit("c1"), 30) == "answer c1"
        await first_batch(batcher, model, ["a2", "b2"])
        batcher.forget("a")  # a ended; b is still out
        monkeypatch.setattr(batcher_module, "MAX_LINGER_S", 60.0)
        c = asyncio.ensure_future(batcher.submit("c2"))
        for _ in range(3):
            await asyncio.sleep(0)
        # a broken forget would hold the batch for a until the 60 s linger ends
        await asyncio.wait_for(asyncio.gather(c, batcher.submit("b3")), 30)
        return model.batches

    assert asyncio.run(main())[1:] == [["c1"], ["a2", "b2"], ["c2", "b3"]]


def test_a_lone_request_never_waits(monkeypatch):
    monkeypatch.setattr(batcher_module, "MAX_LINGER_S", 60.0)

    async def main():
        model = Model()
        batcher = ContinuousBatcher(model.run, 8, key=request_of, linger=1e9)
        for index in range(3):
            assert await batcher.submit(f"a{index}") == f"answer a{index}"
        return model.batches

    assert asyncio.run(main()) == [["a0"], ["a1"], ["a2"]]


def test_callers_that_all_leave_while_the_batch_lingers_run_no_empty_batch(monkeypatch):
    """An empty run would count a batch of 0 calls (the occupancy the autoscaler reads) and
    hop to the worker for nothing."""
    monkeypatch.setattr(batcher_module, "MAX_LINGER_S", 0.05)

    async def main():
        model = Model()
        batcher = ContinuousBatcher(model.run, 8, key=request_of, linger=1e9)
        await first_batch(batcher, model, ["a1", "b1"])
        c = asyncio.ensure_future(batcher.submit("c1"))  # lingers for a and b
        for _ in range(3):
            await asyncio.sleep(0)
        c.cancel()
        await asyncio.sleep(0.2)  # past the linger's deadline
        assert await batcher.submit("a2") == "answer a2"
        return model.batches

    assert asyncio.run(main())[1:] == [["a2"]]


def test_a_request_released_while_the_batch_lingers_for_it_is_not_waited_for(monkeypatch):
    """A release ends the linger for its request at once. (A call withdrawn while it runs is
    still lingered for: a pipelined round withdraws a pre-draft and its request comes back
    with a fresh call; a request that ends is released.)"""
    monkeypatch.setattr(batcher_module, "MAX_LINGER_S", 60.0)

    async def main():
        model = Model()
        batcher = ContinuousBatcher(model.run, 8, key=request_of, linger=1e9)
        await first_batch(batcher, model, ["a3", "d1"])
        a4 = asyncio.ensure_future(batcher.submit("a4"))  # lingers for d
        for _ in range(3):
            await asyncio.sleep(0)
        batcher.forget("d")  # d ended while the batch lingered for it
        assert await asyncio.wait_for(a4, 30) == "answer a4"

    asyncio.run(main())


@pytest.mark.parametrize("running", [False, True])
def test_a_request_released_before_its_call_is_answered_is_not_waited_for(running,
                                                                          monkeypatch):
    """A release that comes while the request's call is queued or in the running batch (a
    request that ended beside its pre-draft) holds for the batch after: its request is not
    lingered for once that call is answered."""
    monkeypatch.setattr(batcher_module, "MAX_LINGER_S", 60.0)

    async def main():
        model = Model()
        model.release.clear()
        batcher = ContinuousBatcher(model.run, 8, key=request_of, linger=1e9)
        first = [asyncio.ensure_future(batcher.submit(c)) for c in ("a1", "d1")]
        await asyncio.sleep(0)  # queued (a call that comes after its release is refused
        # before it queues: deployments.released)
        while running and not model.batches:
            await asyncio.sleep(0)
        batcher.forget("d")  # d ended
        model.release.set()
        await asyncio.gather(*first)
        # a broken forget would hold a2 for d until the 60 s linger ends
        assert await asyncio.wait_for(batcher.submit("a2"), 5) == "answer a2"
        return model.batches

    assert asyncio.run(main()) == [["a1", "d1"], ["a2"]]


def test_the_batcher_says_when_no_call_is_left_to_run_and_not_between_runs():
    """idle() once the queue runs dry (a gauge of the running batch then reads 0), not
    between two runs while calls wait."""
    async def main():
        model, idled = Model(), []
        batcher = ContinuousBatcher(model.run, 2, idle=lambda: idled.append(
            [len(batch) for batch in model.batches]))
        model.release.clear()
        first = asyncio.ensure_future(batcher.submit("a"))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(batcher.submit(c)) for c in "bcd"]  # while it runs
        await asyncio.sleep(0)
        model.release.set()
        await asyncio.gather(first, *rest)
        await asyncio.sleep(0)
        return idled

    assert asyncio.run(main()) == [[1, 2, 1]]  # after the last run only


def test_a_cut_call_takes_no_more_than_half_of_a_batch_of_one():
    """max_batch_size 1: a long prefill cut into chunks went first into every run until its
    last (half the batch rounded up to the whole), and the call that arrived meanwhile
    waited for the whole prefill; it now runs between two chunks."""
    async def main():
        chunks, batches = {"p": 3}, []

        async def run(calls):
            batches.append(list(calls))
            await asyncio.sleep(0)
            answers = []
            for call in calls:
                chunks[call] = chunks.get(call, 1) - 1
                answers.append("unfinished" if chunks[call] else f"answer {call}")
            return answers

        batcher = ContinuousBatcher(run, 1, lambda answer: answer == "unfinished")
        prefill = asyncio.ensure_future(batcher.submit("p"))
        await asyncio.sleep(0)  # its first chunk runs
        decode = asyncio.ensure_future(batcher.submit("d"))
        assert await asyncio.gather(prefill, decode) == ["answer p", "answer d"]
        return batches

    assert asyncio.run(main()) == [["p"], ["d"], ["p"], ["p"]]


def test_releases_of_requests_with_no_call_here_leave_the_batcher_nothing():
    """A request is released after its last call was answered (the common case): its
    release found nothing of it here to withdraw or stop lingering for, yet the batcher kept
    its id and answer until the next batch, which on an idle replica may never come."""
    async def main():
        model = Model()
        batcher = ContinuousBatcher(model.run, 8, key=request_of, linger=0.5)
        for name in ("a1", "b1"):
            await batcher.submit(name)
        for request in "ab":
            assert not batcher.withdraw(request, "released")
            batcher.forget(request)
        return batcher.withdrawn, batcher.ended

    assert asyncio.run(main()) == ({}, set())
