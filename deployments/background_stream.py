"""A background Response's stream (`background: true` with `stream: true`), as OpenAI's: the
POST answers the events a foreground stream sends (its Response `queued` first, then
`response.queued`, `response.in_progress` once admitted), while its task runs as any
background Response's (deployments.background). The task keeps every event for the POST's
client, which may leave (the task goes on), and appends them to the response store in
batches (at most one store call per FLUSH_S; a store that cannot be reached tried again,
less often), so that `GET /v1/responses/{id}?stream=true&starting_after=N` on any replica
replays those after N and follows the rest, reading the store every FOLLOW_S (each wait
twice the last while none came, at most MAX_FOLLOW_S), until the Response's last event, sent
once its end is stored; a replica follows at most as many streams at once as it runs
background Responses (Followers: a 429 beyond). A Response whose stored end is not its
last event's (it ended without one: cancelled, failed, its replica shut down; or a cancel
landed between its last event and its end) ends its stream with `response.<status>` and the
stored Response, as GET reads it (`response.cancelled`: specserve's; OpenAI names no event
for a cancel). Events the store could not keep (past its max_bytes, or given up while it
could not be reached) end a follower's stream with an `error` event saying so; the Response
itself is still stored as it ends.
"""

import asyncio
import json
import logging

from fastapi.responses import Response

from deployments.admission import Ticket
from deployments.ingress import BadRequest, ReleasingStream, error_response, retry_later
from deployments.response_store import (
    FINAL_EVENTS,
    RUNNING,
    ResponseStore,
    StoredEvents,
    not_found,
    retrieved as whole_retrieved,
)
from deployments.store_actor import STORE_TIMEOUT_S, Outdated
from deployments.responses_events import ResponseStream, sse_event

# how long a streamed background Response's new events wait to be appended to the store
# together (one store call for them all, not one per token)
FLUSH_S = 0.05
# how often a follower (GET with stream) reads the store for new events: each wait twice
# the last while none came (a queued Response's, a slow pool's), at most MAX_FOLLOW_S
FOLLOW_S = 0.1
MAX_FOLLOW_S = 1.0
# the longest wait before an unreachable store is tried again with a Response's events
RETRY_S = 1.0
# the ends a stream's last event tells (response.<status>): the others' streams have none
CLOSED = ("completed", "incomplete")
DROPPED = ("its stream's events outgrew the response store's max_bytes and were dropped: "
           "GET /v1/responses/{id} without stream reads the Response once it ends")
UNSTORED = ("its stream's events after sequence number {after} were not stored (the response "
            "store could not be reached): GET /v1/responses/{id} without stream reads the "
            "Response whole")

logger = logging.getLogger(__name__)


def last(text: str) -> bool:
    """Whether an event's text is its stream's last."""
    return text.startswith(FINAL_EVENTS)


def ends(text: str, status: str | None) -> bool:
    """Whether a last event's text is the Response's end with `status`."""
    return text.startswith(f"event: response.{status}\n")


