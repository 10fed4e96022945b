"""The router's admission queue: a request whose choices do not fit waits its turn, first
come first served as vLLM's scheduler; beyond max_waiting waiting requests a 429 at once; a
waiter whose client goes away (its task cancelled) leaves holding nothing, and the slots it
was handed go to the next. The loop is driven by events and by letting it run, never by
the clock."""

import asyncio

import pytest

from deployments.admission import Admission
from deployments.ingress import BadRequest
from deployments.openai_api import CompletionRequest
from tests.tiny import Agreeing
from tests.unit.test_router_parts import posted, router_of


async def settled(until=lambda: False, turns: int = 10) -> None:
    """Every task that can run has run until it waits again (this many turns of the loop),
    or until until() holds."""
    for _ in range(turns):
        if until():
            return
        await asyncio.sleep(0)


async def at_once(awaitable):
    """What awaitable ends with, which it must do without waiting (a test that fails, not
    one that hangs, when it waits instead)."""
    task = asyncio.create_task(awaitable)
    await settled()
    assert task.done(), "it waited"
    return task.result()


async def refusal(awaitable) -> BadRequest:
    with pytest.raises(BadRequest) as refused:
        await at_once(awaitable)
    return refused.value


def turns(admission: Admission, wants: list[int], order: list,
          priorities: list[int] | None = None) -> list[asyncio.Task]:
    """A task per request, in this order, that waits for its turn (wants[i] choices, at
    priorities[i]) and then notes (its index, the choices then running) in order."""
    async def wait(index: int, num_choices: int, priority: int):
        ticket = await admission.wait_turn(num_choices, priority)
        order.append((index, admission.running))
        return ticket

    priorities = priorities or [0] * len(wants)
    return [asyncio.create_task(wait(i, n, p)) for i, (n, p) in
            enumerate(zip(wants, priorities))]


def test_waiting_requests_are_admitted_in_arrival_order_as_slots_come_back():
    async def main():
        admission, order = Admission(2, max_waiting=4), []
        held = admission.admit(2)
        tasks = turns(admission, [1, 1, 2], order)
        await settled()
        assert order == [] and admission.waiting == 3 and admission.running == 2
        held.release()  # two slots: the first two waiters, not the third's two
        await settled()
        assert order == [(0, 2), (1, 2)] and admission.waiting == 1
        tasks[0].result().release()
        await settled()
        assert len(order) == 2  # one slot free, the third wants two
        tasks[1].result().release()
        await settled()
        assert order[2] == (2, 2) and admission.waiting == 0
        tasks[2].result().release()
        assert admission.running == 0

    asyncio.run(main())


def test_a_head_waiter_of_many_choices_is_not_overtaken_by_later_small_ones():
    """First come first served: one slot free does not go to a later request of one choice
    while the head waits for two (it would wait for ever under a stream of small ones)."""
    async def main():
        admission, order = Admission(2, max_waiting=4), []
        first, second = admission.admit(1), admission.admit(1)
        tasks = turns(admission, [2, 1], order)
        await settled()
        first.release()
        await settled()
        assert order == [] and admission.running == 1
        with pytest.raises(BadRequest):  # nor does a caller that does not wait take it
            admission.admit(1)
        second.release()
        await settled()
        assert order == [(0, 2)]
        tasks[0].result().release()
        await settled()
        assert order == [(0, 2), (1, 1)]

    asyncio.run(main())


def test_beyond_the_queue_a_request_gets_429_at_once_and_beyond_the_slots_400():
    async def main():
        admission = Admission(2, max_waiting=1)
        held = admission.admit(2)
        waiter = asyncio.create_task(admission.wait_turn(1))
        await settled()
        with pytest.raises(BadRequest) as full:
            admission.check(1)  # the early check, before the prompt is read
        assert full.value.status == 429 and full.value.headers["Retry-After"] == "1"
        assert (await refusal(admission.wait_turn(1))).status == 429
        assert admission.waiting == 1
        never = await refusal(admission.wait_turn(3))  # it could never run: no wait
        assert never.status == 400 and never.param == "n"
        held.release()
        await settled()
        waiter.result().release()
        assert admission.running == 0 and admission.waiting == 0

    asyncio.run(main())


def test_with_no_queue_a_request_that_does_not_fit_gets_429_at_once():
    async def main():
        admission = Admission(2)  # max_waiting 0: as before the queue
        held = admission.admit(1)
        assert (await refusal(admission.wait_turn(2))).status == 429
        assert admission.waiting == 0
        (await at_once(admission.wait_turn(1))).release()  # what fits runs at once
        held.release()
        assert admission.running == 0

    asyncio.run(main())


def test_a_waiter_whose_client_goes_away_leaves_the_queue_holding_nothing():
    async def main():
        admission, order = Admission(1, max_waiting=4), []
        held = admission.admit(1)
        tasks = turns(admission, [1, 1], order)
        await settled()
        tasks[0].cancel()
        await settled()
        assert tasks[0].cancelled() and admission.waiting == 1 and admission.running == 1
        held.release()
        await settled()
        assert order == [(1, 1)]
        tasks[1].result().release()
        assert admission.running == 0 and admission.waiting == 0

    asyncio.run(main())


