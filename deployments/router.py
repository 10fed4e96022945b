"""The router: OpenAI-compatible HTTP ingress that runs the round loop over gRPC.

Per request it owns the committed ids, the seeded generator and the counters; the drafter and
verifier pools own the KV caches. Rejection sampling happens here; rollback rides on the next
call to each pool.
"""

import asyncio
import hmac
import json
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.json_schema import models_json_schema
from ray import serve

from deployments.clients import CHANNEL_OPTIONS, GrpcDrafter, GrpcVerifier, PoolError
from deployments.metrics import RouterMetrics, rss_mb
from deployments.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    choice_body,
    chunk_body,
    completion_body,
    error_body,
    usage,
)
from drafter.registry import DrafterSpec, build_drafter, router_side_kinds
from engine.checkpoint import (
    Checkpoint,
    check_vocabularies,
    context_limit,
    end_token_ids,
    stop_token_ids,
)
from engine.models import DEMO_TARGET, load_tokenizer
from speculative.driver import Generation, text_decoder
from speculative.loop import Request as SpecRequest
from speculative.policy import CostModel, KBounds, k_policy
from speculative.sampling import derive_seeds
from speculative.stats import SpecStats

log = logging.getLogger("ray.serve")
API_KEY_ENV = "SPECSERVE_API_KEY"
RETRY_AFTER_S = 1

app = FastAPI(title="specserve")


