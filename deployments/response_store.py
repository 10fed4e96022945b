"""Where stored Responses live (the router's `responses_store`, vLLM's
VLLM_ENABLE_RESPONSES_API_STORE): a bounded map of response id -> StoredResponse, least
recently used out past its entries or bytes, each kept at most ttl_s from its storing. The
conversations of OpenAI's Conversations API live in it too, by their conv_ ids, each changed
in one call (edit: deployments.conversation_store); an entry reads only as its own kind.

Every router replica must see one store (a conversation's next turn may reach another
replica): the deployed router's is a named Ray actor per Serve application (ActorStore),
created by whichever replica asks first; LocalStore keeps it in this process (the tests').
Both are ResponseStore; BoundedStore is the map either holds. A background Response
(deployments.background) is stored queued, then replaced as it runs and ends, each step only
while the stored one still runs: a cancel or DELETE, from any replica, is never overwritten.
A streamed one's events (deployments.background_stream) are kept with it, appended while it
runs, counted in its bytes and gone with it: any replica's GET replays and follows them.
"""

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

from fastapi.responses import Response

from deployments.ingress import BadRequest, echoed_id, error_response

# a Response's statuses while it may still change (a background one's)
RUNNING = ("queued", "in_progress")
# the heads of the events after which a Response's stream has no more
FINAL_EVENTS = tuple(f"event: response.{status}\n"
                     for status in ("completed", "incomplete", "failed", "cancelled"))


@dataclass(frozen=True)
class StoredResponse:
    """A stored Response and the chat messages it continued (input and output), each as
    JSON text: GET answers the first as it is, a continuation reads the second; `status`
    the Response's (which the store reads to replace a running one only); `input_items`
    the items it was generated from, as GET .../input_items lists them
    (deployments.response_items; empty: none, as an entry an older router stored reads)."""

    response: bytes
    messages: bytes
    status: str = "completed"
    input_items: bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.response) + len(self.messages) + len(self.input_items)


@dataclass(frozen=True)
class StoredEvents:
    """A stored Response's events after a sequence number, and what a follower needs besides:
    the Response's `status`, whether it was `streamed` (a streamed background one: its events
    kept), whether they were `dropped` (past the store's bytes: none kept any more) and
    whether they `ended` with the stream's last event (FINAL_EVENTS), wherever that lies."""

    texts: tuple[str, ...]
    status: str
    streamed: bool
    dropped: bool = False
    ended: bool = False


