"""The continuous batcher's edges: each caller gets its own call's answer or error, whoever
else in the batch left, failed, was cut short or was withdrawn (test_batcher: the common
paths)."""

import asyncio

import pytest

from deployments import batcher as batcher_module
from deployments.batcher import ContinuousBatcher
from tests.unit.test_batcher import Model as Recording

UNFINISHED = "unfinished"


class Model(Recording):
    """test_batcher's model, but a call in `cuts` comes back unfinished that many times (a
    prefill cut to the forward's budget)."""

    def __init__(self, cuts: dict | None = None) -> None:
        super().__init__()
        self.cuts = dict(cuts or {})

    async def run(self, calls: list) -> list:
        answers = await super().run(calls)
        for i, call in enumerate(calls):
            if self.cuts.get(call):
                self.cuts[call] -= 1
                answers[i] = UNFINISHED
        return answers


def request_of(call: str) -> str:
    return call[0]  # "a1" is request a's first call


def batcher_of(model: Model, max_batch_size: int = 8, **kwargs) -> ContinuousBatcher:
    return ContinuousBatcher(model.run, max_batch_size, lambda answer: answer == UNFINISHED,
                             key=request_of, **kwargs)


async def started(batcher, model, calls) -> list:
    """Submit `calls` as one batch and hold it running (model.release is cleared)."""
    model.release.clear()
    futures = [asyncio.ensure_future(batcher.submit(call)) for call in calls]
    while model.batches[-1:] != [list(calls)]:
        await asyncio.sleep(0)
    return futures


def test_a_withdrawn_cut_call_gets_the_withdrawal_and_anothers_cut_call_goes_on():
    """Two prefills cut short in one batch, one of whose requests was released meanwhile:
    that one ends with the release's answer, the other runs on to its own answer."""
    async def main():
        model = Model(cuts={"a1": 1, "b1": 1})
        batcher = batcher_of(model)
        a, b = await started(batcher, model, ["a1", "b1"])
        assert batcher.withdraw("a", "released")
        model.release.set()
        return await asyncio.wait_for(asyncio.gather(a, b), 30), model.batches

    answers, batches = asyncio.run(main())
    assert answers == ["released", "answer b1"]
    assert batches == [["a1", "b1"], ["b1"]]


def test_a_withdrawal_holds_for_its_batch_alone():
    """A request withdrawn while its call ran (a pipelined round's pre-draft) comes back with
    a fresh call: cut short in a later batch, that call runs on, not answered the old
    withdrawal."""
    async def main():
        model = Model(cuts={"a2": 1})
        batcher = batcher_of(model)
        (a1,) = await started(batcher, model, ["a1"])
        batcher.withdraw("a", "withdrawn")
        model.release.set()
        first = await a1
        return first, await asyncio.wait_for(batcher.submit("a2"), 30)

    assert asyncio.run(main()) == ("answer a1", "answer a2")


def test_calls_left_waiting_by_a_failed_batch_still_run():
    """The batch that fails answers its callers the error; the calls that did not fit in it
    form the next batch at once (not when some later call wakes the batcher)."""
    async def main():
        model = Model()
        batcher = batcher_of(model, 1)
        boom, queued = (asyncio.ensure_future(batcher.submit(c)) for c in ("boom", "c1"))
        with pytest.raises(RuntimeError, match="forward failed"):
            await boom
        done, _ = await asyncio.wait([queued], timeout=30)
        return queued.result() if done else "stuck", model.batches

    assert asyncio.run(main()) == ("answer c1", [["boom"], ["c1"]])


@pytest.mark.parametrize("fails", [False, True])
def test_a_caller_gone_while_its_batch_runs_leaves_the_others_their_answers(fails):
    """b's client went away while its call ran: a and c still get their answers (or the
    batch's error), and the batcher serves the next call."""
    async def main():
        model = Model()
        batcher = batcher_of(model)
        calls = ["a1", "b1", "boom" if fails else "c1"]
        futures = await started(batcher, model, calls)
        futures[1].cancel()
        model.release.set()
        kept = [futures[0], futures[2]]
        done, _ = await asyncio.wait(kept, timeout=30)
        results = [f.exception() or f.result() if f in done else "stuck" for f in kept]
        return [str(r) for r in results], await asyncio.wait_for(batcher.submit("d1"), 30)

    results, after = asyncio.run(main())
    expected = ["the forward failed"] * 2 if fails else ["answer a1", "answer c1"]
    assert results == expected and after == "answer d1"


