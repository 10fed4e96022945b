"""OpenAI's Conversations API (deployments.conversations) and a Responses request's
`conversation` (deployments.conversation_turns) without Ray or a model: the router's routes
with the in-process store, checked against openai-python's types; the items paged in either
order; a Response given the conversation's earlier turns, adding its own (a background one
at its end); two replicas adding to one conversation at once; the refusals, each named."""

import asyncio
import json
from urllib.parse import quote, urlencode

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from openai.types.conversations import (
    Conversation,
    ConversationDeletedResource,
    ConversationItemList,
)
from openai.types.responses import Response

from deployments.conversation_store import MAX_ITEMS, StoredConversation
from deployments.conversations import CONVERSATIONS_PATH, METHODS, path_parts
from deployments.openai_api import ChatCompletionRequest
from deployments.response_store import BoundedStore, LocalStore
from deployments.router import Router
from tests.unit.test_background_responses import TEXT, call, ended, in_process_store, post, replica
from tests.unit.test_response_store import Served, reader  # noqa: F401 (a fixture)
from tests.unit.test_router_parts import posted

TURN = [{"role": "user", "content": "capital of France?"},
        {"id": "msg_given", "type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Paris."}]}]


async def route(router, method: str, path: str = "", body=None, headers=(),
                **query) -> tuple[int, dict]:
    """The router's answer to METHOD /v1/conversations{path}?query (with this body)."""
    request = posted(body or {})
    request.scope.update(method=method, query_string=urlencode(query).encode())
    request.scope["headers"] = [*request.scope["headers"], *headers]
    answer = await Router.conversations(router, path, request)
    return answer.status_code, json.loads(answer.body)


def routed(router, method: str, path: str = "", body=None, **query) -> tuple[int, dict]:
    return asyncio.run(route(router, method, path, body, **query))


def client(router) -> TestClient:
    """A client of the router's conversation routes through Starlette's routing: the path
    decoded, the raw path kept (ASGI's raw_path, as uvicorn and Serve's proxy pass it)."""
    app = FastAPI()

    @app.api_route(CONVERSATIONS_PATH, methods=METHODS)
    async def conversations(path: str, request: Request):
        return await Router.conversations(router, path, request)

    return TestClient(app)


def texts(page: dict) -> list[str]:
    return [item["content"][0]["text"] if item["type"] == "message" else item["type"]
            for item in page["data"]]


def test_a_conversation_is_created_read_updated_and_deleted_in_openais_shapes():
    router = replica(in_process_store())
    status, made = routed(router, "POST", body={"items": TURN, "metadata": {"topic": "geo"}})
    assert status == 200 and made["id"].startswith("conv_")
    assert Conversation.model_validate(made).metadata == {"topic": "geo"}
    conversation = f"/{made['id']}"
    assert routed(router, "GET", conversation) == (200, made)
    status, changed = routed(router, "POST", conversation, {"metadata": {"topic": "maps"}})
    assert status == 200 and changed == {**made, "metadata": {"topic": "maps"}}
    status, items = routed(router, "GET", conversation + "/items", order="asc")
    listed = ConversationItemList.model_validate(items)
    assert status == 200 and [item.type for item in listed.data] == ["message"] * 2
    assert items["data"][1]["id"] == "msg_given" and items["data"][0]["id"].startswith("msg_")
    assert items["data"][0]["content"] == [{"type": "input_text",
                                            "text": "capital of France?"}]
    assert routed(router, "GET", conversation + "/items/msg_given") == (200, items["data"][1])
    status, answer = routed(router, "DELETE", conversation + "/items/msg_given")
    assert status == 200 and Conversation.model_validate(answer).id == made["id"]
    assert routed(router, "GET", conversation + "/items/msg_given")[0] == 404
    assert len(routed(router, "GET", conversation + "/items")[1]["data"]) == 1
    status, gone = routed(router, "DELETE", conversation)
    assert status == 200 and ConversationDeletedResource.model_validate(gone).deleted
    assert gone == {"id": made["id"], "object": "conversation.deleted", "deleted": True}
    status, missing = routed(router, "GET", conversation)
    assert status == 404 and missing["error"] == {
        "message": f"Conversation with id '{made['id']}' not found.",
        "type": "invalid_request_error", "param": "conversation_id", "code": None}


