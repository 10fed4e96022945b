"""The router's planning of a request (Router.plan) without Ray or a model: admission
checked before its prompts are read, the load a completions batch's choices start at, and
their request ids."""

import asyncio
from types import MethodType, SimpleNamespace

import pytest

from deployments.admission import Admission
from deployments.ingress import BadRequest
from deployments.openai_api import CompletionRequest
from deployments.prompts import Prompt
from deployments.router import Router
from speculative.frontend import RequestFrontEnd
from speculative.options import SpeculationDefaults
from speculative.sampling import SamplingParams


def planner(admission: Admission, read_prompts: list):
    """Router.plan over stand-ins: each prompt read (recorded in read_prompts) as two tokens,
    planned under an adaptive K."""

    async def read(body, chat):
        read_prompts.append(body.prompt)
        return Prompt((2, 3), SamplingParams(temperature=1.0, max_tokens=4), ())

    router = SimpleNamespace(  # not a Router: Serve's ingress wrapper wants its event loop
        admission=admission, check_model=lambda body: None,
        front_end=RequestFrontEnd(SpeculationDefaults(num_speculative_tokens="auto")),
        prompts=SimpleNamespace(read=read, context_limit=64))
    router.plan_one = MethodType(Router.plan_one, router)
    return lambda body: asyncio.run(Router.plan(router, body, chat=False))


def test_a_completions_batchs_choices_start_at_the_load_of_all_its_prompts():
    """An adaptive K starts at the load of the choices running beside it (theirs and the
    request's n): a batch's other prompts' choices run beside each prompt's too (3 prompts
    of n = 2 beside 5 running choices: 11, not the 7 each prompt planned alone saw)."""
    admission = Admission(16)
    admission.admit(5)
    plan = planner(admission, [])
    for prompts, load in ((["a", "b", "c"], 11), ("a", 7)):
        choices = plan(CompletionRequest(prompt=prompts, n=2)).choices
        assert [choice.policy.load for choice in choices] == [load] * len(choices)


def test_a_request_that_admission_refuses_is_refused_before_its_prompts_are_read():
    """Its prompts x n beyond the free slots (429) or beyond all of them (400): refused
    before reading (tokenizing a 1 MiB prompt, then refused, held the router's tokenizing
    thread 0.65 s), as vLLM checks admission before it renders a prompt."""
    admission, read = Admission(4), []
    plan = planner(admission, read)
    held = admission.admit(2)
    for prompts, n, status in ((["a", "b"], 2, 429), ("a", 3, 429), (["a", "b"], 3, 400)):
        with pytest.raises(BadRequest) as refused:
            plan(CompletionRequest(prompt=prompts, n=n))
        assert refused.value.status == status
    assert read == [] and admission.running == 2
    held.release()
    assert len(plan(CompletionRequest(prompt=["a", "b"], n=2)).choices) == 4
    assert read == ["a", "b"] and admission.running == 0  # checked, not taken


def test_with_room_in_its_queue_a_request_beyond_the_free_slots_is_read_to_wait_its_turn():
    """The early check refuses only what could neither run nor wait: with the slots held
    and room in the queue the prompts are read (the request then waits in Router's
    admission.wait_turn); more choices than the slots is still 400, unread."""
    admission, read = Admission(4, max_waiting=1), []
    plan = planner(admission, read)
    admission.admit(4)
    assert len(plan(CompletionRequest(prompt=["a", "b"], n=2)).choices) == 4
    assert read == ["a", "b"] and admission.running == 4 and admission.waiting == 0
    with pytest.raises(BadRequest) as never:
        plan(CompletionRequest(prompt=["a", "b"], n=3))
    assert never.value.status == 400 and read == ["a", "b"]


def test_a_prompt_cache_key_reaches_every_choice_after_its_cache_salt():
    """OpenAI's prompt_cache_key is each choice's placement key (Request.cache_key, read by
    deployments.placement), after the request's cache salt so that two tenants' keys never
    meet; none: empty, placed by the prompt's start."""
    plan = planner(Admission(16), [])
    choices = plan(CompletionRequest(prompt="a", n=2, prompt_cache_key="conv-1")).choices
    assert [choice.request.cache_key for choice in choices] == ["\0conv-1"] * 2
    assert plan(CompletionRequest(prompt="a")).choices[0].request.cache_key == ""
    salted = RequestFrontEnd().plan("r", (2, 3), SamplingParams(cache_salt="t1"),
                                    cache_key="conv-1")
    assert salted.choices[0].request.cache_key == "t1\0conv-1"
    with pytest.raises(ValueError, match="prompt_cache_key"):
        CompletionRequest(prompt="a", prompt_cache_key="k" * 1025)


def test_a_batchs_choices_each_have_their_own_request_id():
    """Two prompts' choices under one id would share a session in each pool: prompt i's
    choice j is <id>-i-j."""
    plan = planner(Admission(16), [])(CompletionRequest(prompt=["a", "b"], n=2))
    ids = [choice.request.request_id for choice in plan.choices]
    assert ids == [f"{plan.request_id}-{i}-{j}" for i in (0, 1) for j in (0, 1)]
