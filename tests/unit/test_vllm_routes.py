"""vLLM 0.32's server routes and headers on the router, without Ray: `GET /load` (its
server_load: the requests admitted or waiting) and the X-Request-Id header read as a
request's request_id where the body gives none (the body's first: Serve's proxy sets the
header on every request)."""

import asyncio
import json
from types import MethodType

import pytest
from starlette.requests import Request

from deployments.admission import Admission
from deployments.chat_batch import ChatBatchRoute
from deployments.messages_api import MessagesRequest
from deployments.openai_api import CompletionRequest
from deployments.request_headers import header_request_id
from deployments.responses_api import ResponsesRequest
from deployments.router import Router, app
from deployments.stored_chats import StoredChatRequest
from tests.unit.test_chat_batch import CONVERSATIONS, pair, router_of  # noqa: F401 (fixture)
from tests.unit.test_router_parts import JSON_TYPE

BODY = {"model": "m", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]}


def posted(body: dict, request_id: str | None = None) -> Request:
    """A POST of the body, with this X-Request-Id header (None: none)."""
    raw = json.dumps(body).encode()
    headers = [JSON_TYPE, (b"content-length", str(len(raw)).encode())]
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode("latin-1")))

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "query_string": b"", "headers": headers}, receive)


def answer_ids(router, body: dict, request_id: str | None, stream: bool = False) -> set:
    """The ids of the chat's answer (streamed: of its chunks)."""
    answer = asyncio.run(router.serve_request(posted({**body, "stream": stream}, request_id),
                                              StoredChatRequest))
    assert answer.status_code == 200
    if not stream:
        return {json.loads(answer.body)["id"]}

    async def events():
        return [e async for e in answer.body_iterator]

    texts = [e.decode() if isinstance(e, bytes) else e for e in asyncio.run(events())]
    return {json.loads(t[len("data: "):])["id"] for t in texts if t != "data: [DONE]\n\n"}


@pytest.mark.parametrize("stream", [False, True])
def test_the_x_request_id_header_names_a_chats_answer_as_vllms(pair, stream):  # noqa: F811
    """vLLM's chatcmpl-<X-Request-Id>, on every chunk; the pools' sessions stay the
    router's own (deployments.request_headers)."""
    router = router_of(pair)
    assert answer_ids(router, BODY, "trace-7", stream) == {"chatcmpl-trace-7"}
    assert answer_ids(router, BODY, "", stream) != {"chatcmpl-"}  # an empty one is none


def test_the_bodys_request_id_comes_before_the_header(pair):  # noqa: F811
    """Serve's proxy gives every request an x-request-id: read first, it would override
    every body's request_id (vLLM reads the header first)."""
    router = router_of(pair)
    assert answer_ids(router, {**BODY, "request_id": "mine"}, "serves") == {"chatcmpl-mine"}


def test_a_stored_chat_does_not_read_the_header(pair):  # noqa: F811
    """A stored chat's id names its store entry and is the router's own (its body's
    request_id is a 400); its header, which every request has under Serve, is no refusal."""
    (only,) = answer_ids(router_of(pair), {**BODY, "store": True}, "trace-8")
    assert only.startswith("chatcmpl-") and only != "chatcmpl-trace-8"


def test_a_header_past_the_request_id_bound_is_a_400(pair):  # noqa: F811
    router = router_of(pair)
    answer = asyncio.run(router.serve_request(posted(BODY, "a" * 257), StoredChatRequest))
    assert answer.status_code == 400
    assert "X-Request-Id header has 257 characters" in json.loads(answer.body)["error"]["message"]
    assert router.admission.running == 0


def test_the_header_names_a_chat_batchs_answer(pair):  # noqa: F811
    answer = asyncio.run(ChatBatchRoute.chat_completions_batch(
        router_of(pair), posted({**BODY, "messages": CONVERSATIONS}, "batch-9")))
    assert answer.status_code == 200 and json.loads(answer.body)["id"] == "chatcmpl-batch-9"


def test_the_header_is_a_completions_and_not_a_responses_or_messages_request_id():
    """vLLM reads it for chats and completions (cmpl-<id>); its Responses and Messages ids
    are their own."""
    request = posted({}, "trace-1")
    assert header_request_id(request, CompletionRequest(prompt="x")).request_id == "trace-1"
    assert header_request_id(posted({}), CompletionRequest(prompt="x")).request_id is None
    for body in (ResponsesRequest(model="m", input="hi"),
                 MessagesRequest(model="m", max_tokens=4,
                                 messages=[{"role": "user", "content": "hi"}])):
        assert header_request_id(request, body) is body


def test_load_counts_the_requests_admitted_or_waiting_not_their_choices():
    """vLLM's server_load counts requests: one of n = 3 is one; a waiting one counts; a
    waiter cancelled, handed its slots or not, counts no more."""
    admission = Admission(4, max_waiting=4)

    async def main():
        first = admission.admit(3)
        assert (admission.running, admission.load) == (3, 1)
        waiter = asyncio.ensure_future(admission.wait_turn(2))
        cancelled = asyncio.ensure_future(admission.wait_turn(2))
        await asyncio.sleep(0)
        assert admission.load == 3
        cancelled.cancel()
        await asyncio.sleep(0)
        assert admission.load == 2
        first.release()  # the waiter's slots taken for it: admitted, not yet resumed
        assert (admission.waiting, admission.load) == (0, 1)
        (await waiter).release()
        assert (admission.running, admission.load) == (0, 0)

    asyncio.run(main())


def test_load_is_served_open_and_counts_a_stream_until_it_ends(pair):  # noqa: F811
    """GET /load, open as /metrics is (vLLM's key guards /v1 alone), serving the router's
    count always (vLLM's is 0 without --enable-server-load-tracking)."""
    assert "get" in app.openapi()["paths"]["/load"]
    router = router_of(pair, api_key="secret")
    router.load = MethodType(Router.load, router)
    assert asyncio.run(router.load()) == {"server_load": 0}
    asked = posted({**BODY, "stream": True})
    asked.scope["headers"].append((b"authorization", b"Bearer secret"))

    async def main():
        answer = await router.serve_request(asked, StoredChatRequest)
        during = await router.load()
        [_ async for _ in answer.body_iterator]
        await answer.body_iterator.aclose()
        answer.ticket.release()  # as ReleasingStream's end does
        return during, await router.load()

    assert asyncio.run(main()) == ({"server_load": 1}, {"server_load": 0})
