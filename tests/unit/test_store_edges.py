"""Edges of the router's stores that a client reads (response_store, conversation_store,
conversations, conversation_turns, stored_chats, background_stream): a conversation's TTL
run from its last change, not its reads; stored chats of one second listed in their storing
order; a conversation's metadata replaced whole, its bound of items taken, its bad cursors
named; an incomplete Response's turn kept, a conversation's refused message named
`conversation`, a queued Response not continued; a streamed chat's pieces and logprobs
joined, a failed stream not kept; a GET's stream flag; an unknown id's refusal quoting its
start."""

import asyncio
import json

from deployments.admission import Admission
from deployments.background import failed
from deployments.background_stream import stream_query
from deployments.conversation_store import MAX_ITEMS, StoredConversation, appended, read
from deployments.ingress import ECHOED_ID_CHARS
from deployments.response_items import encoded
from deployments.responses_api import ResponsesRequest
from deployments.responses_events import AsResponse
from deployments.response_store import BoundedStore
from deployments.stored_chats import (AsStored, StoredChat, StoredChatRequest, assembled,
                                      kept, listed_page)
from tests.unit.test_background_responses import TEXT, ended, in_process_store, post, replica
from tests.unit.test_conversations import TURN, routed, texts
from tests.unit.test_response_input_items import listed
from tests.unit.test_response_store import Clock, Served, reader  # noqa: F401 (a fixture)
from tests.unit.test_stored_chats import chat_router, chatted
from tests.unit.test_stored_chats import routed as chats_routed


def test_a_conversations_ttl_runs_from_its_last_change_not_its_reads():
    clock = Clock()
    store = BoundedStore(max_entries=10, max_bytes=1 << 20, ttl_s=10, clock=clock)
    entry = StoredConversation(b'{"id": "conv_a"}')
    store.put("conv_a", entry)
    clock.now = 9
    assert store.edit("conv_a", StoredConversation, read) == (entry, True)
    clock.now = 10  # read at 9, not renewed: gone at 10
    assert store.edit("conv_a", StoredConversation, read) is None
    store.put("conv_b", entry)
    clock.now = 19
    items = encoded([{"id": "msg_1", "type": "message"}])
    assert store.edit("conv_b", StoredConversation, appended, items, "items") == (1, True)
    clock.now = 28  # changed at 19: kept until 29
    assert store.edit("conv_b", StoredConversation, read)[0].items == items


def test_stored_chats_of_one_second_are_listed_in_their_storing_order_however_read():
    store = BoundedStore(max_entries=10, max_bytes=1 << 20, ttl_s=60)
    for key in ("chatcmpl-a", "chatcmpl-b"):
        store.put(key, StoredChat(b'{"id": "%s"}' % key.encode(), b"[]", "m", created=7))
    assert store.get("chatcmpl-a", StoredChat) is not None  # read: the warm end
    found = store.survey(StoredChat, listed_page, (20, "asc", None, None), None, {})
    assert [item["id"] for item in found["data"]] == ["chatcmpl-a", "chatcmpl-b"]


def test_a_conversations_metadata_is_replaced_whole_and_a_missing_items_404_has_no_code():
    router = replica(in_process_store())
    assert routed(router, "POST", body={})[1]["metadata"] == {}  # none given: empty
    _, made = routed(router, "POST", body={"items": TURN, "metadata": {"a": "1"}})
    status, changed = routed(router, "POST", f"/{made['id']}", {"metadata": {"b": "2"}})
    assert status == 200 and changed["metadata"] == {"b": "2"}
    assert routed(router, "GET", f"/{made['id']}")[1]["metadata"] == {"b": "2"}
    assert routed(router, "POST", f"/{made['id']}", {"metadata": None})[1]["metadata"] == {}
    status, missing = routed(router, "DELETE", f"/{made['id']}/items/msg_x")
    assert status == 404 and missing["error"] == {
        "message": "Item with id 'msg_x' not found.", "type": "invalid_request_error",
        "param": "item_id", "code": None}


def test_a_conversation_takes_exactly_its_bound_of_items_and_a_bad_before_is_named():
    router = replica(in_process_store())
    most = [{"role": "user", "content": str(i)} for i in range(MAX_ITEMS)]
    status, made = routed(router, "POST", body={"items": most})
    assert status == 200
    items = f"/{made['id']}/items"
    assert routed(router, "POST", items, {"items": most})[0] == 200
    assert len(routed(router, "GET", items, limit=100)[1]["data"]) == 2 * MAX_ITEMS
    status, refused = routed(router, "GET", items, before="msg_y", after="msg_x")
    assert status == 400 and refused["error"]["param"] == "after"
    status, refused = routed(router, "GET", items, before="msg_y")
    assert status == 400 and refused["error"]["param"] == "before"
    assert refused["error"]["message"] == (
        "Invalid 'before': no item of this conversation has the id 'msg_y'.")