@app.exception_handler(Exception)
async def unexpected(request: Request, error: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered in OpenAI's shape without its details."""
    log.exception("unexpected error serving %s", request.url.path)
    return JSONResponse(error_body("internal error", 500), 500)


class AdaptiveKArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min: int = Field(default=0, ge=0, le=32)  # 0: speculation off when it does not pay
    max: int = Field(default=8, ge=0, le=32)
    # the first round's K (default: the best under the prior and the costs measured so far)
    initial: int | None = Field(default=None, ge=0, le=32)
    # the K of a seeded sampled request: an adaptive K follows timings and load, and the same
    # seed must give the same tokens (greedy output is the same whatever the K)
    seeded: int = Field(default=4, ge=0, le=32)

    def bounds(self) -> KBounds:
        return KBounds(self.min, self.max, self.initial)

    @model_validator(mode="after")
    def ordered(self):
        self.bounds()  # raises ValueError unless 0 <= min <= max
        return self


class RouterArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # the target checkpoint: its end tokens, context length and vocabulary (no weights loaded)
    model: str = DEMO_TARGET
    tokenizer: str | None = None  # default: the model's (the pools only see token ids)
    served_model_name: str = "specserve-demo"
    grpc_address: str = "127.0.0.1:9000"  # Serve's gRPC proxy
    drafter_app: str = "drafter"
    verifier_app: str = "verifier"
    # K drafted per round, or "auto": per request, the K in adaptive_k's bounds that the
    # request's acceptance and the measured costs (the verifier's load among them) say is
    # fastest (a request may say either; a fixed K is kept whatever the load)
    num_speculative_tokens: int | Literal["auto"] = "auto"
    adaptive_k: AdaptiveKArgs = AdaptiveKArgs()
    # draft the next block while the verifier scores this one: "greedy" (greedy requests
    # only: measured, it pays there and not yet for sampled ones), "on" or "off"; a request
    # may say otherwise with "pipelined"
    pipelined_drafting: Literal["off", "greedy", "on"] = "greedy"
    default_max_tokens: int = 16  # completions without max_tokens (OpenAI's default); chat
    # without max_tokens may use the rest of the context, as vLLM's does
    max_context_tokens: int | None = None  # default: the model's max_position_embeddings
    # a pool call's deadline: the verifier's (and the drafter's for seeded sampled
    # requests, whose tokens depend on their drafts); past it the request answers 503
    call_timeout_s: float = Field(default=30.0, gt=0)
    # the drafter's deadline for everyone else: past it (or when the drafter fails) the
    # round runs without a draft, exact, and the request's next rounds skip the drafter a
    # while (speculative.loop.DraftBackoff)
    draft_timeout_s: float = Field(default=1.0, gt=0)
    direct_data_path: bool = True  # after Serve places a request, call its replicas directly
    # admission: choices (n counts) running at once in this replica; beyond it a request
    # gets 429 with Retry-After at once instead of queueing. Keep replicas x this within
    # the pools' session and token bounds (max_cached_requests, max_cached_tokens), so that
    # running requests are never evicted from the caches
    max_running_requests: int = Field(default=64, ge=1)
    max_prompt_bytes: int = Field(default=1 << 20, ge=1)  # checked before tokenizing
    # a bearer key /v1/* require (Authorization: Bearer <key>); default: the environment's
    # SPECSERVE_API_KEY, else none (open, as the embedded config on 127.0.0.1 is)
    api_key: str | None = None


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.headers = status, param, headers


def error_response(error: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(str(error), error.status, error.param), error.status,
                        headers=error.headers)


def pool_failure(error: PoolError) -> BadRequest:
    """What a client learns of a failed pool call: 429 when the pool had no room for the
    request now (its KV cache, or its calls in flight: RESOURCE_EXHAUSTED), 400 with the
    pool's reason when the request can never fit its KV cache (OUT_OF_RANGE), else 503 (an
    INVALID_ARGUMENT from a pool is the router's fault, not the client's); the details go
    to the log."""
    log.warning("pool call failed: %s", error)
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return BadRequest(f"the {error.pool} pool has no room for this request now (its KV "
                          "cache or its calls in flight are full); retry later", 429,
                          headers=retry)
    if error.code == grpc.StatusCode.OUT_OF_RANGE:
        return BadRequest(f"the {error.pool} pool refused the request: {error.details}", 400)
    return BadRequest(f"the {error.pool} pool is unavailable; retry later", 503, headers=retry)


async def all_or_none(coroutines) -> list:
    """Run the coroutines concurrently; when one fails, cancel the others (no pool work goes
    on for a request that has already failed) and raise its error."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def merged_stats(done: list[Generation]) -> dict:
    total = SpecStats()
    for generation in done:
        total.add(generation.stats)
    return total.as_dict()


async def parse(request: Request, schema):
    try:
        payload = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    try:
        return schema.model_validate(payload)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise BadRequest(f"{param}: {first['msg']}", param=param) from None


class Job:
    """One HTTP request: n choices decoded concurrently, each its own speculative request."""

    def __init__(self, router: "Router", request_id: str, prompt_ids, params, k: int | str,
                 drafter_kind: str | None, chat: bool, return_token_ids: bool,
                 stop_ids: tuple[int, ...], pipelined: bool) -> None:
        self.router, self.request_id, self.prompt_ids = router, request_id, prompt_ids
        self.params, self.k, self.drafter_kind, self.chat = params, k, drafter_kind, chat
        self.return_token_ids, self.stop_ids = return_token_ids, stop_ids
        self.pipelined = pipelined
        self.model = router.args.served_model_name
        self.admitted = True  # holds len(params) of the router's running slots

    def generation(self, index: int) -> Generation:
        request = SpecRequest(f"{self.request_id}-{index}", self.prompt_ids, self.params[index],
                              self.stop_ids)
        return Generation(request, self.router.decode)

    async def run_choice(self, index: int, on_text) -> Generation:
        drafter, verifier = self.router.pools(self.drafter_kind)
        generation = self.generation(index)
        policy = self.router.k_policy(self.k, self.drafter_kind, self.pipelined,
                                      self.params[index])
        async for delta in generation.stream(drafter, verifier, policy, self.pipelined):
            await on_text(index, delta)
        self.router.metrics.record(generation.state)
        return generation

    async def complete(self) -> dict:
        async def ignore(index, delta):
            pass

        done = await all_or_none(self.run_choice(i, ignore) for i in range(len(self.params)))
        choices = [choice_body(i, g.text, g.finish_reason, g.stop_reason, self.chat,
                               g.token_ids if self.return_token_ids else None)
                   for i, g in enumerate(done)]
        return completion_body(self.request_id, self.model, choices, self.usage(done),
                               merged_stats(done), self.chat)

    def usage(self, done: list[Generation]) -> dict:
        return usage(len(self.prompt_ids), sum(len(g.token_ids) for g in done))

    async def events(self):
        """Server-sent events: a first chunk per choice (chat: the role, as OpenAI sends it),
        one chunk per text delta, a final chunk per choice, usage, [DONE]."""
        queue: asyncio.Queue = asyncio.Queue()

        async def push(index, delta):
            await queue.put(chunk_body(self.request_id, self.model, index, delta, None, self.chat))

        async def run(index):
            if self.chat:
                await queue.put(chunk_body(self.request_id, self.model, index, "", None, True,
                                           role="assistant"))
            generation = await self.run_choice(index, push)
            token_ids = generation.token_ids if self.return_token_ids else None
            await queue.put(chunk_body(self.request_id, self.model, index, None,
                                       generation.finish_reason, self.chat,
                                       stop_reason=generation.stop_reason, token_ids=token_ids))
            return generation

        task = asyncio.ensure_future(all_or_none(run(i) for i in range(len(self.params))))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (chunk := await queue.get()) is not None:
                yield f"data: {json.dumps(chunk)}\n\n"
            done = await task
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            final = {"id": self.request_id, "object": kind, "model": self.model,
                     "choices": [], "usage": self.usage(done), "speculative": merged_stats(done)}
            yield f"data: {json.dumps(final)}\n\n"
        except PoolError as error:  # the stream ends with an error event, then [DONE]
            failure = pool_failure(error)
            yield f"data: {json.dumps(error_body(str(failure), failure.status))}\n\n"
        except Exception:
            log.exception("unexpected error in a stream")
            yield f"data: {json.dumps(error_body('internal error', 500))}\n\n"
        finally:
            task.cancel()
            self.finished()
        yield "data: [DONE]\n\n"

    def finished(self) -> None:
        """Give back the request's admission (once, however the request ended)."""
        if self.admitted:
            self.admitted = False
            self.router.running -= len(self.params)


def openapi_document() -> dict:
    """FastAPI's document, with the request bodies the endpoints parse themselves (so that
    clients and schema-based fuzzers see them)."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version="1", routes=app.routes)
        _, definitions = models_json_schema(
            [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")],
            ref_template="#/components/schemas/{model}")
        document.setdefault("components", {}).setdefault("schemas", {}).update(
            definitions["$defs"])
        for path, model in (("/v1/completions", "CompletionRequest"),
                            ("/v1/chat/completions", "ChatCompletionRequest")):
            document["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}}
        app.openapi_schema = document
    return app.openapi_schema


app.openapi = openapi_document


# Defined last: Serve serialises the ingress class when it is decorated, so everything it
# uses must exist by then.
@serve.deployment
@serve.ingress(app)
class Router:
    def __init__(self, args: RouterArgs) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.decode = text_decoder(self.tokenizer)
        self.target = Checkpoint.load(args.model)
        check_vocabularies(self.target, self.target, len(self.tokenizer))
        self.context_limit = context_limit(self.target, args.max_context_tokens)
        self.end_ids = end_token_ids(args.model, self.tokenizer)
        self.local_drafters = {kind: build_drafter(DrafterSpec(kind=kind, target=args.model),
                                                   self.target)
                               for kind in router_side_kinds()}
        self.metrics = RouterMetrics()
        self.costs: dict[tuple, CostModel] = {}  # by drafter kind and greedy or not
        self._channel: grpc.aio.Channel | None = None
        self.running = 0  # admitted choices not yet finished
        self.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        # tokenizing is CPU work: off the event loop, one at a time (a fast tokenizer is not
        # safe to share between threads)
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def pools(self, drafter_kind: str | None = None) -> tuple:
        """(drafter, verifier): the pools' gRPC clients, or a drafter run here by kind."""
        if self._channel is None:  # grpc.aio objects belong to the running event loop
            self._channel = grpc.aio.insecure_channel(self.args.grpc_address,
                                                      options=CHANNEL_OPTIONS)
            timeout = self.args.call_timeout_s
            direct = self.args.direct_data_path
            self._drafter = GrpcDrafter(self._channel, self.args.drafter_app, timeout, direct,
                                        self.args.draft_timeout_s)
            self._verifier = GrpcVerifier(self._channel, self.args.verifier_app, timeout, direct)
        return self.local_drafters.get(drafter_kind, self._drafter), self._verifier

    def k_policy(self, k: int | str, drafter_kind: str | None, pipelined: bool, params):
        greedy = params.greedy
        if k == "auto" and not greedy and params.seed is not None:
            k = self.args.adaptive_k.seeded  # reproducible: no K chosen from timings
        costs = self.costs.setdefault((drafter_kind, greedy), CostModel()) if k == "auto" \
            else None
        return k_policy(k, pipelined, greedy, self.args.adaptive_k.bounds(), costs)

    def memory(self) -> dict:
        """This replica's resident memory (MB) and admitted choices (for the soak)."""
        return {"rss_mb": rss_mb(), "running": self.running}

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self, request: Request):
        if refused := self.unauthorized(request):
            return refused
        model = {"id": self.args.served_model_name, "object": "model", "created": 0,
                 "owned_by": "specserve"}
        return {"object": "list", "data": [model]}

    def unauthorized(self, request: Request) -> JSONResponse | None:
        """401 unless the request carries the API key (when one is set)."""
        if self.api_key is None:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(),
                                                              self.api_key.encode()):
            return None
        return error_response(BadRequest("invalid or missing API key (Authorization: Bearer "
                                         "<key>)", 401, headers={"WWW-Authenticate": "Bearer"}))

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.serve_request(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.serve_request(request, ChatCompletionRequest, chat=True)

    async def serve_request(self, request: Request, schema, chat: bool):
        if refused := self.unauthorized(request):
            return refused
        try:
            size = int(request.headers.get("content-length") or 0)
            if size > 2 * self.args.max_prompt_bytes + (1 << 16):
                raise BadRequest(f"the request body has {size} bytes; the limit is about "
                                 f"{2 * self.args.max_prompt_bytes}", 413)
            body = await parse(request, schema)
            self.check_sizes(body, chat)
            prompt_ids = await asyncio.get_running_loop().run_in_executor(
                self.tokenizing, self.prompt_ids, body, chat)
            limit = self.context_limit
            # completions default to OpenAI's 16 tokens; chat may use the rest of the context
            default = self.args.default_max_tokens if not chat else limit - len(prompt_ids)
            params = [body.sampling(min(default, limit - len(prompt_ids)), seed)
                      for seed in derive_seeds(body.seed, body.n)]
            if len(prompt_ids) + params[0].max_tokens > limit:
                raise BadRequest(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens "
                                 f"({params[0].max_tokens}) exceed the context limit of {limit}",
                                 param="max_tokens")
            stop_ids = self.stop_ids(body)
        except BadRequest as error:
            return error_response(error)
        except ValueError as error:
            return error_response(BadRequest(str(error)))
        if body.model not in (None, self.args.served_model_name):
            return error_response(BadRequest(f"model {body.model!r} does not exist; this "
                                             f"server serves {self.args.served_model_name!r}",
                                             404, "model"))
        k = self.args.num_speculative_tokens if body.num_speculative_tokens is None \
            else body.num_speculative_tokens
        # the request's own id, which also keys its pool sessions: never the client's
        # x-request-id (two requests sharing one would share caches), which Serve's proxy
        # logs and echoes
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if self.running + len(params) > self.args.max_running_requests:
            return error_response(BadRequest(
                f"the server is at capacity ({self.args.max_running_requests} running "
                "choices); retry later", 429, headers={"Retry-After": str(RETRY_AFTER_S)}))
        self.running += len(params)
        pipelined = body.pipelined
        if pipelined is None:
            mode = self.args.pipelined_drafting
            pipelined = mode == "on" or mode == "greedy" and params[0].greedy
        job = Job(self, request_id, prompt_ids, params, k, body.drafter, chat,
                  body.return_token_ids, stop_ids, pipelined)
        if body.stream:
            return StreamingResponse(job.events(), media_type="text/event-stream",
                                     background=BackgroundTask(job.finished))
        try:
            return await job.complete()
        except PoolError as error:
            return error_response(pool_failure(error))
        finally:
            job.finished()

    def check_sizes(self, body, chat: bool) -> None:
        """What must hold before tokenizing: the prompt's size in bytes, top_k."""
        text = [m.content for m in body.messages] if chat else \
            [body.prompt] if isinstance(body.prompt, str) else []
        size = sum(len(t.encode()) for t in text)
        if size > self.args.max_prompt_bytes:
            raise BadRequest(f"the prompt has {size} bytes; the limit is "
                             f"{self.args.max_prompt_bytes}", param="messages" if chat
                             else "prompt")
        if body.top_k > self.target.vocab_size:
            raise BadRequest(f"top_k must be at most the vocabulary size "
                             f"({self.target.vocab_size}); 0 disables it", param="top_k")

    def stop_ids(self, body) -> tuple[int, ...]:
        requested = tuple(body.stop_token_ids or ())
        if any(not 0 <= t < self.target.vocab_size for t in requested):
            raise BadRequest(f"stop_token_ids must be in [0, {self.target.vocab_size})",
                             param="stop_token_ids")
        return stop_token_ids(self.end_ids, requested, body.ignore_eos)

    def prompt_ids(self, body, chat: bool) -> tuple[int, ...]:
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise BadRequest("this model has no chat template: use /v1/completions",
                                 param="messages")
            messages = [m.model_dump() for m in body.messages]
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=True)
            except Exception as error:  # a template may raise on roles or order it rejects
                raise BadRequest(f"the model's chat template rejected the messages: "
                                 f"{str(error)[:200]}", param="messages") from None
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        elif isinstance(body.prompt, str):
            ids = self.tokenizer(body.prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = body.prompt
            vocab = self.target.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise BadRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise BadRequest("the prompt is empty after tokenization", param="prompt")
        if len(ids) >= self.context_limit:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the limit is "
                             f"{self.context_limit - 1}", param="prompt")
        return tuple(ids)
