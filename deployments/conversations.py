"""OpenAI's Conversations API, where the router's responses_store keeps them: a
conversation created with up to 20 items and its metadata, read, its metadata replaced,
deleted; its items listed a page at a time (as a Response's input items are:
deployments.response_items), added (up to 20 a call), read and deleted one by one. A
Responses request that names one (`conversation`: deployments.conversation_turns) is given
its items before its input, and adds its input and output items to it.

Each is kept in the store as deployments.conversation_store says (its changes made inside
the store, one call each), under the store's bounds: max_entries and max_bytes with the
Responses, and ttl_s from its last change (OpenAI keeps a conversation until it is deleted;
here it goes with the store's least recently used, or unchanged for ttl_s). Items are as a
Response's input items are listed (ids kept or made: msg_, fc_, fco_, rs_), checked as a
Responses request's input is (deployments.responses_api.chat_messages), their refusals
naming items[i]. Without a store every route is a 404 saying so, as a stored Response's
routes are 404s there.
"""

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from fastapi.responses import JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, ValidationError, field_validator

from deployments.conversation_store import (
    MAX_ITEMS,
    StoredConversation,
    appended,
    deleted,
    edited,
    item_deleted,
    item_not_found,
    read,
    too_large,
    updated,
)
from deployments.chat_messages import ChatMessage
from deployments.ingress import BadRequest, error_response, invalid_body, parse
from deployments.response_items import encoded, page, page_asked, request_items
from deployments.response_store import ResponseStore
from deployments.responses_api import chat_messages, renamed
from deployments.tools import FieldError

# the router's one route for them all (the path after it read here: routed); not in its
# OpenAPI document, which names a path's body (a catch-all path has three)
CONVERSATIONS_PATH, METHODS = "/v1/conversations{path:path}", ["GET", "POST", "DELETE"]
OFF = ("/v1/conversations is off: the router's responses_store keeps conversations (as it "
       "keeps Responses)")
# OpenAI's bounds on metadata: pairs, a key's and a value's characters
METADATA_BOUNDS = (16, 64, 512)


def checked_metadata(value: dict | None) -> dict | None:
    pairs, key_length, value_length = METADATA_BOUNDS
    if value is not None and len(value) > pairs:
        raise FieldError("metadata", f"at most {pairs} key-value pairs, not {len(value)}")
    for key, text in (value or {}).items():
        named = f"metadata.{key[:key_length]}".encode(errors="replace").decode()
        if len(key) > key_length or len(text) > value_length:
            raise FieldError(named, f"keys of at most {key_length} characters, values of at "
                             f"most {value_length}")
        try:  # (a lone surrogate, "\ud800", which JSON carries and UTF-8 cannot)
            f"{key}{text}".encode()
        except UnicodeEncodeError:
            raise FieldError(named, "contains text that is not valid Unicode (a lone "
                             "surrogate?)") from None
    return value


class ConversationBody(BaseModel):
    """POST /v1/conversations (OpenAI's ConversationCreateParams; other fields ignored)."""

    items: list[Any] | None = None
    metadata: dict[str, str] | None = None

    metadata_bounds = field_validator("metadata")(checked_metadata)


class MetadataBody(BaseModel):
    """POST /v1/conversations/{id}: its metadata, required (null: none)."""

    metadata: dict[str, str] | None

    metadata_bounds = field_validator("metadata")(checked_metadata)


class ItemsBody(BaseModel):
    """POST /v1/conversations/{id}/items."""

    items: list[Any]


class ItemMessages(BaseModel):
    """The chat messages a conversation's items become, held to the chat's bounds (a call_id
    of at most 256 characters, ...) when added: not only when a later turn reads them."""

    messages: list[ChatMessage]


def in_items(error, param: str) -> BadRequest:
    """A refusal naming a Responses input's item (input[i]...) as the items' (`param`[i]...)."""
    return BadRequest(str(error).replace("input", param, 1),
                      param=error.param.replace("input", param, 1))


