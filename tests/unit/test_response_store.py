"""Stored Responses (the router's responses_store, vLLM's VLLM_ENABLE_RESPONSES_API_STORE)
without Ray or a model: the bounded store (entries, bytes, TTL, least recently used out),
the actor's class called in this process, and the router's request path with the in-process
store: a conversation continued by previous_response_id (the next prompt rendered with the
first exchange), store false, an unknown id, GET /v1/responses/{id}, and the store off."""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from openai.types.responses import Response

from deployments.openai_api import ChatCompletionRequest
from deployments.response_store import BoundedStore, LocalStore, StoredResponse, retrieved
from deployments.store_actor import ActorStore, StoreActor
from deployments.responses_api import ResponsesRequest
from deployments.router import Router
from deployments.router_args import RouterArgs
from tests.unit.test_chat_prompts import qwen_like_reader
from tests.unit.test_responses_api import CALL, TOOLS, stand_in
from tests.unit.test_router_parts import posted


def entry(size: int) -> StoredResponse:
    return StoredResponse(b"r" * size, b"")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_least_recently_used_go_first_past_the_entries():
    store = BoundedStore(max_entries=2, max_bytes=1 << 20, ttl_s=60)
    store.put("a", entry(1))
    store.put("b", entry(1))
    assert store.get("a") is not None  # read: now the most recent
    store.put("c", entry(1))
    assert [key for key in ("a", "b", "c") if store.get(key)] == ["a", "c"]
    assert store.nbytes == 2 * (1 + 1)  # each id's byte and its text's


def test_past_the_bytes_the_oldest_go_and_one_larger_than_all_is_not_kept():
    store = BoundedStore(max_entries=100, max_bytes=30, ttl_s=60)
    for key in "abc":
        assert store.put(key, entry(9))  # 10 bytes each: full
    assert store.put("d", entry(14))  # 15 bytes: a and b go
    assert [key for key in "abcd" if store.get(key)] == ["c", "d"] and store.nbytes == 25
    assert not store.put("e", entry(30)) and store.get("e") is None
    store.put("c", entry(4))  # stored again: counted once, at its new size
    assert store.nbytes == 15 + 5 and len(store.entries) == 2


def test_an_entry_past_its_ttl_reads_as_absent_and_its_bytes_go():
    clock = Clock()
    store = BoundedStore(max_entries=10, max_bytes=1 << 20, ttl_s=10, clock=clock)
    store.put("a", entry(5))
    clock.now = 9.5
    assert store.get("a") is not None  # read, not renewed: its TTL runs from storing
    store.put("b", entry(5))
    clock.now = 10
    assert store.get("a") is None and store.get("b") is not None
    assert store.nbytes == 6
    clock.now = 30
    store.put("c", entry(5))  # b expired at the cold end: out as c goes in
    assert list(store.entries) == ["c"] and store.nbytes == 6


def test_an_expired_entry_goes_before_a_live_one_however_recently_read():
    """A read moves an entry to the warm end, not its expiry: past the bounds, the expired
    one goes, not the least recently used live one."""
    clock = Clock()
    store = BoundedStore(max_entries=2, max_bytes=1 << 20, ttl_s=10, clock=clock)
    store.put("a", entry(1))
    clock.now = 5
    store.put("b", entry(1))
    clock.now = 6
    assert store.get("a") is not None  # read: the warm end, still expiring at 10
    clock.now = 11
    store.put("c", entry(1))
    assert list(store.entries) == list(store.stored) == ["b", "c"]
    assert store.get("b") is not None and store.nbytes == 2 * 2


def test_the_actors_class_keeps_what_its_calls_put():
    """The methods every replica calls on the one actor (ray.remote'd by ActorStore)."""
    actor = StoreActor(max_entries=1, max_bytes=100, ttl_s=60)
    assert actor.put("a", entry(3)) and actor.get("a") == entry(3)
    assert actor.put("b", entry(3)) and actor.get("a") is None
    assert actor.size() == (1, 4) and not actor.put("c", entry(200))


def test_the_actor_is_looked_up_once_off_the_event_loop():
    """However many ask at once, one lookup (get_if_exists), on another thread; its calls
    awaited."""
    import threading

    looked_up = []

    class Remote:
        def __init__(self, method):
            self.remote = lambda *args: asyncio.ensure_future(method(*args))

    class Handle:
        def __init__(self) -> None:
            local = StoreActor(10, 1 << 10, 60)
            self.put, self.get = Remote(wrapped(local.put)), Remote(wrapped(local.get))

    def wrapped(method):
        async def call(*args):
            return method(*args)
        return call

    def created():
        looked_up.append(threading.current_thread() is threading.main_thread())
        return Handle()

    store = ActorStore("specserve-responses-x", 10, 1 << 10, 60)
    store.created = created

    async def main():
        await asyncio.gather(*(store.put(f"r{i}", entry(1)) for i in range(5)))
        return await store.get("r3")

    assert asyncio.run(main()) == entry(1) and looked_up == [False]


