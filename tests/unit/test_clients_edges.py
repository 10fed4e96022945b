"""PoolClient's edges as its callers see them: a call's own deadline bounds every rpc it
makes, a pinned replica found gone past the deadline fails the call without the proxy, and a
release reaches the replica that holds the request, saying the request ended."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from deployments import auth
from deployments.clients import PoolClient, PoolError


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
