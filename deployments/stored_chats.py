"""OpenAI's stored Chat Completions, where the router's responses_store keeps them: a chat
asked with `store: true` (and its `metadata`, up to 16 pairs) is kept, whole or streamed (the
stream's chunks assembled into the completion), with its request's messages, before its
answer (or its stream's [DONE]) goes out; then listed (`after`, `limit`, `order`, filtered
by `model` and `metadata[key]=value`), read, its metadata replaced, deleted, and its
messages listed a page at a time.

Each is one entry of the store (deployments.response_store), beside the Responses and the
conversations and under the same bounds, read only as its own kind; its changes are made
inside the store, one call each (ResponseStore.edit), and the list is a page read in one
call over the stored chat completions (ResponseStore.survey). Without a store every route
is a 404 saying so, and `store: true` keeps nothing.
"""

import asyncio
import json
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import model_validator

from deployments.conversation_store import Refusal, entry_edited, read
from deployments.conversations import (MetadataBody, checked_metadata, not_allowed,
                                      path_parts, slash_redirect)
from deployments.ingress import BadRequest, echoed_id, error_response, parse
from deployments.openai_api import ChatCompletionRequest
from deployments.tools import FieldError
from deployments.response_items import page, page_asked
from deployments.response_store import ResponseStore
from deployments.responses_events import AsAsked

# the router's one route for them all (POST /v1/chat/completions itself is the chat's)
CHATS_PATH = "/v1/chat/completions{path:path}"
OFF = ("stored chat completions are off: the router's responses_store keeps them (as it "
       "keeps Responses)")


class StoredChatRequest(ChatCompletionRequest):
    """A chat asked on /v1/chat/completions (or /invocations, which serves a chat as it
    does): OpenAI's `store` and `metadata` read (the chats a Responses request makes store
    nothing). The metadata of a chat not stored is taken and unused, whatever it holds (as
    vLLM takes it); a stored one's is OpenAI's: string pairs within its bounds (a 400 naming
    `metadata`)."""

    store: bool | None = None
    metadata: Any = None

    @model_validator(mode="after")
    def stored_metadata(self):
        if self.store and self.metadata is not None:
            if not isinstance(self.metadata, dict) or not all(
                    isinstance(text, str) for pair in self.metadata.items() for text in pair):
                raise FieldError("metadata", "must be an object of string keys and values")
            checked_metadata(self.metadata)
        if self.store and self.request_id is not None:  # the router's own: unique
            raise FieldError("request_id", "not with store: a stored chat's id names its "
                                           "entry, and is the router's own")
        return self


@dataclass(frozen=True)
class StoredChat:
    """A stored chat completion: itself (with its `metadata`) and its request's messages
    (each with its id), as JSON texts; its model, created and metadata, which a list reads."""

    completion: bytes
    messages: bytes
    model: str
    created: int
    metadata: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        pairs = sum(len(key) + len(value) for key, value in self.metadata.items())
        return len(self.completion) + len(self.messages) + len(self.model) + pairs


def kept(completion: dict, body: StoredChatRequest) -> StoredChat:
    """The entry of a finished chat: its completion and the request's messages, their ids
    the completion's with their index (OpenAI's "chatcmpl-...-0")."""
    metadata = body.metadata or {}
    messages = [{"id": f"{completion['id']}-{index}", "content_parts": None,
                 **message.model_dump(exclude_none=True)}
                for index, message in enumerate(body.messages)]
    return StoredChat(json.dumps({**completion, "metadata": metadata},
                                 ensure_ascii=False).encode(),
                      json.dumps(messages, ensure_ascii=False).encode(),
                      completion["model"], completion["created"], metadata)


def delta_into(choice: dict, delta: dict) -> None:
    """A chunk's delta added to its choice's message."""
    message = choice["message"]
    for key, text in delta.items():
        if key == "tool_calls":
            calls = message.setdefault("tool_calls", [])
            for call in text:
                if call["index"] >= len(calls):
                    calls.append({"id": call.get("id"), "type": "function",
                                  "function": {"name": "", "arguments": ""}})
                named = calls[call["index"]]["function"]
                for part, piece in (call.get("function") or {}).items():
                    named[part] = (named.get(part) or "") + (piece or "")
        elif isinstance(text, str) and key != "role":
            message[key] = (message.get(key) or "") + text


def assembled(texts: list[str]) -> dict | None:
    """The completion a chat's stream (its `data: {...}` texts, [DONE] not among them) sent,
    as its whole answer says it (message, finish_reason, logprobs, usage when asked for);
    None for a stream that ended with an error."""
    chunks = [json.loads(text.removeprefix("data: ")) for text in texts]
    if not chunks or any("error" in chunk for chunk in chunks):
        return None
    first, choices = chunks[0], {}
    completion = {"id": first["id"], "object": "chat.completion", "created": first["created"],
                  "model": first["model"], "choices": [], "usage": None}
    for chunk in chunks:
        for key in ("usage", "speculative", "metrics", "prompt_token_ids"):
            if chunk.get(key) is not None:
                completion[key] = chunk[key]
        for part in chunk["choices"]:
            choice = choices.setdefault(part["index"], {
                "index": part["index"], "message": {"role": "assistant", "content": None},
                "finish_reason": None, "logprobs": None, "stop_reason": None})
            delta_into(choice, part.get("delta") or {})
            if part.get("logprobs"):
                held = choice["logprobs"] or {"content": []}
                held["content"] += part["logprobs"].get("content") or []
                choice["logprobs"] = held
            for key in ("finish_reason", "stop_reason"):
                if part.get(key) is not None:
                    choice[key] = part[key]
            if part.get("token_ids") is not None:  # vLLM's return_token_ids
                choice["token_ids"] = choice.get("token_ids", []) + part["token_ids"]
    for choice in choices.values():  # as a whole answer's: no text, null
        choice["message"]["content"] = choice["message"]["content"] or None
    completion["choices"] = [choices[index] for index in sorted(choices)]
    return completion