def test_a_cancelled_head_lets_the_waiters_behind_it_go():
    """The head waited for two slots with one free; the one behind it wants one: once the
    head has gone, nothing else is released, yet the one behind must go (no lost wake-up)."""
    async def main():
        admission, order = Admission(2, max_waiting=4), []
        held = admission.admit(1)
        tasks = turns(admission, [2, 1], order)
        await settled()
        tasks[0].cancel()
        await settled()
        assert order == [(1, 2)] and admission.waiting == 0
        held.release()
        tasks[1].result().release()
        assert admission.running == 0

    asyncio.run(main())


def test_slots_handed_to_a_waiter_as_it_is_cancelled_go_to_the_next():
    """The release hands the head its slot (its future set), and its task is cancelled
    before it runs again: the slot goes back and on to the next waiter, not leaked."""
    async def main():
        admission, order = Admission(1, max_waiting=4), []
        held = admission.admit(1)
        tasks = turns(admission, [1, 1], order)
        await settled()
        held.release()  # taken for the head...
        tasks[0].cancel()  # ...whose client goes away before it resumes
        await settled()
        assert tasks[0].cancelled() and order == [(1, 1)] and admission.running == 1
        tasks[1].result().release()
        assert admission.running == 0 and admission.waiting == 0

    asyncio.run(main())


def test_the_waiting_gauge_follows_the_queue():
    async def main():
        seen = []
        admission = Admission(1, max_waiting=4, on_waiting=seen.append)
        held = admission.admit(1)
        tasks = turns(admission, [1, 1], [])
        await settled()
        tasks[1].cancel()
        await settled()
        held.release()
        await settled()
        tasks[0].result().release()
        assert seen == [1, 2, 1, 0]

    asyncio.run(main())


def test_router_metrics_export_the_waiting_gauge_under_vllms_name(monkeypatch):
    from deployments.metrics import RouterMetrics
    from tests.unit.test_metrics import stood_in_metrics

    created = stood_in_metrics(monkeypatch)
    metrics = RouterMetrics()
    assert ("num_requests_waiting", "new", None, None) in created
    assert metrics.waiting is not metrics.running


class Gated(Agreeing):
    """A verifier that answers once its gate is open."""

    def __init__(self) -> None:
        self.gate, self.calls = asyncio.Event(), 0

    async def score(self, call):
        self.calls += 1
        await self.gate.wait()
        return await super().score(call)


def test_the_router_queues_a_request_beyond_its_slots_and_answers_it_in_turn():
    """Router.serve_request: at max_running_requests a request waits (no 429), runs once the
    running one ends, and a waiting request whose client goes away takes no slot."""
    verifier = Gated()
    serve, admission = router_of(max_running=1, verifier=verifier)
    admission.max_waiting = 2

    def request():
        return serve(posted({"prompt": "hi", "max_tokens": 4}), CompletionRequest, chat=False)

    async def main():
        first = asyncio.create_task(request())
        await settled()
        gone, second = asyncio.create_task(request()), asyncio.create_task(request())
        await settled()
        assert verifier.calls == 1 and admission.waiting == 2
        refused = await at_once(request())  # the queue is full
        assert refused.status_code == 429
        gone.cancel()
        await settled()
        assert admission.waiting == 1
        verifier.gate.set()
        await settled(until=second.done, turns=10_000)  # a lost wake-up fails, not hangs
        answers = [first.result(), second.result()]
        assert gone.cancelled() and [a.status_code for a in answers] == [200, 200]
        assert admission.running == 0 and admission.waiting == 0

    asyncio.run(main())


def test_under_the_priority_policy_the_waiting_go_by_priority_then_arrival():
    """vLLM's --scheduling-policy priority: lower first, ties in arrival order; a request
    ahead of every waiter runs at once when it fits, one behind waits (none is preempted).
    Under FCFS (the default) a priority other than 0 is a 400 naming it, as vLLM's."""
    async def main():
        admission, order = Admission(1, max_waiting=8, by_priority=True), []
        held = admission.admit(1)
        tasks = turns(admission, [1, 1, 1, 1], order, priorities=[5, 0, 5, -3])
        await settled()
        for expected in [3, 1, 0, 2]:
            (held if expected == 3 else tasks[order[-1][0]].result()).release()
            await settled()
            assert order[-1][0] == expected
        tasks[2].result().release()
        assert admission.running == 0 and admission.waiting == 0
        wide = admission.admit(1)
        late = turns(admission, [1], order, priorities=[9])
        await settled()
        assert admission.check(1, priority=-1) is None  # ahead of the waiter: not refused
        wide.release()
        await settled()
        late[0].result().release()
        fcfs = Admission(1, max_waiting=8)
        refused = await refusal(fcfs.wait_turn(1, priority=2))
        assert refused.status == 400 and refused.param == "priority"

    asyncio.run(main())


def test_a_request_that_fails_once_admitted_gives_its_slots_back():
    """Between its admission and its answer (its choices built) nothing keeps the slots: a
    failure there released them only if it came later."""
    serve, admission = router_of(max_running=2)

    def broken(*args):
        raise RuntimeError("a bug")

    serve.router.choices = broken
    with pytest.raises(RuntimeError):
        asyncio.run(serve(posted({"prompt": "hi", "max_tokens": 4}), CompletionRequest,
                          chat=False))
    assert admission.running == 0
