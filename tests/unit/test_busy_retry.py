"""A verifier with no room for a call (its KV cache full: PoolBusy) does not end a request:
the round is tried again after a pause, exactly (the same block, the same seed; a cache the
pool dropped meanwhile is rebuilt), until the request's busy_wait_s is spent; then the
PoolBusy goes up (the router's 429, or a stream's error event)."""

import asyncio

import pytest

from drafter.model import ModelDrafter
from speculative.busy import retried_while_busy
from speculative.driver import Generation
from speculative.state import Request
from speculative.sampling import SamplingParams
from speculative.stats import SpecStats
from speculative.types import PoolBusy
from tests.tiny import decoded, noisy_copy, run, tiny_llama
from verifier.engine import ModelVerifier

PROMPT = [3, 1, 4, 1, 5]


class Full:
    """A verifier that refuses the calls busy(n) picks (n counts calls from 0) as a full
    pool does; dropping: it also forgets the request's cache, as an eviction would."""

    def __init__(self, verifier, busy, dropping: bool = False) -> None:
        self.verifier, self.busy, self.dropping = verifier, busy, dropping
        self.calls = 0

    async def score(self, call):
        n, self.calls = self.calls, self.calls + 1
        if self.busy(n):
            if self.dropping:
                await self.verifier.release(call.request_id)
            raise PoolBusy("verifier: RESOURCE_EXHAUSTED: injected")
        return await self.verifier.score(call)

    async def release(self, request_id):
        await self.verifier.release(request_id)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(3)
    return target, noisy_copy(target, 0.05, seed=4)


def generate(pair, verifier_of, params: SamplingParams, busy_wait_s: float, request_id: str):
    target, draft = pair
    verifier = verifier_of(ModelVerifier(target))
    generation = Generation(Request(request_id, tuple(PROMPT), params, (), busy_wait_s))
    asyncio.run(decoded(ModelDrafter(draft), verifier, generation, 3))
    return generation


@pytest.mark.parametrize("dropping", [False, True], ids=["kept", "dropped"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=24),
                                    SamplingParams(temperature=1.0, seed=7, max_tokens=24)],
                         ids=["greedy", "seeded"])
def test_a_begun_request_retries_a_full_verifier_and_stays_exact(pair, params, dropping):
    target, draft = pair
    expected, _ = run(ModelDrafter(draft), ModelVerifier(target), PROMPT, params, 3,
                      request_id="plain")
    generation = generate(pair, lambda v: Full(v, lambda n: n in (2, 5, 9), dropping), params,
                          busy_wait_s=30, request_id="plain")
    assert generation.token_ids == expected
    assert generation.stats.busy_retries == 3
    assert generation.stats.cache_misses == (3 if dropping else 0)


def test_a_full_pool_past_the_wait_ends_the_request_and_no_wait_fails_at_once(pair):
    params = SamplingParams(temperature=0, max_tokens=24)
    full = {}
    with pytest.raises(PoolBusy):  # full from the third call on, past a wait of 0.3 s
        generate(pair, lambda v: full.setdefault("v", Full(v, lambda n: n >= 2)), params,
                 busy_wait_s=0.3, request_id="b")
    assert full["v"].calls == 2 + 3  # the refused call, then two retries: pauses of 0.05 and
    # 0.1 fit in 0.3 s, the next (0.2) would not
    with pytest.raises(PoolBusy):
        generate(pair, lambda v: full.setdefault("none", Full(v, lambda n: n == 0)), params,
                 busy_wait_s=0, request_id="c")
    assert full["none"].calls == 1


def test_the_wait_counts_the_refused_calls_time_not_only_the_pauses():
    """A pool answers a refusal after its batch in hand: refusals that each take 0.5 s, and
    a wait of 1 s, give up once the next pause would end past it (a clock of the test's)."""
    now = [0.0]

    async def refused():
        calls.append(now[0])
        now[0] += 0.5
        raise PoolBusy("verifier: RESOURCE_EXHAUSTED: injected")

    async def pause(seconds):
        now[0] += seconds

    calls, stats = [], SpecStats()
    with pytest.raises(PoolBusy):
        asyncio.run(retried_while_busy(1.0, stats, refused, lambda: now[0], pause))
    # 0.5 + 0.05 fits in 1 s, 1.05 + 0.1 does not (the pauses alone, 0.05 + 0.1 + 0.2 +
    # 0.4, would have made five calls, the last at 3.25 s)
    assert calls == [0.0, 0.55] and stats.busy_retries == 1
    assert stats.busy_seconds == pytest.approx(0.55)  # the refused call and its pause


