"""The router's API key as vLLM's middleware checks it: the scheme `Bearer` in any case, one
space, then exactly the key (Anthropic's x-api-key read as that key); and asked for before a
path or method the router does not serve is refused, except on the paths vLLM leaves open."""

import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request

from deployments import ingress
from deployments.ingress import ingress_app, unauthorized
from deployments.messages_events import with_api_key


def sent(headers: dict) -> Request:
    """A request to a route behind the key, carrying these headers."""
    return Request({"type": "http", "method": "GET", "path": "/v1/models", "query_string": b"",
                    "headers": [(name.encode(), value.encode())
                                for name, value in headers.items()]})


@pytest.mark.parametrize("authorization, taken", [
    ("Bearer k", True), ("bearer k", True), ("BEARER k", True),
    ("Bearer  k", False), ("Bearer k ", False), ("Bearer k\t", False), ("Bearer\tk", False),
    ("Bearer", False), ("Bearer kk", False), ("Basic k", False), ("k", False)])
def test_the_key_is_the_bearer_scheme_one_space_and_exactly_the_key(authorization, taken):
    """vLLM's AuthenticationMiddleware's check: a stray space before or after the key was
    stripped, and a header vLLM refuses was taken (an HTTP server strips a header's own
    trailing whitespace before the router sees it)."""
    refused = unauthorized(sent({"authorization": authorization}), "k")
    assert (refused is None) == taken
    if refused is not None:
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("x_api_key, taken", [("k", True), ("k ", False), (" k", False)])
def test_an_x_api_key_is_compared_as_the_bearer_key_is(x_api_key, taken):
    request = with_api_key(sent({"x-api-key": x_api_key}), "k")
    assert (unauthorized(request, "k") is None) == taken


def guarded_app(monkeypatch) -> TestClient:
    """An ingress app under the key "k" (as the router's constructor sets it): GET /v1/x
    and GET /health served."""
    monkeypatch.setattr(ingress, "_unrouted_key", None)
    ingress.guard_unrouted("k")
    app = ingress_app("test")
    app.get("/v1/x")(lambda: {})
    app.get("/health")(lambda: {"status": "ok"})
    return TestClient(app)


@pytest.mark.parametrize("method, path, status", [
    ("get", "/v1/embeddings", 404), ("post", "/v1/x", 405), ("get", "/tokenize", 404)])
def test_a_path_or_method_not_served_asks_for_the_key_first(monkeypatch, method, path,
                                                             status):
    """vLLM's middleware asks for the key before routing: a client without it learnt which
    paths and methods the router serves from its 404s and 405s."""
    client = guarded_app(monkeypatch)
    refused = getattr(client, method)(path)
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"]["code"] == "invalid_api_key"
    keyed = getattr(client, method)(path, headers={"Authorization": "Bearer k"})
    assert keyed.status_code == status


@pytest.mark.parametrize("method, path, status", [
    ("post", "/health", 405), ("get", "/health/x", 404), ("get", "/metrics/x", 404),
    ("get", "/ping/x", 404), ("options", "/v1/x", 405)])
def test_an_open_path_or_a_preflight_is_routed_without_the_key(monkeypatch, method, path,
                                                               status):
    """The paths vLLM leaves open (health checks, load, version, metrics, the API's
    documents) and those below them are refused as routing refuses them; a preflight
    carries no key (CORS, where it is on, answers it before routing)."""
    assert getattr(guarded_app(monkeypatch), method)(path).status_code == status
