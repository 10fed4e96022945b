"""The router: OpenAI-compatible HTTP ingress that runs the round loop over gRPC.

Per request it owns the committed ids, the seeded generator and the counters; the drafter and
verifier pools own the KV caches. Rejection sampling happens here; rollback rides on the next
call to each pool. What a request goes through, each in its own module: the ingress (API
key, body, errors: deployments.ingress), the prompt (deployments.prompts), the request front
end shared with the CLI (choices, seeds, K: speculative.frontend) that plans it
(deployments.request_plans), admission (deployments.admission) and the fan-out of its
choices (deployments.choices); vLLM's tokenizer endpoints read prompts as requests do
(deployments.tokenize_api), its SageMaker routes serve a request by its body
(deployments.invocations), Anthropic's Messages API is a chat translated
(deployments.messages_api), and its served names are deployments.served_models'.
"""

import asyncio
import dataclasses
import gc
import importlib.metadata
from concurrent.futures import ThreadPoolExecutor

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse
from ray import serve

from deployments.admission import Admission
from deployments.background import BackgroundRuns, generated
from deployments.background_stream import retrieved
from deployments.beams import choices_kind, refuse_unsearched
from deployments.chat_batch import BATCH_PATH, BatchChatCompletionRequest, ChatBatchRoute
from deployments.choices import Choices
from deployments.clients import channel_options
from deployments.conversation_turns import shaped
from deployments.conversations import CONVERSATIONS_PATH, METHODS, conversations_route
from deployments.ingress import (BadRequest, ReleasingStream, allow_cross_origin, api_key,
                                 error_response, guard_unrouted, ingress_app, parse,
                                 pool_failure, unauthorized)
from deployments.invocations import InvocationRequest
from deployments.local_drafters import local_drafters
from deployments.logprobs import token_bytes_of
from deployments.messages_api import CountTokensRequest, MessagesRequest, counted
from deployments.messages_events import anthropic_error, with_api_key
from deployments.metrics import RouterMetrics, rss_mb
from deployments.openai_api import ChatCompletionRequest, CompletionRequest
from deployments.pool_handles import pool_clients
from deployments.pool_replies import Unserved
from deployments.prometheus import NodeMetrics
from deployments.prompts import PromptReader
from deployments.prompt_logprobs import Echo, PromptAnswer, completion_echoes
from deployments.reasoning import ReasoningSplit, ThinkTokens, request_split
from deployments.request_headers import header_request_id
from deployments.request_plans import RequestPlanning
from deployments.responses_api import ResponsesRequest
from deployments.response_items import listed_items
from deployments.router_args import RouterArgs, response_store
from deployments.served_models import (card_named, check_model, model_list, served_names,
                                       served_tokenizer)
from deployments.stored_chats import CHATS_PATH, StoredChatRequest, chats_route
from deployments.tokenize_api import (DetokenizeRequest, TokenizeChat, TokenizeCompletion,
                                      TokenizeRequest, detokenized, tokenized,
                                      tokenizer_info_answer)
from deployments.tool_parsers import KEPT_TEXTS
from deployments.tools import ToolUse
from engine.checkpoint import Checkpoint, check_vocabularies
from speculative.driver import text_decoder
from speculative.frontend import RequestFrontEnd, RequestPlan
from speculative.types import PoolUnavailable


app = ingress_app("specserve", {"/v1/completions": [CompletionRequest],
                                "/v1/chat/completions": [ChatCompletionRequest],
                                BATCH_PATH: [BatchChatCompletionRequest],
                                "/v1/responses": [ResponsesRequest],
                                "/v1/messages": [MessagesRequest],
                                "/v1/messages/count_tokens": [CountTokensRequest],
                                "/tokenize": [TokenizeCompletion, TokenizeChat],
                                "/detokenize": [DetokenizeRequest],
                                "/invocations": [ChatCompletionRequest, CompletionRequest]})
app.post(BATCH_PATH)(ChatBatchRoute.chat_completions_batch)  # ahead of CHATS_PATH's (a Router's)


