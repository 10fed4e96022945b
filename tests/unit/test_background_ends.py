"""How a background Response (deployments.background) ends when something other than its
generation goes wrong: its final Response larger than the store holds, a shutdown before its
queued state was stored, a CancelledError that no cancel asked for, and a store's actor of
an older router without the calls a cancel or DELETE needs. Never left running or gone."""

import asyncio
import pickle
from types import SimpleNamespace

from deployments.response_store import BoundedStore, LocalStore
from deployments.store_actor import ActorStore, StoreActor
from deployments.router import Router
from tests.tiny import Scripted
from tests.unit.test_background_responses import TEXT, call, ended, post, replica


async def done(router, body: dict) -> dict:
    """A background Response run to its end, as GET then reads it."""
    _, queued = await post(router, {"background": True, **body})
    await ended(router)
    return (await call(Router.response, router, queued["id"]))[1]


def test_a_response_larger_than_the_store_holds_ends_failed_saying_so():
    """Its queued state fits, its final Response does not: the entry is not dropped (a
    GET's 404, the answer lost) but ends `failed`, its error naming the cause."""
    async def main():
        whole = LocalStore(BoundedStore(100, 1 << 20, 60))
        completed = await done(replica(whole), {})
        assert completed["status"] == "completed"
        size = whole.store.nbytes  # the completed one's (the only entry), within a byte
        small = LocalStore(BoundedStore(100, size - 100, 60))
        failed = await done(replica(small), {})
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert "too large" in failed["error"]["message"]

    asyncio.run(main())


class Slow(LocalStore):
    """The in-process store whose first put waits for `gate` (an actor being placed)."""

    def __init__(self) -> None:
        super().__init__(BoundedStore(100, 1 << 20, 60))
        self.entered, self.gate = asyncio.Event(), asyncio.Event()

    async def put(self, response_id, stored) -> None:
        self.entered.set()
        await self.gate.wait()
        await super().put(response_id, stored)


def test_a_shutdown_before_its_queued_state_was_stored_ends_it_failed():
    """The replica shuts down while the queued state's put is still on its way: the task,
    cancelled before its generation began, still ends the Response `failed`."""
    async def main():
        store = Slow()
        router = replica(store)
        posting = asyncio.ensure_future(post(router, {"background": True}))
        await asyncio.wait_for(store.entered.wait(), 5)
        shutdown = asyncio.ensure_future(router.background.shutdown())
        await asyncio.sleep(0.01)  # the task cancelled at its wait for the put
        store.gate.set()
        await asyncio.wait_for(shutdown, 5)
        _, queued = await posting
        assert queued["status"] == "queued" and not router.background.tasks
        _, failed = await call(Router.response, router, queued["id"])
        assert failed["status"] == "failed" and "shut down" in failed["error"]["message"]

    asyncio.run(main())


def test_a_cancelled_error_that_no_cancel_asked_for_ends_it_failed():
    """A library's own CancelledError out of the generation (no cancel, DELETE or shutdown
    asked for it) is a failure: stored `failed`, not left `in_progress` for good."""
    class Raising(Scripted):
        async def score(self, call):
            raise asyncio.CancelledError()

    async def main():
        router = replica(LocalStore(BoundedStore(100, 1 << 20, 60)),
                         Raising(list(range(10, 10 + len(TEXT))), prompt_len=2))
        failed = await done(router, {})
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert "cancel" in failed["error"]["message"]

    asyncio.run(main())


def older_store(*methods: str, max_bytes: int = 1 << 20, calls: list | None = None
                ) -> ActorStore:
    """An ActorStore whose actor's handle has only `methods` (an older router's actor: a Ray
    handle's AttributeError for the others), each answered by a StoreActor in this process,
    its arguments and answer pickled as Ray carries them, its name appended to `calls`."""
    actor = StoreActor(10, max_bytes, 60)

    def remote(method):
        async def called(*args):
            if calls is not None:
                calls.append(method.__name__)
            return pickle.loads(pickle.dumps(method(*pickle.loads(pickle.dumps(args)))))
        return SimpleNamespace(remote=called)

    store = ActorStore("specserve-responses-x", 10, max_bytes, 60)
    store.created = lambda: SimpleNamespace(**{name: remote(getattr(actor, name))
                                               for name in methods})
    return store


def test_a_store_actor_without_replace_or_delete_is_a_503_naming_it():
    """A rolling update: the application's store actor was created by an older router,
    whose class lacks replace and delete (a Ray handle's AttributeError): cancel and DELETE
    answer a 503 that says so, not a bug's 500."""
    async def main():
        router = replica(older_store("put", "get"))
        _, queued = await post(router, {"background": True})
        for route, method in ((Router.cancel_response, "POST"),
                              (Router.delete_response, "DELETE")):
            status, refused = await call(route, router, queued["id"], method)
            assert status == 503 and "older" in refused["error"]["message"]
        await ended(router)  # its states not stored (logged): it reads queued

    asyncio.run(main())
