"""Bounded-load placement by prompt prefix (deployments.placement): requests of a hot prefix
fill its replica up to its share times the load factor, then spill to the least loaded
replica; one replica, or no bound, places by the prefix alone."""

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest

from deployments import auth, placement
from deployments.clients import PoolClient
from deployments.placement import LoadBound

HOT = "prefix-abc"  # the route key of a prompt start every request shares


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setattr(auth, "_secret", "test-secret")  # no Ray to share one through


class Ring:
    """A proxy stub placing a prefix's calls on replica a:1 (its hash's) and any other key
    on the replicas in turn; it records the keys it placed by."""

    def __init__(self, others=("b:1", "c:1")) -> None:
        self.others, self.keys = others, []

    async def Score(self, message, metadata, timeout):
        key = dict(metadata)["session_id"]
        self.keys.append(key)
        await asyncio.sleep(0.001)
        if key.startswith(placement.PREFIX):
            return SimpleNamespace(direct_address="a:1")
        return SimpleNamespace(direct_address=self.others[len(self.keys) % len(self.others)])


def pool_of(bound: LoadBound, ring: Ring) -> tuple[PoolClient, list]:
    pool = PoolClient(None, lambda channel: ring, "verifier", 5.0, direct=True, bound=bound)
    direct = []

    async def straight(address, method, message, timeout_s):
        direct.append(address)
        return "direct"

    pool._direct = straight
    return pool, direct


def first_calls(pool: PoolClient, requests: int, key: str = HOT, together: bool = False):
    """Each request's first call, one after another (or all at once), none released."""
    async def main():
        calls = [pool.call("Score", i, f"r{i}", route_key=key) for i in range(requests)]
        if together:
            await asyncio.gather(*calls)
        else:
            for call in calls:
                await call

    asyncio.run(main())
    return Counter(pool.pins.values())


def known(replicas: int, *addresses: str) -> LoadBound:
    bound = LoadBound(1.25)
    bound.replicas = replicas
    for address in addresses:
        bound.landed("x", address)
    return bound


def test_a_hot_prefix_fills_its_replica_to_its_bound_then_spills_to_the_least_loaded():
    ring = Ring()
    pool, direct = pool_of(known(3, "a:1", "b:1", "c:1"), ring)
    loads = first_calls(pool, 30)
    assert loads == {"a:1": 13, "b:1": 9, "c:1": 8}  # a:1 at its bound, ceil(1.25 x 30 / 3)
    assert set(ring.keys) == {HOT} and len(direct) == 17  # spills go straight, pinned


def test_without_a_bound_or_with_one_replica_the_prefix_alone_places():
    for bound in [LoadBound(None), known(1, "a:1")]:
        ring = Ring()
        pool, direct = pool_of(bound, ring)
        assert first_calls(pool, 12) == {"a:1": 12} and not direct


def test_a_replica_not_met_yet_is_found_through_the_proxy_by_the_requests_own_key():
    """Two replicas, one known: a spill crosses the proxy by its request id (Serve's ring
    places it as any request), and the replica that answers is known from then on."""
    ring = Ring(others=("b:1",))
    bound = known(2, "a:1")
    pool, direct = pool_of(bound, ring)
    loads = first_calls(pool, 8)
    assert ring.keys[:3] == [HOT, HOT, "r2"] and "b:1" in bound.known
    assert loads == {"a:1": 5, "b:1": 3}


def test_first_calls_waiting_for_their_placement_count_against_the_replica():
    """A burst of one prefix's first calls at once: the calls waiting for the first one's
    placement are counted, so the burst does not all follow it to one replica."""
    pool, direct = pool_of(known(2, "a:1", "b:1"), Ring())
    loads = first_calls(pool, 16, together=True)
    assert loads["a:1"] <= 10 and loads["b:1"] >= 6 and not pool.bound.joining
    unbounded, _ = pool_of(LoadBound(None), Ring())
    assert first_calls(unbounded, 16, together=True) == {"a:1": 16}


def test_released_requests_free_their_replica_and_a_gone_one_is_forgotten():
    pool, _ = pool_of(known(2, "a:1", "b:1"), Ring())
    first_calls(pool, 8)

    async def release_all():
        for request_id in list(pool.pins):
            pool.release(request_id)
        await asyncio.gather(*pool._releasing, return_exceptions=True)

    asyncio.run(release_all())
    assert not pool.pins and first_calls(pool, 1) == {"a:1": 1}
    pool._forget("a:1")
    assert "a:1" not in pool.bound.known and HOT not in pool.bound.homes


def test_the_replica_count_is_read_off_the_loop_at_most_once_a_period(monkeypatch):
    counted = []

    def count():
        counted.append(1)
        return 3

    bound = LoadBound(1.25, count)

    async def main():
        for _ in range(5):
            bound.spill(HOT, {})
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert bound.replicas == 3 and len(counted) == 1


@pytest.mark.parametrize("factor", [0.5, 0.99])
def test_a_load_factor_below_one_is_refused(factor):
    from pydantic import ValidationError

    from deployments.router_args import RouterArgs

    with pytest.raises(ValidationError, match="prefix_affinity_load_factor"):
        RouterArgs(prefix_affinity_load_factor=factor)
