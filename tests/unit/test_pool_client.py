"""PoolClient: a proxy answer saying the replica is gone is tried again within the deadline;
the first calls of one placement (the choices of a request) cross the proxy once; a release
goes to the pinned replica. The drafter's handle over it: its deadlines, a malformed answer,
its failures in the log. Its streams to replicas: test_pool_client_streams."""

import asyncio
import logging
from types import SimpleNamespace

import grpc
import pytest

from deployments import auth, clients, pool_handles
from deployments.clients import PoolClient, PoolError


class Gone(grpc.aio.AioRpcError):
    def __init__(self, code=grpc.StatusCode.UNAVAILABLE):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "replica gone")


class Proxy:
    """A proxy stub whose first `failures` Propose calls fail with `code`."""

    def __init__(self, failures: int, code=grpc.StatusCode.UNAVAILABLE) -> None:
        self.failures, self.code, self.calls = failures, code, 0

    async def Propose(self, message, metadata, timeout):
        self.calls += 1
        if self.calls <= self.failures:
            raise Gone(self.code)
        return "answer"


def client(proxy: Proxy, timeout_s: float) -> PoolClient:
    return PoolClient(None, lambda channel: proxy, "drafter", timeout_s, direct=False)


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(auth, "_secret", "test-secret")  # no Ray to share one through
    monkeypatch.setattr(clients, "RETRY_PAUSE_S", 0.001)
    monkeypatch.setattr(clients, "MAX_RETRY_PAUSE_S", 0.002)


def test_a_gone_replica_is_tried_again_until_the_replacement_answers():
    proxy = Proxy(failures=3)
    assert asyncio.run(client(proxy, 5.0).call("Propose", None, "r1")) == "answer"
    assert proxy.calls == 4