@dataclass(frozen=True)
class AsStored(AsAsked):
    """A chat asked with `store: true`, answered as asked and kept in the `store` first."""

    store: ResponseStore | None = None

    async def keep(self, completion: dict | None) -> None:
        if completion is not None:
            entry = await asyncio.get_running_loop().run_in_executor(None, kept, completion,
                                                                     self.body)
            await self.store.put(completion["id"], entry)

    async def answered(self, answer: dict, executor) -> object:
        await self.keep(answer)
        return await super().answered(answer, executor)

    async def events(self, events):
        """The chat's events as they come, the completion they make stored before [DONE];
        closing this closes the chat's stream (its choices, its slot)."""
        texts = []
        try:
            async for text in events:
                if text == "data: [DONE]\n\n":
                    await self.keep(await asyncio.get_running_loop().run_in_executor(
                        None, assembled, texts))
                else:
                    texts.append(text)
                yield text
        finally:
            await events.aclose()


def stored_shape(body, store: ResponseStore | None) -> AsStored | None:
    """A stored chat's shape (None: not one, or no store to keep it)."""
    if isinstance(body, StoredChatRequest) and body.store and store is not None:
        return AsStored(body, store)
    return None


def updated(entry: StoredChat, metadata: dict):
    """Its metadata replaced: the completion."""
    completion = {**json.loads(entry.completion), "metadata": metadata}
    text = json.dumps(completion, ensure_ascii=False).encode()
    return replace(entry, completion=text, metadata=metadata), completion


def deleted(entry: StoredChat):
    completion_id = json.loads(entry.completion)["id"]
    return None, {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}


def listed_page(entries: list, asked: tuple, model: str | None, metadata: dict):
    """(in the store) The page of the stored chat completions, (id, StoredChat) each, of
    `model` with every pair of `metadata`, by their created (then their storing): the page
    with each completion's text as its data; a Refusal for a cursor among none of them."""
    chosen = [{"id": key, "text": entry.completion}
              for key, entry in sorted(entries, key=lambda pair: pair[1].created)
              if (model is None or entry.model == model)
              and all(entry.metadata.get(key) == value for key, value in metadata.items())]
    try:
        return page(chosen, *asked, of="stored chat completion")
    except BadRequest as error:
        return Refusal(str(error), error.param)


def not_found(completion_id: str) -> BadRequest:
    return BadRequest(f"Chat completion with id '{echoed_id(completion_id)}' not found.", 404,
                      param="completion_id", code=None)


async def edited(store: ResponseStore, completion_id: str, change, *args,
                 field: str | None = None):
    return await entry_edited(store, completion_id, StoredChat, not_found(completion_id),
                              "chat completion", change, *args, field=field)


async def listed(request, store: ResponseStore) -> Response:
    """GET /v1/chat/completions: OpenAI's list (limit 1-100, 20; order asc, the default, or
    desc; after; model; metadata[key]=value), the completions' texts joined as stored."""
    query = request.query_params
    asked = page_asked({"order": "asc", **query, "before": None})
    metadata = {key[len("metadata["):-1]: value for key, value in query.items()
                if key.startswith("metadata[") and key.endswith("]")}
    found = await store.survey(StoredChat, listed_page, asked[:3] + (None,),
                               query.get("model"), metadata)
    if isinstance(found, Refusal):
        raise BadRequest(found.message, param=found.param)
    head = {key: found[key] for key in ("first_id", "last_id", "has_more")}
    data = b",".join(item["text"] for item in found["data"])
    return Response(b'{"object":"list","data":[' + data + b"]," + json.dumps(head)[1:].encode(),
                    media_type="application/json")


async def route(request, store: ResponseStore, max_bytes: int, parts: list[str]) -> Response:
    """The route of a path's `parts` after /v1/chat/completions, answered."""
    method = request.method
    if not parts:
        if method != "GET":
            raise not_allowed(["GET", "POST"])  # POST: the chat's own route
        return await listed(request, store)
    completion_id = parts[0]
    if len(parts) == 2:  # /{id}/messages
        if method != "GET":
            raise not_allowed(["GET"])
        asked = page_asked({"order": "asc", **request.query_params, "before": None})
        entry = await edited(store, completion_id, read)
        messages = await asyncio.get_running_loop().run_in_executor(None, json.loads,
                                                                    entry.messages)
        return JSONResponse(page(messages, *asked, of="message of this chat completion"))
    if method == "GET":
        entry = await edited(store, completion_id, read)
        return Response(entry.completion, media_type="application/json")
    if method == "POST":
        body = await parse(request, MetadataBody, max_bytes)
        return JSONResponse(await edited(store, completion_id, updated, body.metadata or {},
                                         field="metadata"))
    return JSONResponse(await edited(store, completion_id, deleted))


async def chats_route(request, path: str, store: ResponseStore | None,
                      max_bytes: int) -> Response:
    """A request to /v1/chat/completions{path} other than the chat's POST (the router's,
    behind its API key) answered: "" (the list), /{id} or /{id}/messages; its refusal in
    OpenAI's shape, 404 without a store; 503 where the store cannot be reached (its path
    with a trailing "/": the chat's route, redirected)."""
    if redirect := slash_redirect(request, path):
        return redirect
    try:
        if store is None:
            raise BadRequest(OFF, 404, code=None)
        parts = path_parts(path, "messages", 2, request.scope.get("raw_path"))
        return await route(request, store, max_bytes, parts)
    except BadRequest as error:
        return error_response(error)