def test_a_full_batch_does_not_linger_for_the_requests_still_out(monkeypatch):
    """c and d fill the batch while a and b (answered by the last one) are not back: there is
    no room for them, so the batch runs at once (a linger would only delay it)."""
    monkeypatch.setattr(batcher_module, "MAX_LINGER_S", 60.0)  # only their return ends it

    async def main():
        model = Model()
        batcher = batcher_of(model, 2, linger=1e9)
        await asyncio.gather(batcher.submit("a1"), batcher.submit("b1"))
        full = [asyncio.ensure_future(batcher.submit(call)) for call in ("c1", "d1")]
        done, _ = await asyncio.wait(full, timeout=30)
        return len(done), model.batches

    assert asyncio.run(main()) == (2, [["a1", "b1"], ["c1", "d1"]])



def test_a_batch_that_runs_a_cut_call_again_does_not_linger(monkeypatch):
    """p's prefill was cut short beside b's decode: the next batch runs p's next chunk at
    once, not lingering for b (which may take its turn elsewhere first)."""
    monkeypatch.setattr(batcher_module, "MAX_LINGER_S", 60.0)  # only b's return ends it

    async def main():
        model = Model(cuts={"p1": 1})
        batcher = batcher_of(model, linger=1e9)
        p, b = await started(batcher, model, ["p1", "b1"])
        model.release.set()
        done, _ = await asyncio.wait([p, b], timeout=30)
        return [f.result() for f in done], model.batches

    answers, batches = asyncio.run(main())
    assert sorted(answers) == ["answer b1", "answer p1"]
    assert batches == [["p1", "b1"], ["p1"]]


def test_a_request_released_while_its_call_waits_is_forgotten_once_it_is_answered():
    """The batcher keeps a released request's id only while a call of it is queued or runs
    (a router serves requests for months: kept, every such release was kept for good)."""
    async def main():
        model = Model()
        batcher = batcher_of(model, linger=0.5)
        calls = await started(batcher, model, ["a1", "d1"])
        batcher.forget("d")
        model.release.set()
        await asyncio.gather(*calls)
        return batcher.ended

    assert asyncio.run(main()) == set()


def test_a_batcher_without_request_keys_ignores_its_linger_and_serves_every_call():
    """Lingering needs to know the calls' requests: without key it is off, and the calls
    queued behind a running batch are served next."""
    async def main():
        model = Model()
        batcher = ContinuousBatcher(model.run, 8, linger=0.5)
        (first,) = await started(batcher, model, ["a1"])
        queued = [asyncio.ensure_future(batcher.submit(call)) for call in ("b1", "c1")]
        await asyncio.sleep(0)
        model.release.set()
        done, _ = await asyncio.wait([first, *queued], timeout=30)
        return sorted(future.result() for future in done), model.batches

    answers, batches = asyncio.run(main())
    assert answers == ["answer a1", "answer b1", "answer c1"]
    assert batches == [["a1"], ["b1", "c1"]]


def test_a_failed_batchs_error_reaches_its_callers_without_any_frames():
    """The error the callers get, and the one it was raised while handling (an out-of-memory
    error's, whose frames hold the forward's tensors), carry no traceback."""
    async def run(calls):
        try:
            raise MemoryError("out of memory")
        except MemoryError:
            raise RuntimeError("the forward failed")

    async def main():
        with pytest.raises(RuntimeError) as error:
            await ContinuousBatcher(run, 8).submit("a1")
        return error.value

    error = asyncio.run(main())
    assert isinstance(error.__context__, MemoryError)
    assert error.__context__.__traceback__ is None
