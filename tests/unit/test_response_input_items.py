"""A stored Response's input items (GET /v1/responses/{id}/input_items,
deployments.response_items) without Ray or a model: the router's request path with the
in-process store, the items listed in OpenAI's shape (ids given kept, others made), a page
at a time in either order, the query's refusals, a continuation's items after its
previous Response's, a background Response's, and an entry stored without items."""

import asyncio
import json
from urllib.parse import urlencode

from openai.types.responses import ResponseItemList

from deployments.background import with_status
from deployments.response_store import StoredResponse
from deployments.router import Router
from tests.unit.test_background_responses import ended, in_process_store, post, replica
from tests.unit.test_response_store import Served, reader  # noqa: F401 (a fixture)
from tests.unit.test_responses_api import CALL, TOOLS
from tests.unit.test_router_parts import posted

INPUT = [{"role": "system", "content": "be brief"},
         {"id": "msg_given", "type": "message", "role": "user",
          "content": [{"type": "input_text", "text": "time?"}]},
         {"role": "assistant", "content": "checking"},
         {"id": "fc_given", "type": "function_call", "call_id": "call_1", "name": "now",
          "arguments": "{}"},
         {"type": "function_call_output", "call_id": "call_1", "output": "noon"},
         {"role": "user", "content": "so?"}]


def listed(router, response_id: str, headers=(), **query) -> tuple[int, dict]:
    """The route's answer to GET .../input_items?query."""
    request = posted({})
    request.scope.update(method="GET", headers=list(headers),
                         query_string=urlencode(query).encode())
    answer = asyncio.run(Router.input_items(router, response_id, request))
    return answer.status_code, json.loads(answer.body)


def test_the_input_is_listed_as_openais_items_with_their_ids(reader):
    served = Served("Paris.", reader)
    _, answer = served.post({"input": INPUT, "instructions": "not an item", "tools": TOOLS})
    status, page = listed(served.router, answer["id"], order="asc")
    assert status == 200 and ResponseItemList.model_validate(page).object == "list"
    items = page["data"]
    assert [item["type"] for item in items] == ["message"] * 3 + [
        "function_call", "function_call_output", "message"]
    assert [item["id"][:4] for item in items] == ["msg_", "msg_", "msg_", "fc_g", "fco_",
                                                  "msg_"]
    assert (items[1]["id"], items[3]["id"]) == ("msg_given", "fc_given")
    assert len({item["id"] for item in items}) == 6 and {item["status"] for item in items} \
        == {"completed"}
    assert items[0] == {"id": items[0]["id"], "role": "system", "type": "message",
                        "status": "completed",
                        "content": [{"type": "input_text", "text": "be brief"}]}
    assert items[2]["content"] == [{"type": "output_text", "text": "checking",
                                    "annotations": []}]
    assert items[4]["call_id"] == "call_1" and items[4]["output"] == "noon"
    assert (page["first_id"], page["last_id"], page["has_more"]) == (
        items[0]["id"], items[-1]["id"], False)
    assert listed(served.router, answer["id"])[1]["data"] == items[::-1]  # desc: the default
    _, streamed = served.post({"input": "hi", "stream": True})  # stored as well
    [item] = listed(served.router, streamed["response"]["id"])[1]["data"]
    assert item["role"] == "user" and item["content"] == [{"type": "input_text",
                                                           "text": "hi"}]


