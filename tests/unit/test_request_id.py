"""vLLM's request_id: the answer's id ("chatcmpl-<id>", "cmpl-<id>", on every chunk), never
the key of the pools' sessions, which two requests of one id would share."""

import asyncio
import json

import pytest
from pydantic import ValidationError

from deployments.admission import Admission
from deployments.chat_batch import ChatBatchRoute
from deployments.openai_api import CompletionRequest
from deployments.stored_chats import StoredChatRequest
from tests.unit.test_chat_batch import CONVERSATIONS, pair, router_of  # noqa: F401 (fixture)
from tests.unit.test_router_parts import posted
from tests.unit.test_router_plan import planner

BODY = {"model": "m", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]}


def answered(router, body: dict, stream: bool = False) -> list[dict]:
    """The answer (streamed: each chunk but the usage's)."""
    answer = asyncio.run(router.serve_request(posted({**body, "stream": stream}),
                                              StoredChatRequest))
    if not stream:
        return [json.loads(answer.body)]

    async def events():
        return [e async for e in answer.body_iterator]

    texts = [e.decode() if isinstance(e, bytes) else e for e in asyncio.run(events())]
    return [json.loads(t[len("data: "):]) for t in texts if t != "data: [DONE]\n\n"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_chats_request_id_names_its_answer_as_vllms(pair, stream):  # noqa: F811
    router = router_of(pair)
    mine = answered(router, {**BODY, "request_id": "abc-1"}, stream)
    assert {body["id"] for body in mine} == {"chatcmpl-abc-1"}
    own = answered(router, BODY, stream)
    assert len({body["id"] for body in own}) == 1 and own[0]["id"] != "chatcmpl-abc-1"
    assert own[0]["id"].startswith("chatcmpl-")
    assert [b["choices"] for b in mine] == [b["choices"] for b in own]  # the same answer


def test_two_requests_of_one_request_id_keep_their_own_sessions():
    """The plan's request_id (each choice's pool sessions: deployments.clients) is the
    router's own; the client's names the answer (a completion's "cmpl-<id>")."""
    plan = planner(Admission(8), [])
    first, second = (plan(CompletionRequest(prompt="a", request_id="same")) for _ in "ab")
    assert first.answer_id == second.answer_id == "cmpl-same"
    assert first.request_id != second.request_id
    assert {c.request.request_id for c in first.choices}.isdisjoint(
        c.request.request_id for c in second.choices)
    assert plan(CompletionRequest(prompt=["a", "b"], request_id="x")).answer_id == "cmpl-x"
    assert plan(CompletionRequest(prompt="a")).answer_id == ""


def test_a_batchs_request_id_names_its_answer(pair):  # noqa: F811
    body = {**BODY, "messages": CONVERSATIONS, "request_id": "batch-7"}
    answer = asyncio.run(ChatBatchRoute.chat_completions_batch(router_of(pair), posted(body)))
    assert answer.status_code == 200 and json.loads(answer.body)["id"] == "chatcmpl-batch-7"


def test_request_id_is_bounded_and_refused_with_store():
    """At most 256 characters (each chunk repeats it); not with store: true, where the
    stored chat's id, which names its entry, is the router's own."""
    with pytest.raises(ValidationError, match="at most 256"):
        CompletionRequest(prompt="x", request_id="a" * 257)
    with pytest.raises(ValidationError) as refused:
        StoredChatRequest(**BODY, request_id="r", store=True)
    assert refused.value.errors()[0]["ctx"]["error"].param == "request_id"
    assert StoredChatRequest(**BODY, request_id="r", store=False).request_id == "r"