class BusyDrafter:
    """A drafter that refuses the calls busy(n) picks (n counts calls from 0) as a drafter
    without room does (PoolBusy)."""

    def __init__(self, drafter, busy) -> None:
        self.drafter, self.busy, self.calls = drafter, busy, 0
        self.asked: list[int] = []  # each call's K

    async def propose(self, call):
        n, self.calls = self.calls, self.calls + 1
        self.asked.append(call.num_speculative_tokens)
        if self.busy(n):
            raise PoolBusy("drafter: RESOURCE_EXHAUSTED: injected")
        return await self.drafter.propose(call)

    async def release(self, request_id):
        await self.drafter.release(request_id)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_a_seeded_request_waits_for_a_full_drafter_and_keeps_its_tokens(pair, pipelined):
    """Its tokens depend on its drafts: a drafter without room is waited for (as a full
    verifier is), not run without; an unseeded request runs those rounds without a draft."""
    target, draft = pair
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24)
    expected, _ = run(ModelDrafter(draft), ModelVerifier(target), PROMPT, seeded, 3,
                      pipelined=pipelined)
    for params in (seeded, SamplingParams(temperature=0, max_tokens=24)):
        generation = Generation(Request("r", tuple(PROMPT), params, (), 30))
        drafter = BusyDrafter(ModelDrafter(draft), lambda n: n in (2, 5))
        asyncio.run(decoded(drafter, ModelVerifier(target), generation, 3, pipelined))
        stats = generation.stats
        if params is seeded:
            assert generation.token_ids == expected
            assert stats.busy_retries == 2 and stats.draft_fallback_rounds == 0
            assert stats.draft_busy_seconds > 0 and stats.busy_seconds == 0
        else:
            assert stats.busy_retries == 0 and drafter.calls < 30
        # the pauses are left out of the draft's and the verify's times, never out of the
        # wrong one (a drafter's pause beside a verify made the verify's negative)
        assert stats.draft_seconds >= 0 and stats.verify_seconds >= 0


def test_a_refused_prefill_changes_no_seeded_token(pair):
    """The drafter's prefill beside the first verify (a call of 0 tokens) is not waited for,
    but its refusal for want of room drafted nothing: the next round drafts as it would have
    (it was skipped, as after a failure, and the seeded request's tokens changed with load)."""
    target, draft = pair
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24)
    expected, _ = run(ModelDrafter(draft), ModelVerifier(target), PROMPT, seeded, 3)
    generation = Generation(Request("r", tuple(PROMPT), seeded, (), 30))
    drafter = BusyDrafter(ModelDrafter(draft), lambda n: n == 0)
    asyncio.run(decoded(drafter, ModelVerifier(target), generation, 3))
    assert drafter.asked[:2] == [0, 3] and generation.stats.busy_retries == 0
    assert generation.token_ids == expected


def test_a_first_call_refused_waits_too(pair):
    """Not yet begun: a stream has already answered 200, so the request waits as well."""
    params = SamplingParams(temperature=0, max_tokens=24)
    target, draft = pair
    expected, _ = run(ModelDrafter(draft), ModelVerifier(target), PROMPT, params, 3)
    generation = generate(pair, lambda v: Full(v, lambda n: n < 3), params, busy_wait_s=30,
                          request_id="d")
    assert generation.token_ids == expected and generation.stats.busy_retries == 3


def test_requests_beside_each_other_in_a_full_kv_pool_all_finish_exactly():
    """A real full pool: three requests of 100 positions each need 7 of the verifier's 13
    usable blocks (tests/unit/test_admission.py's pool), so they cannot all run at once;
    the ones refused mid-output wait, retry and finish as each would alone."""
    from tests.tiny import Batched
    target = tiny_llama(1)
    params = SamplingParams(temperature=0, max_tokens=40)
    prompts = [[(7 * i + j) % 60 + 1 for i in range(60)] for j in range(3)]
    alone = [run(ModelDrafter(noisy_copy(target, 0.05, seed=2)), ModelVerifier(target), p,
                 params, 3)[0] for p in prompts]

    async def main():
        verifier = Batched(ModelVerifier(target, engine="paged", kv_cache_tokens=208,
                                         max_cached_requests=2))
        drafter = Batched(ModelDrafter(noisy_copy(target, 0.05, seed=2)))
        requests = [Request(f"r{i}", tuple(p), params, (), busy_wait_s=30)
                    for i, p in enumerate(prompts)]
        return await asyncio.gather(*(decoded(drafter, verifier, Generation(r), 3)
                                      for r in requests))

    done = asyncio.run(main())
    assert [g.token_ids for g in done] == alone
    assert sum(g.stats.busy_retries for g in done) > 0


class Recording:
    """A pool that records each call's cache key (the placement key the router's clients
    route its first calls by) and answers through the real one."""

    def __init__(self, pool) -> None:
        self.pool, self.keys = pool, []

    async def score(self, call):
        self.keys.append(call.cache_key)
        return await self.pool.score(call)

    async def propose(self, call):
        self.keys.append(call.cache_key)
        return await self.pool.propose(call)

    async def release(self, request_id):
        await self.pool.release(request_id)


def test_every_pool_call_carries_the_requests_cache_key(pair):
    """The round loop hands each drafter and verifier call its request's cache_key (OpenAI's
    prompt_cache_key), which deployments.pool_handles places its first calls by."""
    target, draft = pair
    drafter = Recording(ModelDrafter(draft))
    verifier = Recording(ModelVerifier(target))
    generation = Generation(Request("r", tuple(PROMPT), SamplingParams(max_tokens=12),
                                    cache_key="\0conv-1"))
    asyncio.run(decoded(drafter, verifier, generation, 3))
    assert drafter.keys and verifier.keys
    assert set(drafter.keys) == set(verifier.keys) == {"\0conv-1"}