def test_items_are_added_and_paged_in_either_order():
    router = replica(in_process_store())
    _, made = routed(router, "POST", body={"items": [{"role": "user", "content": "0"}]})
    items = f"/{made['id']}/items"
    status, added = routed(router, "POST", items, {"items": [
        {"role": "user", "content": str(i)} for i in range(1, 5)]})
    assert status == 200 and texts(ConversationItemList.model_validate(added).model_dump()) \
        == list("1234")
    assert (added["first_id"], added["last_id"], added["has_more"]) == (
        added["data"][0]["id"], added["data"][-1]["id"], False)
    every = routed(router, "GET", items, order="asc")[1]
    assert texts(every) == list("01234") and every["data"][1:] == added["data"]
    assert routed(router, "GET", items)[1]["data"] == every["data"][::-1]  # desc: default
    for order, expected in (("asc", list("01234")), ("desc", list("43210"))):
        pages, after = [], None
        while True:  # openai-python's cursor pages: after the last one's id
            query = {"order": order, "limit": 2, **({"after": after} if after else {})}
            page = routed(router, "GET", items, **query)[1]
            pages.append(texts(page))
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert pages == [expected[:2], expected[2:4], expected[4:]]


def test_refusals_name_their_field():
    router = replica(in_process_store())
    many = [{"role": "user", "content": "x"}] * (MAX_ITEMS + 1)
    _, made = routed(router, "POST", body={"items": TURN})
    items = f"/{made['id']}/items"
    for method, path, body, query, param in [
            ("POST", "", {"items": many}, {}, "items"),
            ("POST", "", {"items": [{"role": "tool", "content": "x"}]}, {}, "items[0].role"),
            ("POST", "", {"items": [{"type": "web_search_call"}]}, {}, "items[0].type"),
            ("POST", "", {"items": [TURN[0], {"type": "function_call_output", "output": "1",
                                               "call_id": "c" * 257}]}, {}, "items[1]"),
            ("POST", "", {"metadata": {str(i): "v" for i in range(17)}}, {}, "metadata"),
            ("POST", "", {"items": "hi"}, {}, "items"),
            ("POST", items, {"items": many}, {}, "items"),
            ("POST", items, {"items": []}, {}, "items"),
            ("POST", items, {}, {}, "items"),
            ("POST", items, {"items": [TURN[1]]}, {}, "items[0].id"),  # already in it
            ("POST", f"/{made['id']}", {}, {}, "metadata"),
            ("GET", items, None, {"limit": 101}, "limit"),
            ("GET", items, None, {"limit": "ten"}, "limit"),
            ("GET", items, None, {"order": "up"}, "order"),
            ("GET", items, None, {"after": "msg_x"}, "after")]:
        status, refused = routed(router, method, path, body, **query)
        assert status == 400 and refused["error"]["param"] == param, (path, body, query)
        assert refused["error"]["type"] == "invalid_request_error"
    assert len(routed(router, "GET", items)[1]["data"]) == 2  # nothing added
    for method, path, param in [("GET", "/conv_x", "conversation_id"),
                                ("POST", "/conv_x/items", "conversation_id"),
                                ("DELETE", items + "/msg_x", "item_id"),
                                ("GET", items + "/msg_x", "item_id"),
                                ("GET", f"/{made['id']}/things", None),
                                ("GET", "x", None)]:
        status, missing = routed(router, method, path, {"items": TURN})
        assert status == 404 and missing["error"]["param"] == param, path
    assert routed(router, "PUT", f"/{made['id']}")[0] == 405


