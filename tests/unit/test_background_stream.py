"""Streamed background Responses (deployments.background_stream) without Ray or a model:
the POST's events (a foreground stream's, its Response queued first), their replay and
following by GET with stream and starting_after (from another replica, through the store),
a resume that neither drops nor repeats one, a pool failure, a cancel and a DELETE while
followed, events past the store's bytes, GET's refusals and an older store actor."""

import asyncio
import json

from openai.types.responses import Response

from deployments.response_store import BoundedStore, LocalStore
from deployments.responses_api import ResponsesRequest
from deployments.router import Router
from speculative.types import PoolUnavailable
from tests.tiny import Scripted
from tests.unit.test_background_ends import older_store
from tests.unit.test_background_responses import (
    TEXT,
    Blocking,
    call,
    ended,
    in_process_store,
    post,
    replica,
)
from tests.unit.test_responses_api import EVENTS, without_ids
from tests.unit.test_router_parts import posted


def parsed(raw: str) -> dict:
    """An event's text read, checked: `event:` its type, a valid openai event (but for
    specserve's response.cancelled)."""
    head, data = raw.removesuffix("\n\n").split("\n")
    event = json.loads(data.removeprefix("data: "))
    assert head == f"event: {event['type']}"
    if event["type"] != "response.cancelled":
        EVENTS.validate_python(event)
    return event


async def opened(router, body: dict):
    """A streamed POST's answer's events (an async iterator of texts)."""
    request = posted({"model": "m", "input": "hi", "stream": True, **body})
    answer = await Router.serve_request(router, request, ResponsesRequest)
    assert answer.status_code == 200, answer.body
    return answer.body_iterator


async def read(texts, until: str | None = None) -> list[dict]:
    """The events, all or up to the first of type `until` (then the stream closed)."""
    events = []
    async for text in texts:
        events.append(parsed(text))
        if events[-1]["type"] == until:
            await texts.aclose()
            break
    return events


async def got(router, response_id: str, query: str):
    """GET /v1/responses/{id}?query: (status, its events' texts, or the error body)."""
    request = posted({})
    request.scope.update(method="GET", query_string=query.encode())
    answer = await Router.response(router, response_id, request)
    if answer.status_code != 200 or answer.media_type != "text/event-stream":
        return answer.status_code, json.loads(answer.body)
    return answer.status_code, answer.body_iterator


async def followed(router, response_id: str, after: int) -> list[dict]:
    status, texts = await got(router, response_id, f"stream=true&starting_after={after}")
    assert status == 200, texts
    return await read(texts)


def test_a_streamed_background_response_sends_a_foreground_streams_events_queued_first():
    """The events a foreground stream sends, numbered from 0, but for its opening: created
    and queued (the Response queued), then in_progress; its last the Response that GET
    reads, equal to the foreground's but for its ids and `background`."""
    async def main():
        router = replica(in_process_store())
        background = await read(await opened(router, {"background": True}))
        foreground = await read(await opened(router, {}))
        await ended(router)
        kinds = [event["type"] for event in background]
        assert kinds == ["response.created", "response.queued"] + \
            [event["type"] for event in foreground][1:]
        assert [e["sequence_number"] for e in background] == list(range(len(background)))
        assert [e["response"]["status"] for e in background[:3]] == [
            "queued", "queued", "in_progress"]
        final = background[-1]["response"]
        assert final["background"] is True and final["status"] == "completed"
        assert without_ids(final) == without_ids(foreground[-1]["response"])
        assert Response.model_validate(final).output_text == TEXT
        assert (await call(Router.response, router, final["id"]))[1] == final

    asyncio.run(main())


def test_get_with_starting_after_replays_exactly_the_later_events():
    """Once it ended, any replica's GET with stream replays the stored events after
    starting_after (-1 or none: all), each as the POST sent it; none at or past its last."""
    async def main():
        store = in_process_store()
        router, other = replica(store), replica(store)
        sent = await read(await opened(router, {"background": True}))
        await ended(router)
        response_id = sent[0]["response"]["id"]
        assert (await read((await got(other, response_id, "stream=true"))[1])) == sent
        for after in (-1, 0, 4, len(sent) - 2, len(sent) - 1, len(sent) + 5):
            assert await followed(other, response_id, after) == sent[after + 1:]  # at or
            # past its last: none (its last event was sent again, numbered after it)

    asyncio.run(main())