class EventLog:
    """One streamed Response's events (each an SSE text, its index its sequence_number)."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.nbytes = 0
        self.dropped = False

    def drop(self) -> int:
        """Its events gone (too large to keep): the bytes that frees."""
        freed, self.texts, self.nbytes, self.dropped = self.nbytes, [], 0, True
        return freed


class ResponseStore(Protocol):
    max_bytes: int  # the most one entry (with its id) may be: the store's bound

    async def put(self, response_id: str, stored: StoredResponse) -> None: ...

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def replace(self, response_id: str, stored: StoredResponse) -> bool: ...

    async def delete(self, response_id: str) -> bool: ...

    async def append(self, response_id: str, first: int, texts: list[str]) -> bool: ...

    async def events(self, response_id: str, after: int) -> StoredEvents | None: ...

    async def edit(self, key: str, kind: type, change: Callable, *args) -> tuple | None: ...

    async def survey(self, kind: type, reading: Callable, *args): ...


class BoundedStore:
    """The map: at most max_entries and max_bytes (the ids and the texts), the least
    recently read or stored out first; an entry older than ttl_s reads as absent, and goes
    before any live one (`stored`: the ids in their storing order, which is their expiry's,
    however recently each was read)."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self.clock = clock
        self.entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()
        self.stored: OrderedDict[str, None] = OrderedDict()
        self.logs: dict[str, EventLog] = {}  # the streamed ones' events, kept across states
        self.nbytes = 0

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keeps it (False: larger than the whole store, not kept, and what the id held
        stays: a running Response's last state, which its end then replaces `failed`); its
        events stay with it unless both outgrow the store: then they are dropped."""
        size = len(response_id) + stored.nbytes
        if size > self.max_bytes:
            return False
        log = self.logs.get(response_id)
        if log is not None and size + log.nbytes > self.max_bytes:
            self.nbytes -= log.drop()
        self.pop(response_id)
        if log is not None:
            self.logs[response_id] = log
            size += log.nbytes
        now = self.clock()
        while self.stored and self.entries[next(iter(self.stored))][0] <= now:
            self.pop(next(iter(self.stored)))  # expired (the first stored first): out first
        self.entries[response_id] = (now + self.ttl_s, stored)
        self.stored[response_id] = None
        self.nbytes += size
        while len(self.entries) > self.max_entries or self.nbytes > self.max_bytes:
            self.pop(next(iter(self.entries)))
        return True

    def get(self, response_id: str, kind: type = StoredResponse):
        """The entry of type `kind` (another's id, a conversation's, reads as absent)."""
        found = self.entries.get(response_id)
        if found is None or not isinstance(found[1], kind):
            return None
        if found[0] <= self.clock():  # expired: gone
            self.pop(response_id)
            return None
        self.entries.move_to_end(response_id)
        return found[1]

    def replace(self, response_id: str, stored: StoredResponse) -> bool:
        """Stored in place of one still RUNNING (False: none such, cancelled, ended or gone,
        or it is larger than the store: nothing stored). Its TTL runs again from now."""
        found = self.get(response_id)
        return found is not None and found.status in RUNNING and self.put(response_id, stored)

    def delete(self, response_id: str) -> bool:
        """Gone (False: it was not there)."""
        found = self.get(response_id) is not None
        if found:
            self.pop(response_id)
        return found

    def edit(self, key: str, kind: type, change: Callable, *args) -> tuple | None:
        """The entry `key` of type `kind` changed in one step (in the actor, one call: two
        replicas' changes of one entry both land) by change(entry, *args) -> (its new entry,
        None: gone, or itself: unchanged; an answer): (the answer, whether the change was
        kept: not where the new entry outgrows the store); None: no such entry."""
        found = self.get(key, kind)
        if found is None:
            return None
        changed, answer = change(found, *args)
        if changed is None:
            self.pop(key)
        elif changed is not found and not self.put(key, changed):
            return answer, False
        return answer, True

    def survey(self, kind: type, reading: Callable, *args):
        """reading(the live entries of type `kind`, (key, entry) in storing order, *args)."""
        now, entries = self.clock(), self.entries
        return reading([(key, entries[key][1]) for key in self.stored
                        if entries[key][0] > now and isinstance(entries[key][1], kind)], *args)

    def append(self, response_id: str, first: int, texts: list[str]) -> bool:
        """A running Response's events `first`, `first` + 1, ... kept after those it holds
        (False: none such, not the next ones, or they were dropped: past max_bytes with
        their Response, they are, and none kept after). Those it holds (a timed-out call
        landed, then its retry) are skipped: one feed numbers a Response's events, so the
        same numbers are the same events; of two such calls, in either order, the later
        adds only what it lacks (True)."""
        found = self.get(response_id)
        if found is None or found.status not in RUNNING:
            return False
        log = self.logs.setdefault(response_id, EventLog())
        held = len(log.texts) - first
        if log.dropped or held < 0 or log.texts[first:first + len(texts)] != texts[:held]:
            return False
        texts = texts[held:]
        size = sum(len(text.encode()) for text in texts)
        if len(response_id) + found.nbytes + log.nbytes + size > self.max_bytes:
            self.nbytes -= log.drop()
            return False
        log.texts += texts
        log.nbytes += size
        self.nbytes += size
        self.entries.move_to_end(response_id)
        while self.nbytes > self.max_bytes:  # others out (this one, the most recent, fits)
            self.pop(next(iter(self.entries)))
        return True

    def events(self, response_id: str, after: int) -> StoredEvents | None:
        """Its events after sequence number `after` (None: not stored)."""
        found = self.get(response_id)
        if found is None:
            return None
        log = self.logs.get(response_id)
        if log is None:
            return StoredEvents((), found.status, False)
        ended = bool(log.texts) and log.texts[-1].startswith(FINAL_EVENTS)
        return StoredEvents(tuple(log.texts[after + 1:]), found.status, True, log.dropped,
                            ended)

    def pop(self, response_id: str) -> None:
        found = self.entries.pop(response_id, None)
        if found is not None:
            del self.stored[response_id]
            self.nbytes -= len(response_id) + found[1].nbytes
        log = self.logs.pop(response_id, None)
        if log is not None:
            self.nbytes -= log.nbytes


class LocalStore:
    """A ResponseStore in this process (one replica's; the tests')."""

    def __init__(self, store: BoundedStore) -> None:
        self.store = store

    @property
    def max_bytes(self) -> int:
        return self.store.max_bytes

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        self.store.put(response_id, stored)

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    async def replace(self, response_id: str, stored: StoredResponse) -> bool:
        return self.store.replace(response_id, stored)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)

    async def append(self, response_id: str, first: int, texts: list[str]) -> bool:
        return self.store.append(response_id, first, texts)

    async def events(self, response_id: str, after: int) -> StoredEvents | None:
        return self.store.events(response_id, after)

    async def edit(self, key: str, kind: type, change: Callable, *args) -> tuple | None:
        return self.store.edit(key, kind, change, *args)

    async def survey(self, kind: type, reading: Callable, *args):
        return self.store.survey(kind, reading, *args)


async def retrieved(store: ResponseStore | None, response_id: str) -> Response:
    """GET /v1/responses/{response_id}: the stored Response as it was answered; 404 (vLLM's
    error) when it is not stored, no longer, or nothing is; 503 when the store cannot be
    reached (ActorStore's BadRequest, answered here: raised, it was a bug's 500)."""
    try:
        stored = None if store is None else await store.get(response_id)
    except BadRequest as error:
        return error_response(error)
    if stored is None:
        return error_response(not_found(response_id))
    return Response(stored.response, media_type="application/json")


def not_found(response_id: str) -> BadRequest:
    """vLLM's 404 for a response id not stored (its code null: a response is no model)."""
    return BadRequest(f"Response with id '{echoed_id(response_id)}' not found.", 404,
                      param="response_id", code=None)
