"""The router's ingress answers a bug with a logged 500, and a request Serve cancelled (its
client went away) with a quiet 499; it parses a body without the cycle collector."""

import asyncio
import gc
import json
import logging

from fastapi.testclient import TestClient
from ray.exceptions import TaskCancelledError

import grpc
import pytest

from deployments import ingress
from deployments.ingress import CLIENT_CLOSED, ingress_app, log, parse
from deployments.router_args import RouterArgs
from deployments.openai_api import CompletionRequest
from deployments.replica_stream import pool_error
from speculative.types import TargetScores
from tests.tiny import Agreeing
from tests.unit.test_router_parts import JSON_TYPE, posted, router_of


class Records(logging.Handler):
    """The records the ingress logs (its logger, Serve's, does not propagate to pytest's)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> list[logging.LogRecord]:
        log.addHandler(self)
        return self.records

    def __exit__(self, *exc) -> None:
        log.removeHandler(self)


def app_raising(error: Exception, raised_on: bool = False) -> TestClient:
    """A client of an ingress app whose endpoint raises error; raised_on: the client raises
    what the app raises on to the server."""
    app = ingress_app("test")

    @app.get("/v1/x")
    async def fail():
        raise error

    return TestClient(app, raise_server_exceptions=raised_on)


def test_a_bug_is_a_logged_500():
    with Records() as records:
        response = app_raising(RuntimeError("boom")).get("/v1/x")
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal error"
    assert [r.levelno for r in records] == [logging.ERROR] and records[0].exc_info


def test_a_path_or_method_not_served_is_refused_in_openais_shape():
    """As vLLM's and OpenAI's own: FastAPI's {"detail": "Not Found"} was no error an OpenAI
    client reads. A path is no model: no model_not_found; a 405 keeps its Allow header."""
    client = app_raising(RuntimeError("unused"))
    for method, path, status in [("get", "/v1/embeddings", 404), ("post", "/v1/x", 405)]:
        answer = getattr(client, method)(path)
        assert answer.status_code == status
        assert answer.json() == {"error": {
            "message": f"{answer.reason_phrase} ({method.upper()} {path})",
            "type": "invalid_request_error", "param": None, "code": None}}
    assert answer.headers["allow"] == "GET"


PREFLIGHT = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def test_browsers_may_call_the_router_as_vllms_defaults_allow(monkeypatch):
    """The router's args (vLLM's defaults: any origin, method and header, no credentials)
    answer a preflight and mark the answers (a refusal's too) as readable by the page."""
    monkeypatch.setattr(ingress, "_cross_origin", None)
    ingress.allow_cross_origin(RouterArgs().cross_origin())
    client = app_raising(RuntimeError("boom"))
    preflight = client.options("/v1/x", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == PREFLIGHT[
        "Access-Control-Request-Headers"]
    assert "access-control-allow-credentials" not in preflight.headers
    refused = client.get("/v1/embeddings", headers={"Origin": "https://chat.example"})
    assert refused.status_code == 404 and refused.headers["access-control-allow-origin"] == "*"


def test_a_bugs_500_carries_the_cors_headers_too(monkeypatch):
    """Starlette answers a bug outside every added middleware: the 500 went without CORS
    headers, and a browser's page saw a failed cross-origin call, not the error. Still
    logged once, and still raised on to the server."""
    monkeypatch.setattr(ingress, "_cross_origin", None)
    ingress.allow_cross_origin(RouterArgs(allowed_origins=["https://ui.example"],
                                          allow_credentials=True).cross_origin())
    with Records() as records:
        failed = app_raising(RuntimeError("boom")).get("/v1/x",
                                                       headers={"Origin": "https://ui.example"})
    assert failed.status_code == 500 and failed.json()["error"]["message"] == "internal error"
    assert failed.headers["access-control-allow-origin"] == "https://ui.example"
    assert failed.headers["access-control-allow-credentials"] == "true"
    assert [r.levelno for r in records] == [logging.ERROR]
    with pytest.raises(RuntimeError, match="boom"):
        app_raising(RuntimeError("boom"), raised_on=True).get("/v1/x")


def test_an_origin_the_args_do_not_list_is_refused_and_a_pools_app_has_no_cors(monkeypatch):
    monkeypatch.setattr(ingress, "_cross_origin", None)
    pool = app_raising(RuntimeError("boom"))  # nothing allowed: no header, no preflight
    assert pool.options("/v1/x", headers=PREFLIGHT).status_code == 405
    assert "access-control-allow-origin" not in pool.get(
        "/v1/embeddings", headers={"Origin": "https://chat.example"}).headers
    ingress.allow_cross_origin(RouterArgs(allowed_origins=["https://ui.example"],
                                          allow_credentials=True).cross_origin())
    client = app_raising(RuntimeError("boom"))
    assert client.options("/v1/x", headers=PREFLIGHT).status_code == 400
    allowed = client.options("/v1/x", headers={**PREFLIGHT, "Origin": "https://ui.example"})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://ui.example"
    assert allowed.headers["access-control-allow-credentials"] == "true"


def test_a_request_serve_cancelled_is_not_a_bug():
    """Answered 499 and not raised on to the server (Starlette raises what its handler of
    Exception answered on: Serve then logged a failed request with its traceback)."""
    with Records() as records:
        response = app_raising(TaskCancelledError(), raised_on=True).get("/v1/x")
    assert response.status_code == CLIENT_CLOSED == 499
    assert [r.levelno for r in records] == [logging.INFO] and not records[0].exc_info


def test_a_client_gone_before_its_body_is_whole_is_not_a_bug():
    """Starlette raises ClientDisconnect when the body's receive brings the disconnect that
    Serve's proxy passes on: it reached the ingress's handler as a bug (a 500 logged with
    its traceback, raised on into Serve). Answered as Serve's cancellation is, nothing
    admitted."""
    from starlette.requests import Request

    serve, admission = router_of(max_running=1)
    raw = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
    messages = iter([{"type": "http.request", "body": raw[:5], "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive():
        return next(messages)

    request = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                       "query_string": b"", "headers": [
                           JSON_TYPE, (b"content-length", str(len(raw)).encode())]}, receive)
    with Records() as records:
        answer = asyncio.run(serve(request, CompletionRequest, chat=False))
    assert answer.status_code == CLIENT_CLOSED and admission.running == 0
    assert [r.levelno for r in records] == [logging.INFO] and not records[0].exc_info


class Unavailable(Agreeing):
    async def score(self, call):
        raise pool_error("verifier", grpc.StatusCode.UNAVAILABLE, "replica gone")


def failing_request(verifier) -> tuple:
    """(the whole answer, the stream's chunks, the ingress's log records, the admission) of
    a completion, whole and then streamed, over this verifier."""
    serve, admission = router_of(max_running=2, verifier=verifier)

    async def main():
        whole = await serve(posted({"prompt": "hi", "max_tokens": 4}), CompletionRequest,
                            chat=False)
        stream = await serve(posted({"prompt": "hi", "max_tokens": 4, "stream": True}),
                             CompletionRequest, chat=False)
        return whole, [chunk async for chunk in stream.body_iterator]

    with Records() as records:
        whole, chunks = asyncio.run(main())
    return whole, chunks, records, admission


def test_a_failed_pool_call_is_logged_with_the_requests_id():
    """The id that keys the request's pool sessions (a pool logs a failed batch by them):
    the warning named only the pool's error, and Serve's own request id is another."""
    whole, chunks, records, admission = failing_request(Unavailable())
    assert whole.status_code == 503 and "unavailable" in chunks[0]  # the stream's error event
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert warnings == ["pool call failed for cmpl-x-0: verifier: UNAVAILABLE: replica gone"] * 2
    assert admission.running == 0


class Lawless(Agreeing):  # a sampled row whose law is not finite (NaN or inf logits)
    async def score(self, call):
        from speculative.types import LAWLESS

        return TargetScores(target_token_ids=(LAWLESS,) * (len(call.draft_token_ids) + 1))


def test_an_answer_the_router_refuses_to_read_is_the_verifiers_503_not_a_bug():
    """The router's own checks of a verifier's answer (a row that is not finite, a tree
    scored as a chain) raise a PoolUnavailable that is no gRPC call's PoolError: it was
    answered as a bug, a logged 500 (and a stream's error event said internal error)."""
    whole, chunks, records, admission = failing_request(Lawless())
    assert whole.status_code == 503
    assert json.loads(chunks[0][len("data: "):])["error"]["message"] == \
        "the verifier pool is unavailable; retry later"
    assert not any(r.levelno >= logging.ERROR for r in records) and admission.running == 0


def collections_while(work) -> tuple[object, list[int]]:
    """(work()'s value, the generations of the collections that began while it ran)."""
    started = []

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])

    async def main():
        gc.collect()
        gc.callbacks.append(count)
        try:
            return await work()
        finally:
            gc.callbacks.remove(count)

    return asyncio.run(main()), started


def test_a_body_of_small_arrays_is_parsed_without_the_cycle_collector():
    """A body's JSON (here 200,000 empty arrays, in a field the schema ignores) made with
    the collector on set off a collection every 700 containers (10,000 under these tests'
    conftest), and a full one over the whole heap now and then: 0.8 s of the event loop for
    2 MiB in the router's process. Counted: none while it is parsed (19 without the
    pause)."""
    request = posted({"prompt": "x", "ignored": [[]] * 200_000})
    parsed, started = collections_while(lambda: parse(request, CompletionRequest, 1 << 20))
    assert parsed.prompt == "x" and len(started) <= 1 and gc.isenabled()


def test_a_schema_given_as_text_is_read_with_the_body():
    """structured_outputs.json as a JSON text was read where it compiles, with the collector
    on (2 MiB of arrays: 0.9 s of the event loop, the tokenizing thread holding the GIL):
    it is read with the body."""
    schema = json.dumps({"type": "object", "x": [[]] * 200_000})
    request = posted({"prompt": "x", "structured_outputs": {"json": schema}})
    parsed, started = collections_while(lambda: parse(request, CompletionRequest, 1 << 20))
    assert parsed.structured_outputs.json_ == json.loads(schema) and len(started) <= 1


def test_a_number_too_long_to_read_is_a_400():
    """Python's int() refuses past 4,300 digits with a ValueError, not the decoder's
    JSONDecodeError: /tokenize and /detokenize answered a bug's 500, the completions
    endpoints a 400 that named sys.set_int_max_str_digits."""
    from starlette.requests import Request

    from deployments.ingress import BadRequest
    from deployments.tokenize_api import DetokenizeRequest

    async def receive():
        return {"type": "http.request", "body": b'{"tokens": [' + b"9" * 5000 + b"]}"}

    request = Request({"type": "http", "method": "POST", "path": "/detokenize",
                       "query_string": b"", "headers": [JSON_TYPE]}, receive)
    with pytest.raises(BadRequest) as refused:
        asyncio.run(parse(request, DetokenizeRequest, 1 << 20))
    assert refused.value.status == 400 and "too long" in str(refused.value)


def test_a_body_that_never_finishes_is_refused_at_its_deadline(monkeypatch):
    """A client that sends the start of a body and then nothing held the router's slot
    (Serve's max_ongoing_requests) for ever: a few hundred of them shut everyone out."""
    from deployments import ingress

    monkeypatch.setattr(ingress, "BODY_TIMEOUT_S", 0.2)
    monkeypatch.setattr(ingress, "BODY_GRACE_S", 30)  # the whole body's deadline alone
    refused = refusal(body_of([b'{"prompt": "'], 0))
    assert refused.status == 408 and "0.2 s" in str(refused)


def body_of(chunks: list[bytes], pause_s: float, ends: bool = False):
    """A completions request whose body comes as these chunks, pause_s apart, then ends, or
    stalls (never more, never closed)."""
    from starlette.requests import Request

    sent = []

    async def receive():
        if len(sent) < len(chunks):
            if sent:
                await asyncio.sleep(pause_s)
            sent.append(chunks[len(sent)])
            return {"type": "http.request", "body": sent[-1],
                    "more_body": not ends or len(sent) < len(chunks)}
        await asyncio.sleep(3600)

    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "query_string": b"", "headers": [JSON_TYPE]}, receive)