def test_pages_follow_after_and_before_in_either_order(reader):
    served = Served("Paris.", reader)
    _, answer = served.post({"input": [{"role": "user", "content": str(i)}
                                       for i in range(5)]})
    every = listed(served.router, answer["id"], order="asc")[1]["data"]
    assert [item["content"][0]["text"] for item in every] == list("01234")
    ids = [item["id"] for item in every]
    for order, expected in (("asc", ids), ("desc", ids[::-1])):
        pages, after = [], None
        while True:  # openai-python's cursor pages: after the last one's id
            query = {"order": order, "limit": 2, **({"after": after} if after else {})}
            page = listed(served.router, answer["id"], **query)[1]
            pages.append([item["id"] for item in page["data"]])
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert pages == [expected[:2], expected[2:4], expected[4:]]
        back = listed(served.router, answer["id"], order=order, limit=2,
                      before=expected[3])[1]  # the two just before it, in the order
        assert [item["id"] for item in back["data"]] == expected[1:3] and back["has_more"]
        first = listed(served.router, answer["id"], order=order, before=expected[1])[1]
        assert [item["id"] for item in first["data"]] == expected[:1]
        assert not first["has_more"]
        between = listed(served.router, answer["id"], order=order, after=expected[0],
                         before=expected[4], limit=2)[1]
        assert [item["id"] for item in between["data"]] == expected[1:3]
        assert between["has_more"]


