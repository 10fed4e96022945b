"""Background Responses (deployments.background) without Ray or a model: the router's
request path with the in-process store, answered `queued` and then read `in_progress` and
ended by GET; cancelled while it runs (its slots and pool sessions released), also from
another replica through the store; DELETE; the refusals (no store, store false),
the bound on a replica's runs and its shutdown."""

import asyncio
import json

import pytest
from openai.types.responses import Response

from deployments.admission import Admission
from deployments.background import BackgroundRuns
from deployments.ingress import BadRequest
from deployments.response_store import BoundedStore, LocalStore, StoredResponse
from deployments.responses_api import ResponsesRequest
from deployments.conversation_turns import continued_shape
from deployments.router import Router
from speculative.types import PoolUnavailable
from tests.tiny import Scripted
from tests.unit.test_responses_api import stand_in, without_ids
from tests.unit.test_router_parts import posted

TEXT = "Paris is the capital of France."
SESSION = "chatcmpl-x-0"  # the stand-in's one choice's pool session


class Blocking(Scripted):
    """The verifier's pool: its first round answered, then every call held until it is
    cancelled; its releases recorded."""

    def __init__(self) -> None:
        super().__init__(list(range(10, 10 + len(TEXT))), prompt_len=2)
        self.entered = asyncio.Event()
        self.released: list[str] = []

        self.gate = asyncio.Event()  # set: the held calls go on

    async def score(self, call):
        if call.sync.committed_len > 2:
            self.entered.set()
            await self.gate.wait()
        return await super().score(call)

    async def release(self, request_id):
        self.released.append(request_id)


def replica(store, verifier=None, limit: int = 4, **options):
    """The stand-in router with its background runs (the store read every 10 ms)."""
    router = stand_in(TEXT, store=store, verifier=verifier, **options)
    router.background = BackgroundRuns(store, limit, poll_s=0.01)
    return router


def in_process_store() -> LocalStore:
    return LocalStore(BoundedStore(100, 1 << 20, 60))


async def post(router, body: dict, headers=()) -> tuple[int, dict]:
    request = posted({"model": "m", "input": "hi", **body})
    request.scope["headers"] = [*request.scope["headers"], *headers]
    answer = await Router.serve_request(router, request, ResponsesRequest)
    return answer.status_code, json.loads(answer.body)


async def call(route, router, response_id: str, method: str = "GET",
               headers=()) -> tuple[int, dict]:
    """GET, cancel (POST) or DELETE of a response id, as the router's route answers."""
    request = posted({})
    request.scope.update(method=method, headers=list(headers))
    answer = await route(router, response_id, request)
    return answer.status_code, json.loads(answer.body)


async def ended(router) -> None:
    tasks = set(router.background.tasks.values())
    if tasks:
        await asyncio.wait(tasks, timeout=5)
    assert not router.background.tasks and router.admission.running == 0


def test_a_background_response_is_queued_then_get_reads_the_foreground_answer():
    """Answered at once, queued with no output; the store holds it running, then the
    answer a foreground request of the same (greedy) body gets."""
    async def main():
        router = replica(in_process_store())
        status, queued = await post(router, {"background": True, "max_output_tokens": 9})
        assert status == 200 and (queued["status"], queued["output"]) == ("queued", [])
        assert queued["background"] is True and queued["usage"] is None
        Response.model_validate(queued)
        status, running = await call(Router.response, router, queued["id"])
        assert status == 200 and running["status"] in ("queued", "in_progress")
        await ended(router)
        _, done = await call(Router.response, router, queued["id"])
        _, foreground = await post(router, {"max_output_tokens": 9})
        assert done["id"] == queued["id"] and done["background"] is True
        assert without_ids(done) == without_ids(foreground)
        assert Response.model_validate(done).output_text == TEXT[:9]
        assert done["status"] == "incomplete"

    asyncio.run(main())


def test_a_background_response_waits_its_turn_queued():
    """Admission's queue as a foreground request's: queued while the slots are held, in
    progress once admitted, completed."""
    async def main():
        router = replica(in_process_store())
        router.admission = Admission(2, max_waiting=4)
        held = router.admission.admit(2)
        _, queued = await post(router, {"background": True})
        await asyncio.sleep(0.05)
        assert (await call(Router.response, router, queued["id"]))[1]["status"] == "queued"
        assert router.admission.waiting == 1
        held.release()
        await ended(router)
        _, done = await call(Router.response, router, queued["id"])
        assert Response.model_validate(done).output_text == TEXT and done["status"] == "completed"

    asyncio.run(main())


