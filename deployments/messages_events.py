"""The answers of Anthropic's Messages API, built from the chat path's (deployments.choices):
a whole chat completion read into a message, a chat stream's chunks into the Messages'
events (`event: <type>` and `data: {...}`: message_start, each content block's start,
deltas and stop, message_delta, message_stop; an `error` event ends a failed stream), and
the router's refusals in Anthropic's error shape, its API key also taken from x-api-key.
The request side: deployments.messages_api."""

import asyncio
import json
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse

from deployments.ingress import BadRequest, json_answer, unauthorized
from deployments.messages_api import MessagesRequest, renamed

# Anthropic's error types by HTTP status (else invalid_request_error below 500, api_error)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
# a chat stream's error (OpenAI's type, which is all it carries of its status) -> Anthropic's
STREAM_ERRORS = {"requests": "rate_limit_error", "server_error": "api_error"}
KEY_HELP = "invalid or missing API key (x-api-key: <key>, or Authorization: Bearer <key>)"


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(answer):
    """The answer, a refusal in OpenAI's shape (the router's, any status) turned into
    Anthropic's ({"type": "error", "error": {"type", "message"}}, the field named in the
    message), its status and headers (Retry-After, WWW-Authenticate) kept."""
    if not isinstance(answer, JSONResponse) or answer.status_code < 400:
        return answer
    error, status = json.loads(answer.body)["error"], answer.status_code
    message, param = error["message"], error.get("param")
    if status == 401:
        message = KEY_HELP
    elif param and param not in message:
        message = f"{param}: {message}"
    headers = {name: value for name, value in answer.headers.items()
               if name not in ("content-length", "content-type")}
    return JSONResponse({"type": "error", "error": {"type": error_type(status),
                                                    "message": message}}, status, headers)


def with_api_key(request: Request, key: str | None) -> Request:
    """The request, its x-api-key (Anthropic's header, which its SDK sends) read as the
    bearer key the router checks, where its Authorization header does not carry the key."""
    sent = request.headers.get("x-api-key")
    if key is None or sent is None or unauthorized(request, key) is None:
        return request
    headers = [(name, value) for name, value in request.scope["headers"]
               if name.lower() != b"authorization"]
    headers.append((b"authorization", b"Bearer " + sent.encode("latin-1")))
    return Request({**request.scope, "headers": headers}, request.receive)


def message_usage(usage: dict | None) -> dict:
    """The chat's usage in Anthropic's names: input_tokens the prompt's less those read
    from the prefix cache (cache_read_input_tokens, as vLLM and Anthropic count them)."""
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached,
            "output_tokens": usage.get("completion_tokens") or 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def stop_of(finish_reason: str | None, stop_reason, called: bool,
            cut: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence), as vLLM maps a chat's end: max_tokens at the length, a
    call's tool_use, the stop string a stop_sequence (a stop token id is none), else
    end_turn; a stop string wins over a call it `cut` short (which must not run)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called and not cut:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return ("tool_use" if called else "end_turn"), None