def checked_items(given: list, param: str = "items") -> list[dict]:
    """The items as listed (ids kept or made), at most MAX_ITEMS, each checked as a
    Responses input's item is; BadRequest naming `param`, or its item (`param`[i])."""
    if len(given) > MAX_ITEMS:
        raise BadRequest(f"Invalid '{param}': array too long. Expected an array with maximum "
                         f"length {MAX_ITEMS}, but got an array with length {len(given)} "
                         "instead.", param=param)
    try:
        messages, places = chat_messages(None, given)
        ItemMessages(messages=messages)
        return request_items(given, [])
    except ValidationError as error:  # a chat message's bound, named as input[i]
        raise in_items(renamed(invalid_body(error), places), param) from None
    except FieldError as error:  # named as an input's: input[i]...
        raise in_items(error, param) from None
    except BadRequest as error:  # an id that is no string, or a duplicate: 'input[i].id';
        # an item JSON cannot keep: input[i] (deployments.response_items.encoded)
        raise BadRequest(re.sub(r"\binput\[", f"{param}[", str(error), count=1), error.status,
                         error.param.replace("input", param, 1)) from None


@dataclass(frozen=True)
class Asked:
    """A request to a conversations route, and what the router serves it with."""

    request: Any
    store: ResponseStore
    max_bytes: int  # the router's max_prompt_bytes, which bounds a body

    async def body(self, schema):
        return await parse(self.request, schema, self.max_bytes)


async def created(asked: Asked) -> Response:
    body = await asked.body(ConversationBody)
    items = checked_items(body.items or [])
    conversation = {"id": f"conv_{uuid.uuid4().hex}", "object": "conversation",
                    "created_at": int(time.time()), "metadata": body.metadata or {}}
    entry = StoredConversation(json.dumps(conversation, ensure_ascii=False).encode(),
                               encoded(items))
    nbytes = len(conversation["id"]) + entry.nbytes  # as the store counts it
    if nbytes > asked.store.max_bytes:  # the client's: a 400, not the store's 503
        raise too_large(f"the conversation ({nbytes} bytes)", asked.store.max_bytes,
                        "items" if items else "metadata")
    await asked.store.put(conversation["id"], entry)
    try:  # (put keeps no answer: an unreachable store, logged)
        await edited(asked.store, conversation["id"], read)
    except BadRequest:
        raise BadRequest("the conversation was not stored: the response store could not be "
                         "reached", 503) from None
    return JSONResponse(conversation)


async def retrieved(asked: Asked, conversation_id: str) -> Response:
    entry = await edited(asked.store, conversation_id, read)
    return Response(entry.conversation, media_type="application/json")


async def metadata_updated(asked: Asked, conversation_id: str) -> Response:
    body = await asked.body(MetadataBody)
    return JSONResponse(await edited(asked.store, conversation_id, updated,
                                     body.metadata or {}, field="metadata"))


async def removed(asked: Asked, conversation_id: str) -> Response:
    return JSONResponse(await edited(asked.store, conversation_id, deleted))


def items_page(entry: StoredConversation, asked: tuple) -> Response:
    """A page of its items (decoded and encoded on a thread: it may be megabytes)."""
    try:
        return JSONResponse(page(entry.listed(), *asked, of="item of this conversation"))
    except BadRequest as error:  # a cursor that is no item of it
        return error_response(error)


async def listed(asked: Asked, conversation_id: str) -> Response:
    """OpenAI's list of its items: limit (1-100, 20), order (desc, the default, or asc),
    after (and before) as a Response's input items are paged; include read and ignored."""
    query = page_asked(asked.request.query_params)
    entry = await edited(asked.store, conversation_id, read)
    return await asyncio.get_running_loop().run_in_executor(None, items_page, entry, query)


async def added(asked: Asked, conversation_id: str) -> Response:
    """The items added after its own, answered as a list (in their order)."""
    body = await asked.body(ItemsBody)
    if not body.items:
        raise BadRequest("Invalid 'items': expected at least one item.", param="items")
    items = checked_items(body.items)
    await edited(asked.store, conversation_id, appended, encoded(items), "items",
                 field="items")
    return JSONResponse({"object": "list", "data": items, "first_id": items[0]["id"],
                         "last_id": items[-1]["id"], "has_more": False})


