"""Admission's early check (before the prompt is read) agrees with wait_turn: under the
priority policy a request of a higher priority than the queue's head, whose choices fit
the free slots, runs at once even with the queue full (a 429 there would refuse what
wait_turn admits), and the plan asks it with the body's priority."""

import asyncio

import pytest

from deployments.admission import Admission
from deployments.ingress import BadRequest
from deployments.openai_api import CompletionRequest
from tests.unit.test_router_plan import planner
from tests.unit.test_router_queue import at_once, settled


def test_a_higher_priority_request_that_fits_passes_a_full_queue():
    async def main():
        admission = Admission(4, max_waiting=1, by_priority=True)
        held = admission.admit(2)
        waiter = asyncio.create_task(admission.wait_turn(4, 0))  # the head: waits for 4
        await settled()
        assert admission.waiting == 1
        admission.check(1, -1)  # it fits now, ahead of the head: not a 429
        ticket = await at_once(admission.wait_turn(1, -1))
        assert admission.running == 3
        with pytest.raises(BadRequest) as full:  # of the head's priority: behind it, full
            admission.check(1, 0)
        assert full.value.status == 429
        ticket.release()
        held.release()
        await settled()
        waiter.result().release()
        assert admission.running == 0 and admission.waiting == 0

    asyncio.run(main())


def test_a_priority_fcfs_does_not_run_is_refused_before_the_prompt_is_read():
    """The early check is asked with the body's priority: FCFS refuses a priority (400
    naming it) before tokenizing the prompt, as it refuses n beyond the slots."""
    admission, read = Admission(4), []
    with pytest.raises(BadRequest) as refused:
        planner(admission, read)(CompletionRequest(prompt="a", priority=5))
    assert refused.value.status == 400 and refused.value.param == "priority" and read == []
