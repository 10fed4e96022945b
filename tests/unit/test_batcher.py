"""The pool replica's continuous batcher: the next batch forms when the model frees up."""

import asyncio

import pytest

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