def test_other_errors_are_not_retried():
    proxy = Proxy(failures=3, code=grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(PoolError) as error:
        asyncio.run(client(proxy, 5.0).call("Propose", None, "r1"))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and proxy.calls == 1


def test_retries_stop_at_the_deadline():
    proxy = Proxy(failures=10**9)
    with pytest.raises(PoolError) as error:
        asyncio.run(client(proxy, 0.05).call("Propose", None, "r1"))
    assert error.value.code == grpc.StatusCode.UNAVAILABLE and 1 < proxy.calls < 10**9


def test_whole_prompts_that_start_alike_are_placed_alike():
    """A call carrying a whole prompt is placed by its first 32 tokens (prefix caching's
    replica); a call that builds on a held prefix, or a short prompt, by its request."""
    from deployments.placement import ROUTE_PREFIX_TOKENS, prefix_route_key
    from speculative.prefixes import EMPTY_PREFIX_HASH
    from speculative.types import PrefixSync

    shared = tuple(range(1, ROUTE_PREFIX_TOKENS + 1))
    first = prefix_route_key("a", PrefixSync(0, EMPTY_PREFIX_HASH, shared + (7, 8)))
    second = prefix_route_key("b", PrefixSync(0, EMPTY_PREFIX_HASH, shared + (9,)))
    other = prefix_route_key("c", PrefixSync(0, EMPTY_PREFIX_HASH, (5,) + shared))
    assert first == second != other and first.startswith("prefix-")
    assert prefix_route_key("d", PrefixSync(0, EMPTY_PREFIX_HASH, shared[:-1])) == "d"
    assert prefix_route_key("e", PrefixSync(40, 123, (1,))) == "e"
    # a short prompt: the placement its request's choices share; a later call: its own id
    assert prefix_route_key("g-0", PrefixSync(0, EMPTY_PREFIX_HASH, (5,)), placement="g") == "g"
    assert prefix_route_key("g-0", PrefixSync(3, 123, (1,)), placement="g") == "g-0"
    whole = PrefixSync(0, EMPTY_PREFIX_HASH, shared + (7,))
    assert prefix_route_key("f", whole, tokens=0) == "f"  # the router's knob: off


def test_a_prompt_cache_key_places_a_conversations_turns_together_and_spreads_a_prefix():
    """OpenAI's prompt_cache_key (Request.cache_key): a first call is placed by its key's hash
    whatever its prompt, so a conversation's short first turn and its longer later ones meet
    on one replica, and a hot prefix's requests of several keys spread by key; the key is a
    prefix's (bounded: LoadBound); a later call still by its request."""
    from deployments.placement import PREFIX, ROUTE_PREFIX_TOKENS, LoadBound, prefix_route_key
    from speculative.prefixes import EMPTY_PREFIX_HASH
    from speculative.types import PrefixSync

    shared = tuple(range(1, ROUTE_PREFIX_TOKENS + 1))
    first_turn = PrefixSync(0, EMPTY_PREFIX_HASH, (9, 8, 7))
    later_turn = PrefixSync(0, EMPTY_PREFIX_HASH, (9, 8, 7) + shared)
    hot = PrefixSync(0, EMPTY_PREFIX_HASH, shared + (5,))
    key = prefix_route_key("a", first_turn, placement="a", cache_key="\0conv-1")
    assert key == prefix_route_key("b", later_turn, placement="b", cache_key="\0conv-1")
    assert key == prefix_route_key("c", hot, cache_key="\0conv-1") and key.startswith(PREFIX)
    keys = {prefix_route_key(f"d{i}", hot, cache_key=f"\0conv-{i}") for i in range(8)}
    assert len(keys) == 8 and prefix_route_key("e", hot) not in keys
    assert prefix_route_key("f", hot, cache_key="salt\0conv-1") != key  # another salt's
    assert prefix_route_key("g", PrefixSync(3, 123, (1,)), cache_key="\0conv-1") == "g"
    assert LoadBound(1.25).bounds(key)


def test_only_a_pools_refusal_for_want_of_room_is_busy():
    """RESOURCE_EXHAUSTED from the pool (its KV cache or its calls in flight full) is
    PoolBusy, which the round loop waits out; gRPC's own for an oversized message, and any
    other code, is not."""
    import grpc

    from deployments.replica_stream import pool_error
    from speculative.types import PoolBusy

    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(pool_error("verifier", exhausted, "the KV cache needs 3 more"), PoolBusy)
    assert not isinstance(pool_error("verifier", exhausted,
                                     "Received message larger than max (9 vs. 4)"), PoolBusy)
    assert not isinstance(pool_error("verifier", grpc.StatusCode.UNAVAILABLE, "gone"), PoolBusy)


class Placing:
    """A proxy stub whose Score calls stay in flight a moment, then name replica r:1 (or fail
    with INVALID_ARGUMENT, the first `failures` of them)."""

    def __init__(self, failures: int = 0) -> None:
        self.failures, self.calls = failures, 0

    async def Score(self, message, metadata, timeout):
        self.calls += 1
        await asyncio.sleep(0.01)  # the other choices start meanwhile
        if self.calls <= self.failures:
            raise Gone(grpc.StatusCode.INVALID_ARGUMENT)
        return SimpleNamespace(direct_address="r:1")


def placed(proxy: Placing, monkeypatch, choices: int = 4):
    """Each choice's first call (as the router makes them: one route key, at once) and the
    direct calls made: (results or errors, [(address, message)], client)."""
    pool = PoolClient(None, lambda channel: proxy, "verifier", 5.0, direct=True)
    direct = []

    async def straight(address, method, message, timeout_s):
        direct.append((address, message))
        return "direct"

    monkeypatch.setattr(pool, "_direct", straight)

    async def main():
        return await asyncio.gather(*(pool.call("Score", i, f"x-{i}", route_key="x")
                                      for i in range(choices)), return_exceptions=True)

    return asyncio.run(main()), direct, pool


def test_the_choices_of_a_request_cross_the_proxy_once(monkeypatch):
    """One choice's first call is placed through the proxy; the others wait for its answer
    and go straight to the replica it names, pinned there."""
    proxy = Placing()
    results, direct, pool = placed(proxy, monkeypatch)
    assert proxy.calls == 1 and sorted(message for _, message in direct) == [1, 2, 3]
    assert {address for address, _ in direct} == {"r:1"}
    assert pool.pins == {f"x-{i}": "r:1" for i in range(4)} and not pool.placing
    assert results.count("direct") == 3


def test_when_the_placing_call_fails_the_others_are_placed_by_the_proxy(monkeypatch):
    proxy = Placing(failures=1)
    results, direct, pool = placed(proxy, monkeypatch)
    assert isinstance(results[0], PoolError) and proxy.calls == 4 and not direct
    assert pool.pins == {f"x-{i}": "r:1" for i in range(1, 4)} and not pool.placing


def test_a_call_waiting_for_its_placement_when_its_request_is_cancelled_ends():
    """A request's choices are cancelled together (its client went away): the placing call
    ends, resolving the placement, in the same turn of the loop as the cancellation of a
    call waiting for it. That call ends cancelled; it was going on through the proxy (with
    asyncio.wait_for, which returned the placement), a pre-draft's leaving a session on the
    pool and a pin in the router after the request's release."""
    proxy = Placing()
    pool = PoolClient(None, lambda channel: proxy, "verifier", 5.0, direct=True)

    async def main():
        placing = pool.placing["x"] = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(pool.call("Score", 1, "x-1", route_key="x"))
        await asyncio.sleep(0.01)  # it waits for the placement
        placing.set_result(None)  # the placing call ended (cancelled: no replica named)...
        waiting.cancel()  # ...as this one was cancelled
        await asyncio.gather(waiting, return_exceptions=True)
        del pool.placing["x"]
        return waiting.cancelled()

    assert asyncio.run(main())
    assert proxy.calls == 0 and not pool.pins


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.OUT_OF_RANGE,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.UNAUTHENTICATED])
def test_only_a_gone_replica_is_tried_again_through_the_proxy(code):
    """A pool's failure or refusal fails the call at once (the round loop decides: a busy
    pool is waited out there); trying it again here would hold the request to its deadline."""
    proxy = Proxy(failures=10**9, code=code)
    with pytest.raises(PoolError) as error:
        asyncio.run(client(proxy, 5.0).call("Propose", None, "r1"))
    assert error.value.code == code and proxy.calls == 1