def test_a_cancel_while_it_runs_releases_its_slots_and_sessions():
    """In progress (its pool call held): cancelled, answered `cancelled` once its task
    ended (its verifier session released, its slot back); a second cancel answers it."""
    async def main():
        verifier = Blocking()
        router = replica(in_process_store(), verifier)
        _, queued = await post(router, {"background": True})
        await asyncio.wait_for(verifier.entered.wait(), 5)
        running = (await call(Router.response, router, queued["id"]))[1]
        assert running["status"] == "in_progress" and router.admission.running == 1
        status, cancelled = await call(Router.cancel_response, router, queued["id"], "POST")
        assert status == 200 and cancelled["status"] == "cancelled"
        Response.model_validate(cancelled)
        assert verifier.released == [SESSION] and router.admission.running == 0
        assert not router.background.tasks
        assert (await call(Router.response, router, queued["id"]))[1] == cancelled
        assert await call(Router.cancel_response, router, queued["id"], "POST") == (
            200, cancelled)

    asyncio.run(main())


@pytest.mark.parametrize("route, method, then", [
    (Router.cancel_response, "POST", (200, "cancelled")),
    (Router.delete_response, "DELETE", (404, None)),
])
def test_a_cancel_or_delete_on_another_replica_stops_the_run_through_the_store(
        route, method, then):
    """The cancel (or DELETE) reaches a replica that does not run it: the store marked
    cancelled (or the entry gone) at once, and the running replica's task, reading it,
    cancelled (released) within its poll, its pool call still held; its end never
    overwrites the cancel, nor stores the deleted one again."""
    async def main():
        store, verifier = in_process_store(), Blocking()
        running, other = replica(store, verifier), replica(store)
        _, queued = await post(running, {"background": True})
        await asyncio.wait_for(verifier.entered.wait(), 5)
        assert (await call(route, other, queued["id"], method))[0] == 200
        await ended(running)
        assert verifier.released == [SESSION]
        status, got = await call(Router.response, other, queued["id"])
        assert (status, got.get("status")) == then

    asyncio.run(main())


def test_a_run_that_ends_after_a_cancel_elsewhere_leaves_it_cancelled():
    """The cancel marked in the store before the running replica's watch read it, and the
    run ended meanwhile: its end is not stored over the cancel."""
    async def main():
        store, verifier = in_process_store(), Blocking()
        running, other = replica(store, verifier), replica(store)
        running.background.poll_s = 60  # its watch reads nothing before the run ends
        _, queued = await post(running, {"background": True})
        await asyncio.wait_for(verifier.entered.wait(), 5)
        assert (await call(Router.cancel_response, other, queued["id"], "POST"))[0] == 200
        verifier.gate.set()
        await ended(running)
        assert (await call(Router.response, other, queued["id"]))[1]["status"] == "cancelled"

    asyncio.run(main())


def test_a_response_that_ended_cannot_be_cancelled_and_an_unknown_one_is_not_found():
    async def main():
        router = replica(in_process_store())
        _, foreground = await post(router, {})
        _, background = await post(router, {"background": True})
        await ended(router)
        for response_id in (foreground["id"], background["id"]):
            status, refused = await call(Router.cancel_response, router, response_id, "POST")
            assert status == 400 and "completed" in refused["error"]["message"]
            assert (await call(Router.response, router, response_id))[1]["status"] == \
                "completed"
        status, missing = await call(Router.cancel_response, router, "resp_x", "POST")
        assert status == 404 and missing["error"]["param"] == "response_id"

    asyncio.run(main())


def test_delete_removes_a_stored_response_and_cancels_a_running_one():
    async def main():
        store, verifier = in_process_store(), Blocking()
        router = replica(store, verifier)
        _, answer = await post(replica(store), {"store": True})  # (answered in the foreground)
        status, deleted = await call(Router.delete_response, router, answer["id"], "DELETE")
        assert status == 200 and deleted == {"id": answer["id"], "object": "response.deleted",
                                             "deleted": True}
        assert (await call(Router.response, router, answer["id"]))[0] == 404
        assert (await call(Router.delete_response, router, answer["id"], "DELETE"))[0] == 404
        _, queued = await post(router, {"background": True})
        await asyncio.wait_for(verifier.entered.wait(), 5)
        assert (await call(Router.delete_response, router, queued["id"], "DELETE"))[0] == 200
        assert verifier.released == [SESSION] and router.admission.running == 0
        assert not router.background.tasks
        assert (await call(Router.response, router, queued["id"]))[0] == 404

    asyncio.run(main())


def test_background_needs_the_store_and_store_true():
    """The router's store off: today's 400 naming background, and cancel and DELETE find
    nothing; on: store false is vLLM's 400 (a stream is served: test_background_stream)."""
    async def main():
        off = replica(None)
        status, refused = await post(off, {"background": True})
        assert status == 400 and refused["error"]["param"] == "background"
        assert "foreground" in refused["error"]["message"]
        assert (await call(Router.cancel_response, off, "resp_x", "POST"))[0] == 404
        assert (await call(Router.delete_response, off, "resp_x", "DELETE"))[0] == 404
        on = replica(in_process_store())
        status, refused = await post(on, {"background": True, "store": False})
        assert status == 400 and refused["error"] == {
            "message": "background can only be used when `store` is true",
            "type": "invalid_request_error", "param": "background", "code": None}
        assert (await post(on, {"background": False}))[1]["background"] is False
        assert not on.background.tasks and on.admission.running == 0

    asyncio.run(main())