def test_an_incomplete_response_adds_its_turn_to_its_conversation():
    router = replica(in_process_store())
    _, made = routed(router, "POST", body={"items": TURN})
    status, answer = asyncio.run(post(router, {"conversation": made["id"], "input": "Italy?",
                                               "max_output_tokens": 9}))
    assert status == 200 and answer["status"] == "incomplete"
    items = routed(router, "GET", f"/{made['id']}/items", order="asc")[1]
    assert texts(items) == ["capital of France?", "Paris.", "Italy?", TEXT[:9]]


def chunk(delta: dict, **choice) -> str:
    return "data: " + json.dumps({"id": "chatcmpl-a", "created": 7, "model": "m", "choices": [
        {"index": 0, "delta": delta, **choice}]})


def test_a_streamed_tool_calls_pieces_are_stored_joined_its_empty_content_null():
    call = {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": '{"a"'}}
    texts = [chunk({"role": "assistant", "content": ""}), chunk({"tool_calls": [call]}),
             chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
             chunk({}, finish_reason="tool_calls")]
    choice = assembled(texts)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert choice["finish_reason"] == "tool_calls"


def test_a_stored_chats_replaced_metadata_is_what_the_list_filters_by():
    router = chat_router(in_process_store())
    answer_id = chatted(router, store=True, metadata={"k": "old"})[1]["id"]
    assert chats_routed(router, "POST", f"/{answer_id}", {"metadata": {"k": "new"}})[0] == 200

    def found(value):
        return [c["id"] for c in chats_routed(router, "GET", **{"metadata[k]": value})[1]["data"]]

    assert found("new") == [answer_id] and found("old") == []


def test_a_gets_stream_reads_one_and_zero_as_true_and_false():
    assert stream_query({"stream": "1"}) == (True, -1)
    assert stream_query({"stream": "True", "starting_after": "3"}) == (True, 3)
    assert stream_query({"stream": "0"}) == (False, -1)


def test_a_background_run_refused_by_a_full_queue_fails_as_rate_limit_exceeded():
    """OpenAI's codes on the failed Response: the admission queue's 429 is
    rate_limit_exceeded, a pool's failure server_error; the message is the error's."""
    shape = AsResponse(None, ResponsesRequest(input="hi", background=True), [], "m")
    full = failed(shape, Admission(1, max_waiting=0).at_capacity())["error"]
    assert full["code"] == "rate_limit_exceeded" and "at capacity" in full["message"]
    broken = failed(shape, RuntimeError())
    assert broken["status"] == "failed"
    assert broken["error"] == {"code": "server_error", "message": "RuntimeError"}


def test_a_conversations_message_the_chat_refuses_is_named_conversation():
    """A call_id over 256 characters is refused when added (test_conversations); one stored
    before that check, the chat's refusal of it names the conversation."""
    store = in_process_store()
    router = replica(store)
    call_id = "c" * 300  # a chat message's tool_call_id is <= 256
    items = [{"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}",
              "id": "fc_1"},
             {"type": "function_call_output", "call_id": call_id, "output": "1", "id": "fco_1"}]
    assert routed(router, "POST", body={"items": items})[0] == 400
    conversation = {"id": "conv_old", "object": "conversation", "created_at": 0, "metadata": {}}
    asyncio.run(store.put("conv_old", StoredConversation(json.dumps(conversation).encode(),
                                                         encoded(items))))
    status, answer = asyncio.run(post(router, {"conversation": "conv_old", "input": "and?"}))
    assert status == 400 and answer["error"]["param"] == "conversation"
    assert answer["error"]["message"].startswith("conversation: ")


def test_a_response_still_queued_is_not_continued():
    async def main():
        router = replica(in_process_store())
        router.admission = Admission(2, max_waiting=4)
        held = router.admission.admit(2)
        _, queued = await post(router, {"background": True})
        try:  # refused at once (continued, it would wait behind `held`: a hang, guarded)
            status, answer = await asyncio.wait_for(
                post(router, {"previous_response_id": queued["id"]}), 30)
        finally:
            held.release()
        await ended(router)
        return status, answer["error"]

    status, error = asyncio.run(main())
    assert status == 400 and error["param"] == "previous_response_id"
    assert "is still queued" in error["message"]


def test_a_streams_logprobs_are_stored_whole_and_a_failed_stream_not_at_all():
    def logprob(token):
        return {"content": [{"token": token, "logprob": -1.0, "bytes": None, "top_logprobs": []}]}

    texts = [chunk({"content": "a"}, logprobs=logprob("a")),
             chunk({"content": "b"}, logprobs=logprob("b"), finish_reason="stop")]
    choice = assembled(texts)["choices"][0]
    assert [entry["token"] for entry in choice["logprobs"]["content"]] == ["a", "b"]
    assert assembled(texts[:1] + ['data: {"error": {"message": "x"}}']) is None


def test_stored_chats_are_listed_by_their_created_not_their_storing_or_id_order():
    """OpenAI's order is by created: a stream begun first and finished last is listed first."""
    store = BoundedStore(max_entries=10, max_bytes=1 << 20, ttl_s=60)
    for key, created in (("chatcmpl-a", 9), ("chatcmpl-b", 7)):
        store.put(key, StoredChat(b'{"id": "%s"}' % key.encode(), b"[]", "m", created))
    found = store.survey(StoredChat, listed_page, (20, "asc", None, None), None, {})
    assert [item["id"] for item in found["data"]] == ["chatcmpl-b", "chatcmpl-a"]


def test_a_stored_chats_size_counts_its_metadata_and_its_messages_have_content_parts():
    """nbytes: its two texts, its model and each metadata pair's key and value; each message
    kept in OpenAI's shape, its content_parts there and null."""
    assert StoredChat(b"abc", b"[]", "m", 7, {"k": "vv"}).nbytes == 3 + 2 + 1 + 3
    body = StoredChatRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                             store=True)
    entry = kept({"id": "chatcmpl-a", "model": "m", "created": 7}, body)
    assert json.loads(entry.messages) == [{"id": "chatcmpl-a-0", "content_parts": None,
                                           "role": "user", "content": "hi"}]