class Releases:
    """A stub class whose stubs record the Release calls they get, by channel (None: the
    proxy's)."""

    def __init__(self) -> None:
        self.released = []

    def __call__(self, channel):
        outer = self

        class Stub:
            async def Release(self, message, metadata=None, timeout=None):
                outer.released.append((channel, message.request_id))

        return Stub()


def test_a_release_goes_to_the_pinned_replica_and_forgets_the_pin(monkeypatch):
    """The replica that holds the request's cache gets its Release (the proxy's routing may
    pick another, which would leave the cache to the TTL); the pin goes at once (a router
    serves requests for months: a pin kept per request is a leak)."""
    stubs = Releases()
    monkeypatch.setattr(clients.grpc.aio, "insecure_channel", lambda address, options: address)
    pool = PoolClient("proxy", stubs, "verifier", 5.0, direct=True)
    pool.pins.update({"pinned": "r:1"})

    async def main():
        pool.release("pinned")
        pool.release("unpinned")
        await asyncio.gather(*pool._releasing)

    asyncio.run(main())
    assert sorted(stubs.released) == [("proxy", "unpinned"), ("r:1", "pinned")]
    assert not pool.pins and not pool.routes


def test_a_seeded_sampled_draft_waits_as_long_as_a_verify(monkeypatch):
    """Its tokens depend on the drafts it gets: a draft given up on would change them. Other
    drafts wait draft_timeout_s (a round goes on without one)."""
    from speculative.prefixes import EMPTY_PREFIX_HASH
    from speculative.sampling import SamplingParams
    from speculative.types import PrefixSync, ProposeCall

    monkeypatch.setattr(pool_handles.pb_grpc, "DrafterStub", lambda channel: None)
    drafter = pool_handles.GrpcDrafter(None, "drafter", timeout_s=30.0, draft_timeout_s=0.05)
    deadlines = []

    async def call(method, message, request_id, timeout_s=None, route_key=None, spill_key=None):
        deadlines.append(timeout_s or drafter.pool.timeout_s)  # as PoolClient.call reads it
        raise PoolError("drafter", grpc.StatusCode.UNAVAILABLE, "gone")

    monkeypatch.setattr(drafter.pool, "call", call)
    sync = PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3))
    for sampling in (SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0),
                     SamplingParams(temperature=0.0, seed=7)):
        with pytest.raises(PoolError):
            asyncio.run(drafter.propose(ProposeCall("r", sync, 3, sampling, seed=0)))
    assert deadlines == [30.0, 0.05, 0.05]