def test_a_resume_after_the_client_left_neither_drops_nor_repeats_an_event():
    """The POST's client leaves at its first delta, the run goes on (held); another
    replica's GET from the last event it read follows the rest as they come: together,
    every event once, in order, their deltas the whole text, as a replay from the start."""
    async def main():
        store, verifier = in_process_store(), Blocking()
        running, other = replica(store, verifier), replica(store)
        first = await read(await opened(running, {"background": True}),
                           until="response.output_text.delta")
        response_id = first[0]["response"]["id"]
        assert running.background.tasks  # the client gone, the run goes on
        resumed = asyncio.ensure_future(followed(other, response_id,
                                                 first[-1]["sequence_number"]))
        await asyncio.wait_for(verifier.entered.wait(), 5)
        await asyncio.sleep(0.3)  # the follower polls the store meanwhile
        verifier.gate.set()
        events = first + await asyncio.wait_for(resumed, 5)
        await ended(running)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.completed"
        assert "".join(e["delta"] for e in events
                       if e["type"] == "response.output_text.delta") == TEXT
        assert await followed(other, response_id, -1) == events

    asyncio.run(main())


def test_a_follower_and_the_posts_client_see_a_cancel():
    """Cancelled on another replica while it runs: the POST's stream and a follower's
    each end with response.cancelled, the Response cancelled as GET reads it."""
    async def main():
        store, verifier = in_process_store(), Blocking()
        running, other = replica(store, verifier), replica(store)
        posted_events = asyncio.ensure_future(read(await opened(running, {"background": True})))
        await asyncio.wait_for(verifier.entered.wait(), 5)
        response_id = next(iter(running.background.feeds))
        following = asyncio.ensure_future(followed(other, response_id, -1))
        await asyncio.sleep(0.2)
        status, cancelled = await call(Router.cancel_response, other, response_id, "POST")
        assert status == 200
        for events in (await asyncio.wait_for(posted_events, 5),
                       await asyncio.wait_for(following, 5)):
            assert events[-1]["type"] == "response.cancelled"
            assert events[-1]["response"] == cancelled
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
        await ended(running)
        assert verifier.released

    asyncio.run(main())


def test_a_pool_failure_is_its_error_event_then_response_failed():
    class Unavailable(Scripted):
        async def score(self, call):
            raise PoolUnavailable("verifier: UNAVAILABLE")

    async def main():
        router = replica(in_process_store(), Unavailable([10], prompt_len=2))
        events = await read(await opened(router, {"background": True}))
        await ended(router)
        assert [e["type"] for e in events] == ["response.created", "response.queued",
                                               "response.in_progress", "error",
                                               "response.failed"]
        failed = events[-1]["response"]
        assert failed["error"]["code"] == "server_error"
        assert await followed(router, failed["id"], -1) == events

    asyncio.run(main())


def test_a_deleted_one_ends_its_follower_with_an_error_and_is_then_not_found():
    async def main():
        store, verifier = in_process_store(), Blocking()
        router = replica(store, verifier)
        stream = await opened(router, {"background": True})
        await asyncio.wait_for(verifier.entered.wait(), 5)
        response_id = next(iter(router.background.feeds))
        following = asyncio.ensure_future(followed(router, response_id, 2))
        await asyncio.sleep(0.2)
        assert (await call(Router.delete_response, router, response_id, "DELETE"))[0] == 200
        events = await asyncio.wait_for(following, 5)
        assert events[0]["sequence_number"] == 3
        assert events[-1]["type"] == "error" and "deleted" in events[-1]["message"]
        assert (await read(stream))[-1]["type"] == "error"  # the POST's client's too
        assert (await got(router, response_id, "stream=true"))[0] == 404

    asyncio.run(main())


def test_get_with_a_bad_stream_or_starting_after_or_on_no_stream_is_refused():
    """A bad starting_after or stream is a 400 naming it; stream on a Response that was not
    streamed in the background a 400 naming stream; an unknown id the 404."""
    async def main():
        router = replica(in_process_store())
        _, foreground = await post(router, {})
        _, background = await post(router, {"background": True})
        await ended(router)
        for query, param in (("stream=true&starting_after=x", "starting_after"),
                             ("stream=true&starting_after=-2", "starting_after"),
                             ("stream=maybe", "stream")):
            status, refused = await got(router, background["id"], query)
            assert status == 400 and refused["error"]["param"] == param
        for response_id in (foreground["id"], background["id"]):
            status, refused = await got(router, response_id, "stream=true")
            assert status == 400 and refused["error"]["param"] == "stream"
        assert (await got(router, "resp_x", "stream=true"))[0] == 404
        status, whole = await got(router, background["id"], "stream=false&starting_after=3")
        assert status == 200 and whole["status"] == "completed"

    asyncio.run(main())