def refusal(request):
    from deployments.ingress import BadRequest

    async def main():
        with pytest.raises(BadRequest) as refused:
            await asyncio.wait_for(parse(request, CompletionRequest, 1 << 20), 10)
        return refused.value

    return asyncio.run(main())


def test_a_stalled_or_trickled_body_is_refused_long_before_the_whole_bodys_deadline(
        monkeypatch):
    """A body must start within BODY_GRACE_S and keep coming at BODY_MIN_RATE after it: a
    few hundred stalled bodies, sent again each minute, held every slot of the router for
    the whole BODY_TIMEOUT_S (60 s: a completion waited 57.7 s for a slot). The grace here
    0.2 s and the rate 1,000 bytes a second; the whole body's deadline stays 60 s (the test
    gives up at 10 s)."""
    from deployments import ingress

    monkeypatch.setattr(ingress, "BODY_GRACE_S", 0.2)
    monkeypatch.setattr(ingress, "BODY_MIN_RATE", 1000)
    stalled = refusal(body_of([b'{"prompt": "'], 0))
    assert stalled.status == 408 and "12 bytes" in str(stalled)
    trickled = refusal(body_of([b'{"prompt": "'] + [b"a"] * 200, 0.05))  # 20 bytes a second
    assert trickled.status == 408 and "bytes in" in str(trickled)


def test_a_body_that_keeps_coming_is_read_whole(monkeypatch):
    """Each chunk extends the body's deadline by its bytes over BODY_MIN_RATE: a body of 35
    chunks, each 25 ms after the one before, is read whole where the grace alone is 0.2 s
    (a rate of a byte a second: each chunk of 30 bytes gives 30 s more)."""
    from deployments import ingress

    monkeypatch.setattr(ingress, "BODY_GRACE_S", 0.2)
    monkeypatch.setattr(ingress, "BODY_MIN_RATE", 1)
    body = b'{"prompt": "' + b"a" * 1000 + b'", "max_tokens": 3}'
    chunks = [body[i:i + 30] for i in range(0, len(body), 30)]
    parsed = asyncio.run(parse(body_of(chunks, 0.025, ends=True), CompletionRequest, 1 << 20))
    assert parsed.prompt == "a" * 1000 and parsed.max_tokens == 3
