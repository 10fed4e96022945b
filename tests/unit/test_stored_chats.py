"""OpenAI's stored Chat Completions (deployments.stored_chats) without Ray or a model: a chat
asked with `store: true`, whole or streamed, kept in the in-process store and listed, read,
updated and deleted through the router's routes, checked against openai-python's types; the
list's pages, filters and orders; the store's bounds; the refusals, each named."""

import asyncio
import itertools
import json
from types import MethodType
from urllib.parse import urlencode

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionDeleted, ChatCompletionStoreMessage

from deployments.response_store import BoundedStore, LocalStore
from deployments.router import Router
from deployments.stored_chats import StoredChat, listed_page
from speculative.frontend import RequestFrontEnd
from speculative.sampling import SamplingParams
from tests.unit.test_background_responses import TEXT, in_process_store
from tests.unit.test_responses_api import stand_in
from tests.unit.test_router_parts import posted

ASKED = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "capital of France?"}]


def chat_router(store, text: str = TEXT, **options):
    """The stand-in router (its answers `text`), each request with its own id."""
    router = stand_in(text, store=store, **options)
    ids = itertools.count()

    async def plan(body, chat):
        Router.check_model(router, body)
        sampling = SamplingParams(temperature=0.0, max_tokens=body.max_tokens or 256)
        return RequestFrontEnd().plan(f"chatcmpl-{next(ids)}", (2, 3), sampling, n=body.n,
                                      stop_token_ids=(0,))

    router.plan = plan
    router.serve_request = MethodType(Router.serve_request, router)
    return router


async def chat(router, body: dict):
    """The chat's answer: its body, or a stream's chunks (each decoded; [DONE] last)."""
    request = posted({"model": "m", "messages": ASKED, **body})
    answer = await Router.chat_completions(router, request)
    if not body.get("stream"):
        return answer.status_code, json.loads(answer.body)
    return answer.status_code, [event async for event in answer.body_iterator]


def chatted(router, **body):
    return asyncio.run(chat(router, body))


async def route(router, method: str, path: str = "", body=None, **query) -> tuple[int, dict]:
    """The router's answer to METHOD /v1/chat/completions{path}?query (with this body)."""
    request = posted(body or {})
    request.scope.update(method=method, query_string=urlencode(query).encode())
    answer = await Router.stored_chats(router, path, request)
    return answer.status_code, json.loads(answer.body)


def routed(router, method: str, path: str = "", body=None, **query) -> tuple[int, dict]:
    return asyncio.run(route(router, method, path, body, **query))


def test_a_stored_chat_is_listed_read_updated_and_deleted_in_openais_shapes():
    router = chat_router(in_process_store())
    status, answer = chatted(router, store=True, metadata={"topic": "geo"})
    assert status == 200
    chatted(router)  # not asked to be stored: not listed
    status, page = routed(router, "GET")
    assert status == 200 and page["object"] == "list" and not page["has_more"]
    assert [c["id"] for c in page["data"]] == [answer["id"]] == [page["first_id"]]
    stored = ChatCompletion.model_validate(page["data"][0])
    assert stored.choices[0].message.content == TEXT and page["data"][0]["metadata"] == {
        "topic": "geo"}
    assert page["data"][0] == {**answer, "metadata": {"topic": "geo"}}
    path = f"/{answer['id']}"
    assert routed(router, "GET", path) == (200, page["data"][0])
    status, changed = routed(router, "POST", path, {"metadata": {"topic": "maps"}})
    assert status == 200 and changed == {**answer, "metadata": {"topic": "maps"}}
    assert routed(router, "GET", path)[1]["metadata"] == {"topic": "maps"}
    status, gone = routed(router, "DELETE", path)
    assert status == 200 and ChatCompletionDeleted.model_validate(gone).deleted
    assert gone == {"id": answer["id"], "object": "chat.completion.deleted", "deleted": True}
    status, refused = routed(router, "GET", path)
    assert status == 404 and refused["error"] == {
        "message": f"Chat completion with id '{answer['id']}' not found.",
        "type": "invalid_request_error", "param": "completion_id", "code": None}
    assert routed(router, "GET")[1] == {"object": "list", "data": [], "first_id": None,
                                        "last_id": None, "has_more": False}


