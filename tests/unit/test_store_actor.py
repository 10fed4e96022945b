"""The store actor's handle in a router replica (deployments.store_actor.ActorStore), without
Ray: Ray destroys an actor no handle refers to, so the handle is held through slow calls and
dropped only when a call shows the actor gone; the lookup starts with the replica."""

import asyncio
import threading
from types import SimpleNamespace

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from deployments import store_actor
from deployments.response_store import StoredResponse
from deployments.store_actor import ActorStore, StoreActor

ENTRY = StoredResponse(b"{}", b"[]")


class Actor:
    """A stand-in for the actor's handle: its calls run on a StoreActor in this process,
    after `failures` (errors to raise, or "hang": answer nothing) are used up."""

    def __init__(self, failures: list) -> None:
        self.local, self.failures = StoreActor(10, 1 << 10, 60), failures

    def __getattr__(self, method: str):
        async def remote(*args):
            if self.failures:
                failure = self.failures.pop(0)
                if failure == "hang":
                    await asyncio.Event().wait()
                raise failure
            return getattr(self.local, method)(*args)
        return SimpleNamespace(remote=remote)


def counted_store(failures: list) -> tuple[ActorStore, list]:
    """An ActorStore whose lookups are counted (each on the thread that made it)."""
    lookups = []
    store = ActorStore("specserve-responses-x", 10, 1 << 10, 60)

    def created():
        lookups.append(threading.current_thread() is threading.main_thread())
        return Actor(failures)

    store.created = created
    return store, lookups


def test_a_slow_call_keeps_the_actors_handle(monkeypatch):
    """A put past STORE_TIMEOUT_S goes out unstored, a GET past it is a 503, and neither drops
    the handle: dropped, the actor (starting under load, or slow) was destroyed with what it
    held, and the next call created another, empty (the shared cluster's store lost a stored
    Response between its continuation and its GET). An actor restarting keeps it too."""
    monkeypatch.setattr(store_actor, "STORE_TIMEOUT_S", 0.01)
    store, lookups = counted_store(["hang", "hang", ActorUnavailableError("restarting", None)])

    async def main():
        await store.put("r", ENTRY)  # timed out: logged
        for _ in range(2):  # timed out, then the actor restarting: 503s
            assert (await store_answer(store, "r")) == 503
        await store.put("r", ENTRY)
        return await store.get("r")

    assert asyncio.run(main()) == ENTRY and lookups == [False]


def test_a_call_that_finds_the_actor_gone_looks_it_up_again():
    """Its replica gone (ActorDiedError): the handle dropped, the next call finds or creates
    the actor again."""
    store, lookups = counted_store([ActorDiedError()])

    async def main():
        await store.put("r", ENTRY)  # the actor gone: logged
        await store.put("r", ENTRY)
        return await store.get("r")

    assert asyncio.run(main()) == ENTRY and lookups == [False, False]


def test_an_error_the_actors_method_raised_keeps_the_handle():
    """An error raised in the actor (Ray's RayTaskError, an instance of its cause's class: a
    ValueError's is a ValueError) shows the actor alive: the handle is kept (dropped on the
    replica that created the actor, Ray destroyed the store and what it held)."""
    try:
        b"\xff".decode()
    except ValueError as cause:
        raised = RayTaskError("StoreActor.edit", "", cause).as_instanceof_cause()
    assert isinstance(raised, ValueError)
    store, lookups = counted_store([raised])

    async def main():
        assert (await store_answer(store, "r")) == 503  # (unreachable's, as before)
        await store.put("r", ENTRY)
        return await store.get("r")

    assert asyncio.run(main()) == ENTRY and lookups == [False]


def test_the_lookup_starts_before_any_request_off_the_event_loop():
    """start() (the replica's constructor, no event loop running) looks the actor up on a
    thread; the requests then use that lookup."""
    store, lookups = counted_store([])
    store.start()
    store.lookup.result(timeout=10)
    assert lookups == [False]
    asyncio.run(store.put("r", ENTRY))
    assert asyncio.run(store.get("r")) == ENTRY and lookups == [False]


class SlowStart(Actor):
    """The stand-in of an actor whose worker runs `delay_s` after its creation (a process
    that imports torch: 10 s under load): its calls wait for it."""

    def __init__(self, delay_s: float) -> None:
        super().__init__([])
        self.running = threading.Event()
        threading.Timer(delay_s, self.running.set).start()

    def __getattr__(self, method: str):
        call = getattr(self.local, method)

        async def remote(*args):
            while not self.running.is_set():
                await asyncio.sleep(0.01)
            return call(*args)
        return SimpleNamespace(remote=remote)


def test_a_replica_starts_once_its_stores_worker_runs(monkeypatch):
    """The lookup returns the handle before the actor's worker runs: the replica's start
    (router_args.response_store) waits for the worker, so the first Response, answered as
    soon as the replica is up, is stored (past STORE_TIMEOUT_S it went out unstored, and its
    continuation was a 404)."""
    from ray import serve

    from deployments.router_args import ResponsesStoreArgs, response_store

    monkeypatch.setattr(store_actor, "STORE_TIMEOUT_S", 0.05)
    actor = SlowStart(0.3)
    monkeypatch.setattr(ActorStore, "created", lambda self: actor)
    monkeypatch.setattr(ActorStore, "started", staticmethod(
        lambda lookup, timeout_s: lookup.result().running.wait(timeout_s)))
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(app_name="x"))
    store = response_store(ResponsesStoreArgs())
    asyncio.run(store.put("r", ENTRY))
    assert asyncio.run(store.get("r")) == ENTRY


async def store_answer(store: ActorStore, response_id: str):
    """A GET's status: 200 with the entry, else its BadRequest's status."""
    try:
        await store.get(response_id)
    except store_actor.BadRequest as error:
        return error.status
    return 200
