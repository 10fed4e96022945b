"""The answers of OpenAI's Responses API, built from the chat path's (deployments.choices):
a whole chat completion read into a Response, and a chat stream's chunks into the
Responses' events (`event: <type>` and `data: {...}`, each with its sequence_number, in
OpenAI's order), and kept in the router's response store (if any) before it goes out. The
request side: deployments.responses_api."""

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from deployments.ingress import BadRequest, json_answer
from deployments.response_items import request_items
from deployments.response_store import ResponseStore, StoredResponse
from deployments.responses_api import (
    STATELESS,
    ResponsesRequest,
    chat_messages,
    refused_background,
    renamed,
)

TEXT = {"type": "text"}  # the format OpenAI echoes for none


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(kind: str, sequence: int, **fields) -> str:
    """One of the Responses' events, as its server-sent text."""
    data = {"type": kind, "sequence_number": sequence, **fields}
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class AsAsked:
    """A chat or completions request, answered in its own API's shape."""

    body: object
    background = False  # answered now (deployments.background runs a Response's later)

    def renamed(self, error: BadRequest) -> BadRequest:
        return error

    def whole(self, answer: dict) -> dict:
        return answer

    def events(self, events):
        return events

    async def answered(self, answer: dict, executor) -> object:
        """The whole answer, encoded on `executor` (FastAPI's encoder would walk it on the
        event loop: an 8-choice chat's 512 tokens each with their top 20 logprobs, 1.2 s)."""
        return await asyncio.get_running_loop().run_in_executor(executor, json_answer, answer)


def answer_shape(body, model: str, store: ResponseStore | None = None,
                 previous: list[dict] | None = None,
                 earlier: list[dict] = ()) -> "AsAsked | AsResponse":
    """How a parsed body is served: a Responses request as the chat it translates to, after
    the `previous` conversation (its previous_response_id's, read from the `store`; without
    a store, one is refused), answered as a Response of the served `model` and kept in the
    store, after the `earlier` input items, unless it says `store: false` (BadRequest
    naming its field where the chat refuses it)."""
    if not isinstance(body, ResponsesRequest):
        return AsAsked(body)
    if body.previous_response_id is not None and (store is None or previous is None):
        raise BadRequest(f"previous_response_id: not served: {STATELESS} (the router's "
                         "responses_store keeps them)", param="previous_response_id")
    refused_background(body, store is not None)
    chat, places, messages = body.chat_request(previous or [])
    kept = messages[1:] if body.instructions is not None else messages  # not carried over
    store = None if body.store is False else store
    items = [] if store is None else request_items(body.input, list(earlier))
    return AsResponse(chat, body, places, model, store, kept, items)


def stored_response(response: dict, messages: list[dict],
                    items: list[dict] = ()) -> StoredResponse:
    """A Response as stored: itself, the conversation a continuation of it gives the
    template (the messages it continued, then its output's, read as an input's items) and
    its input items (deployments.response_items)."""
    output = chat_messages(None, response["output"])[0]
    return StoredResponse(json.dumps(response, ensure_ascii=False).encode(),
                          json.dumps(messages + output, ensure_ascii=False).encode(),
                          response["status"], json.dumps(list(items), ensure_ascii=False).encode())


def response_usage(usage: dict) -> dict:
    """The chat's usage in the Responses' names (cache writes are not counted: 0)."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["total_tokens"]}


def item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def text_part(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": logprobs or []}


def message_item(item_id: str, text: str | None, logprobs: list | None,
                 status: str) -> dict:
    content = [] if text is None else [text_part(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def call_item(item_id: str, call: dict, status: str) -> dict:
    """A chat tool call as a function_call item (its arguments "" while streamed)."""
    return {"id": item_id, "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def logprob_entries(logprobs: dict | None) -> list:
    """The chat logprobs' entries ({token, logprob, bytes, top_logprobs}, OpenAI's shape
    for output_text's too)."""
    return list((logprobs or {}).get("content") or [])