# Serve's ingress serialises the app when it decorates the class, so everything it uses must
# exist by then: defined last, after the app, and what it calls is imported above. The
# deployment is deployments.apps's, by import path (the replica imports this module, an app
# build does not).
@serve.ingress(app)
class Router(ChatBatchRoute, RequestPlanning, Unserved):
    serves = "the router"

    def __init__(self, args: RouterArgs) -> None:
        self.args = args
        tokenizer = served_tokenizer(args.model, args.tokenizer)
        self.decode = text_decoder(tokenizer)
        # with tools in effect, the special tokens the tool call parser reads are kept
        self.tool_decode = text_decoder(tokenizer, keep=KEPT_TEXTS[args.tool_call_parser])
        self.special_decode = text_decoder(tokenizer, skip_special=False)  # every token's text
        # the reasoning parser's tags, by which usage counts a chat's reasoning tokens
        self.think_tokens = ThinkTokens.of(tokenizer, args.reasoning_parser) \
            if args.reasoning_parser else None
        target = Checkpoint.load(args.model)
        check_vocabularies(target, target, len(tokenizer))
        # room for any message the pools of this target send or take (a q of 64 rows)
        self.channel_options = channel_options(target.vocab_size, target.max_position_embeddings)
        self.prompts = PromptReader(args, tokenizer, target)
        # finished answers read into their bodies and encoded (deployments.choices): a few
        # threads, so that one long answer does not hold the others' ends back
        self.rendering = ThreadPoolExecutor(max_workers=4, thread_name_prefix="render")
        self.token_bytes = token_bytes_of(self.prompts.grammar_tokenizer)
        self.local_drafters = local_drafters(args.model, target, args.max_running_requests,
                                             args.local_drafter_cached_tokens)
        self.front_end = RequestFrontEnd(args.speculation_defaults())
        self.metrics = RouterMetrics()
        self.node_metrics = NodeMetrics(served_names(args.served_model_name)[0],
                                        (args.drafter_app, args.verifier_app))
        self.responses_store = response_store(args.responses_store)  # None: off
        self.admission = Admission(args.max_running_requests,
                                   lambda running: self.metrics.running.set(running),
                                   max_waiting=args.max_waiting_requests,
                                   on_waiting=lambda waiting: self.metrics.waiting.set(waiting),
                                   by_priority=args.scheduling_policy == "priority")
        self.background = BackgroundRuns(self.responses_store,  # as many as admission holds
                                         args.max_running_requests + args.max_waiting_requests)
        self.api_key = api_key(args.api_key)
        guard_unrouted(self.api_key)  # a path or method not served: 401 first, as vLLM's
        allow_cross_origin(args.cross_origin())
        self._channel: grpc.aio.Channel | None = None
        # what start-up built (modules, the tokenizers: some 400k objects) lives as long as
        # the replica: kept out of the collector's full passes, each of which walked it all
        # (0.22 s of the event loop) when a request's objects set one off (a 2 MiB body, the
        # logprobs of an answer, even read on another thread)
        gc.collect()
        gc.freeze()

    def pools(self, drafter_kind: str | None = None) -> tuple:
        """(drafter, verifier): the pools' gRPC clients, or a drafter run here by kind."""
        if self._channel is None:  # grpc.aio objects belong to the running event loop
            self._channel = grpc.aio.insecure_channel(self.args.grpc_address,
                                                      options=self.channel_options)
            self._drafter, self._verifier = pool_clients(self._channel, self.args,
                                                         self.channel_options)
        return self.local_drafters.get(drafter_kind, self._drafter), self._verifier

    def memory(self) -> dict:
        """This replica's resident memory (MB) and admitted choices (for the soak)."""
        return {"rss_mb": rss_mb(), "running": self.admission.running}

    async def check_health(self) -> None:
        """Serve's periodic health check (every 10 s by default): the running and waiting
        gauges set again, which Ray's agent drops 20 s after their last set (an idle or
        steady router's vanished from /metrics: deployments.metrics)."""
        self.metrics.refresh(self.admission.running, self.admission.waiting)

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/ping")
    @app.post("/ping")
    async def ping(self) -> dict:
        """vLLM's SageMaker health check (deployments.invocations): /health's, as open."""
        return await self.health()

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(self):
        """vLLM's Prometheus metrics (deployments.prometheus), open as vLLM's /metrics is."""
        return await self.node_metrics.response()

    @app.get("/v1/models")
    async def models(self, request: Request):
        return unauthorized(request, self.api_key) or model_list(
            served_names(self.args.served_model_name), self.args.model,
            self.prompts.context_limit)

    @app.get("/v1/models/{name:path}")
    async def model(self, name: str, request: Request):
        """The served model's card by its name, any of them (OpenAI's models.retrieve);
        another name is a 404 (model_not_found), as a request naming it is. A name may hold
        "/"."""
        return unauthorized(request, self.api_key) or card_named(
            name, served_names(self.args.served_model_name), self.args.model,
            self.prompts.context_limit)

    @app.get("/load")
    async def load(self) -> dict:
        """vLLM's server load: the requests admitted or waiting here (Admission.load), open."""
        return {"server_load": self.admission.load}

    @app.get("/version")
    async def version(self) -> dict:
        return {"version": importlib.metadata.version("specserve")}

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        return await self.serve_tokenizer(request, TokenizeRequest, tokenized)

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        return await self.serve_tokenizer(request, DetokenizeRequest, detokenized)

    @app.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request):
        """vLLM's (deployments.tokenize_api.tokenizer_info_answer), behind the API key."""
        return unauthorized(request, self.api_key) or tokenizer_info_answer(
            self.prompts.tokenizer, self.args.enable_tokenizer_info_endpoint)

    async def serve_tokenizer(self, request: Request, schema, answer):
        """vLLM's tokenizer endpoints (deployments.tokenize_api), behind the API key."""
        if refused := unauthorized(request, self.api_key):
            return refused
        try:
            body = await parse(request, schema, self.args.max_prompt_bytes)
            self.check_model(body)
            answered = await answer(self.prompts, body)
            # rendered off the event loop: FastAPI's encoder walks a returned dict on it, and
            # a prompt past the context may bring a million ids (0.3 s for half a million)
            return await asyncio.get_running_loop().run_in_executor(
                self.prompts.tokenizing, JSONResponse, answered)
        except BadRequest as error:
            return error_response(error)

    def check_model(self, body) -> None:
        check_model(body.model, served_names(self.args.served_model_name))

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.serve_request(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.serve_request(request, StoredChatRequest)  # `store` read

    @app.api_route(CHATS_PATH, methods=METHODS, include_in_schema=False)
    async def stored_chats(self, path: str, request: Request):
        """OpenAI's stored chat completions (deployments.stored_chats), behind the API key."""
        return unauthorized(request, self.api_key) or await chats_route(
            request, path, self.responses_store, self.args.max_prompt_bytes)

    @app.post("/v1/responses")
    async def responses(self, request: Request):
        """OpenAI's Responses API, served as the chat it translates to
        (deployments.responses_api)."""
        return await self.serve_request(request, ResponsesRequest)

    @app.post("/v1/messages")
    async def messages(self, request: Request):
        """Anthropic's Messages API, served as the chat it translates to
        (deployments.messages_api), behind the API key (also as x-api-key)."""
        return anthropic_error(await self.serve_request(with_api_key(request, self.api_key),
                                                        MessagesRequest))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request):
        """A Messages request's prompt tokens, counted as /tokenize counts a chat's."""
        return anthropic_error(await self.serve_tokenizer(
            with_api_key(request, self.api_key), CountTokensRequest, counted))

    @app.get("/v1/responses/{response_id}")
    async def response(self, response_id: str, request: Request):
        """A stored Response or its events (deployments.background_stream), behind the API key."""
        return unauthorized(request, self.api_key) or await retrieved(
            self.responses_store, response_id, request.query_params, self.background.followers)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(self, response_id: str, request: Request):
        """A page of a stored Response's input items (deployments.response_items)."""
        return await listed_items(request, self.api_key, self.responses_store, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request):
        """A background Response cancelled (deployments.background), behind the API key."""
        return unauthorized(request, self.api_key) or await self.background.cancel(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request):
        """A stored Response deleted (cancelled first if it runs), behind the API key."""
        return unauthorized(request, self.api_key) or await self.background.delete(response_id)

    @app.api_route(CONVERSATIONS_PATH, methods=METHODS, include_in_schema=False)
    async def conversations(self, path: str, request: Request):
        """OpenAI's Conversations API (deployments.conversations), behind the API key."""
        return unauthorized(request, self.api_key) or await conversations_route(
            request, path, self.responses_store, self.args.max_prompt_bytes)

    async def __del__(self) -> None:
        """Serve's shutdown of this replica (awaited): no background Response left running."""
        await self.background.shutdown()

    @app.post("/invocations")
    async def invocations(self, request: Request):
        """vLLM's SageMaker route: a chat or a completion by its body
        (deployments.invocations), behind the API key."""
        return await self.serve_request(request, InvocationRequest)

    async def serve_request(self, request: Request, schema):
        """A chat (a Responses request's is one) or a completion, as its parsed body says."""
        if refused := unauthorized(request, self.api_key):
            return refused
        shape = None  # how the answer is shaped: its own API's, or a Response
        try:
            asked = header_request_id(request, await parse(request, schema,
                                                           self.args.max_prompt_bytes))
            shape = await shaped(asked, served_names(self.args.served_model_name)[0],
                                 self.responses_store,
                                 isinstance(asked, MessagesRequest) and self.prompts.system_first)
            body = shape.body
            chat = isinstance(body, ChatCompletionRequest)
            refuse_unsearched(body, chat)  # a beam search's (deployments.beams)
            plan = await self.plan(body, chat)
            tools = await self.tool_use(body) if chat else None  # checked by the prompt's reading
            if shape.background:  # answered queued, run later (deployments.background)
                return await self.background.start(shape, lambda: generated(self, shape, body,
                                                                            plan, tools))
            ticket = await self.admission.wait_turn(len(plan.choices),  # queued while full
                                                    body.priority)
        except (BadRequest, ValueError) as error:
            error = error if isinstance(error, BadRequest) else \
                BadRequest(str(error), param=getattr(error, "param", None))  # a FieldError's
            return error_response(shape.renamed(error) if shape is not None else error)
        try:
            choices = self.choices(body, plan, tools, ticket, chat)
        except BaseException:  # (none seen) the slots go back however it ends
            ticket.release()
            raise
        if body.stream:
            return ReleasingStream(shape.events(choices.events()), ticket)
        try:
            return await shape.answered(await choices.complete(), self.rendering)
        except PoolUnavailable as error:  # a pool's (PoolError), or the router's check of one
            return error_response(pool_failure(error, plan.request_id))
        finally:
            ticket.release()

    def choices(self, body, plan: RequestPlan, tools, ticket, chat: bool) -> Choices:
        """The request's choices to run (a beam search's, or Choices) on its admitted slots."""
        decode = self.special_decode if not body.skip_special_tokens else \
            self.tool_decode if tools else self.decode  # tags kept: calls read
        kind = choices_kind(body, self.prompts)
        return kind(plan, self.pools(plan.drafter_kind), decode, self.metrics, ticket,
                    model=served_names(self.args.served_model_name)[0], chat=chat,
                    return_token_ids=body.return_token_ids,
                    tokens_as_ids=body.return_tokens_as_token_ids, tools=tools,
                    include_usage=body.include_usage, continuous_usage=body.continuous_usage,
                    stop_token_ids=self.prompts.reported_stop_ids(body),
                    token_bytes=self.token_bytes, render=self.rendering,
                    reasoning=self.reasoning(body, plan) if chat else None,
                    think_tokens=self.think_tokens if chat else None,
                    prompt=self.prompt_answer(body, plan, chat),
                    stream_interval=body.stream_interval or 1)

    def prompt_answer(self, body, plan: RequestPlan, chat: bool) -> PromptAnswer | None:
        """What the request asked of its prompts (deployments.prompt_logprobs): their
        logprobs (not streamed), an echo; None: neither."""
        top_n = None if body.stream else body.prompt_logprobs
        prompts = [request.prompt_token_ids for request in plan.prompt_requests()]
        if not body.echo:
            echo = None
        elif chat:  # the last message's text, if any (no logprobs, as vLLM's)
            echo = [Echo(echoed, self.decode)] if (echoed := body.echoed()) else None
        else:
            echo = completion_echoes(
                body.prompts(), prompts,
                self.prompts.added_around if body.add_special_tokens else ([], []),
                self.decode if body.skip_special_tokens else self.special_decode,
                self.special_decode)
        if top_n is None and echo is None:
            return None
        echo_top_n = body.logprobs if echo is not None and not chat else None
        return PromptAnswer(self.pools(plan.drafter_kind)[1], plan.request_id, prompts, top_n,
                            echo, echo_top_n, self.special_decode,
                            body.return_tokens_as_token_ids)

    async def tool_use(self, body) -> ToolUse | None:
        """A chat's tools in effect, their calls read in the router's tool_call_parser (a
        forced call in its grammar's format) with the ids its chat template takes, a request's
        own read on the tokenizing thread (read_template keeps a reading until 32 others push
        it out: compiled and rendered again on the event loop, it held every stream)."""
        tools = body.tool_use()
        if tools is None:
            return None
        template = self.prompts.chat_template(body) if body.chat_template is None else \
            await asyncio.get_running_loop().run_in_executor(
                self.prompts.tokenizing, self.prompts.chat_template, body)
        return dataclasses.replace(tools, call_id_length=template.call_id_length,
                                   parser=self.args.tool_call_parser)

    def reasoning(self, body, plan: RequestPlan) -> ReasoningSplit | None:
        """How a chat's outputs are split into reasoning and content (the router's
        reasoning_parser), for this request (deployments.reasoning.request_split)."""
        return request_split(self.args.reasoning_parser, body, plan, self.think_tokens
                             if self.args.structured_outputs_enable_in_reasoning else None)
