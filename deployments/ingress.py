"""What the router's HTTP ingress does around a request: errors in OpenAI's shape (a failed
pool call among them), the API key, body parsing, the OpenAPI document."""

import asyncio
import contextlib
import functools
import gc
import hmac
import json
import logging
import os

import grpc
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from deployments.responses import WHOLE, error_body, json_text
from deployments.router_args import bearer_key
from speculative.types import PoolBusy, PoolUnavailable

log = logging.getLogger("ray.serve")
API_KEY_ENV = "SPECSERVE_API_KEY"
RETRY_AFTER_S = 1
# a body trickled in (or never finished) held its Serve slot on the router for as long as
# its client liked: a few hundred such connections, which cost their client nothing, left
# no room for anyone else. So a body must start within BODY_GRACE_S, keep coming at
# BODY_MIN_RATE bytes a second on average after it, and end within BODY_TIMEOUT_S (6 MiB
# in this time is 105 KB/s): with only the last, 270 stalled bodies (sent again each
# minute) made a completion wait 57.7 s for a slot
BODY_TIMEOUT_S = 60
BODY_GRACE_S = 5
BODY_MIN_RATE = 32 * 1024
# a body's bytes per byte of a prompt within max_prompt_bytes: at worst a control character
# escaped as \u00XX (json.dumps's default writes a 4-byte character as two \uXXXX: 3 a
# byte); BODY_ALLOWANCE more for the request's other fields
ESCAPED_BYTES = 6
BODY_ALLOWANCE = 1 << 16
# of an id a refusal quotes: the router's own whole ("resp_" and 32 hex digits), one named
# after a client's request_id (256 characters at most) its start
ECHOED_ID_CHARS = 100


