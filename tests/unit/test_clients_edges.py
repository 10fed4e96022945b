"""PoolClient's edges as its callers see them: a call's own deadline bounds every rpc it
makes, a pinned replica found gone past the deadline fails the call without the proxy, a
replica going away (its calls UNAVAILABLE or CANCELLED) sends the call to the proxy and is
forgotten, a gone answer through the proxy is tried again at growing pauses within the
deadline (not an app's that failed to deploy), and a release reaches the replica that holds
the request, saying the request ended."""

import asyncio
import functools
from types import SimpleNamespace

import grpc
import pytest

from deployments import auth, clients
from deployments.clients import PoolClient, PoolError
from tests.unit.test_pool_client import Gone


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setattr(auth, "_secret", "test-secret")  # no Ray to share one through


class Proxy:
    """A proxy stub whose Score calls name replica r:1; it records each call's deadline, and
    each Release's session key and message."""

    def __init__(self) -> None:
        self.timeouts, self.released = [], []

    async def Score(self, message, metadata, timeout):
        self.timeouts.append(timeout)
        return SimpleNamespace(direct_address="r:1")

    async def Release(self, message, metadata, timeout):
        self.released.append((dict(metadata)["session_id"], message))


def pool_of(proxy: Proxy, timeout_s: float) -> tuple[PoolClient, list]:
    """A direct client over `proxy`, and the deadlines its direct calls get."""
    pool = PoolClient(None, lambda channel: proxy, "verifier", timeout_s, direct=True)
    direct = []

    async def straight(address, method, message, timeout_s):
        direct.append(timeout_s)
        return "direct"

    pool._direct = straight
    return pool, direct


def test_a_calls_own_deadline_bounds_its_proxy_and_direct_calls():
    """A seeded sampled draft waits as long as a verify (timeout_s): its first call through
    the proxy and its pinned calls get that deadline, not the pool's short one; a call
    without one gets the pool's."""
    proxy = Proxy()
    pool, direct = pool_of(proxy, timeout_s=1.0)

    async def main():
        await pool.call("Score", 0, "r", timeout_s=60.0)  # placed through the proxy
        await pool.call("Score", 1, "r", timeout_s=60.0)  # pinned: direct
        await pool.call("Score", 2, "r")

    asyncio.run(main())
    assert len(proxy.timeouts) == 1 and proxy.timeouts[0] > 30
    assert direct[0] > 30 and direct[1] <= 1.0


def test_a_pinned_replica_found_gone_past_the_deadline_fails_the_call_at_once():
    """Its replica gone (UNAVAILABLE) once the deadline has passed: the call fails with that
    error, and the proxy is not asked (a call past its deadline there is only late)."""
    proxy = Proxy()
    pool, _ = pool_of(proxy, timeout_s=0.01)
    pool.pins["r"] = "r:1"

    async def gone(address, method, message, timeout_s):
        await asyncio.sleep(2 * timeout_s)  # the deadline passes
        raise PoolError("verifier", grpc.StatusCode.UNAVAILABLE, "replica gone")

    pool._direct = gone
    with pytest.raises(PoolError) as error:
        asyncio.run(pool.call("Score", 0, "r"))
    assert error.value.code == grpc.StatusCode.UNAVAILABLE and not proxy.timeouts
    assert "r" not in pool.pins


def test_an_unpinned_release_goes_by_the_key_its_request_was_placed_by(monkeypatch):
    """A request placed by its prompt's prefix (route key) and not pinned: the proxy routes
    its Release by that key, to the replica holding its session (by the request id, another
    replica, and the session waited for the TTL); the Release says the request ended."""
    proxy = Proxy()
    pool = PoolClient(None, lambda channel: proxy, "verifier", 1.0, direct=False)

    async def main():
        await pool.call("Score", 0, "r", route_key="prefix-abc")
        pool.release("r")
        await asyncio.gather(*pool._releasing)

    asyncio.run(main())
    [(key, message)] = proxy.released
    assert key == "prefix-abc" and message.request_id == "r" and message.ended
    assert not pool.routes and not pool.pins