@dataclass
class AsResponse:
    """A Responses request served as the chat `body`: its answer read into a Response."""

    body: object  # the ChatCompletionRequest it translates to
    asked: ResponsesRequest
    places: list[str]  # each chat message's place in the request (its errors' names)
    model: str  # the served model's name
    store: ResponseStore | None = None  # where the Response is kept; None: not kept
    messages: list[dict] = field(default_factory=list)  # the chat's, less the instructions
    items: list[dict] = field(default_factory=list)  # its input items, as stored
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def renamed(self, error: BadRequest) -> BadRequest:
        return renamed(error, self.places)

    @property
    def background(self) -> bool:
        return self.asked.background

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 extra: dict | None = None) -> dict:
        """The Response: its output and the request's parameters echoed, as OpenAI's."""
        asked = self.asked
        body = {"id": self.response_id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "instructions": asked.instructions,
                "max_output_tokens": asked.max_output_tokens,
                "max_tool_calls": asked.max_tool_calls,
                "service_tier": asked.service_tier,
                "temperature": asked.temperature, "top_p": asked.top_p,
                "tools": asked.tools or [], "tool_choice": asked.tool_choice or "auto",
                "parallel_tool_calls": asked.parallel_tool_calls,
                "text": {"format": (asked.text or {}).get("format") or TEXT},
                "top_logprobs": asked.top_logprobs,
                "metadata": asked.metadata or {}, "user": asked.user,
                "previous_response_id": asked.previous_response_id,
                "reasoning": asked.reasoning_echoed(),
                "store": self.store is not None,
                "truncation": asked.truncation, "background": asked.background, "usage": usage,
                "completed_at": int(time.time()) if status == "completed" else None}
        return {**body, **(extra or {})}

    def whole(self, answer: dict) -> dict:
        """A whole chat completion (one choice) as a Response: a reasoning item when the
        reasoning parser gave reasoning, a message item when there is content, a
        function_call item per call."""
        choice = answer["choices"][0]
        message, finish_reason = choice["message"], choice["finish_reason"]
        status, output = item_status(finish_reason), []
        if message.get("reasoning"):  # ended by the content, if any (as streamed)
            output.append(reasoning_item(new_id("rs"), message["reasoning"],
                                         "completed" if message.get("content") else status))
        if message.get("content"):
            output.append(message_item(new_id("msg"), message["content"],
                                       logprob_entries(choice.get("logprobs")), status))
        for call in message.get("tool_calls") or ():
            output.append(call_item(new_id("fc"), call, status))
        return self.response(status, output, response_usage(answer["usage"]),
                             {"speculative": answer["speculative"],
                              "metrics": answer["metrics"]})

    async def built(self, answer: dict, executor) -> dict:
        """The whole Response, built on `executor`."""
        return await asyncio.get_running_loop().run_in_executor(executor, self.whole, answer)

    async def answered(self, answer: dict, executor) -> object:
        """The whole Response, built and encoded on `executor`, kept first."""
        response = await self.built(answer, executor)
        await self.keep(response, executor)
        return await asyncio.get_running_loop().run_in_executor(executor, json_answer,
                                                                response)

    async def keep(self, response: dict, executor) -> None:
        """The Response stored (encoded on `executor`), before it goes out: a client that
        continues it at once finds it."""
        if self.store is not None:
            stored = await asyncio.get_running_loop().run_in_executor(
                executor, stored_response, response, self.messages, self.items)
            await self.store.put(response["id"], stored)
        await self.ended(response)

    async def ended(self, response: dict) -> None:
        """What follows its end, once kept (a conversation's turn added to it:
        deployments.conversation_turns); a background one's too (deployments.background)."""

    async def events(self, chat_events):
        """The chat stream's chunks (deployments.choices: `data: {...}` texts) as the
        Responses' events; closing this closes the chat stream (its choices, its slot)."""
        stream = ResponseStream(self)
        try:
            for event in stream.opening():
                yield event
            async for events in stream.fed(chat_events):
                for event in events:
                    yield event
            closing = stream.closing()
            if stream.final is not None:
                await self.keep(stream.final, None)
            for event in closing:
                yield event
        finally:
            await chat_events.aclose()