def test_events_past_the_stores_bytes_are_dropped_and_the_response_still_ends():
    """A store that holds the final Response but not its events too: the POST's client
    still gets them all (from its replica), a follower an error event saying they were
    dropped, and GET the completed Response."""
    async def main():
        whole = in_process_store()
        sent = await read(await opened(replica(whole), {"background": True}))
        response_id = sent[0]["response"]["id"]
        size = len(response_id) + whole.store.entries[response_id][1].nbytes
        small = LocalStore(BoundedStore(100, size + 200, 60))
        router = replica(small)
        again = await read(await opened(router, {"background": True}))
        await ended(router)
        response_id = again[0]["response"]["id"]
        assert [e["type"] for e in again] == [e["type"] for e in sent]
        events = await followed(router, response_id, -1)
        assert events[-1]["type"] == "error" and "dropped" in events[-1]["message"]
        assert (await call(Router.response, router, response_id))[1]["status"] == "completed"
        assert small.store.nbytes <= size + 200

    asyncio.run(main())


def test_events_are_appended_in_batches():
    """Not one store call per event: those made within FLUSH_S go together."""
    class Counting(LocalStore):
        appends = 0

        async def append(self, response_id, first, texts):
            self.appends += 1
            return await super().append(response_id, first, texts)

    async def main():
        store = Counting(BoundedStore(100, 1 << 20, 60))
        router = replica(store)
        events = await read(await opened(router, {"background": True}))
        await ended(router)
        assert len(events) > 20 and 1 <= store.appends <= len(events) // 4

    asyncio.run(main())


def test_the_store_keeps_a_running_responses_events_in_order_within_its_bytes():
    """BoundedStore: events appended only next (those it holds skipped: a retry's) and
    while it runs, counted in its bytes, kept across its states, dropped (none after) past
    max_bytes, gone with it."""
    from deployments.response_store import StoredResponse

    store = BoundedStore(10, 200, 60)
    store.put("a", StoredResponse(b"q" * 20, b"", "queued"))
    assert store.append("a", 0, ["e0", "e1"]) and not store.append("a", 3, ["e3"])
    assert not store.append("a", 1, ["x1", "e2"])  # not the events it holds
    assert store.append("a", 1, ["e1", "e2"]) and store.events("a", 0).texts == ("e1", "e2")
    assert store.append("a", 0, ["e0"]) and store.events("a", -1).texts == ("e0", "e1", "e2")
    assert store.nbytes == 1 + 20 + 6
    assert store.put("a", StoredResponse(b"c" * 30, b"", "completed"))
    assert store.events("a", -1).texts == ("e0", "e1", "e2") and store.nbytes == 1 + 30 + 6
    assert not store.append("a", 3, ["e3"])  # it ended
    store.put("b", StoredResponse(b"", b"", "in_progress"))
    assert not store.append("b", 0, ["x" * 200])  # past max_bytes: dropped
    assert store.events("b", -1).dropped and not store.append("b", 0, ["e"])
    assert not store.events("a", -1).dropped and store.events("c", -1) is None
    assert store.delete("a") and store.delete("b") and store.nbytes == 0


def test_an_older_store_actor_streams_from_its_replica_and_get_is_a_503_naming_it():
    """A rolling update: the store's actor lacks append and events. The POST's client
    still gets every event (its replica's), the Response still ends stored, and GET with
    stream is a 503 saying why."""
    async def main():
        router = replica(older_store("put", "get", "replace"))
        events = await read(await opened(router, {"background": True}))
        await ended(router)
        assert events[-1]["type"] == "response.completed"
        response_id = events[0]["response"]["id"]
        assert (await call(Router.response, router, response_id))[1]["status"] == "completed"
        status, refused = await got(router, response_id, "stream=true")
        assert status == 503 and "`events`" in refused["error"]["message"]

    asyncio.run(main())


def test_a_followers_last_event_comes_once_get_reads_the_ended_response():
    """The end stored after its events (the store slow to take it): a follower on another
    replica holds response.completed back until then, as the POST's stream does, so that a
    GET (or a continuation) right after it reads the Response completed."""
    class SlowEnd(LocalStore):
        async def replace(self, response_id, stored):
            if stored.status not in ("queued", "in_progress"):
                await asyncio.sleep(0.5)
            return await super().replace(response_id, stored)

    async def main():
        store = SlowEnd(BoundedStore(100, 1 << 20, 60))
        running, other = replica(store), replica(store)
        stream = await opened(running, {"background": True})
        response_id = parsed(await stream.__anext__())["response"]["id"]
        events = await followed(other, response_id, -1)
        assert events[-1]["type"] == "response.completed"
        assert (await call(Router.response, other, response_id))[1]["status"] == "completed"
        await read(stream)
        await ended(running)

    asyncio.run(main())
