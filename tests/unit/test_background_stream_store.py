"""Streamed background Responses (deployments.background_stream) whose store fails them,
without Ray or a model: an append that cannot reach the store (lost, or landed though it
timed out) tried again, every event kept once and in order; events given up, a follower's
stream ending with an error saying so; a cancel landing between the stream's last event
and its stored end, or an end too large to store, every stream's end and GET agreeing."""

import asyncio

from deployments.background_stream import followed as stored_followed
from deployments.ingress import BadRequest
from deployments.response_store import BoundedStore, LocalStore, StoredResponse
from deployments.router import Router
from tests.unit.test_background_responses import Blocking, call, ended, replica
from tests.unit.test_background_stream import followed, opened, parsed, read


class Unreachable(LocalStore):
    """A store whose appends numbered in `lost` (from 1) fail as an unreachable actor's
    (ActorStore's 503), and those in `landed` too, but only once they were kept (a call
    that timed out after it reached the actor); past `away`, every append fails."""

    def __init__(self, lost=(), landed=(), away: int | None = None) -> None:
        super().__init__(BoundedStore(100, 1 << 20, 60))
        self.lost, self.landed, self.away, self.appends = lost, landed, away, 0
        self.called = asyncio.Event()

    async def append(self, response_id, first, texts):
        self.appends += 1
        self.called.set()
        if self.appends in self.landed:
            await super().append(response_id, first, texts)
        if self.appends in (*self.lost, *self.landed) or self.appends > (self.away or 1e9):
            raise BadRequest("the response store is unavailable: TimeoutError()", 503)
        return await super().append(response_id, first, texts)


def test_an_unreachable_store_is_tried_again_and_a_follower_gets_every_event():
    """Appends that failed (lost, or landed though they failed) are tried again at the
    next flush, while the run goes on (held until then): a follower replays every event
    the POST's client got, each once."""
    async def main():
        for lost, landed in (((2,), ()), ((), (2,)), ((1, 3), (2, 4))):
            store, verifier = Unreachable(lost, landed), Blocking()
            running, other = replica(store, verifier), replica(store)
            stream = await opened(running, {"background": True})
            while store.appends <= max(lost + landed):  # (each retry's wait twice the last)
                store.called.clear()
                await asyncio.wait_for(store.called.wait(), 5)
            verifier.gate.set()
            sent = await read(stream)
            await ended(running)
            assert sent[-1]["type"] == "response.completed"
            assert await followed(other, sent[0]["response"]["id"], -1) == sent

    asyncio.run(main())


def test_events_given_up_end_a_follower_with_an_error_not_the_whole_response(monkeypatch):
    """The store unreachable for its appends past the task's end (STORE_TIMEOUT_S): the
    rest given up, the Response still ends stored; a follower gets the events stored, then
    an error event naming the gap (not response.completed, as if it had them all)."""
    monkeypatch.setattr("deployments.background_stream.STORE_TIMEOUT_S", 0.2)

    async def main():
        store = Unreachable(away=1)  # (its opening stored)
        router = replica(store)
        sent = await read(await opened(router, {"background": True}))
        await ended(router)
        assert sent[-1]["type"] == "response.completed"
        response_id = sent[0]["response"]["id"]
        assert (await call(Router.response, router, response_id))[1]["status"] == "completed"
        events = await followed(router, response_id, -1)
        assert events[:2] == sent[:2] and len(events) == 3
        assert events[2]["type"] == "error" and events[2]["sequence_number"] == 2
        assert "not stored" in events[2]["message"]

    asyncio.run(main())


def test_a_stored_end_after_some_events_ends_a_follower_with_an_error_naming_the_gap():
    """The store itself: a completed Response whose last events it lacks."""
    async def main():
        store = LocalStore(BoundedStore(100, 1 << 20, 60))
        await store.put("r", StoredResponse(b"{}", b"", "in_progress"))
        assert await store.append("r", 0, ["e0", "e1"])
        await store.replace("r", StoredResponse(b"{}", b"", "completed"))
        texts = [text async for text in stored_followed(store, "r", -1, 0.01)]
        assert texts[:2] == ["e0", "e1"] and len(texts) == 3
        assert parsed(texts[2])["sequence_number"] == 2 and "not stored" in texts[2]

    asyncio.run(main())


class HeldEnd(LocalStore):
    """A store that holds the task's replace with its end (`completed`) until `gate`."""

    def __init__(self) -> None:
        super().__init__(BoundedStore(100, 1 << 20, 60))
        self.reached, self.gate = asyncio.Event(), asyncio.Event()

    async def replace(self, response_id, stored):
        if stored.status == "completed":
            self.reached.set()
            await self.gate.wait()
        return await super().replace(response_id, stored)


def test_a_cancel_between_the_last_event_and_the_stored_end_ends_every_stream_cancelled():
    """Every event (response.completed last) stored, its end not yet: a cancel from another
    replica lands first (the end's replace then refused). The POST's stream and a
    follower's end with response.cancelled, the Response that GET reads."""
    async def main():
        store = HeldEnd()
        running, other = replica(store), replica(store)
        stream = await opened(running, {"background": True})
        response_id = parsed(await stream.__anext__())["response"]["id"]
        await asyncio.wait_for(store.reached.wait(), 5)
        following = asyncio.ensure_future(followed(other, response_id, -1))
        status, cancelled = await call(Router.cancel_response, other, response_id, "POST")
        assert status == 200 and cancelled["status"] == "cancelled"
        store.gate.set()
        posted_events = await asyncio.wait_for(read(stream), 5)
        await ended(running)
        assert (await call(Router.response, other, response_id))[1] == cancelled
        for events in (posted_events, await asyncio.wait_for(following, 5)):
            assert events[-1]["type"] == "response.cancelled"
            assert events[-1]["response"] == cancelled

    asyncio.run(main())


def test_an_end_too_large_to_store_ends_the_posts_stream_as_get_reads_it_failed():
    """Its events and final Response outgrow the store (the events dropped, the Response
    stored `failed`): the POST's stream ends with that response.failed, not the
    response.completed it made."""
    async def main():
        whole = LocalStore(BoundedStore(100, 1 << 20, 60))
        sent = await read(await opened(replica(whole), {"background": True}))
        response_id = sent[0]["response"]["id"]
        size = len(response_id) + whole.store.entries[response_id][1].nbytes
        router = replica(LocalStore(BoundedStore(100, size - 100, 60)))
        events = await read(await opened(router, {"background": True}))
        await ended(router)
        assert events[-1]["type"] == "response.failed"
        assert "too large" in events[-1]["response"]["error"]["message"]
        got = (await call(Router.response, router, events[0]["response"]["id"]))[1]
        assert got == events[-1]["response"]

    asyncio.run(main())