@pytest.mark.parametrize("rows, tokens", [(2, (1, 2, 3)), (3, (1, 2, 16))])
def test_a_drafters_q_unlike_its_tokens_costs_the_draft_not_the_request(monkeypatch, rows,
                                                                         tokens):
    """q with fewer rows than drafted tokens, or a token outside q's vocabulary: the answer
    is malformed (PoolUnavailable: the round goes on without a draft). Taken, the verifier
    refused the round's q (INVALID_ARGUMENT), or accept() its tokens, and the request failed."""
    import torch

    from deployments import wire
    from speculative.prefixes import EMPTY_PREFIX_HASH
    from speculative.sampling import SamplingParams
    from speculative.types import (
        DraftBlock,
        DraftDists,
        PoolUnavailable,
        PrefixSync,
        ProposeCall,
    )

    monkeypatch.setattr(pool_handles.pb_grpc, "DrafterStub", lambda channel: None)
    drafter = pool_handles.GrpcDrafter(None, "drafter", timeout_s=1.0)
    q = DraftDists.from_dense(torch.full((rows, 16), 1 / 16))
    answer = wire.block_to_proto(DraftBlock(tokens, q))

    async def call(method, message, request_id, timeout_s=None, route_key=None, spill_key=None):
        return answer

    monkeypatch.setattr(drafter.pool, "call", call)
    propose = ProposeCall("r", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3)), 3,
                          SamplingParams(temperature=1.0), seed=0)
    with pytest.raises(PoolUnavailable, match="malformed answer: draft_probs"):
        asyncio.run(drafter.propose(propose))


def test_a_drafter_whose_calls_keep_failing_is_said_in_the_log_at_most_once_a_minute(
        monkeypatch):
    """Each failure turns a round into the target's alone (speculative.loop), which only a
    counter showed: a misnamed or dead drafter app switched speculation off silently."""
    from speculative.prefixes import EMPTY_PREFIX_HASH
    from speculative.sampling import SamplingParams
    from speculative.types import PrefixSync, ProposeCall

    monkeypatch.setattr(pool_handles.pb_grpc, "DrafterStub", lambda channel: None)
    drafter = pool_handles.GrpcDrafter(None, "drafterr", timeout_s=30.0, draft_timeout_s=0.05)
    now = [100.0]
    drafter.failures.clock = lambda: now[0]

    async def call(method, message, request_id, timeout_s=None, route_key=None, spill_key=None):
        raise PoolError("drafter", grpc.StatusCode.NOT_FOUND, "no application 'drafterr'")

    monkeypatch.setattr(drafter.pool, "call", call)
    propose = ProposeCall("r", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3)), 3,
                          SamplingParams(temperature=0.0), seed=0)
    from tests.unit.test_ingress import Records  # Serve's logger does not propagate

    with Records() as records:
        for seconds in (0, 1, 30, 59, 61, 62):
            now[0] = 100.0 + seconds
            with pytest.raises(PoolError):
                asyncio.run(drafter.propose(propose))
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("'drafterr'" in w for w in warnings)
    assert "1 failed" in warnings[0] and "4 failed" in warnings[1]