def test_a_bad_limit_order_or_cursor_is_a_400_naming_it(reader):
    served = Served("Paris.", reader)
    _, answer = served.post({"input": [{"role": "user", "content": str(i)}
                                       for i in range(101)]})
    for query, param in [({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                         ({"limit": "ten"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "msg_x"}, "after"), ({"before": "msg_x"}, "before")]:
        status, refused = listed(served.router, answer["id"], **query)
        assert status == 400 and refused["error"]["param"] == param, query
        assert refused["error"]["type"] == "invalid_request_error"
    assert len(listed(served.router, answer["id"])[1]["data"]) == 20  # the default
    assert len(listed(served.router, answer["id"], limit=1)[1]["data"]) == 1
    page = listed(served.router, answer["id"], limit=100)[1]
    assert len(page["data"]) == 100 and page["has_more"]


def test_an_unknown_id_or_no_store_is_a_404_behind_the_api_key(reader):
    served = Served("Paris.", reader)
    _, answer = served.post({"input": "hi"})
    status, missing = listed(served.router, "resp_x")
    assert status == 404 and missing == served.get("resp_x")[1]
    _, unstored = served.post({"input": "hi", "store": False})
    assert listed(served.router, unstored["id"])[0] == 404
    served.router.api_key = "k"
    assert listed(served.router, answer["id"])[0] == 401
    assert listed(served.router, answer["id"],
                  [(b"authorization", b"Bearer k")])[0] == 200
    off = Served("Paris.", reader, store=False)
    _, answer = off.post({"input": "hi"})
    assert listed(off.router, answer["id"])[0] == 404


def test_a_continuation_lists_its_previous_items_then_a_call_output(reader):
    """A function_call answered by its output alone: the second Response's items are the
    first's input, the first's output (the call's item, its id kept) and the output."""
    served = Served("sure" + CALL, reader)
    _, first = served.post({"input": "time?", "tools": TOOLS})
    call = first["output"][1]
    output = {"type": "function_call_output", "call_id": call["call_id"],
              "output": [{"type": "input_text", "text": "noon"}]}
    _, second = served.post({"previous_response_id": first["id"], "tools": TOOLS,
                             "input": [output]})
    [asked] = listed(served.router, first["id"])[1]["data"]
    items = listed(served.router, second["id"], order="asc")[1]["data"]
    assert items[:3] == [asked, *first["output"]] and items[2]["id"] == call["id"]
    assert items[3] == {"id": items[3]["id"], **output, "status": "completed"}
    ResponseItemList.model_validate(listed(served.router, second["id"])[1])
    status, refused = served.post({"previous_response_id": second["id"], "tools": TOOLS,
                                   "input": [{**output, "id": items[3]["id"]}]})
    assert status == 400 and refused["error"]["param"] == "input[0].id"  # OpenAI's: twice


def test_a_background_response_keeps_its_items_through_its_end_and_a_cancel():
    async def main():
        router = replica(in_process_store())
        _, queued = await post(router, {"background": True, "input": INPUT[:2]})
        await ended(router)
        stored = await router.responses_store.get(queued["id"])
        return router, queued, stored

    router, queued, stored = asyncio.run(main())
    assert json.loads(stored.response)["status"] == "completed"
    data = listed(router, queued["id"], order="asc")[1]["data"]
    assert [item["id"] for item in data][1] == "msg_given" and len(data) == 2
    assert with_status(stored, "cancelled").input_items == stored.input_items


def test_an_entry_stored_without_items_lists_none_and_items_count_in_its_bytes():
    old = StoredResponse.__new__(StoredResponse)  # as an older router's entry unpickles
    old.__dict__.update(response=b'{"output": []}', messages=b"[]", status="completed")

    class Store:
        async def get(self, response_id):
            return old

    router = type("Router", (), {"api_key": None, "responses_store": Store()})()
    assert listed(router, "resp_old")[1] == {"object": "list", "data": [], "first_id": None,
                                             "last_id": None, "has_more": False}
    assert StoredResponse(b"ab", b"c", input_items=b"[1]").nbytes == 6 and old.nbytes == 16


def test_an_input_item_id_that_is_no_string_is_a_400_naming_it(reader):
    """An id that is an object or a list (unhashable) or a number: a 400 naming it, as
    OpenAI's, not a 500 (nor a number kept, which no cursor names)."""
    served = Served("Paris.", reader)
    for item_id in ({"a": 1}, ["x"], 5):
        status, refused = served.post({"input": [{"role": "user", "content": "hi"},
                                                 {"role": "user", "content": "hi",
                                                  "id": item_id}]})
        assert status == 400 and refused["error"]["param"] == "input[1].id", refused


def test_an_item_utf8_cannot_encode_is_a_400_before_its_generation(reader):
    """A lone surrogate in a field no tokenizer reads (a message's extra key): a 400 naming
    the item where the Response is stored (its storing failed after its generation: a
    500), and served where it is not."""
    served = Served("Paris.", reader)
    item = {"role": "user", "content": "hi", "note": "\ud800"}
    status, refused = served.post({"input": [item]})
    assert status == 400 and refused["error"]["param"] == "input[0]", refused
    assert served.post({"input": [item], "store": False})[0] == 200


def test_an_item_holding_nan_or_infinity_is_a_400_not_a_listing_that_fails(reader):
    """NaN and Infinity (Python's JSON reads them, JSON has neither) in a field no tokenizer
    reads: a 400 naming the item where the Response is stored (kept, every later listing of
    its items was a 500)."""
    served = Served("Paris.", reader)
    for value in (float("nan"), float("inf")):
        item = {"role": "user", "content": "hi", "note": [value]}
        status, refused = served.post({"input": [{"role": "user", "content": "a"}, item]})
        assert status == 400 and refused["error"]["param"] == "input[1]", refused
    assert served.post({"input": [item], "store": False})[0] == 200


def test_a_page_that_ends_at_the_last_item_has_no_more(reader):
    """has_more: items past the page, not a page as long as the limit."""
    served = Served("Paris.", reader)
    _, answer = served.post({"input": [{"role": "user", "content": str(i)}
                                       for i in range(4)]})
    ids = [item["id"] for item in listed(served.router, answer["id"], order="asc")[1]["data"]]
    last = listed(served.router, answer["id"], order="asc", limit=2, after=ids[1])[1]
    assert [item["id"] for item in last["data"]] == ids[2:] and not last["has_more"]
    whole = listed(served.router, answer["id"], limit=4)[1]
    assert len(whole["data"]) == 4 and not whole["has_more"]


def test_an_items_given_status_is_listed_as_given(reader):
    served = Served("Paris.", reader)
    _, answer = served.post({"input": [
        {"role": "user", "content": "time?"},
        {"type": "message", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "it is"}]},
        {"role": "user", "content": "go on"}]})
    items = listed(served.router, answer["id"], order="asc")[1]["data"]
    assert [item["status"] for item in items] == ["completed", "incomplete", "completed"]