class EventFeed:
    """A streamed background Response's events as its task makes them (`stream` numbers
    them): all kept here for the POST's client, and appended to the store in order, those
    made within FLUSH_S of each other in one call, until the store refuses them. A store
    that cannot be reached is tried again at the next flush, each wait twice the last (at
    most RETRY_S), the events kept in order (append skips those a call that timed out
    stored after all); at the task's end they wait at most STORE_TIMEOUT_S for it."""

    def __init__(self, store: ResponseStore, stream: ResponseStream,
                 flush_s: float = FLUSH_S) -> None:
        self.store, self.stream, self.flush_s = store, stream, flush_s
        self.response_id = stream.shape.response_id
        self.texts: list[str] = []
        self.stored = 0  # how many of them the store holds
        self.kept = True  # False: the store takes no more (ended, gone, dropped, outdated)
        self.wait_s = flush_s  # the next flush's wait (longer while the store is away)
        self.flushing: asyncio.Future | None = None  # the appends under way
        self.changed = asyncio.Event()  # new events, or the task's end
        self.done = False  # the task ended: no more events
        self.settled: str | None = None  # the status its task stored as its end

    async def opened(self) -> None:
        """Its opening events made and stored with its queued state, before the POST's
        answer: a GET with stream right after it finds the Response streamed (the store
        unreachable: they are flushed later)."""
        self.texts = self.stream.queued()
        self.changed.set()
        await self.append(self.texts)
        self.flushes()

    def add(self, texts: list[str]) -> None:
        self.texts += texts
        self.changed.set()
        self.flushes()

    def flushes(self) -> None:
        """The unstored events' flush started, unless one runs or the store takes none."""
        if self.flushing is None and self.kept and self.stored < len(self.texts):
            self.flushing = asyncio.ensure_future(self.flush())

    async def flush(self) -> None:
        """The events not yet stored appended, each call wait_s after the last, one at a
        time (the next ones follow the store's count)."""
        try:
            while self.kept and self.stored < len(self.texts):
                await asyncio.sleep(self.wait_s)
                await self.append(self.texts[self.stored:])
        finally:
            self.flushing = None

    async def append(self, texts: list[str]) -> None:
        """The next events appended to the store: once it refuses them (or its actor is an
        older router's), none after; unreachable, tried again later (logged)."""
        try:
            self.kept = await self.store.append(self.response_id, self.stored, texts)
        except Outdated as error:
            logger.warning("background response %s: its events not stored: %s",
                           self.response_id, error)
            self.kept = False
        except BadRequest as error:  # unreachable: the next flush tries again, later
            self.wait_s = min(2 * self.wait_s, RETRY_S)
            logger.warning("background response %s: its events not stored yet (again in "
                           "%.2f s): %s", self.response_id, self.wait_s, error)
            return
        self.wait_s = self.flush_s
        self.stored += len(texts) if self.kept else 0

    async def flushed(self) -> None:
        """Every event made so far stored, or the store takes no more, or it could not be
        reached for STORE_TIMEOUT_S: the rest given up (a follower's stream then ends with
        an error event saying so)."""
        if (flushing := self.flushing) is None:
            return
        if (await asyncio.wait({flushing}, timeout=STORE_TIMEOUT_S))[0]:
            flushing.result()  # (a bug's error raised here)
            return
        logger.warning("background response %s: its events from %d on not stored: the "
                       "response store is unavailable", self.response_id, self.stored)
        flushing.cancel()
        self.kept = False

    def stop(self) -> None:
        """The task's end: no more events, nor appends."""
        if self.flushing is not None:
            self.flushing.cancel()
        self.done = True
        self.changed.set()

    async def generated(self, chat_events) -> dict:
        """The admitted Response's events, from the chat stream's chunks, all stored before
        its final Response is returned; BadRequest for the chat stream's error (it ends
        `failed`)."""
        self.add(self.stream.admitted())
        fed = self.stream.fed(chat_events)
        try:
            async for events in fed:
                self.add(events)
        finally:
            await fed.aclose()
            await chat_events.aclose()
        self.add(self.stream.closing())
        await self.flushed()
        if self.stream.error is not None:
            raise BadRequest(self.stream.error["message"], 503)
        return self.stream.final

    async def live(self):
        """The POST's stream: the events as the task makes them, the last once its task
        ended with it stored as its end (a GET then reads it, as after a foreground
        stream); else (cancelled, failed, its end not stored: a cancel landed between its
        last event and its end) the stored Response's (ended_event), as GET reads it."""
        after = -1
        while True:
            while after + 1 < len(self.texts) and not last(self.texts[after + 1]):
                after += 1
                yield self.texts[after]
            if self.done:
                break
            self.changed.clear()
            await self.changed.wait()
        if after + 1 < len(self.texts) and ends(self.texts[after + 1], self.settled):
            yield self.texts[after + 1]
        else:
            yield await ended_event(self.store, self.response_id, after + 1)


def error_event(sequence: int, message: str) -> str:
    return sse_event("error", sequence, code=None, message=message, param=None)


async def ended_event(store: ResponseStore, response_id: str, sequence: int) -> str:
    """A Response's stream's last event when its events have none, or not the stored end:
    `response.<status>` with the stored Response; an `error` event when it is gone or
    cannot be read."""
    try:
        whole = await store.get(response_id)
    except BadRequest as error:
        return error_event(sequence, f"{error} (resume with starting_after)")
    if whole is None:
        return error_event(sequence, f"Response with id '{response_id}' was deleted.")
    if whole.status in RUNNING:  # its task gone without its end stored (its replica's)
        return error_event(sequence, f"Response with id '{response_id}' is still "
                           f"{whole.status}, its events unknown here")
    return sse_event(f"response.{whole.status}", sequence,
                     response=json.loads(whole.response))


