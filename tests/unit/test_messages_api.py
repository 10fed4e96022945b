"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) without Ray or
a model: a request read into the chat it asks for (the same prompt tokens as that chat's),
and the router's answers built from scripted choices, whole and streamed, checked against
the anthropic package's own types and read by its client (its stream accumulator too);
refusals in Anthropic's error shape, the API key as x-api-key."""

import asyncio
import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from types import MethodType, SimpleNamespace

import anthropic
import httpx2
import jsonschema
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fastapi import FastAPI, Request
from pydantic import TypeAdapter

from deployments.openai_api import ChatCompletionRequest
from deployments.router import Router
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from speculative.types import PoolUnavailable
from tests.tiny import Scripted
from tests.unit.test_chat_prompts import qwen_like_reader
from tests.unit.test_responses_api import CALL, UNFINISHED, FailsAfterARound, stand_in
from tests.unit.test_router_parts import posted

EVENTS = TypeAdapter(RawMessageStreamEvent)
RAW_EVENTS = ("message_start", "content_block_start", "content_block_delta",
              "content_block_stop", "message_delta", "message_stop")
TOOLS = [{"name": "now", "description": "the time", "input_schema": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}]
HI = [{"role": "user", "content": "hi"}]


def messages_router(text: str = "Paris is the capital.", **options) -> SimpleNamespace:
    """stand_in's router (each output `text`, a character a token), its Messages routes'
    methods bound."""
    router = stand_in(text, **options)
    for name in ("serve_request", "serve_tokenizer", "check_model"):
        setattr(router, name, MethodType(getattr(Router, name), router))

    async def plan(body, chat):  # stand_in's, with the body's stop strings
        Router.check_model(router, body)
        sampling = SamplingParams(temperature=0.0, max_tokens=body.max_tokens,
                                  stop=tuple(body.stop or ()))
        return RequestFrontEnd().plan("chatcmpl-x", (2, 3), sampling, n=1,
                                      stop_token_ids=(0,))

    router.plan = plan
    return router


def app_of(router) -> FastAPI:
    """The router's Messages routes and its chat route, in-process."""
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await Router.messages(router, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await Router.count_tokens(router, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await Router.serve_request(router, request, ChatCompletionRequest)

    return app


def run(router, call, api_key: str | None = "k", **options):
    """call(client) with anthropic's AsyncAnthropic over an in-process ASGI transport to
    the router (no retries: a refusal is seen as it is)."""
    async def main():
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app_of(router)))
        client = anthropic.AsyncAnthropic(api_key=api_key, base_url="http://router",
                                          http_client=http, max_retries=0, **options)
        return await call(client)

    return asyncio.run(main())


def created(router, **fields) -> Message:
    return run(router, lambda client: client.messages.create(
        **{"model": "m", "max_tokens": 100, "messages": HI, **fields}))


def streamed(router, **fields) -> Message:
    """The stream's message as the client's accumulator builds it, each event checked."""
    async def call(client):
        async with client.messages.stream(**{"model": "m", "max_tokens": 100,
                                             "messages": HI, **fields}) as stream:
            async for event in stream:  # the raw events (and the client's own: text, ...)
                if event.type in RAW_EVENTS:
                    EVENTS.validate_python(event.model_dump())
            return await stream.get_final_message()

    return run(router, call)


def kept(message: Message) -> dict:
    """A message less its ids (its own, its tool_use blocks'; the `speculative` block the
    whole one has: left out)."""
    kept = {key: value for key, value in message.model_dump().items()
            if key in ("content", "stop_reason", "stop_sequence", "usage", "model", "role")}
    kept["content"] = [{key: value for key, value in block.items() if key != "id"}
                       for block in kept["content"]]
    return kept


def posted_to(router, body: dict, path=Router.messages, headers=()) -> tuple[int, dict]:
    request = posted(body)
    request.scope["headers"] = [*request.scope["headers"], *headers]
    answer = asyncio.run(path(router, request))
    return answer.status_code, json.loads(answer.body)


def exact_router(reader) -> tuple[SimpleNamespace, list]:
    """A router whose prompts are read by `reader` and whose every answer is its own
    prompt's ids (greedy): two requests answer alike only if they are fed alike."""
    fed, router = [], messages_router()
    router.prompts = reader

    async def plan(body, chat):
        Router.check_model(router, body)
        fed.append(list(reader.token_ids(body, chat)))
        sampling = SamplingParams(temperature=0.0, max_tokens=body.max_tokens)
        return RequestFrontEnd().plan("chatcmpl-x", fed[-1], sampling, n=1,
                                      stop_token_ids=(0,))

    def pools(kind=None):
        return (Scripted([t for t in fed[-1] if t], prompt_len=len(fed[-1])),
                Scripted([t for t in fed[-1] if t], prompt_len=len(fed[-1])))

    router.plan, router.pools = plan, pools
    router.decode = router.tool_decode = router.special_decode = reader.tokenizer.decode
    return router, fed


@pytest.fixture
def reader():
    reader = qwen_like_reader()
    reader.max_prompt_bytes, reader.tokenizing = 1 << 16, ThreadPoolExecutor(1)
    reader.end_ids = ()
    return reader


def test_a_greedy_message_is_the_chat_completions_answer_to_the_same_prompt(reader):
    """The translation changes no prompt token: the same ids fed, the same text answered
    (whole and streamed), and count_tokens counts them."""
    router, fed = exact_router(reader)
    system, turns = "answer in French", [{"role": "user", "content": "hello world"},
                                         {"role": "assistant", "content": "hello"},
                                         {"role": "user", "content": "answer"}]
    chat = asyncio.run(Router.serve_request(router, posted({
        "model": "m", "messages": [{"role": "system", "content": system}, *turns],
        "max_tokens": 200, "temperature": 0}), ChatCompletionRequest))
    text = json.loads(chat.body)["choices"][0]["message"]["content"]
    fields = {"system": [{"type": "text", "text": system}], "messages": turns}
    greedy = {"max_tokens": 200, "extra_body": {"temperature": 0}}  # (no longer the SDK's own)
    whole = created(router, **greedy, **fields)
    assert fed[1] == fed[0] and whole.content[0].text == text
    assert whole.usage.input_tokens == len(fed[0])
    assert streamed(router, **greedy, **fields).content[0].text == text
    start = raw_events(router, {"model": "m", "max_tokens": 200, **fields})[0]  # as Anthropic's
    assert start["message"]["usage"]["input_tokens"] == len(fed[0])
    counted = run(router, lambda client: client.messages.count_tokens(model="m", **fields))
    assert counted.input_tokens == len(fed[0])


@pytest.mark.parametrize("text, fields, options", [
    ("Paris is the capital.", {}, {}),
    ("Paris is the capital.", {"max_tokens": 7}, {}),  # cut
    ("Paris is the capital.", {"stop_sequences": [" the"]}, {}),
    ("sure" + CALL, {"tools": TOOLS}, {}),
    (CALL, {"tools": TOOLS, "tool_choice": {"type": "any"}}, {}),
    ("<think>capital</think>Paris.", {}, {"parser": "deepseek_r1"}),
    ("", {}, {}),  # one empty text block, as Anthropic's
])
def test_a_streamed_message_accumulates_to_the_whole_one(text, fields, options):
    """The official client's stream accumulator (messages.stream, get_final_message) builds
    the message the whole answer is, each event one of the anthropic package's types."""
    router = messages_router(text, **options)
    whole = created(router, **fields)
    Message.model_validate(whole.model_dump())
    assert kept(streamed(router, **fields)) == kept(whole)


def test_the_stop_reason_is_anthropics():
    """end_turn, max_tokens at the limit, stop_sequence with the matched one."""
    router = messages_router("Paris is the capital.")
    ended = created(router)
    assert (ended.stop_reason, ended.content[0].text) == ("end_turn", "Paris is the capital.")
    cut = created(router, max_tokens=5)
    assert (cut.stop_reason, cut.content[0].text, cut.usage.output_tokens) == (
        "max_tokens", "Paris", 5)
    stopped = created(router, stop_sequences=["cap", " is"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", " is")
    assert stopped.content[0].text == "Paris"


def test_a_call_is_a_tool_use_block_whose_input_validates():
    router = messages_router("sure" + CALL)
    for message in (created(router, tools=TOOLS), streamed(router, tools=TOOLS)):
        assert message.stop_reason == "tool_use"
        text, call = message.content
        assert text.text == "sure" and call.type == "tool_use" and call.name == "now"
        assert call.id.startswith("toolu_") and call.input == {"tz": "UTC"}
        jsonschema.validate(call.input, TOOLS[0]["input_schema"])


@pytest.mark.parametrize("fields, stop", [
    ({"max_tokens": 40}, ("max_tokens", None)),
    ({"stop_sequences": ["UT"]}, ("stop_sequence", "UT")),
])
def test_a_forced_call_cut_short_is_a_tool_use_block_that_does_not_run(fields, stop):
    """The chat's call as far as it came (its arguments no JSON) is a tool_use block with
    input {}, whole and streamed alike; the stop reason says why it ended (a stop string
    wins over the call it cut, as vLLM's), never tool_use."""
    router = messages_router(CALL)
    forced = {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "now"}, **fields}
    whole = created(router, **forced)
    assert [(block.type, block.name, block.input) for block in whole.content] == [
        ("tool_use", "now", {})]
    assert (whole.stop_reason, whole.stop_sequence) == stop
    assert kept(streamed(router, **forced)) == kept(whole)
    assert router.admission.running == 0


def test_count_tokens_counts_the_prompt_the_request_renders(reader):
    """The system prompt counted too, as the chat renders it."""
    router = messages_router()
    router.prompts = reader
    body = {"model": "m", "system": "answer in French", "messages": HI}
    status, answer = posted_to(router, body, Router.count_tokens)
    chat = ChatCompletionRequest(messages=[{"role": "system", "content": "answer in French"},
                                           *HI])
    assert (status, answer) == (200, {"input_tokens": len(reader.token_ids(chat, True))})
    assert posted_to(router, {**body, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, Router.count_tokens)[0] == 400


def test_the_client_raises_anthropics_errors_with_the_routers_status():
    """A 400 is a BadRequestError, a model not served a 404 not_found_error, admission full
    a 429 rate_limit_error (Retry-After kept), a pool down a 503 overloaded_error."""
    router = messages_router()
    with pytest.raises(anthropic.BadRequestError) as refused:
        created(router, messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        created(router, model="other")
    assert missing.value.body["error"]["type"] == "not_found_error"
    held = router.admission.admit(2)
    with pytest.raises(anthropic.RateLimitError) as full:
        created(router)
    held.release()
    assert full.value.body["error"]["type"] == "rate_limit_error"
    assert full.value.response.headers["retry-after"] == "1"

    class Down(Scripted):
        async def score(self, call):
            raise PoolUnavailable("verifier: UNAVAILABLE")

    down = messages_router(verifier=Down([10], prompt_len=2))
    with pytest.raises(anthropic.InternalServerError) as unavailable:
        created(down)
    assert unavailable.value.status_code == 503
    assert unavailable.value.body["error"]["type"] == "overloaded_error"
    assert down.admission.running == 0


def test_an_error_mid_stream_is_an_error_event_and_the_slot_goes_back():
    router = messages_router(UNFINISHED, verifier=FailsAfterARound(UNFINISHED))
    events = raw_events(router, {"model": "m", "max_tokens": 100, "messages": HI})
    assert [e["type"] for e in events[:2]] == ["message_start", "content_block_start"]
    assert events[-1]["type"] == "error" and "verifier" in events[-1]["error"]["message"]
    assert events[-1]["error"]["type"] == "api_error"
    assert not any(e["type"] == "message_stop" for e in events[:-1])
    assert router.admission.running == 0
    with pytest.raises(anthropic.APIStatusError, match="verifier"):
        streamed(router)


class PrefixCached(Scripted):
    """stand_in's verifier, its every score saying one prompt token came from the prefix
    cache."""

    async def score(self, call):
        return dataclasses.replace(await super().score(call), cached_tokens=1)


def test_message_start_splits_the_prompt_as_message_delta_does():
    """A streamed message's message_start counted the whole prompt as input (cache_read 0)
    where its message_delta split off the tokens read from the prefix cache: the chat's
    first chunk carried no cached count. Both now say the same."""
    text = "Paris is the capital."
    router = messages_router(text, verifier=PrefixCached(
        list(range(10, 10 + len(text))), prompt_len=2))
    events = raw_events(router, {"model": "m", "max_tokens": 100, "messages": HI})
    start = events[0]["message"]["usage"]
    delta = next(e for e in events if e["type"] == "message_delta")["usage"]
    for usage in (start, delta):
        assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (1, 1)
    assert start["output_tokens"] == 0 and delta["output_tokens"] == len(text) + 1  # its end


def raw_events(router, body: dict) -> list[dict]:
    """A streamed body's events as the router sends them (`event:` checked: their type)."""
    async def read():
        answer = await Router.messages(router, posted({**body, "stream": True}))
        return [text async for text in answer.body_iterator]

    events = []
    for text in asyncio.run(read()):
        head, data = text.removesuffix("\n\n").split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {events[-1]['type']}"
    return events


def test_the_api_key_is_taken_as_x_api_key_or_bearer_on_these_routes():
    """The anthropic package (2.x) sends its api_key as a bearer key; older ones, and
    clients of their own (Claude Code's), as x-api-key."""
    router = messages_router()
    router.api_key = "k"
    assert created(router).content[0].text == "Paris is the capital."  # Bearer k
    assert run(router, lambda client: client.messages.create(
        model="m", max_tokens=10, messages=HI), api_key=None,
        default_headers={"x-api-key": "k"}).content[0].text == "Paris is t"
    body = {"model": "m", "max_tokens": 10, "messages": HI}
    assert posted_to(router, body, headers=[(b"x-api-key", b"k"),  # either one
                                            (b"authorization", b"Bearer other")])[0] == 200
    assert posted_to(router, body, headers=[(b"x-api-key", b"other"),
                                            (b"authorization", b"Bearer k")])[0] == 200
    with pytest.raises(anthropic.AuthenticationError) as refused:
        run(router, lambda client: client.messages.create(model="m", max_tokens=10,
                                                           messages=HI), api_key="wrong")
    assert refused.value.status_code == 401
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert posted_to(router, {"model": "m", "messages": HI}, Router.count_tokens,
                     [(b"x-api-key", b"wrong")])[0] == 401
    # the chat's route takes no x-api-key (Anthropic's header, on its routes only)
    chat = posted(json.loads(json.dumps({"model": "m", "messages": HI})))
    chat.scope["headers"] = [*chat.scope["headers"], (b"x-api-key", b"k")]
    assert asyncio.run(Router.serve_request(router, chat, ChatCompletionRequest)
                       ).status_code == 401
