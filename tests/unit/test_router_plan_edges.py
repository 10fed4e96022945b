"""deployments.request_plans at its edges: a completions batch's choices keep their own
request ids (their pools' sessions are keyed by them)."""

from deployments.admission import Admission
from deployments.openai_api import CompletionRequest
from tests.unit.test_router_plan import planner


def test_a_batchs_choices_each_have_their_own_request_id():
    """Two prompts' choices under one id would share a session in each pool: prompt i's
    choice j is <id>-i-j."""
    plan = planner(Admission(16), [])(CompletionRequest(prompt=["a", "b"], n=2))
    ids = [choice.request.request_id for choice in plan.choices]
    assert ids == [f"{plan.request_id}-{i}-{j}" for i in (0, 1) for j in (0, 1)]
