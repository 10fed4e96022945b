"""vLLM's SageMaker routes on the router without Ray or a model: `/ping` answers as /health,
`POST /invocations` serves a chat or a completion by its body (vLLM's 400 for neither),
behind the API key; and an answer names the first of the served names, whichever the request
gave (vLLM's)."""

import asyncio
import json
from types import MethodType, SimpleNamespace

import pytest

from deployments.invocations import NO_HANDLER, InvocationRequest
from deployments.router import Router, app
from deployments.router_args import RouterArgs
from tests.unit.test_responses_api import stand_in
from tests.unit.test_router_parts import posted


def invoked(body: dict, router=None):
    router = router or stand_in("bonjour")
    answer = asyncio.run(Router.serve_request(router, posted(body), InvocationRequest))
    return answer.status_code, json.loads(answer.body)


def test_ping_is_sagemakers_health_check_by_get_and_post():
    paths = app.openapi()["paths"]
    assert {"get", "post"} <= set(paths["/ping"]) and "post" in paths["/invocations"]
    router = SimpleNamespace()
    router.health = MethodType(Router.health, router)
    assert asyncio.run(Router.ping(router)) == asyncio.run(Router.health(router))


@pytest.mark.parametrize("body, kind", [
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}, "chat.completion"),
    ({"prompt": "hi", "max_tokens": 7}, "text_completion"),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "chat.completion"),
])
def test_an_invocation_is_a_chat_with_messages_else_a_completion_with_a_prompt(body, kind):
    """As vLLM's dispatch (the chat's schema tried first)."""
    status, answer = invoked(body)
    assert status == 200 and answer["object"] == kind
    text = answer["choices"][0]["message"]["content"] if kind == "chat.completion" else \
        answer["choices"][0]["text"]
    assert text == "bonjour"


@pytest.mark.parametrize("body, kind", [
    ({"prompt": "hi", "messages": None, "max_tokens": 7}, "text_completion"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": None}, "chat.completion"),
])
def test_a_null_messages_or_prompt_is_absent_in_the_dispatch(body, kind):
    """A null field is its default, as everywhere in a body: a completion with `messages:
    null` was read as a chat and refused ("messages: Field required"); vLLM, whose chat
    schema refuses it, serves the completion."""
    status, answer = invoked(body)
    assert status == 200 and answer["object"] == kind


@pytest.mark.parametrize("body, message, param", [
    ({"input": "hi"}, NO_HANDLER, None),
    ({"messages": None, "prompt": None}, NO_HANDLER, None),
    ([1, 2], NO_HANDLER, None),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature",
     "temperature"),
    ({"prompt": "hi", "n": 0}, "n", "n"),
])
def test_an_invocation_that_is_neither_or_is_invalid_is_a_400(body, message, param):
    """Neither: vLLM's message. A chat (or a completion) with a bad field: that field's 400,
    as its own route's (vLLM's dispatch fell through to the next schema and answered
    NO_HANDLER)."""
    status, answer = invoked(body)
    assert status == 400 and message in answer["error"]["message"]
    assert answer["error"]["param"] == param


def test_an_invocation_needs_the_api_key_as_v1_does():
    """vLLM's newer authentication guards every route but its public ones (/health, /ping,
    /version, /metrics, the docs): /invocations serves what /v1 does."""
    router = stand_in("bonjour")
    router.api_key = "k"  # posted() sends no Authorization
    status, answer = invoked({"prompt": "hi"}, router)
    assert status == 401


@pytest.mark.parametrize("named", [None, "first", "second"])
def test_an_answer_names_the_first_served_name_whichever_the_request_gave(named):
    """vLLM's --served-model-name with several names: any may be asked for, answers carry
    the first (its OpenAIServingModels.model_name())."""
    router = stand_in("bonjour")
    router.args = RouterArgs(served_model_name=["first", "second"])
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    status, answer = invoked(body if named is None else {**body, "model": named}, router)
    assert status == 200 and answer["model"] == "first"
    status, answer = invoked({**body, "model": "third"}, router)
    assert status == 404 and answer["error"]["param"] == "model"


def test_an_invoked_chat_with_store_is_stored_as_on_its_own_route():
    """vLLM's /invocations serves a chat with /v1/chat/completions' own handler: `store` and
    `metadata` read as there (deployments.stored_chats), a bad metadata its 400."""
    from tests.unit.test_background_responses import in_process_store
    from tests.unit.test_stored_chats import chat_router, routed

    router = chat_router(in_process_store())
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    status, answer = invoked({**body, "store": True, "metadata": {"topic": "geo"}}, router)
    assert status == 200 and answer["object"] == "chat.completion"
    status, listed = routed(router, "GET")
    assert [c["id"] for c in listed["data"]] == [answer["id"]]
    assert listed["data"][0]["metadata"] == {"topic": "geo"}
    assert invoked(body, router)[0] == 200  # not asked to be: not stored
    assert len(routed(router, "GET")[1]["data"]) == 1
    status, refused = invoked({**body, "store": True, "metadata": {"k": 1}}, router)
    assert status == 400 and refused["error"]["param"] == "metadata"