def test_a_streams_choices_are_stored_in_index_order_with_its_first_created_and_all_ids():
    """Choices interleaved (n > 1), each one's token_ids joined across its chunks, and the
    completion's created its first chunk's."""
    def part(created: int, index: int, content: str, ids: list, **choice) -> str:
        return "data: " + json.dumps({"id": "chatcmpl-a", "created": created, "model": "m",
                                      "choices": [{"index": index, "delta": {"content": content},
                                                   "token_ids": ids, **choice}]})

    texts = [part(7, 1, "x", [1]), part(8, 0, "a", [2], finish_reason="stop"),
             part(8, 1, "y", [3], finish_reason="length")]
    completion = assembled(texts)
    assert completion["created"] == 7
    assert [(c["index"], c["message"]["content"], c["token_ids"], c["finish_reason"])
            for c in completion["choices"]] == [(0, "a", [2], "stop"),
                                               (1, "xy", [1, 3], "length")]


def test_only_a_bracketed_metadata_key_filters_the_list_and_messages_take_no_before():
    """`metadata[k` is no filter; a chat's messages page reads after, limit and order only
    (OpenAI's), a `before` ignored."""
    router = chat_router(in_process_store())
    answer_id = chatted(router, store=True, metadata={"k": "1"})[1]["id"]
    assert len(chats_routed(router, "GET", **{"metadata[k": "2"})[1]["data"]) == 1
    page = chats_routed(router, "GET", f"/{answer_id}/messages", before=f"{answer_id}-1")[1]
    assert [m["id"] for m in page["data"]] == [f"{answer_id}-0", f"{answer_id}-1"]


def test_closing_a_stored_chats_stream_closes_the_chats_own_and_stores_nothing():
    """A client gone mid-stream: the chat's events closed (its choices, its slot freed), no
    completion stored; read to its [DONE], the completion is stored."""
    body = StoredChatRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                             store=True)

    async def streamed(store, closed: list, read_all: bool) -> None:
        async def chats_events():
            try:
                yield chunk({"content": "a"}, finish_reason="stop") + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                closed.append(True)

        own = chats_events()  # held: closed by the stream, not collected
        events = AsStored(body, store).events(own)
        if read_all:
            assert [text async for text in events][-1] == "data: [DONE]\n\n"
        else:
            assert (await events.__anext__()).startswith("data: ")
            await events.aclose()
        assert closed == [True]  # at once, not when the loop ends

    for read_all in (False, True):
        closed, store = [], in_process_store()
        asyncio.run(streamed(store, closed, read_all))
        assert (store.store.get("chatcmpl-a", StoredChat) is not None) == read_all


def test_a_refusal_quotes_an_unknown_ids_start_only(reader):
    """An id of 100 KB (in a path, a body, a cursor) was echoed whole by its 404 or 400: each
    refusal quotes its first ECHOED_ID_CHARS characters and "..." (ingress.echoed_id)."""
    asked = "x" * 100_000
    quoted = f"{asked[:ECHOED_ID_CHARS]}..."
    conversations, chats = replica(in_process_store()), chat_router(in_process_store())
    _, made = routed(conversations, "POST", body={"items": TURN})
    responses = Served("Paris.", reader)
    _, answer = responses.post({"input": "hi"})
    refusals = [routed(conversations, "GET", f"/{asked}"),
                routed(conversations, "DELETE", f"/{made['id']}/items/{asked}"),
                routed(conversations, "GET", f"/{made['id']}/items", after=asked),
                chats_routed(chats, "GET", f"/{asked}"),
                chats_routed(chats, "GET", after=asked),
                responses.get(asked),
                responses.post({"input": "hi", "previous_response_id": asked}),
                listed(responses.router, answer["id"], after=asked)]
    for status, refused in refusals:
        message = refused["error"]["message"]
        assert status in (400, 404) and quoted in message and len(message) < 200, message[:300]