def test_a_pool_failure_ends_it_failed():
    class Unavailable(Scripted):
        async def score(self, call):
            raise PoolUnavailable("verifier: UNAVAILABLE")

    async def main():
        router = replica(in_process_store(), Unavailable([10], prompt_len=2))
        _, queued = await post(router, {"background": True})
        await ended(router)
        _, failed = await call(Router.response, router, queued["id"])
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        Response.model_validate(failed)

    asyncio.run(main())


def test_a_replicas_runs_are_bounded_and_its_shutdown_cancels_them():
    """Past its limit a 429; shut down, each run is cancelled (released) and ends failed."""
    async def main():
        verifier = Blocking()
        router = replica(in_process_store(), verifier, limit=1)
        _, queued = await post(router, {"background": True})
        status, refused = await post(router, {"background": True})
        assert status == 429 and "background" in refused["error"]["message"]
        await asyncio.wait_for(verifier.entered.wait(), 5)
        await router.background.shutdown()
        assert not router.background.tasks and router.admission.running == 0
        assert verifier.released == [SESSION]
        _, failed = await call(Router.response, router, queued["id"])
        assert failed["status"] == "failed" and "shut down" in failed["error"]["message"]

    asyncio.run(main())


def test_cancel_and_delete_are_behind_the_api_key():
    async def main():
        router = replica(in_process_store())
        router.api_key = "k"
        for route, method in ((Router.cancel_response, "POST"),
                              (Router.delete_response, "DELETE")):
            assert (await call(route, router, "resp_x", method))[0] == 401
            assert (await call(route, router, "resp_x", method,
                               [(b"authorization", b"Bearer k")]))[0] == 404

    asyncio.run(main())


def test_the_store_replaces_only_a_running_response():
    """A background Response's later states replace it only while it runs: a cancel's
    `cancelled`, or DELETE, is never overwritten by its end."""
    store = BoundedStore(10, 1 << 10, 60)

    def entry(status: str) -> StoredResponse:
        return StoredResponse(status.encode(), b"", status)

    assert not store.replace("a", entry("completed"))  # not there
    store.put("a", entry("queued"))
    assert store.replace("a", entry("in_progress")) and store.replace("a", entry("cancelled"))
    assert not store.replace("a", entry("completed")) and store.get("a").status == "cancelled"
    assert store.delete("a") and not store.delete("a") and store.nbytes == 0


def test_the_actor_replaces_and_deletes_and_an_unreachable_one_is_a_503():
    """ActorStore's calls of the two (the actor's class in this process), and a store that
    cannot be reached answers a 503 (BadRequest) where the caller needs the answer."""
    from types import SimpleNamespace

    from ray.exceptions import RayActorError

    from deployments.ingress import BadRequest
    from deployments.store_actor import ActorStore, StoreActor

    local = StoreActor(10, 1 << 10, 60)

    def remote(method):
        async def call(*args):
            return method(*args)
        return SimpleNamespace(remote=call)

    async def gone(*args):
        raise RayActorError()

    async def main(store):
        await store.put("a", StoredResponse(b"q", b"", "queued"))
        replaced = await store.replace("a", StoredResponse(b"c", b"", "cancelled"))
        return replaced, await store.delete("a"), await store.delete("a")

    store = ActorStore("specserve-responses-x", 10, 1 << 10, 60)
    store.created = lambda: SimpleNamespace(**{name: remote(getattr(local, name)) for name in
                                               ("put", "get", "replace", "delete")})
    assert asyncio.run(main(store)) == (True, True, False)
    unreachable = ActorStore("specserve-responses-x", 10, 1 << 10, 60)
    unreachable.created = lambda: SimpleNamespace(put=SimpleNamespace(remote=gone),
                                                  replace=SimpleNamespace(remote=gone),
                                                  delete=SimpleNamespace(remote=gone))
    for method, args in (("replace", ("a", StoredResponse(b"", b""))), ("delete", ("a",))):
        with pytest.raises(BadRequest) as refused:
            asyncio.run(getattr(unreachable, method)(*args))
        assert refused.value.status == 503


def test_continuing_a_response_that_still_runs_is_a_400():
    """A running background Response has no output yet: a request continuing it is a 400
    naming previous_response_id (it ran without the answer it meant to continue)."""
    store = in_process_store()
    for status in ("queued", "in_progress"):
        asyncio.run(store.put("resp_running", StoredResponse(b"{}", b"[]", status)))
        asked = ResponsesRequest(model="m", input="go on", previous_response_id="resp_running")
        with pytest.raises(BadRequest) as refused:
            asyncio.run(continued_shape(asked, "m", store))
        assert (refused.value.status, refused.value.param) == (400, "previous_response_id")