class BadRequest(Exception):
    """A refusal; its `code` OpenAI's for its status (error_body's) unless given (None:
    null, as a 404 for what is no model: not model_not_found)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict | None = None, code: str | None = ...):
        super().__init__(message)
        self.status, self.param, self.headers, self.code = status, param, headers, code


def echoed_id(asked: str) -> str:
    """An id a client asked for, as a refusal quotes it: its first ECHOED_ID_CHARS characters,
    then "..." (an id of 100 KB in a path or a body was echoed whole, each 404 as large)."""
    return asked if len(asked) <= ECHOED_ID_CHARS else f"{asked[:ECHOED_ID_CHARS]}..."


def error_response(error: BadRequest) -> JSONResponse:
    body = error_body(str(error), error.status, error.param)
    if error.code is not ...:
        body["error"]["code"] = error.code
    return JSONResponse(body, error.status, headers=error.headers)


def json_answer(body: dict) -> Response:
    """A whole answer's body as JSONResponse writes it, encoded a piece at a time (a thread
    that encodes it stalls the event loop no longer than a piece)."""
    return Response(json_text(body, **WHOLE), media_type="application/json")


def retry_later(message: str, status: int) -> BadRequest:
    return BadRequest(message, status, headers={"Retry-After": str(RETRY_AFTER_S)})


def pool_failure(error: PoolUnavailable, request_id: str | None = None) -> BadRequest:
    """What a client learns of a failed pool call: 429 when the pool had no room for the
    request now (its KV cache, or its calls in flight: RESOURCE_EXHAUSTED, a PoolBusy; a
    message too large for the channel never fits, so it is not one), 400 with the pool's
    reason when the request can never fit its KV cache or its grammar cannot go on
    (OUT_OF_RANGE), else 503 (an INVALID_ARGUMENT from a pool is the router's fault, not
    the client's); the details go to the log, with the request's id (its pool sessions',
    which a pool's own log of a failed batch names: deployments.health). A failure that is
    no gRPC call's (a PoolError) is the router's own check of the verifier's answer (a
    sampled row that is not finite, a tree scored as a chain): the verifier's 503."""
    log.warning("pool call failed for %s: %s", request_id, error)
    pool = getattr(error, "pool", "verifier")
    if isinstance(error, PoolBusy):  # not a message too large, which never fits
        return retry_later(f"the {pool} pool has no room for this request now (its KV "
                           "cache or its calls in flight are full); retry later", 429)
    if getattr(error, "code", None) == grpc.StatusCode.OUT_OF_RANGE:
        return BadRequest(f"the {pool} pool refused the request: {error.details}", 400)
    return retry_later(f"the {pool} pool is unavailable; retry later", 503)


CLIENT_CLOSED = 499  # nginx's status for a request its client closed: no one reads it


async def unexpected(request: Request, error: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered in OpenAI's shape without its details
    (Starlette then raises it on to the server, which logs it too)."""
    log.exception("unexpected error serving %s", request.url.path)
    return JSONResponse(error_body("internal error", 500), 500)


async def cancelled(request: Request, error: TaskCancelledError) -> JSONResponse:
    """Serve cancelling the request's task is no bug: its client went away (a stream's
    disconnect can surface as that cancellation instead of Starlette's own disconnect).
    Its own handler, not unexpected's: Starlette raises what the handler of Exception
    answered on to the server, which logged it as a failed request with its traceback."""
    log.info("the client of %s went away", request.url.path)
    return JSONResponse(error_body("client closed the request", CLIENT_CLOSED), CLIENT_CLOSED)


async def not_routed(request: Request, error: HTTPException) -> JSONResponse:
    """Routing's own refusals (a path it does not serve: 404; a method the path does not
    take: 405, with its Allow header) in OpenAI's shape, as vLLM's and OpenAI's own, not
    FastAPI's {"detail": ...}; a path is no model, so no model_not_found. Under this
    process's API key (guard_unrouted) a path not open is a 401 first, as vLLM's, whose
    middleware asks for the key before routing; a preflight (OPTIONS) carries no key."""
    if request.method != "OPTIONS" and not open_path(request.url.path) \
            and (refused := unauthorized(request, _unrouted_key)):
        return refused
    return error_response(BadRequest(f"{error.detail} ({request.method} {request.url.path})",
                                     error.status_code, headers=error.headers, code=None))


# the paths vLLM leaves open under its API key (its PUBLIC_ENDPOINTS), and those below them:
# health checks (SageMaker's /ping among them), load, version, metrics, the API's documents
OPEN_PATHS = ("/health", "/ping", "/load", "/version", "/metrics", "/docs", "/redoc",
              "/openapi.json", "/static")
# the key this process's routes ask for, which not_routed asks for too: set by the router's
# constructor, as _cross_origin is (None: a pool's app, or a router without a key)
_unrouted_key: str | None = None


def guard_unrouted(key: str | None) -> None:
    global _unrouted_key
    _unrouted_key = key


def open_path(path: str) -> bool:
    """Whether the path is one of OPEN_PATHS or below one (/health/x; not /healthz)."""
    return any(path == root or path.startswith(root + "/") for root in OPEN_PATHS)


def api_key(configured: str | None) -> str | None:
    """The key /v1/* require: the router's arg, else the environment's (empty: unset), else
    none. ValueError naming the variable for a key no client could send (bearer_key)."""
    if configured is not None:
        return configured
    key = os.environ.get(API_KEY_ENV) or None
    if key is not None:
        try:
            bearer_key(key)
        except ValueError as error:
            raise ValueError(f"{API_KEY_ENV}: {error}") from None
    return key


def unauthorized(request: Request, key: str | None) -> JSONResponse | None:
    """401 unless the request carries the API key (when one is set): vLLM's check, the
    scheme `Bearer` in any case, one space, then exactly the key (`Bearer  <key>` is not it),
    compared in constant time."""
    if key is None:
        return None
    scheme, _, sent = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(sent.encode(), key.encode()):
        return None
    return error_response(BadRequest("invalid or missing API key (Authorization: Bearer "
                                     "<key>)", 401, headers={"WWW-Authenticate": "Bearer"}))


async def parse(request: Request, schema, max_prompt_bytes: int):
    """The body as `schema`, refused before reading when it is not JSON (check_json_type) or
    its declared size is beyond what a prompt of max_prompt_bytes needs (body_limit), and
    when it does not come in time (408: the BODY_ constants)."""
    check_json_type(request.headers)
    size = int(request.headers.get("content-length") or 0)
    if size > body_limit(max_prompt_bytes):
        raise too_large(str(size), max_prompt_bytes)
    body = bytearray()
    try:
        await read_body(request, body, max_prompt_bytes)
    except ClientDisconnect:  # gone before its body was whole (Serve's proxy passes the
        # disconnect on): raised on, it was a bug's logged 500, and Serve's "Request failed"
        log.info("the client of %s went away before its body was whole", request.url.path)
        raise BadRequest("client closed the request", CLIENT_CLOSED) from None
    try:
        with collector_paused():
            return schema.model_validate(decoded(body))
    except ValidationError as error:
        raise invalid_body(error) from None
    except RecursionError:  # a few KB of nested brackets exhaust the decoder's stack
        raise BadRequest("the request body is nested too deeply") from None


def check_json_type(headers) -> None:
    """415 unless the body is read as JSON, as FastAPI reads one (its strict_content_type,
    vLLM's behaviour): application/json or application/<x>+json, any case, any parameters. A
    body of another type (text/plain, a form's) or of none (fetch() of a Blob) is one a web
    page may POST to any origin without a CORS preflight: read, a router without an API key
    generated for every page that asked. An empty body needs no type (its parse says why)."""
    content_type = headers.get("content-type", "")
    media = content_type.partition(";")[0].strip().lower()
    kind, _, subtype = media.partition("/")
    if kind == "application" and (subtype == "json" or subtype.endswith("+json")) \
            or not media and headers.get("content-length") == "0":
        return
    said = f"is {media!r}" if media else "is not given"
    raise BadRequest(f"the request body's Content-Type {said}; the router reads "
                     "application/json (or application/<x>+json)", 415)


def body_limit(max_prompt_bytes: int) -> int:
    """The most bytes a body may have: what the worst escaping of a prompt within
    max_prompt_bytes takes (ESCAPED_BYTES a byte), and BODY_ALLOWANCE for the rest."""
    return ESCAPED_BYTES * max_prompt_bytes + BODY_ALLOWANCE


def too_large(size: str, max_prompt_bytes: int) -> BadRequest:
    return BadRequest(f"the request body has {size} bytes; the limit is "
                      f"{body_limit(max_prompt_bytes)} ({ESCAPED_BYTES} for each byte of a "
                      f"prompt of {max_prompt_bytes}, as escaped JSON at worst, and "
                      f"{BODY_ALLOWANCE} more)", 413)


async def read_body(request: Request, body: bytearray, max_prompt_bytes: int) -> None:
    """The request's body into `body`, chunk by chunk, each awaited until the body's
    deadline: BODY_GRACE_S from the start, and a second more for every BODY_MIN_RATE bytes
    come, BODY_TIMEOUT_S at most (408); past body_limit, 413 (a chunked body declares no
    length: counted)."""
    limit = body_limit(max_prompt_bytes)
    loop = asyncio.get_running_loop()
    start, chunks = loop.time(), request.stream().__aiter__()
    while True:
        allowed = min(BODY_TIMEOUT_S, BODY_GRACE_S + len(body) / BODY_MIN_RATE)
        try:  # (wait_for, not asyncio.timeout: Python 3.10 is supported)
            chunk = await asyncio.wait_for(chunks.__anext__(), start + allowed - loop.time())
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise BadRequest(
                f"the request body did not arrive in time: {len(body)} bytes in "
                f"{loop.time() - start:.1f} s (it must start within {BODY_GRACE_S} s, keep "
                f"coming at {BODY_MIN_RATE // 1024} KB/s and end within {BODY_TIMEOUT_S} s)",
                408) from None
        body.extend(chunk)
        if len(body) > limit:
            raise too_large(f"more than {limit}", max_prompt_bytes)


def invalid_body(error: ValidationError) -> BadRequest:
    """A body's first validation error as a 400 naming its field."""
    first = error.errors()[0]
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "model_type":  # not "a valid dictionary or instance of <a class>"
        message = "Input should be an object"
    # a refusal that names its own field (deployments.tools.FieldError: a body-level
    # check's, such as vLLM's earlier guided_*)
    if named := getattr(first.get("ctx", {}).get("error"), "param", None):
        return BadRequest(message, param=named)
    param = ".".join(str(p) for p in first["loc"] if not union_member(p)) or None
    return BadRequest(f"{param}: {message}" if param else message, param=param)


def decoded(body: bytes):
    """The body's JSON value. A number past Python's 4,300 digits is the decoder's int()'s
    ValueError, not a JSONDecodeError: it was a bug's 500 on the tokenizer endpoints, and
    a 400 elsewhere that told the client of sys.set_int_max_str_digits."""
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    except ValueError:
        raise BadRequest("the request body holds a number too long to read") from None


@contextlib.contextmanager
def collector_paused():
    """Python's cycle collector held off while a body is parsed and validated. A body of
    small arrays (2 MiB of `[]`: 700k) sets off a collection every 700 made, and now and
    then a full one over the whole heap: 0.8 s of the event loop in a process with torch
    and Ray loaded, against 0.04 s paused (a thread would not help: the parser holds the
    GIL throughout). A parsed body holds no cycles: its counts free it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def union_member(part) -> bool:
    """Whether a part of a validation error's place is pydantic's name of a union's member
    (`str`, `constrained-int`, `function-after[...]`), not a field, key or index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or
                                      any(mark in part for mark in "[]()-'"))


class ReleasingStream(StreamingResponse):
    """Server-sent events that end their generator and give the request's admission back
    however the response ends: when the client has gone before the first chunk, Starlette
    skips a background task and a generator never started runs no `finally`; one paused at
    a chunk would run it only when collected."""

    def __init__(self, events, ticket) -> None:  # an admission Ticket (None: holds none)
        super().__init__(events, media_type="text/event-stream")
        self.ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except TaskCancelledError:  # Serve's receive telling of a client gone mid-stream:
            # raised on, it reached Serve's call as an error nobody reads, and the replica
            # logged "Future exception was never retrieved" with its traceback every time
            log.info("the client of %s went away mid-stream", scope.get("path"))
        finally:  # the events' own end (their choices' tasks cancelled), then the slot
            await self.body_iterator.aclose()
            if self.ticket is not None:
                self.ticket.release()


def openapi_document(app: FastAPI, bodies: dict) -> dict:
    """FastAPI's document, with the request bodies the endpoints parse themselves (so that
    clients and schema-based fuzzers see them): bodies maps a POST path to its models (a
    body that is any one of several: anyOf)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version="1", routes=app.routes)
        models = list(dict.fromkeys(m for ms in bodies.values() for m in ms))
        _, definitions = models_json_schema([(m, "validation") for m in models],
                                            ref_template="#/components/schemas/{model}")
        document.setdefault("components", {}).setdefault("schemas", {}).update(
            definitions["$defs"])
        for path, ms in bodies.items():
            refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in ms]
            schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
            document["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": schema}}}
        app.openapi_schema = document
    return app.openapi_schema


# This process's CORS settings (Starlette's CORSMiddleware's arguments), set by the router's
# constructor from its args: Serve copies an ingress app when it decorates the class, before
# any args exist, so the middleware added then reads them here, in the replica's own process.
# Unset (a pool's app): no CORS headers, and a preflight is an unrouted request.
_cross_origin: dict | None = None


def allow_cross_origin(settings: dict) -> None:
    global _cross_origin
    _cross_origin = settings


class CrossOrigin:
    """Starlette's CORSMiddleware under the settings allow_cross_origin gave this process,
    read at the first request."""

    def __init__(self, app) -> None:
        self.app = app
        self.handler = None

    async def __call__(self, scope, receive, send) -> None:
        if self.handler is None:
            self.handler = (self.app if _cross_origin is None
                            else CORSMiddleware(self.app, **_cross_origin))
        await self.handler(scope, receive, send)


class IngressApp(FastAPI):
    """FastAPI with CrossOrigin around all of it. Starlette answers a bug (the handler of
    Exception: `unexpected`) in its ServerErrorMiddleware, outside every added middleware:
    added, CrossOrigin left that 500 without CORS headers, and a browser's page saw a
    failed cross-origin call instead of the error (vLLM's catch-all answers the same way)."""

    def build_middleware_stack(self):
        return CrossOrigin(super().build_middleware_stack())


def ingress_app(title: str, bodies: dict | None = None) -> FastAPI:
    """A FastAPI app that answers bugs and unrouted requests in OpenAI's shape, answers
    browsers' cross-origin requests as allow_cross_origin says (every answer, a bug's
    among them), and documents the request bodies (openapi_document's bodies)."""
    app = IngressApp(title=title)
    app.add_exception_handler(Exception, unexpected)
    app.add_exception_handler(TaskCancelledError, cancelled)
    app.add_exception_handler(HTTPException, not_routed)
    app.openapi = functools.partial(openapi_document, app, bodies or {})
    return app