def test_an_item_id_holding_a_slash_is_read_and_deleted_percent_encoded():
    """A client's item id may hold "/" (listed as it is): read and deleted by its segment
    percent-encoded (quote(id, safe="")), the raw path split, each segment decoded on its
    own; so behind a route prefix (Serve's: in the raw path, not in the route's path)."""
    http = client(replica(in_process_store()))
    given = "msg_a/b c"  # (not "%": TestClient decodes its path twice, uvicorn once)
    made = http.post("/v1/conversations", json={"items": [{**TURN[1], "id": given}]}).json()
    conversation = f"/v1/conversations/{quote(made['id'], safe='')}"
    assert http.get(conversation).json() == made
    items = f"{conversation}/items"
    assert [item["id"] for item in http.get(items).json()["data"]] == [given]
    one = f"{items}/{quote(given, safe='')}"
    answer = http.get(one)
    assert answer.status_code == 200 and answer.json()["id"] == given
    assert http.get(f"{items}/msg_a/b").status_code == 404  # not encoded: another path
    assert http.delete(one).json() == made and http.get(one).status_code == 404
    assert http.get(items).json()["data"] == []
    raw = b"/app/v1/conversations/conv_a/items/a%2Fb"
    assert path_parts("/conv_a/items/a/b", "items", 3, raw) == ["conv_a", "items", "a/b"]


def test_a_conversation_too_large_for_the_store_is_a_400_naming_its_bound():
    """The client's items (or metadata) past the store's max_bytes: a 400 naming them and
    the bound, nothing stored or changed (not the 503 of a store that cannot be reached)."""
    store = LocalStore(BoundedStore(100, 4096, 60))
    router = replica(store)
    large = [{"role": "user", "content": "x" * 5000}]
    status, refused = routed(router, "POST", body={"items": large})
    assert status == 400 and refused["error"]["param"] == "items"
    assert "(4096 bytes: its max_bytes)" in refused["error"]["message"]
    assert len(store.store.entries) == 0
    _, made = routed(router, "POST", body={"items": TURN})
    items = f"/{made['id']}/items"
    status, refused = routed(router, "POST", items, {"items": large})
    assert status == 400 and refused["error"]["param"] == "items"
    assert "(4096 bytes: its max_bytes)" in refused["error"]["message"]
    routed(router, "POST", items, {"items": [{"role": "user", "content": "y" * 1000}] * 3})
    metadata = {f"k{i}": "v" * 512 for i in range(16)}
    status, refused = routed(router, "POST", f"/{made['id']}", {"metadata": metadata})
    assert status == 400 and refused["error"]["param"] == "metadata"
    assert routed(router, "GET", f"/{made['id']}") == (200, made)
    assert len(routed(router, "GET", items)[1]["data"]) == 5


def test_text_utf8_cannot_encode_is_a_400_naming_it_not_a_500(reader):
    """A lone surrogate ("\\ud800", which JSON carries) where no tokenizer reads it: an item's
    unread field, a reasoning item's, metadata; a Response's turn refused before it runs."""
    served = Served("Rome.", reader)
    lone = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "\ud800"}]}
    _, made = routed(served.router, "POST", body={"items": TURN})
    for path, body, param in [
            ("", {"items": [{"role": "user", "content": "x", "note": "\ud800"}]}, "items[0]"),
            ("", {"items": [TURN[0], lone]}, "items[1]"),
            ("", {"metadata": {"topic": "\ud800"}}, "metadata.topic"),
            ("", {"metadata": {"\ud800" * 65: "v"}}, "metadata." + "?" * 64),
            (f"/{made['id']}", {"metadata": {"\ud800": "v"}}, "metadata.?"),
            (f"/{made['id']}/items", {"items": [lone]}, "items[0]"),
            # NaN (Python's JSON reads it; JSON has none): kept, every listing was a 500
            (f"/{made['id']}/items", {"items": [{**TURN[0], "x": float("nan")}]}, "items[0]")]:
        status, refused = routed(served.router, "POST", path, body)
        assert status == 400 and refused["error"]["param"] == param, body
    status, refused = routed(served.router, "POST", "", {"items": [{**TURN[0], "id": 5}]})
    assert refused["error"]["message"].startswith("Invalid type for 'items[0].id'")
    for value in ("\ud800", float("inf")):  # named as the conversation's item, not input[0]
        status, refused = routed(served.router, "POST", "", {"items": [{**TURN[0], "x": value}]})
        assert refused["error"]["message"].startswith("items[0]: "), refused
    for store in (True, False):
        status, refused = served.post({"input": [lone, {"role": "user", "content": "hi"}],
                                       "conversation": made["id"], "store": store})
        assert status == 400 and refused["error"]["param"] == "input[0]"
    assert len(served.prompts) == 0  # (refused before its prompt was read)
    assert len(routed(served.router, "GET", f"/{made['id']}/items")[1]["data"]) == 2