async def item(asked: Asked, conversation_id: str, item_id: str) -> Response:
    text = (await edited(asked.store, conversation_id, read)).item(item_id)
    if text is None:
        found = item_not_found(item_id)
        raise BadRequest(found.message, found.status, found.param, code=None)
    return Response(text, media_type="application/json")


async def item_removed(asked: Asked, conversation_id: str, item_id: str) -> Response:
    """The item gone: the conversation answered (OpenAI's)."""
    return JSONResponse(await edited(asked.store, conversation_id, item_deleted, item_id))


# (the path's segments after /v1/conversations, the method) -> its route
ROUTES = {(0, "POST"): created, (1, "GET"): retrieved, (1, "POST"): metadata_updated,
          (1, "DELETE"): removed, (2, "GET"): listed, (2, "POST"): added,
          (3, "GET"): item, (3, "DELETE"): item_removed}


def raw_segments(path: str, raw: bytes | None, most: int) -> list[str] | None:
    """The catch-all `path`'s segments as the request's raw path (ASGI's raw_path) spells
    them, each percent-decoded on its own, so that an id may hold "/" (sent as %2F): the
    raw path's last segments (at most `most`) whose decoding is `path`; None where there is
    no raw path or none such (Serve's route prefix is in the raw path, before them)."""
    spelt = [] if raw is None else raw.decode("latin-1").split("/")
    for count in range(min(most, len(spelt) - 1) + 1):
        segments = [unquote(text) for text in spelt[len(spelt) - count:]] if count else []
        if "".join(f"/{segment}" for segment in segments) == path:
            return segments
    return None


def path_parts(path: str, below: str, most: int, raw: bytes | None = None) -> list[str]:
    """The segments of a catch-all route's path ("", or /{id}, /{id}/`below`...), at most
    `most` of them, split where the raw path (`raw`) has "/" (raw_segments); 404 for
    another path."""
    parts = raw_segments(path, raw, most)
    if parts is None:
        parts = [] if path == "" else path.split("/")[1:] if path.startswith("/") else None
    if parts is None or "" in parts or len(parts) > most or parts[1:2] not in ([], [below]):
        raise BadRequest("Not Found", 404, code=None)
    return parts


def not_allowed(methods) -> BadRequest:
    """A catch-all route's 405 with its Allow header (HTTP requires one; Starlette's, for
    the routes it matches itself, carries it: deployments.ingress.not_routed)."""
    return BadRequest("Method Not Allowed", 405, headers={"Allow": ", ".join(sorted(methods))})


def slash_redirect(request, path: str) -> Response | None:
    """Starlette's redirect_slashes for a catch-all route's own path with a trailing "/"
    (POST /v1/chat/completions/ reaches {path:path} as "/", so Starlette never redirects
    it): a 307 to the path without it, as the router's other routes (/v1/completions/) and
    vLLM's answer, not the store's 404; None for any other path."""
    if path != "/":
        return None
    url = request.url
    return RedirectResponse(str(url.replace(path=url.path.rstrip("/"))), 307)


def routed(method: str, path: str, raw: bytes | None = None) -> tuple:
    """(the route, its ids) of a path after /v1/conversations: "", /{id}, /{id}/items or
    /{id}/items/{item_id} (an id percent-encoded: `raw`, the request's raw path); 404 for
    another, 405 for another method."""
    parts = path_parts(path, "items", 3, raw)
    route = ROUTES.get((len(parts), method))
    if route is None:
        raise not_allowed(m for (count, m) in ROUTES if count == len(parts))
    return route, [part for index, part in enumerate(parts) if index != 1]


async def conversations_route(request, path: str, store: ResponseStore | None,
                              max_bytes: int) -> Response:
    """A request to /v1/conversations{path} (the router's, behind its API key) answered: its
    route's answer, or its refusal in OpenAI's shape; 503 where the store cannot be
    reached."""
    if redirect := slash_redirect(request, path):
        return redirect
    try:
        if store is None:
            raise BadRequest(OFF, 404, code=None)
        route, ids = routed(request.method, path, request.scope.get("raw_path"))
        return await route(Asked(request, store, max_bytes), *ids)
    except BadRequest as error:
        return error_response(error)
