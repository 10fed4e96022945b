"""The router reads a body as JSON only when its Content-Type says JSON: a text/plain or form
body, or one of no type, is what a browser's page may POST to any origin without a CORS
preflight, so reading it let any page make a router without an API key generate."""

import asyncio
import json

import pytest
from starlette.requests import Request

from deployments.ingress import BadRequest, parse
from deployments.openai_api import CompletionRequest
from tests.unit.test_router_parts import posted, router_of

BODY = {"prompt": "x", "max_tokens": 4}
REFUSED = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
           "multipart/form-data; boundary=----x", "text/json", "application/xml",
           "application/jsonl", "; charset=utf-8", None, ""]
ACCEPTED = ["application/json", "Application/JSON; charset=utf-8",
            "application/json;charset=UTF-8", " application/json ", "application/vnd.api+json",
            "application/merge-patch+JSON"]


def typed(content_type: str | None, receive=None) -> Request:
    """A completions request (test_router_parts.posted's) with this Content-Type (None: no
    header), its body read by `receive` when given."""
    request = posted(BODY)
    headers = [header for header in request.scope["headers"] if header[0] != b"content-type"]
    if content_type is not None:
        headers.append((b"content-type", content_type.encode()))
    return Request({**request.scope, "headers": headers}, receive or request.receive)


def refused(request: Request) -> BadRequest:
    with pytest.raises(BadRequest) as refusal:
        asyncio.run(parse(request, CompletionRequest, 1 << 20))
    return refusal.value


@pytest.mark.parametrize("content_type", REFUSED)
def test_a_body_that_says_it_is_not_json_is_a_415_naming_both_types(content_type):
    refusal = refused(typed(content_type))
    media = (content_type or "").partition(";")[0].strip().lower()
    assert refusal.status == 415 and "application/json" in str(refusal)
    assert f"is '{media}'" in str(refusal) if media else "is not given" in str(refusal)


@pytest.mark.parametrize("content_type", ACCEPTED)
def test_a_json_type_is_read_as_before(content_type):
    parsed = asyncio.run(parse(typed(content_type), CompletionRequest, 1 << 20))
    assert parsed.prompt == "x" and parsed.max_tokens == 4


def test_an_empty_body_needs_no_type():
    """(fetch() of nothing POSTs no type): the body's own refusal, not the type's."""
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    refusal = refused(Request({**posted(BODY).scope, "headers": [(b"content-length", b"0")]},
                              receive))
    assert refusal.status == 400


def test_the_type_is_refused_before_the_body_is_read():
    """No chunk of the body is asked for (a megabyte need not come to be refused)."""
    asked = []

    async def receive():
        asked.append(True)
        raise AssertionError("the body was read")

    assert refused(typed("text/plain", receive)).status == 415 and not asked


def test_the_refusal_reaches_the_client_in_openais_shape_and_admits_nothing():
    serve, admission = router_of(max_running=1)
    answer = asyncio.run(serve(typed("application/x-www-form-urlencoded"), CompletionRequest,
                               chat=False))
    error = json.loads(answer.body)["error"]
    assert answer.status_code == 415 and admission.running == 0
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert "'application/x-www-form-urlencoded'" in error["message"]