def test_no_store_is_a_404_and_the_api_key_guards_them(reader):
    off = Served("Paris.", reader, store=False)
    status, refused = routed(off.router, "POST", body={})
    assert status == 404 and "responses_store" in refused["error"]["message"]
    status, refused = off.post({"input": "hi", "conversation": "conv_x"})
    assert status == 400 and refused["error"]["param"] == "conversation"
    served = Served("Paris.", reader)
    served.router.api_key = "k"
    assert routed(served.router, "POST", body={})[0] == 401
    status, made = asyncio.run(route(served.router, "POST", body={},
                                     headers=[(b"authorization", b"Bearer k")]))
    assert status == 200 and made["object"] == "conversation"


def test_a_response_sees_the_conversation_and_adds_its_turn(reader):
    """Its items after the instructions, before the input (the chat messages the template
    renders); its input and output items added, also when streamed or not stored."""
    served = Served("Rome.", reader)
    _, made = routed(served.router, "POST", body={"items": TURN})
    status, first = served.post({"input": "and Italy?", "instructions": "terse",
                                 "conversation": made["id"]})
    assert status == 200 and Response.model_validate(first).conversation.id == made["id"]
    expected = [{"role": "system", "content": "terse"},
                {"role": "user", "content": "capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "and Italy?"}]
    assert served.messages[0] == expected
    assert served.prompts[0] == reader.token_ids(ChatCompletionRequest(messages=expected),
                                                 chat=True)
    items = routed(served.router, "GET", f"/{made['id']}/items", order="asc")[1]
    assert texts(items) == ["capital of France?", "Paris.", "and Italy?", "Rome."]
    assert items["data"][3] == first["output"][0]  # the output item, as answered
    # the Response's own input items: the conversation's, then its input (the same ids)
    stored = asyncio.run(served.store.get(first["id"]))
    assert [item["id"] for item in json.loads(stored.input_items)] == [
        item["id"] for item in items["data"][:3]]
    _, second = served.post({"input": "and Spain?", "conversation": {"id": made["id"]},
                             "stream": True})
    assert served.messages[1] == [*expected[1:], {"role": "assistant", "content": "Rome."},
                                  {"role": "user", "content": "and Spain?"}]
    assert second["response"]["conversation"] == {"id": made["id"]}
    _, third = served.post({"input": "and?", "conversation": made["id"], "store": False})
    assert served.get(third["id"])[0] == 404  # not stored, but its turn is added
    items = routed(served.router, "GET", f"/{made['id']}/items", order="asc")[1]
    assert texts(items)[4:] == ["and Spain?", "Rome.", "and?", "Rome."]


def test_a_conversation_with_previous_response_id_or_unknown_is_refused(reader):
    served = Served("Rome.", reader)
    _, made = routed(served.router, "POST", body={"items": TURN})
    _, answer = served.post({"input": "hi"})
    status, refused = served.post({"input": "hi", "conversation": made["id"],
                                   "previous_response_id": answer["id"]})
    assert status == 400 and refused["error"]["param"] == "conversation"
    assert "Mutually exclusive" in refused["error"]["message"]
    status, missing = served.post({"input": "hi", "conversation": "conv_x"})
    assert status == 404 and missing["error"]["param"] == "conversation"
    status, refused = served.post({"input": [TURN[1]], "conversation": made["id"]})
    assert status == 400 and refused["error"]["param"] == "input[0].id"  # already in it
    assert len(routed(served.router, "GET", f"/{made['id']}/items")[1]["data"]) == 2


def test_conversations_and_responses_do_not_read_each_other():
    """One store holds both, by id: a conversation's is no Response's, and the reverse."""
    async def main():
        router = replica(in_process_store())
        _, made = await route(router, "POST", body={})
        for route_of, method in ((Router.response, "GET"), (Router.input_items, "GET"),
                                 (Router.delete_response, "DELETE"),
                                 (Router.cancel_response, "POST")):
            assert (await call(route_of, router, made["id"], method))[0] == 404
        assert (await route(router, "GET", f"/{made['id']}"))[0] == 200
        _, answer = await post(router, {})
        assert (await route(router, "GET", f"/{answer['id']}"))[0] == 404
        assert (await route(router, "DELETE", f"/{answer['id']}"))[0] == 404
        assert (await call(Router.response, router, answer["id"]))[0] == 200

    asyncio.run(main())


def test_a_background_response_adds_its_turn_at_its_end():
    async def main():
        router = replica(in_process_store())
        _, made = await route(router, "POST", body={"items": TURN})
        status, queued = await post(router, {"background": True, "conversation": made["id"],
                                             "input": "and Italy?"})
        assert status == 200 and queued["conversation"] == {"id": made["id"]}
        await ended(router)
        _, items = await route(router, "GET", f"/{made['id']}/items", order="asc")
        assert texts(items) == ["capital of France?", "Paris.", "and Italy?", TEXT]
        _, done = await call(Router.response, router, queued["id"])
        assert done["status"] == "completed" and items["data"][3] == done["output"][0]

    asyncio.run(main())


class Slow(LocalStore):
    """The in-process store, each call a turn of the event loop late (as an actor's)."""

    async def edit(self, *args):
        await asyncio.sleep(0)
        return await super().edit(*args)


@pytest.mark.parametrize("seed", range(3))
def test_replicas_adding_to_one_conversation_at_once_keep_every_item(seed):
    async def main():
        store = Slow(in_process_store().store)
        replicas = [replica(store), replica(store)]
        _, made = await route(replicas[0], "POST", body={"items": TURN})
        asked = [post(replicas[i % 2], {"conversation": made["id"], "input": f"r{i}"})
                 for i in range(4)]
        asked += [route(replicas[i % 2], "POST", f"/{made['id']}/items",
                        {"items": [{"role": "user", "content": f"a{i}"}] * 2})
                  for i in range(4)]
        order = list(range(len(asked)))
        order = order[seed:] + order[:seed]
        assert all(status == 200 for status, _ in await asyncio.gather(
            *(asked[i] for i in order)))
        _, items = await route(replicas[0], "GET", f"/{made['id']}/items", limit=100)
        kept = texts(items)
        assert len(kept) == 2 + 4 * 2 + 4 * 2 and kept.count(TEXT) == 4
        assert sorted(t for t in kept if t[0] in "ra") == sorted(
            [f"r{i}" for i in range(4)] + [f"a{i}" for i in range(4)] * 2)
        entry = store.store.get(made["id"], StoredConversation)
        assert len({item_id for item_id, _ in entry.items}) == len(kept)  # ids unique

    asyncio.run(main())


def test_the_actor_edits_a_conversation_in_one_call_its_change_carried_by_name():
    """ActorStore's edit: one call of the actor (its class in this process), whose arguments
    (the entry's type, the change, its items) travel pickled, as Ray carries them; an actor
    of an older router, without edit, is a 503 saying so."""
    from deployments.conversation_store import appended, edited, read
    from deployments.response_items import encoded
    from deployments.ingress import BadRequest
    from tests.unit.test_background_ends import older_store

    calls = []
    store = older_store("put", "edit", max_bytes=1 << 12, calls=calls)
    entry = StoredConversation(b'{"id": "conv_a"}')
    items = encoded([{"id": "msg_1", "type": "message"}])

    async def main():
        await store.put("conv_a", entry)
        return await edited(store, "conv_a", appended, items, "items")

    assert asyncio.run(main()) == 1 and calls == ["put", "edit"]
    assert asyncio.run(edited(store, "conv_a", read)).items == items
    with pytest.raises(BadRequest) as refused:
        asyncio.run(edited(older_store("put"), "conv_a", appended, items, "items"))
    assert refused.value.status == 503 and "`edit`" in str(refused.value)