def test_a_streamed_chat_is_stored_whole_before_its_done():
    router = chat_router(in_process_store())
    _, whole = chatted(router, store=True)
    status, events = chatted(router, store=True, stream=True,
                             stream_options={"include_usage": True})
    assert status == 200 and events[-1] == "data: [DONE]\n\n"
    streamed_id = json.loads(events[0].removeprefix("data: "))["id"]
    status, stored = routed(router, "GET", f"/{streamed_id}")
    assert status == 200 and ChatCompletion.model_validate(stored).object == "chat.completion"
    assert stored["choices"] == whole["choices"] and stored["usage"] == whole["usage"]
    assert stored["created"] == json.loads(events[0].removeprefix("data: "))["created"]


CALLS = ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
         '<tool_call>\n{"name": "g", "arguments": {"b": "xy"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {}}} for name in "fg"]


@pytest.mark.parametrize("text, body, options", [
    (CALLS, {"tools": TOOLS}, {}),
    (TEXT, {"logprobs": True, "top_logprobs": 2, "n": 2, "return_token_ids": True}, {}),
    (f"<think>hm</think>{TEXT}", {}, {"parser": "qwen3"})])
def test_a_streamed_chats_calls_logprobs_and_reasoning_are_stored_as_a_whole_answers(
        text, body, options):
    router = chat_router(in_process_store(), text, **options)
    _, whole = chatted(router, store=True, **body)
    _, events = chatted(router, store=True, stream=True, **body)
    _, stored = routed(router, "GET", f"/{json.loads(events[0][6:])['id']}")
    assert ChatCompletion.model_validate(stored).choices[-1].finish_reason == \
        whole["choices"][-1]["finish_reason"]
    for choice in whole["choices"] + stored["choices"]:  # (each call's id its own)
        for call in choice["message"].get("tool_calls", []):
            assert call.pop("id").startswith("call_")
    assert stored["choices"] == whole["choices"]


def test_the_list_pages_filters_and_orders_them():
    router = chat_router(in_process_store())
    ids = [chatted(router, store=True, metadata={"k": str(i % 2), "all": "y"})[1]["id"]
           for i in range(5)]
    listed = lambda **query: routed(router, "GET", **query)[1]  # noqa: E731
    first = listed(limit=2)
    assert [c["id"] for c in first["data"]] == ids[:2] and first["has_more"]
    assert first["first_id"] == ids[0] and first["last_id"] == ids[1]
    rest = listed(limit=10, after=first["last_id"])
    assert [c["id"] for c in rest["data"]] == ids[2:] and not rest["has_more"]
    assert [c["id"] for c in listed(order="desc")["data"]] == ids[::-1]
    odd = listed(**{"metadata[k]": "1", "metadata[all]": "y"})
    assert [c["id"] for c in odd["data"]] == [ids[1], ids[3]]
    assert listed(model="m")["data"] and listed(model="other")["data"] == []
    assert len(listed()["data"]) == 5  # limit 20 by default


def test_a_stored_chats_messages_are_listed_with_their_ids():
    router = chat_router(in_process_store())
    answer_id = chatted(router, store=True)[1]["id"]
    status, page = routed(router, "GET", f"/{answer_id}/messages")
    assert status == 200 and page["object"] == "list" and not page["has_more"]
    assert [m["id"] for m in page["data"]] == [f"{answer_id}-0", f"{answer_id}-1"]
    for message, asked in zip(page["data"], ASKED):
        kept = ChatCompletionStoreMessage.model_construct(**message)
        assert (kept.role, kept.content, kept.content_parts) == (asked["role"],
                                                                 asked["content"], None)
    later = routed(router, "GET", f"/{answer_id}/messages", order="desc", limit=1)[1]
    assert [m["id"] for m in later["data"]] == [f"{answer_id}-1"] and later["has_more"]
    rest = routed(router, "GET", f"/{answer_id}/messages", after=f"{answer_id}-0")[1]
    assert [m["id"] for m in rest["data"]] == [f"{answer_id}-1"]