class Followers:
    """The streams (GETs with stream) a replica follows at once, at most `limit`: each
    reads the store until its client leaves; a 429 beyond. A Ticket holds one."""

    def __init__(self, limit: int) -> None:
        self.limit, self.following = limit, 0

    def admit(self) -> Ticket:
        if self.following >= self.limit:
            raise retry_later(f"the server follows {self.limit} response streams at once; "
                              "retry later", 429)
        self.following += 1
        return Ticket(self, 1)

    def release(self, count: int) -> None:
        self.following -= count


async def followed(store: ResponseStore, response_id: str, after: int,
                   follow_s: float = FOLLOW_S):
    """A stored stream's events after sequence number `after`, read every `follow_s` (each
    wait twice the last while no new one came, at most MAX_FOLLOW_S) until its last, sent
    once the Response's end is stored and is that event's (or else, ended_event's: the
    stored end); an `error` event when it is gone, its events were dropped or not all
    stored, or the store cannot be read (resume with starting_after)."""
    wait_s = follow_s
    while True:
        sent = after
        try:
            found = await store.events(response_id, after)
        except BadRequest as error:
            yield error_event(after + 1, f"{error} (resume with starting_after)")
            return
        if found is None:
            yield error_event(after + 1, f"Response with id '{response_id}' was deleted.")
            return
        for text in found.texts:
            if last(text) and found.status in RUNNING:
                break  # its end not stored yet: sent once it is (as the POST's stream)
            if last(text) and not ends(text, found.status):  # (a cancel stored first)
                yield await ended_event(store, response_id, after + 1)
                return
            after += 1
            yield text
            if last(text):
                return
        if found.dropped:
            yield error_event(after + 1, DROPPED.format(id=response_id))
            return
        if found.status not in RUNNING and not found.texts:
            if found.ended:  # its last event sent already, or asked past: none more
                return
            if found.status in CLOSED:  # its last event (and those before) not stored
                yield error_event(after + 1, UNSTORED.format(id=response_id, after=after))
            else:
                yield await ended_event(store, response_id, after + 1)
            return
        wait_s = follow_s if after > sent else min(2 * wait_s, max(follow_s, MAX_FOLLOW_S))
        await asyncio.sleep(wait_s)


async def released(events, ticket: Ticket):
    """A follower's events, its place given back as they end (or by ReleasingStream,
    should they never start)."""
    try:
        async for text in events:
            yield text
    finally:
        await events.aclose()
        ticket.release()


def stream_query(query) -> tuple[bool, int]:
    """(stream, starting_after) of a GET's query; BadRequest naming a bad one."""
    stream = query.get("stream", "false").lower()
    if stream not in ("true", "false", "1", "0"):
        raise BadRequest(f"stream must be true or false, not {query['stream']!r}",
                         param="stream")
    after = query.get("starting_after", "-1")
    try:
        starting_after = int(after)
    except ValueError:
        starting_after = -2
    if starting_after < -1:
        raise BadRequest(f"starting_after must be an integer >= -1 (a sequence number), "
                         f"not {after!r}", param="starting_after")
    return stream in ("true", "1"), starting_after


async def retrieved(store: ResponseStore | None, response_id: str, query,
                    followers: Followers) -> Response:
    """GET /v1/responses/{response_id}: the stored Response (response_store.retrieved),
    or with `stream=true` its events after `starting_after` (-1: all), followed, holding
    one of `followers` until its stream ends (however it ends: ReleasingStream), a 429 when
    none is free; a Response that was not streamed in the background is a 400 naming
    `stream`."""
    try:
        stream, after = stream_query(query)
        if not stream:
            return await whole_retrieved(store, response_id)
        found: StoredEvents | None = None if store is None else \
            await store.events(response_id, after)
        if found is None:
            raise not_found(response_id)
        if not found.streamed:
            raise BadRequest(f"Response with id '{response_id}' was not created with "
                             "background and stream: only those can be streamed; GET it "
                             "without stream", param="stream")
        ticket = followers.admit()  # (no await after it: the stream releases it)
    except BadRequest as error:
        return error_response(error)
    return ReleasingStream(released(followed(store, response_id, after), ticket), ticket)