class ResponseStream:
    """One streamed Response's events, fed the chat stream's chunks in order: the items
    open as their text comes (reasoning, then the message, then the calls) and each closes
    before the next opens."""

    def __init__(self, shape: AsResponse) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict] = []  # the items, each whole once closed
        self.open: dict | None = None  # the item being streamed, its text so far in it
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.extra: dict = {}
        self.error: dict | None = None  # the chat stream's error, which ended it
        self.logprobs: list = []  # entries not yet sent with a text delta
        self.calls: list[dict] = []  # the chat's calls, sent at the end (their status)
        self.final: dict | None = None  # the whole Response, once closed

    def event(self, kind: str, **fields) -> str:
        self.sequence += 1
        return sse_event(kind, self.sequence - 1, **fields)

    def opening(self) -> list[str]:
        head = self.shape.response("in_progress", [])
        return [self.event("response.created", response=head),
                self.event("response.in_progress", response=head)]

    def queued(self) -> list[str]:
        """A background stream's opening, as OpenAI's: the Response created and queued."""
        head = self.shape.response("queued", [])
        return [self.event("response.created", response=head),
                self.event("response.queued", response=head)]

    def admitted(self) -> list[str]:
        """A background stream's Response, admitted: in progress."""
        return [self.event("response.in_progress",
                           response=self.shape.response("in_progress", []))]

    async def fed(self, chat_events):
        """The chat stream's chunks (`data: {...}` texts) fed in, each one's events."""
        async for text in chat_events:
            payload = text[len("data: "):].strip()
            if payload == "[DONE]":
                return
            yield self.feed(json.loads(payload))

    def feed(self, chunk: dict) -> list[str]:
        if "error" in chunk:  # the chat stream's error, then its end
            error = self.error = chunk["error"]
            return [self.event("error", code=error.get("code") or error.get("type"),
                               message=error["message"], param=error.get("param"))]
        if not chunk.get("choices"):  # the usage chunk
            self.usage = response_usage(chunk["usage"])
            self.extra = {"speculative": chunk.get("speculative"),
                          "metrics": chunk.get("metrics")}
            return []
        choice = chunk["choices"][0]
        delta, events = choice.get("delta") or {}, []
        self.logprobs += logprob_entries(choice.get("logprobs"))
        if delta.get("reasoning"):
            events += self.text("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self.text("message", delta["content"])
        self.calls += delta.get("tool_calls") or ()
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            events += self.close()
            for call in self.calls:
                events += self.call(call)
            self.calls = []
        return events

    def text(self, kind: str, delta: str) -> list[str]:
        """A delta of the reasoning's or the message's text: its item opened first."""
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            events += self.start(kind)
        self.open["text"] += delta
        where = self.where()
        if kind == "reasoning":
            return events + [self.event("response.reasoning_text.delta", delta=delta,
                                        content_index=0, **where)]
        sent, self.logprobs = self.logprobs, []
        self.open["logprobs"] += sent
        return events + [self.event("response.output_text.delta", delta=delta,
                                    content_index=0, logprobs=sent, **where)]

    def where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def start(self, kind: str) -> list[str]:
        prefix = "rs" if kind == "reasoning" else "msg"
        self.open = {"type": kind, "id": new_id(prefix), "text": "", "logprobs": []}
        item = reasoning_item(self.open["id"], "", "in_progress") if kind == "reasoning" \
            else message_item(self.open["id"], None, None, "in_progress")
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" \
            else text_part("", [])
        return [self.event("response.output_item.added", output_index=len(self.output),
                           item=item),
                self.event("response.content_part.added", part=part, content_index=0,
                           **self.where())]

    def close(self) -> list[str]:
        """The open item's end: its text's, its part's and its own done events."""
        if self.open is None:
            return []
        status, where, text = item_status(self.finish_reason), self.where(), self.open["text"]
        if self.open["type"] == "reasoning":
            item = reasoning_item(self.open["id"], text, status)
            part = {"type": "reasoning_text", "text": text}
            done = self.event("response.reasoning_text.done", text=text, content_index=0,
                              **where)
        else:
            self.open["logprobs"] += self.logprobs  # those after the last delta
            self.logprobs = []
            item = message_item(self.open["id"], text, self.open["logprobs"], status)
            part = item["content"][0]
            done = self.event("response.output_text.done", text=text, content_index=0,
                              logprobs=self.open["logprobs"], **where)
        events = [done, self.event("response.content_part.done", part=part, content_index=0,
                                   **where),
                  self.event("response.output_item.done", output_index=len(self.output),
                             item=item)]
        self.output.append(item)
        self.open = None
        return events

    def call(self, call: dict) -> list[str]:
        """A tool call (the chat stream sends each whole, at its end): its item's events."""
        index, item_id = len(self.output), new_id("fc")
        arguments = call["function"]["arguments"]
        item = call_item(item_id, call, "in_progress")
        done = {**item, "status": item_status(self.finish_reason)}
        self.output.append(done)
        return [self.event("response.output_item.added", output_index=index,
                           item={**item, "arguments": ""}),
                self.event("response.function_call_arguments.delta", item_id=item_id,
                           output_index=index, delta=arguments),
                self.event("response.function_call_arguments.done", item_id=item_id,
                           output_index=index, arguments=arguments),
                self.event("response.output_item.done", output_index=index, item=done)]

    def closing(self) -> list[str]:
        """response.completed (or .incomplete at max_output_tokens) with the whole
        Response; nothing after an error."""
        if self.error is not None:
            return []
        events = self.close()
        status = item_status(self.finish_reason)
        response = self.final = self.shape.response(status, self.output, self.usage,
                                                    self.extra)
        return events + [self.event(f"response.{status}", response=response)]