def test_the_store_bounds_them_and_reads_them_only_as_their_own_kind():
    clock = [0.0]
    store = LocalStore(BoundedStore(3, 1 << 20, 60, clock=lambda: clock[0]))
    router = chat_router(store)
    ids = [chatted(router, store=True)[1]["id"] for _ in range(4)]
    assert [c["id"] for c in routed(router, "GET")[1]["data"]] == ids[1:]  # max_entries
    assert routed(router, "GET", f"/{ids[0]}")[0] == 404
    from deployments.response_store import retrieved  # another kind's GET reads none
    assert asyncio.run(retrieved(store, ids[1])).status_code == 404
    clock[0] = 61.0  # past ttl_s
    assert routed(router, "GET")[1]["data"] == []


def test_a_chat_too_large_to_store_is_answered_unstored_and_metadata_past_it_a_400():
    """A completion past the store's max_bytes still goes out (its storing is the server's
    to fail, logged); a metadata update that would take one past it is the client's: a 400
    naming `metadata` and the bound, nothing changed."""
    store = LocalStore(BoundedStore(100, 1 << 20, 60))
    router = chat_router(store)
    kept = chatted(router, store=True)[1]
    store.store.max_bytes = bound = store.store.nbytes + 100  # room for little more
    metadata = {f"k{i}": "v" * 512 for i in range(16)}
    status, answer = chatted(router, store=True, metadata=metadata)
    assert status == 200 and answer["choices"][0]["message"]["content"] == TEXT
    assert routed(router, "GET", f"/{answer['id']}")[0] == 404
    status, refused = routed(router, "POST", f"/{kept['id']}", {"metadata": metadata})
    assert status == 400 and refused["error"]["param"] == "metadata"
    assert f"({bound} bytes: its max_bytes)" in refused["error"]["message"]
    assert routed(router, "GET", f"/{kept['id']}")[1]["metadata"] == {}


def test_a_stored_chats_id_is_read_percent_encoded_as_a_conversations_is():
    """Its route's path split where the raw path has "/" (conversations.path_parts)."""
    from deployments.conversations import path_parts

    raw = b"/app/v1/chat/completions/chatcmpl-a%2Fb/messages"
    assert path_parts("/chatcmpl-a/b/messages", "messages", 2, raw) == ["chatcmpl-a/b",
                                                                         "messages"]
    router = chat_router(in_process_store())
    answer_id = chatted(router, store=True)[1]["id"]
    request = posted({})
    request.scope.update(method="GET", query_string=b"",
                         raw_path=f"/v1/chat/completions/{answer_id}/messages".encode())
    answer = asyncio.run(Router.stored_chats(router, f"/{answer_id}/messages", request))
    assert answer.status_code == 200 and len(json.loads(answer.body)["data"]) == 2


def test_the_refusals_are_named_and_without_a_store_it_is_off():
    router = chat_router(in_process_store())
    answer_id = chatted(router, store=True)[1]["id"]
    for query, param in [({"limit": 0}, "limit"), ({"limit": "x"}, "limit"),
                         ({"order": "up"}, "order"), ({"after": "chatcmpl-none"}, "after")]:
        status, refused = routed(router, "GET", **query)
        assert status == 400 and refused["error"]["param"] == param, query
    status, refused = routed(router, "GET", f"/{answer_id}/messages", after="nope")
    assert status == 400 and refused["error"]["param"] == "after"
    too_many = {f"k{i}": "v" for i in range(17)}
    for metadata in (too_many, {"k": 1}, ["k"]):
        status, refused = chatted(router, store=True, metadata=metadata)
        assert status == 400 and refused["error"]["param"] == "metadata", metadata
        assert chatted(router, metadata=metadata)[0] == 200  # not stored: unused (as vLLM)
    status, refused = routed(router, "POST", f"/{answer_id}", {"metadata": too_many})
    assert status == 400 and refused["error"]["param"] == "metadata"
    assert routed(router, "POST", "/a/b/c")[0] == 404
    assert routed(router, "DELETE", "")[0] == 405
    assert routed(router, "POST", f"/{answer_id}/messages")[0] == 405
    router.api_key = "secret"
    assert routed(router, "GET")[0] == 401
    off = chat_router(None)
    assert chatted(off, store=True)[0] == 200  # answered, nothing kept
    status, refused = routed(off, "GET", f"/{answer_id}")
    assert status == 404 and "responses_store" in refused["error"]["message"]


