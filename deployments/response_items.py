"""A stored Response's input items (OpenAI's `GET /v1/responses/{id}/input_items`): the
items it was generated from, as OpenAI lists them, kept with it in the router's response
store (StoredResponse.input_items), and answered a page at a time.

What is kept: a continuation's (previous_response_id) earlier items first, that is the
Response it continues' own input items then that Response's output items, then its own
input's items (as OpenAI and OpenAI-compatible servers list a chained Response's: the whole
context it was given, but not the instructions, which are no item). Each item as the request
gave it, with an id (the one given, else a new one: msg_, fc_, fco_ or rs_) and a status
(completed unless given), a message's text content as parts (input_text; an assistant's,
output_text). An entry stored before its input items were kept lists none.
"""

import asyncio
import json
import uuid

from fastapi.responses import JSONResponse, Response

from deployments.ingress import BadRequest, echoed_id, error_response, unauthorized
from deployments.response_store import ResponseStore, StoredResponse, not_found

PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
            "reasoning": "rs"}
LIMITS = (1, 100)  # a page's items, OpenAI's bounds
DEFAULT_LIMIT = 20
ORDERS = ("asc", "desc")  # the items' order in the request, or the reverse (the default)


def input_items(given: str | list) -> list[dict]:
    """A request's input as listed items (its items checked already: chat_messages, but
    for their ids: BadRequest naming one that is no string)."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    for index, item in enumerate(given):
        if not isinstance(item.get("id"), (str, type(None))):
            raise BadRequest(f"Invalid type for 'input[{index}].id': expected a string, but "
                             f"got {item['id']!r} instead.", param=f"input[{index}].id")
    return [listed_item(item) for item in given]


def listed_item(item: dict) -> dict:
    kind = item.get("type", "message")
    listed = {"id": item.get("id") or f"{PREFIXES[kind]}_{uuid.uuid4().hex}",
              **{key: value for key, value in item.items() if key != "id"},
              "type": kind, "status": item.get("status") or "completed"}
    if kind == "message":
        listed["content"] = content_parts(item["role"], item["content"])
    return listed


def content_parts(role: str, content: str | list) -> list[dict]:
    """A message's content as its parts: a string as one text part (an assistant's
    output_text, with the annotations OpenAI's always has), parts as given."""
    if isinstance(content, list):
        return [{**part, "annotations": part.get("annotations") or []}
                if part.get("type") == "output_text" else part for part in content]
    if role == "assistant":
        return [{"type": "output_text", "text": content, "annotations": []}]
    return [{"type": "input_text", "text": content}]


def encoded(items: list[dict], param: str = "items") -> tuple[tuple[str, bytes], ...]:
    """The items as kept; BadRequest naming `param`[i] for one that UTF-8 cannot encode (JSON
    may carry a lone surrogate, "\\ud800", where no tokenizer reads it: a reasoning item's,
    an unread field's), or that holds a NaN or an infinity (Python's JSON reads them; kept,
    every later listing of the items failed to encode: a 500)."""
    kept = []
    for index, item in enumerate(items):
        try:
            kept.append((item["id"], json.dumps(item, ensure_ascii=False,
                                                allow_nan=False).encode()))
        except UnicodeEncodeError:
            raise BadRequest(f"{param}[{index}]: contains text that is not valid Unicode (a "
                             "lone surrogate?)", param=f"{param}[{index}]") from None
        except ValueError:  # allow_nan's refusal
            raise BadRequest(f"{param}[{index}]: holds a number JSON cannot carry (NaN or "
                             "Infinity)", param=f"{param}[{index}]") from None
    return tuple(kept)


def request_items(given: str | list, earlier: list[dict]) -> list[dict]:
    """The items a Response is stored with: the `earlier` ones (its previous Response's,
    continued), then its input's; BadRequest naming an input item whose id is already
    there (OpenAI's refusal: a cursor names one item), or one that UTF-8 cannot encode (a
    lone surrogate in a field no tokenizer reads: its storing would fail after its
    generation)."""
    items = input_items(given)
    seen = {item["id"] for item in earlier}
    for index, item in enumerate(items):
        if item["id"] in seen:
            raise BadRequest(f"Duplicate item found with id {item['id']}. Remove duplicate "
                             "items from your input and try again.", param=f"input[{index}].id")
        seen.add(item["id"])
    encoded(items, "input")
    return [*earlier, *items]


def continued(stored: StoredResponse) -> tuple[list[dict], list[dict]]:
    """(the conversation a continuation of `stored` gives the template, the items it is
    listed after: the stored Response's input items, then its output)."""
    output = json.loads(stored.response)["output"]
    return json.loads(stored.messages), stored_items(stored) + output


def stored_items(stored: StoredResponse) -> list[dict]:
    return json.loads(stored.input_items) if stored.input_items else []


def page_asked(query) -> tuple[int, str, str | None, str | None]:
    """(limit, order, after, before) from the query (`include` is read and ignored: what it
    asks for is in the items already, or is not served); BadRequest naming a bad one."""
    limit = query.get("limit", str(DEFAULT_LIMIT))
    try:
        number = int(limit)
    except ValueError:
        number = None
    if number is None or not LIMITS[0] <= number <= LIMITS[1]:
        raise BadRequest(f"Invalid 'limit': expected an integer from {LIMITS[0]} to "
                         f"{LIMITS[1]}, but got {limit!r} instead.", param="limit")
    order = query.get("order", "desc")
    if order not in ORDERS:
        raise BadRequest(f"Invalid 'order': expected one of {list(ORDERS)}, but got "
                         f"{order!r} instead.", param="order")
    return number, order, query.get("after"), query.get("before")


def page(items: list[dict], limit: int, order: str, after: str | None,
         before: str | None, *, of: str) -> dict:
    """OpenAI's list of `items` in `order`: the `limit` after the item `after` (from the
    first), or the `limit` just before the item `before` (both: between them); has_more,
    whether more lie past the page in that direction. BadRequest for an unknown cursor,
    naming it and quoting its id: no `of` (what the items are) has it."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = 0 if after is None else cursor(ids, after, "after", of) + 1
    end = len(ids) if before is None else cursor(ids, before, "before", of)
    window = ordered[start:end]
    data = window[-limit:] if before is not None and after is None else window[:limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(window) > limit}


def cursor(ids: list[str], item_id: str, param: str, of: str) -> int:
    if item_id not in ids:
        raise BadRequest(f"Invalid '{param}': no {of} has the id {echoed_id(item_id)!r}.",
                         param=param)
    return ids.index(item_id)


def page_answer(stored: StoredResponse, asked: tuple) -> Response:
    """The page, decoded and encoded (on a thread: a conversation may be megabytes)."""
    try:
        return JSONResponse(page(stored_items(stored), *asked,
                                 of="input item of this response"))
    except BadRequest as error:
        return error_response(error)


async def listed_items(request, api_key: str | None, store: ResponseStore | None,
                       response_id: str) -> Response:
    """GET /v1/responses/{response_id}/input_items, behind the API key: a page of the stored
    Response's input items; 404 as GET's (not stored, no longer, or no store); 503 when the
    store cannot be reached; 400 naming a bad limit, order, after or before."""
    if refused := unauthorized(request, api_key):
        return refused
    try:
        asked = page_asked(request.query_params)
        stored = None if store is None else await store.get(response_id)
        if stored is None:
            raise not_found(response_id)
    except BadRequest as error:
        return error_response(error)
    return await asyncio.get_running_loop().run_in_executor(None, page_answer, stored, asked)
