"""The followers of streamed background Responses (GET /v1/responses/{id}?stream=true,
deployments.background_stream) without Ray or a model: a replica follows at most its
bound at once (a 429 with Retry-After beyond), each place given back however its stream
ends (its client gone mid-stream, or its last event sent); a follower reads the store less
often while no new event comes."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from deployments import background_stream
from deployments.response_store import BoundedStore, LocalStore, StoredResponse
from deployments.router import Router
from tests.unit.test_background_responses import Blocking, ended, in_process_store, replica
from tests.unit.test_background_stream import opened, parsed, read
from tests.unit.test_router_parts import posted

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}}


async def get(router, response_id: str, query: str = "stream=true"):
    """GET /v1/responses/{id}?query, as the router's route answers it."""
    request = posted({})
    request.scope.update(method="GET", query_string=query.encode())
    return await Router.response(router, response_id, request)


async def served(answer, leave_after: int | None = None) -> list[dict]:
    """A stream's answer sent to a client (as Starlette serves it), who reads all its
    events or goes away after `leave_after` of them."""
    events = []

    async def send(message):
        if len(events) == leave_after:  # (0: before the answer's start)
            raise OSError("the client has gone")
        if message["type"] == "http.response.body" and message.get("body"):
            events.append(parsed(message["body"].decode()))

    async def receive():
        await asyncio.Event().wait()

    if leave_after is None:
        await answer(SCOPE, receive, send)
    else:
        with pytest.raises(Exception):
            await answer(SCOPE, receive, send)
    return events


def test_a_replica_follows_at_most_its_bound_and_a_followers_end_frees_its_place():
    """Another replica bounded to one follower: a second GET with stream is a 429 with
    Retry-After (GET without stream, a 404 and a 400 are not bounded, and hold none); the
    place is free again once the first one's client leaves before its first event, once
    the next one's leaves mid-stream, and once a follower's stream ends with its last
    event."""
    async def main():
        store, verifier = in_process_store(), Blocking()
        running, other = replica(store, verifier), replica(store, limit=1)
        posted_events = asyncio.ensure_future(read(await opened(running, {"background": True})))
        await asyncio.wait_for(verifier.entered.wait(), 5)
        response_id = next(iter(running.background.feeds))
        first = await get(other, response_id)
        assert first.status_code == 200
        refused = await get(other, response_id)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = json.loads(refused.body)["error"]
        assert error["code"] == "rate_limit_exceeded" and "1 response streams" in error["message"]
        assert (await get(other, response_id, "stream=false")).status_code == 200
        assert (await get(other, "resp_x")).status_code == 404
        assert (await get(other, response_id, "stream=x")).status_code == 400
        assert other.background.followers.following == 1
        assert await served(first, leave_after=0) == []  # its client gone at once
        assert other.background.followers.following == 0
        second = await get(other, response_id)
        assert len(await served(second, leave_after=2)) == 2  # gone mid-stream
        assert other.background.followers.following == 0
        again = await get(other, response_id, "stream=true&starting_after=1")
        assert again.status_code == 200
        verifier.gate.set()
        events = await asyncio.wait_for(served(again), 5)
        assert events[0]["sequence_number"] == 2 and events[-1]["type"] == "response.completed"
        assert other.background.followers.following == 0
        assert (await asyncio.wait_for(posted_events, 5))[2:] == events
        await ended(running)

    asyncio.run(main())


class Arriving(LocalStore):
    """A running Response's store whose events arrive as `script` says: at its read k (from
    1) of the events, the texts script[k] appended first (a status: stored as the end)."""

    def __init__(self, script: dict) -> None:
        super().__init__(BoundedStore(100, 1 << 20, 60))
        self.script, self.reads, self.texts = script, 0, 0

    async def events(self, response_id, after):
        self.reads += 1
        for arrived in self.script.get(self.reads, ()):
            if arrived == "completed":
                await self.replace(response_id, StoredResponse(b"{}", b"", arrived))
            else:
                assert await self.append(response_id, self.texts, [arrived])
                self.texts += 1
        return await super().events(response_id, after)


def test_a_follower_reads_the_store_less_often_while_no_new_event_comes(monkeypatch):
    """Each wait twice the last while none came, at most MAX_FOLLOW_S, and FOLLOW_S again
    after a new one; every event still sent once, the last once its end is stored."""
    waits = []

    async def sleep(seconds):
        waits.append(seconds)
        await asyncio.sleep(0)

    last = "event: response.completed\ndata: {}\n\n"
    store = Arriving({1: ["e0"], 7: ["e1"], 9: [last], 10: ["completed"]})
    monkeypatch.setattr(background_stream, "asyncio", SimpleNamespace(sleep=sleep))

    async def main():
        await store.put("r", StoredResponse(b"{}", b"", "in_progress"))
        texts = [text async for text in background_stream.followed(store, "r", -1)]
        assert texts == ["e0", "e1", last]

    asyncio.run(main())
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 0.1, 0.2, 0.4]
