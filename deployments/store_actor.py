"""The deployed router's ResponseStore: one BoundedStore in a named Ray actor per Serve
application (StoreActor), which every router replica reaches through ActorStore, created by
whichever replica asks first (deployments.response_store has the map and its contract)."""

import asyncio
import concurrent.futures
import logging
from typing import Callable

from deployments.ingress import BadRequest
from deployments.response_store import BoundedStore, StoredEvents, StoredResponse

# a store call's longest wait (its actor restarting, or waiting to be placed): past it the
# answer goes out unstored, or a continuation or GET is a 503
STORE_TIMEOUT_S = 5.0
# how long a replica's start waits for its store's worker to run (a guard against a hang, not
# a speed check: past it the replica starts, and the calls wait STORE_TIMEOUT_S as before)
STORE_START_TIMEOUT_S = 120.0

logger = logging.getLogger(__name__)
# the actor's lookups (a blocking call to Ray's GCS), off the replica's event loop
_LOOKUPS = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store-lookup")


class StoreActor:
    """The Ray actor's class (ray.remote'd by ActorStore): one BoundedStore that every
    replica of the application calls; its methods run one at a time."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self.store = BoundedStore(max_entries, max_bytes, ttl_s)

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        return self.store.put(response_id, stored)

    def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    def replace(self, response_id: str, stored: StoredResponse) -> bool:
        return self.store.replace(response_id, stored)

    def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)

    def append(self, response_id: str, first: int, texts: list[str]) -> bool:
        return self.store.append(response_id, first, texts)

    def events(self, response_id: str, after: int) -> StoredEvents | None:
        return self.store.events(response_id, after)

    def edit(self, key: str, kind: type, change: Callable, *args) -> tuple | None:
        return self.store.edit(key, kind, change, *args)

    def survey(self, kind: type, reading: Callable, *args):
        return self.store.survey(kind, reading, *args)

    def size(self) -> tuple[int, int]:
        """(entries, bytes) held."""
        return len(self.store.entries), self.store.nbytes


class ActorStore:
    """A ResponseStore in the named actor `name` (one per Serve application), created by
    whichever replica comes first (get_if_exists; no CPU reserved: it only holds bytes). Not
    detached: it lives as long as the replica that created it (as vLLM's store lives as long
    as its server), so that `serve shutdown` leaves nothing running; once it is gone, the
    next replica to use it creates it again, empty. Each replica looks it up at its start
    (start), off the event loop, and its start waits until the actor's worker runs
    (wait_started): that worker (a process importing torch) took 10 s to start under load,
    past STORE_TIMEOUT_S, and the lookup alone returns before it runs, so a Response
    answered soon after the replica was up went unstored. The handle is held until a call
    shows the actor gone (ActorStore.gone): Ray destroys an actor no handle refers to, so a
    handle dropped on a slow call destroyed the store it waited for, and what it held."""

    def __init__(self, name: str, max_entries: int, max_bytes: int, ttl_s: float) -> None:
        self.name, self.bounds, self.max_bytes = name, (max_entries, max_bytes, ttl_s), max_bytes
        self.lookup: concurrent.futures.Future | None = None  # the actor's handle, once found

    def created(self):
        import ray

        actor = ray.remote(StoreActor).options(
            name=self.name, get_if_exists=True, num_cpus=0, max_restarts=-1)
        return actor.remote(*self.bounds)

    def start(self) -> None:
        """The actor looked up (or created) on a thread, once however many ask."""
        if self.lookup is None:
            self.lookup = _LOOKUPS.submit(self.created)

    def wait_started(self, timeout_s: float = STORE_START_TIMEOUT_S) -> bool:
        """Block (the replica's start) until the actor's worker runs: whether it did within
        timeout_s. Past it (or when the lookup failed) the replica starts anyway, logged."""
        self.start()
        try:
            _LOOKUPS.submit(self.started, self.lookup, timeout_s).result()
        except Exception as error:  # a call then finds it gone, or waits for it, as before
            logger.warning("the response store %s is not running at its replica's start: %r",
                           self.name, error)
            return False
        return True

    @staticmethod
    def started(lookup: concurrent.futures.Future, timeout_s: float) -> None:
        """On the lookup thread: once the actor's worker answers (Ray's __ray_ready__)."""
        import ray

        ray.get(lookup.result().__ray_ready__.remote(), timeout=timeout_s)

    async def actor(self):
        self.start()
        lookup = self.lookup
        try:  # shielded: one caller's cancelling (its timeout) leaves the lookup running
            return await asyncio.shield(asyncio.wrap_future(lookup))
        except Exception:
            self.forget(lookup)  # the next call tries again
            raise

    def forget(self, lookup: concurrent.futures.Future | None) -> None:
        if self.lookup is lookup:
            self.lookup = None

    @staticmethod
    def gone(error: Exception) -> bool:
        """Whether the error shows the actor gone for good (its replica with it, or the
        lookup's race lost: get_if_exists's ValueError), so that the next call finds or
        creates it again; a timeout, a restarting actor or an error its method raised (a
        RayTaskError, an instance of its cause's class: a ValueError's is one) keeps it."""
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        if isinstance(error, RayTaskError):  # raised in the actor: it lives
            return False
        return isinstance(error, ValueError) or (
            isinstance(error, RayActorError) and not isinstance(error, ActorUnavailableError))

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        """Stored, or logged when the store cannot be reached within STORE_TIMEOUT_S (the
        answer still goes out, and its admission slots back: a continuation of it then
        finds no response; a put sent before the timeout still lands)."""
        try:
            if not await self.within("put", response_id, stored):
                logger.warning("response %s (%d bytes) exceeds the response store",
                               response_id, stored.nbytes)
        except (*unreachable(), asyncio.TimeoutError) as error:
            logger.warning("response %s not stored: %r", response_id, error)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self.answer("get", response_id)

    async def replace(self, response_id: str, stored: StoredResponse) -> bool:
        return await self.answer("replace", response_id, stored)

    async def delete(self, response_id: str) -> bool:
        return await self.answer("delete", response_id)

    async def append(self, response_id: str, first: int, texts: list[str]) -> bool:
        return await self.answer("append", response_id, first, texts)

    async def events(self, response_id: str, after: int) -> StoredEvents | None:
        return await self.answer("events", response_id, after)

    async def edit(self, key: str, kind: type, change: Callable, *args) -> tuple | None:
        return await self.answer("edit", key, kind, change, *args)

    async def survey(self, kind: type, reading: Callable, *args):
        return await self.answer("survey", kind, reading, *args)

    async def answer(self, method: str, *args):
        """A call whose answer the caller needs: a 503 (BadRequest) when the store cannot be
        reached within STORE_TIMEOUT_S."""
        try:
            return await self.within(method, *args)
        except (*unreachable(), asyncio.TimeoutError) as error:
            raise BadRequest(f"the response store is unavailable: {error!r}", 503) from None

    async def within(self, method: str, *args):
        """The call's answer within STORE_TIMEOUT_S; where its error shows the actor gone,
        the lookup it used forgotten."""
        self.start()
        lookup = self.lookup
        try:
            return await asyncio.wait_for(self.call(method, *args), STORE_TIMEOUT_S)
        except (*unreachable(), asyncio.TimeoutError) as error:
            if self.gone(error):
                self.forget(lookup)
            raise

    async def call(self, method: str, *args):
        call = getattr(await self.actor(), method, None)
        if call is None:  # a rolling update: an older router's replica created the actor
            raise Outdated(f"the response store ({self.name}) was created by an older "
                           f"version of the router, without `{method}`: retry once its "
                           "older replicas are gone", 503)
        return await call.remote(*args)


class Outdated(BadRequest):
    """A 503: the actor, an older router's, lacks the method (no retry mends it yet)."""


def unreachable() -> tuple[type[Exception], ...]:
    """What a call to the store's actor raises when it cannot be reached: Ray's errors, and
    get_if_exists's ValueError when the actor went (its replica with it) between its
    lookup and its creation's (ray.get_actor's: no such actor)."""
    from ray.exceptions import RayError

    return RayError, ValueError