def test_get_is_a_503_when_the_store_cannot_be_reached():
    """The actor gone (its calls a RayActorError): GET answers ActorStore's 503, not a
    bug's 500; the answer it would have stored still went out (put logs it)."""
    from ray.exceptions import RayActorError

    async def gone(*args):
        raise RayActorError()

    store = ActorStore("specserve-responses-x", 10, 1 << 10, 60)
    store.created = lambda: SimpleNamespace(put=SimpleNamespace(remote=gone),
                                            get=SimpleNamespace(remote=gone))
    asyncio.run(store.put("r", entry(1)))
    answer = asyncio.run(retrieved(store, "r"))
    assert answer.status_code == 503
    assert json.loads(answer.body)["error"]["type"] == "server_error"


def test_a_store_that_does_not_answer_is_waited_for_within_its_timeout(monkeypatch):
    """An actor restarting or not yet placed answers nothing: a put gives up after
    STORE_TIMEOUT_S (the answer goes out unstored, its slots back), a GET is a 503."""
    from deployments import store_actor

    async def never(*args):
        await asyncio.Event().wait()

    monkeypatch.setattr(store_actor, "STORE_TIMEOUT_S", 0.01)
    store = ActorStore("specserve-responses-x", 10, 1 << 10, 60)
    store.created = lambda: SimpleNamespace(put=SimpleNamespace(remote=never),
                                            get=SimpleNamespace(remote=never))
    asyncio.run(store.put("r", entry(1)))  # returns, logged
    assert asyncio.run(retrieved(store, "r")).status_code == 503


def test_an_answer_goes_out_when_the_actor_cannot_be_found():
    """get_if_exists's last lookup finds no actor (it went, with its replica, after its
    creation lost the race: ray.get_actor's ValueError): the answer goes out unstored,
    whole and streamed; GET is a 503."""
    def vanished():
        raise ValueError("Failed to look up actor with name 'specserve-responses-x'")

    store = ActorStore("specserve-responses-x", 10, 1 << 10, 60)
    store.created = vanished
    router = stand_in("Paris.", store=store)

    async def served(stream: bool) -> list[str]:
        answer = await Router.serve_request(
            router, posted({"model": "m", "input": "hi", "stream": stream}), ResponsesRequest)
        assert answer.status_code == 200
        return [answer.body.decode()] if not stream else \
            [event async for event in answer.body_iterator]

    assert json.loads(asyncio.run(served(False))[0])["status"] == "completed"
    assert asyncio.run(served(True))[-1].startswith("event: response.completed")
    assert router.admission.running == 0
    assert asyncio.run(retrieved(store, "resp_x")).status_code == 503


def test_its_args_default_to_off_and_bound_the_store():
    assert RouterArgs().responses_store is None
    bounds = RouterArgs(responses_store={}).responses_store
    assert (bounds.max_entries, bounds.ttl_s) == (10_000, 86_400)
    with pytest.raises(ValueError):
        RouterArgs(responses_store={"max_entrys": 3})


@pytest.fixture(scope="module")
def reader():
    reader = qwen_like_reader()
    reader.max_prompt_bytes, reader.tokenizing = 1 << 16, ThreadPoolExecutor(1)
    return reader


class Served:
    """The stand-in router (deployments.router's request path) with an in-process store:
    each request's chat messages, as given to the template, and its rendered prompt."""

    def __init__(self, text: str, reader, store=True) -> None:
        self.store = LocalStore(BoundedStore(100, 1 << 20, 60)) if store else None
        self.router = stand_in(text, store=self.store)
        self.messages, self.prompts = [], []
        planned = self.router.plan

        async def plan(body, chat):
            self.messages.append([m.for_template() for m in body.messages])
            self.prompts.append(reader.token_ids(body, chat=True))
            return await planned(body, chat)

        self.router.plan = plan

    def post(self, body: dict, headers=()) -> tuple[int, dict]:
        request = posted({"model": "m", **body})
        request.scope["headers"] = [*request.scope["headers"], *headers]
        answer = asyncio.run(Router.serve_request(self.router, request, ResponsesRequest))
        if body.get("stream"):
            async def read():
                return [json.loads(event.split("\n")[1][6:])
                        async for event in answer.body_iterator]
            return answer.status_code, asyncio.run(read())[-1]
        assert self.router.admission.running == 0
        return answer.status_code, json.loads(answer.body)

    def get(self, response_id: str, headers=()) -> tuple[int, dict]:
        request = posted({})
        request.scope.update(method="GET", headers=list(headers))
        answer = asyncio.run(Router.response(self.router, response_id, request))
        return answer.status_code, json.loads(answer.body)