class Leaving:
    """A stub class: the stub of replica old:1's channel fails every Score call with `code`
    (the replica going away); the proxy's (channel None) fails its first one so too, then
    names replica new:1. It records the channel of each call."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code, self.channels = code, []

    def __call__(self, channel):
        return SimpleNamespace(Score=functools.partial(self.score, channel))

    async def score(self, channel, message, metadata=None, timeout=None):
        self.channels.append(channel)
        if channel == "old:1" or self.channels.count(None) == 1:
            raise Gone(self.code)
        return SimpleNamespace(direct_address="new:1")


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_pinned_replica_going_away_sends_the_call_through_the_proxy(monkeypatch, code):
    """A replica shutting down cancels its calls (CANCELLED) or is unreachable (UNAVAILABLE):
    the call goes through the proxy (tried again while Serve's routing still picks the replica
    leaving), pinned where it lands; the replica left is forgotten, its channel and its place
    for spills. Taken as the pool's failure, CANCELLED failed the request."""
    monkeypatch.setattr(clients, "RETRY_PAUSE_S", 0.001)
    monkeypatch.setattr(clients.grpc.aio, "insecure_channel", lambda address, options: address)
    stubs = Leaving(code)
    pool = PoolClient(None, stubs, "verifier", 5.0, direct=True, streams=False)
    pool.pins["r"] = "old:1"
    pool.bound.landed("x", "old:1")

    answer = asyncio.run(pool.call("Score", 0, "r"))
    assert answer.direct_address == "new:1" and stubs.channels == ["old:1", None, None]
    assert pool.pins == {"r": "new:1"}
    assert "old:1" not in pool._channels and "old:1" not in pool.bound.known


class Clock:
    """asyncio as deployments.clients sees it, on a clock the test moves: a sleep returns at
    once, moving the clock on by its seconds, and the loop's time reads that clock."""

    def __init__(self) -> None:
        self.now, self.pauses = 0.0, []

    def __getattr__(self, name):
        return getattr(asyncio, name)

    def get_running_loop(self):
        loop = asyncio.get_running_loop()
        return SimpleNamespace(time=lambda: self.now, create_future=loop.create_future)

    async def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def test_a_gone_answer_through_the_proxy_is_tried_again_at_growing_pauses_within_the_deadline(
        monkeypatch):
    """Serve's routing picks a replica gone until it notices: each try waits twice as long as
    the one before (50 ms, up to 0.8 s), and none starts once the deadline is closer than the
    next pause (a call tried past it held its caller past the call's own deadline)."""
    clock = Clock()
    monkeypatch.setattr(clients, "asyncio", clock)
    calls = []

    async def gone(message, metadata, timeout):
        calls.append(clock.now)
        raise Gone()

    pool = PoolClient(None, lambda channel: SimpleNamespace(Score=gone), "verifier", 3.0,
                      direct=False)
    with pytest.raises(PoolError) as error:
        asyncio.run(pool.call("Score", 0, "r"))
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert clock.pauses == [0.05, 0.1, 0.2, 0.4, 0.8, 0.8] and len(calls) == 7
    assert max(calls) < 3.0


def test_a_pool_app_that_failed_to_deploy_fails_the_call_at_once(monkeypatch):
    """Serve's proxy answers UNAVAILABLE for an app that failed to deploy too, and that lasts
    until it is deployed again: the call fails at its first answer, not at its deadline
    (each verify waited its 30 s for a 503, each seeded draft its 30 s for a fallback)."""
    clock = Clock()
    monkeypatch.setattr(clients, "asyncio", clock)
    calls = []

    async def undeployed(message, metadata, timeout):
        calls.append(clock.now)
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
            "Deployment(name='VerifierPool', app='verifier') is unavailable because it "
            "failed to deploy.")

    pool = PoolClient(None, lambda channel: SimpleNamespace(Score=undeployed), "verifier", 3.0,
                      direct=False)
    with pytest.raises(PoolError) as error:
        asyncio.run(pool.call("Score", 0, "r"))
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert calls == [0.0] and clock.pauses == []


def test_the_later_calls_of_a_requests_choices_keep_their_own_replicas():
    """Two choices of one request, placed apart (one spilled), call together: each goes to its
    own replica at once. Only a choice's first call waits to follow the first choice's
    placement: a later one waiting so went, once that call ended, to the other's replica,
    which lacks its session."""
    pool = PoolClient(None, lambda channel: Proxy(), "verifier", 5.0, direct=True)
    pool.pins.update({"g-0": "a:1", "g-1": "b:1"})
    pool.routes.update({"g-0": "prefix-abc", "g-1": "g"})
    direct, entered, gate = [], asyncio.Event(), asyncio.Event()

    async def held(address, method, message, timeout_s):
        direct.append((message, address))
        if message == 0:  # the first choice's call is answered once the gate opens
            entered.set()
            await gate.wait()
        return "direct"

    pool._direct = held

    async def main():
        first = asyncio.ensure_future(pool.call("Score", 0, "g-0", spill_key="g"))
        await entered.wait()
        second = asyncio.ensure_future(pool.call("Score", 1, "g-1", spill_key="g"))
        await asyncio.sleep(0)  # the second call starts while the first is in flight
        gate.set()
        return await asyncio.gather(first, second)

    assert asyncio.run(main()) == ["direct", "direct"]
    assert direct == [(0, "a:1"), (1, "b:1")]
    assert pool.pins == {"g-0": "a:1", "g-1": "b:1"} and not pool.choices