def test_a_lists_refusal_quotes_the_cursor_it_names():
    """The page's refusal of an unknown `before` quoted the `after` it was given (or None),
    as the `before`'s id."""
    entries = [("chatcmpl-a", StoredChat(b"{}", b"[]", "m", 1))]
    for asked, param, quoted in [((20, "asc", "chatcmpl-a", "chatcmpl-z"), "before", "z"),
                                 ((20, "asc", None, "chatcmpl-y"), "before", "y"),
                                 ((20, "asc", "chatcmpl-x", None), "after", "x")]:
        refusal = listed_page(entries, asked, None, {})
        assert (refusal.param, refusal.message) == (param, f"Invalid '{param}': no stored "
                                                    f"chat completion has the id "
                                                    f"'chatcmpl-{quoted}'.")


def test_the_actor_lists_them_in_one_call_its_answer_pickled():
    """Through ActorStore, as the deployed router calls it: the page is read inside the
    actor (listed_page carried by name), and only the page comes back."""
    from tests.unit.test_background_ends import older_store

    calls = []
    store = older_store("put", "survey", max_bytes=1 << 16, calls=calls)
    router = chat_router(store)
    ids = [chatted(router, store=True)[1]["id"] for _ in range(3)]
    status, page = routed(router, "GET", limit=2, order="desc")
    assert status == 200 and [c["id"] for c in page["data"]] == ids[:0:-1] and page["has_more"]
    assert calls == ["put"] * 3 + ["survey"]


@pytest.mark.parametrize("store", [None, "in-process"])
def test_the_chats_path_with_a_trailing_slash_is_redirected_to_it(store):
    """POST /v1/chat/completions/ reaches the stored chats' catch-all route as "/": a 307 to
    the chat's route (query kept), as Starlette redirects /v1/completions/ and vLLM does,
    not the store's 404 ("stored chat completions are off"), with a store or without."""
    router = chat_router(in_process_store() if store else None)
    request = posted({"model": "m", "messages": ASKED})
    request.scope.update(path="/v1/chat/completions/", query_string=b"a=1",
                         headers=[(b"host", b"h:1")])
    answer = asyncio.run(Router.stored_chats(router, "/", request))
    assert answer.status_code == 307
    assert answer.headers["location"] == "http://h:1/v1/chat/completions?a=1"
    request = posted({})
    request.scope.update(path="/v1/conversations/", headers=[(b"host", b"h:1")])
    answer = asyncio.run(Router.conversations(router, "/", request))
    assert (answer.status_code, answer.headers["location"]) == (307, "http://h:1/v1/conversations")


def test_a_catch_all_routes_405_names_the_methods_its_path_takes():
    """HTTP's 405 carries Allow (as Starlette's for the routes it matches itself): the
    stored chats' and the conversations' own 405s name what their path takes."""
    router = chat_router(in_process_store())
    answer_id = chatted(router, store=True)[1]["id"]
    for call, method, path, allowed in [
            (Router.stored_chats, "DELETE", "", "GET, POST"),
            (Router.stored_chats, "POST", f"/{answer_id}/messages", "GET"),
            (Router.conversations, "GET", "", "POST"),
            (Router.conversations, "PUT", "/conv_x", "DELETE, GET, POST"),
            (Router.conversations, "DELETE", "/conv_x/items", "GET, POST")]:
        request = posted({})
        request.scope.update(method=method)
        answer = asyncio.run(call(router, path, request))
        assert (answer.status_code, answer.headers.get("allow")) == (405, allowed), path