def test_a_stored_response_is_continued_by_its_id(reader):
    """The next request's prompt is the first exchange then its own input, under its own
    instructions only (OpenAI's); a continuation's continuation holds all of it."""
    served = Served("Paris.", reader)
    status, first = served.post({"input": "capital of France?", "instructions": "brief"})
    assert status == 200 and first["store"] is True and first["previous_response_id"] is None
    _, second = served.post({"input": "and Italy?", "previous_response_id": first["id"],
                             "instructions": "terse"})
    assert Response.model_validate(second).previous_response_id == first["id"]
    exchange = [{"role": "user", "content": "capital of France?"},
                {"role": "assistant", "content": "Paris."}]
    expected = [{"role": "system", "content": "terse"}, *exchange,
                {"role": "user", "content": "and Italy?"}]
    assert served.messages[1] == expected
    assert served.prompts[1] == reader.token_ids(ChatCompletionRequest(messages=expected),
                                                 chat=True)
    _, third = served.post({"input": "and Spain?", "previous_response_id": second["id"],
                            "stream": True})  # streamed, and stored as well
    assert served.messages[2] == [*expected[1:], {"role": "assistant", "content": "Paris."},
                                  {"role": "user", "content": "and Spain?"}]
    assert third["response"]["store"] is True
    served.post({"input": "and?", "previous_response_id": third["response"]["id"]})
    assert served.messages[3][-3:-1] == [{"role": "user", "content": "and Spain?"},
                                         {"role": "assistant", "content": "Paris."}]


def test_a_call_is_continued_by_its_output_alone(reader):
    """A function_call answered: the next request gives only its function_call_output; the
    template sees the assistant's call before the tool's result."""
    served = Served("sure" + CALL, reader)
    _, first = served.post({"input": "time?", "tools": TOOLS})
    call_id = first["output"][1]["call_id"]
    served.post({"previous_response_id": first["id"], "tools": TOOLS, "input": [
        {"type": "function_call_output", "call_id": call_id, "output": "noon"}]})
    user, assistant, tool = served.messages[1]
    assert user == {"role": "user", "content": "time?"} and assistant["content"] == "sure"
    assert [(c["id"], c["function"]["name"]) for c in assistant["tool_calls"]] == [
        (call_id, "now")]
    assert tool == {"role": "tool", "tool_call_id": call_id, "content": "noon"}


def test_store_false_keeps_nothing(reader):
    served = Served("Paris.", reader)
    _, first = served.post({"input": "hi", "store": False})
    assert first["store"] is False and served.store.store.nbytes == 0
    assert served.get(first["id"])[0] == 404
    status, refused = served.post({"input": "and?", "previous_response_id": first["id"]})
    assert status == 404 and refused["error"]["param"] == "previous_response_id"


def test_an_unknown_id_is_vllms_not_found(reader):
    served = Served("Paris.", reader)
    status, refused = served.post({"input": "hi", "previous_response_id": "resp_gone"})
    assert status == 404 and refused["error"] == {  # OpenAI's code: no model_not_found
        "message": "Response with id 'resp_gone' not found.", "type": "invalid_request_error",
        "param": "previous_response_id", "code": "previous_response_not_found"}
    assert served.messages == []  # refused before its prompt was read


def test_get_returns_the_stored_response_behind_the_api_key(reader):
    served = Served("Paris.", reader)
    _, whole = served.post({"input": "hi", "metadata": {"k": "v"}})
    _, streamed = served.post({"input": "hi", "stream": True})
    assert served.get(whole["id"]) == (200, whole)
    status, got = served.get(streamed["response"]["id"])
    assert status == 200 and got == streamed["response"]
    assert Response.model_validate(got).output_text == "Paris."
    status, missing = served.get("resp_x")
    assert status == 404 and missing["error"]["param"] == "response_id"
    assert missing["error"]["code"] is None  # a response is no model
    served.router.api_key = "k"
    assert served.get(whole["id"])[0] == 401
    assert served.get(whole["id"], [(b"authorization", b"Bearer k")]) == (200, whole)


def test_without_a_store_a_continuation_is_refused_and_get_finds_nothing(reader):
    """Today's behaviour, the flag off: a 400 naming previous_response_id, no store."""
    served = Served("Paris.", reader, store=False)
    _, answer = served.post({"input": "hi"})
    assert answer["store"] is False
    status, refused = served.post({"input": "hi", "previous_response_id": answer["id"]})
    assert status == 400 and refused["error"]["param"] == "previous_response_id"
    assert served.get(answer["id"])[0] == 404
    assert asyncio.run(retrieved(None, "resp_x")).status_code == 404