def call_input(call: dict) -> dict | None:
    """A chat tool call's arguments as a tool_use block's input; None where they are no
    JSON object: a forced call cut short (by max_tokens or a stop string) has its
    arguments as far as they came (docs/serving.md), which the block cannot carry."""
    try:
        found = json.loads(call["function"]["arguments"])
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def tool_use(call: dict) -> dict:
    """A chat tool call as a tool_use block (a call cut short: its input {}); its id toolu_
    (the call's tail, which a template that cuts ids keeps,
    deployments.chat_messages.with_call_ids_cut)."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"], "input": call_input(call) or {}}


def opened(kind: str) -> dict:
    """A thinking or text block as it opens in a stream, its text empty (a tool_use block
    opens in MessageStream.call, its input {})."""
    return {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
        else {"type": "text", "text": ""}


@dataclass
class AsMessage:
    """A Messages request served as the chat `body`: its answer read into a message."""

    body: object  # the ChatCompletionRequest it translates to
    places: list[str]  # each chat message's place in the request (its errors' names)
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    background = False  # answered now

    def renamed(self, error: BadRequest) -> BadRequest:
        return renamed(error, self.places)

    def message(self, model: str, content: list[dict], stop: tuple, usage: dict) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage}

    def whole(self, answer: dict) -> dict:
        """A whole chat completion (one choice) as a message: a thinking block when the
        reasoning parser gave reasoning, a text block when there is text, a tool_use block
        per call; one empty text block when there is none of them (as vLLM and Anthropic)."""
        choice = answer["choices"][0]
        message = choice["message"]
        content = [{"type": "thinking", "thinking": message["reasoning"], "signature": ""}] \
            if message.get("reasoning") else []
        content += [{"type": "text", "text": message["content"]}] if message["content"] else []
        chat_calls = message.get("tool_calls") or ()
        calls = [tool_use(call) for call in chat_calls]
        stop = stop_of(choice["finish_reason"], choice.get("stop_reason"), bool(calls),
                       any(call_input(call) is None for call in chat_calls))
        return {**self.message(answer["model"], content + calls or [opened("text")], stop,
                               message_usage(answer["usage"])),
                "speculative": answer["speculative"]}

    async def answered(self, answer: dict, executor) -> object:
        """The whole message, built and encoded on `executor`."""
        return await asyncio.get_running_loop().run_in_executor(
            executor, lambda: json_answer(self.whole(answer)))

    async def events(self, chat_events):
        """The chat stream's chunks (`data: {...}` texts) as the Messages' events; closing
        this closes the chat stream (its choices, its slot)."""
        stream = MessageStream(self)
        try:
            async for text in chat_events:
                payload = text[len("data: "):].strip()
                if payload == "[DONE]":
                    return
                for event in stream.feed(json.loads(payload)):
                    yield event
        finally:
            await chat_events.aclose()


def message_shape(body: MessagesRequest, merged: bool = False) -> AsMessage:
    """How a Messages request is served (BadRequest naming its field where the chat refuses
    it); merged: system messages merged into the system prompt
    (MessagesRequest.chat_request)."""
    return AsMessage(*body.chat_request(merged=merged))


class MessageStream:
    """One streamed message's events, fed the chat stream's chunks in order: a block opens
    as its text comes (thinking, then text; each call whole) and closes before the next."""

    def __init__(self, shape: AsMessage) -> None:
        self.shape = shape
        self.started = False  # message_start sent
        self.index = 0  # the next block's
        self.open: str | None = None  # the type of the block being streamed
        self.end: tuple = (None, None)  # the chat's finish_reason and stop_reason
        self.called = False  # a tool_use block sent
        self.cut = False  # one of a call cut short (its input {}: call_input)

    @staticmethod
    def event(kind: str, **fields) -> str:
        data = json.dumps({"type": kind, **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def feed(self, chunk: dict) -> list[str]:
        if "error" in chunk:  # the chat stream's error, then its end
            error = chunk["error"]
            return [self.event("error", error={
                "type": STREAM_ERRORS.get(error.get("type"), "invalid_request_error"),
                "message": error["message"]})]
        events = [] if self.started else self.start(chunk)
        if not chunk.get("choices"):  # the last chunk: the usage
            return events + self.closing(chunk["usage"])
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        if delta.get("reasoning"):
            events += self.text("thinking", delta["reasoning"])
        if delta.get("content"):
            events += self.text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self.call(call)
        if choice.get("finish_reason") is not None:
            self.end = (choice["finish_reason"], choice.get("stop_reason"))
        return events

    def start(self, chunk: dict) -> list[str]:
        """message_start: the message, empty, with its prompt's tokens (the first chunk's
        usage so far)."""
        self.started = True
        usage = {**message_usage(chunk.get("usage")), "output_tokens": 0}
        return [self.event("message_start", message=self.shape.message(
            chunk["model"], [], (None, None), usage))]

    def text(self, kind: str, text: str) -> list[str]:
        events = [] if self.open == kind else \
            self.close() + [self.event("content_block_start", index=self.index,
                                       content_block=opened(kind))]
        self.open = kind
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" \
            else {"type": "text_delta", "text": text}
        return events + [self.event("content_block_delta", index=self.index, delta=delta)]

    def call(self, call: dict) -> list[str]:
        """A tool call (the chat stream sends each whole, at its end): its block's events,
        its arguments one input_json_delta (none for a call cut short: input {}, as the
        whole message's)."""
        events, cut = self.close(), call_input(call) is None
        events.append(self.event("content_block_start", index=self.index,
                                 content_block={**tool_use(call), "input": {}}))
        events += [] if cut else [self.event("content_block_delta", index=self.index, delta={
            "type": "input_json_delta", "partial_json": call["function"]["arguments"]})]
        events.append(self.event("content_block_stop", index=self.index))
        self.index, self.called, self.cut = self.index + 1, True, self.cut or cut
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open, self.index = None, self.index + 1
        return [self.event("content_block_stop", index=self.index - 1)]

    def closing(self, usage: dict) -> list[str]:
        """The open block's end (an empty text block if none was sent, as the whole message
        has), message_delta with the stop and the usage, message_stop."""
        events = self.close()
        if self.index == 0:
            events += [self.event("content_block_start", index=0, content_block=opened("text")),
                       self.event("content_block_stop", index=0)]
        stop_reason, stop_sequence = stop_of(*self.end, self.called, self.cut)
        return events + [self.event("message_delta", usage=message_usage(usage), delta={
                             "stop_reason": stop_reason, "stop_sequence": stop_sequence}),
                         self.event("message_stop")]
