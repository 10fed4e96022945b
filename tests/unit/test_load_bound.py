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
from tests.unit.test_ingress import Records

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


def test_a_first_burst_waits_for_the_replica_count_and_finds_the_replicas_not_met():
    """The router's first burst of one prefix: no replica known, the count being read. The
    calls waiting for the prefix's first placement wait for the count too, and those beyond
    the bound cross the proxy by their own keys (Serve's ring), meeting the other replica;
    before, all 16 followed the first to its replica."""
    ring = Ring(others=("b:1",))
    pool, _ = pool_of(LoadBound(1.25, lambda: 2), ring)
    loads = first_calls(pool, 16, together=True)
    assert loads["a:1"] <= 10 and loads["b:1"] >= 6 and "b:1" in pool.bound.known
    assert pool.bound.replicas == 2 and any(not key.startswith(HOT) for key in ring.keys)


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


def test_a_call_pinned_beside_its_keys_first_call_is_counted_once():
    """Four first calls of a hot prefix at once land on a:1, the three that waited pinned
    beside the first while their prefill runs: counted by their pins only (counted among
    those joining too, a:1 looked 7 of 20 held and a fifth request spilled from it while
    every replica held 4)."""
    bound = known(4, "a:1", "b:1", "c:1", "d:1")
    pool, _ = pool_of(bound, Ring())
    pool.pins.update({f"old{i}": address for i, address in enumerate(["b:1", "c:1", "d:1"] * 4)})

    async def prefill(address, method, message, timeout_s):
        await asyncio.sleep(0.1)

    pool._direct = prefill

    async def main():
        calls = [asyncio.create_task(pool.call("Score", i, f"r{i}", route_key=HOT))
                 for i in range(4)]
        await asyncio.sleep(0.05)  # r0 landed on a:1, r1-r3 pinned there in their prefill
        assert Counter(pool.pins.values())["a:1"] == 4
        assert bound.spill(HOT, pool.pins) == (False, None)  # 4 < ceil(1.25 x 17 / 4)
        assert not bound.joining
        await asyncio.gather(*calls)

    asyncio.run(main())


@pytest.mark.parametrize("held", [0, 2])
def test_the_choices_of_one_request_are_placed_together(held):
    """One request's n = 4 choices start at once: the first is placed (by its prefix, or
    spilled), the others follow it to its replica once it has answered, a prefix hit there,
    instead of each going to the least loaded replica and prefilling the prompt there."""
    ring = Ring()
    pool, direct = pool_of(known(4, "a:1", "b:1", "c:1", "d:1"), ring)
    pool.bound.landed(HOT, "a:1")
    pool.pins.update({f"old{i}": "a:1" for i in range(held)})

    async def prefill(address, method, message, timeout_s):
        direct.append(address)
        await asyncio.sleep(0.001)

    async def main():
        await asyncio.gather(*[pool.call("Score", i, f"h-{i}", route_key=HOT, spill_key="h")
                               for i in range(4)])

    pool._direct = prefill
    asyncio.run(main())
    choices = {pool.pins[f"h-{i}"] for i in range(4)}
    assert len(choices) == 1 and (choices != {"a:1"} if held else choices == {"a:1"})
    assert not pool.choices and len(ring.keys) == (0 if held else 1)


def test_a_replica_whose_streams_ended_is_not_spilled_to():
    """A replica scaled down ends its streams (UNAVAILABLE): it holds none of the router's
    requests, so kept as known it was the least loaded, and every spill went to it."""
    pool, _ = pool_of(known(3, "a:1", "b:1", "c:1"), Ring())
    pool.bound.landed(HOT, "a:1")
    pool.pins.update({"r0": "a:1", "r1": "a:1", "r2": "b:1"})
    gone = SimpleNamespace(broken=None)  # a stream that ended
    pool._streams["c:1", "Score"] = gone

    async def main():
        pool._ended(gone)
        return pool.bound.spill(HOT, pool.pins)

    assert asyncio.run(main()) == (True, None)  # found through the proxy, not c:1
    assert "c:1" not in pool.bound.known


def test_an_unreadable_replica_count_is_said_once_and_the_replicas_met_stand_for_it():
    def unreadable():
        raise RuntimeError("no controller")

    bound = LoadBound(1.25, unreadable)

    async def main():
        for _ in range(3):
            bound.counted_at = -float("inf")  # due again
            bound.refresh()
            await bound.counted(asyncio.get_running_loop().time() + 5)

    with Records() as records:  # Serve's logger, which need not propagate to pytest's
        asyncio.run(main())
    assert bound.replicas is None and not bound.read
    assert [r.getMessage().count("unreadable") for r in records] == [1]


def test_a_replica_count_that_hangs_is_given_up_and_asked_again_later(monkeypatch):
    """A controller that never answers: the count is given up after COUNT_TIMEOUT_S (the
    replicas met stand for it) and read again a period later; before, it was never read
    again."""
    import threading

    monkeypatch.setattr(placement, "COUNT_TIMEOUT_S", 0.05)
    answer = threading.Event()
    counts = []

    def count():
        counts.append(1)
        answer.wait(5)
        return 2

    bound = LoadBound(1.25, count)

    async def main():
        bound.refresh()
        await bound.counted(asyncio.get_running_loop().time() + 5)
        assert bound._counting is None and bound.replicas is None
        bound.counted_at = -float("inf")  # a period later
        bound.refresh()
        answer.set()
        await bound.counted(asyncio.get_running_loop().time() + 5)

    asyncio.run(main())
    assert len(counts) == 2 and bound.replicas == 2


def test_the_replica_count_runs_outside_the_request_that_asked_for_it():
    """The count is read in a context of its own: a request's context (Ray's id of its task,
    by which Ray cancels the calls made under it when the client goes away) does not reach
    it. Read under the request, a client's disconnect cancelled Serve's status call: a
    warning with a traceback, and the pool's replica count dropped until the next period."""
    import contextvars

    request = contextvars.ContextVar("request", default=None)
    seen = []

    def count():
        seen.append(request.get())
        return 2

    bound = LoadBound(1.25, count)

    async def main():
        request.set("the request that asked")
        bound.refresh()
        await bound.counted(asyncio.get_running_loop().time() + 5)

    asyncio.run(main())
    assert seen == [None] and bound.replicas == 2
