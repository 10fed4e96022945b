"""The drafter is optional: a draft that fails makes its round a target-alone round, the
request goes on exact, and speculation comes back when the drafter answers again."""

import random

import pytest

from deployments import health
from deployments.health import FailureLog
from deployments.pool_handles import DRAFT_FAILURES_LOGGED_EVERY_S
from drafter.model import ModelDrafter
from speculative.busy import MAX_SKIPPED_DRAFTS, DraftBackoff
from speculative.fixed_k import FixedK
from speculative.sampling import SamplingParams
from speculative.types import PoolUnavailable, StaleBase
from tests.tiny import hf_greedy, noisy_copy, run, tiny_llama
from verifier.engine import ModelVerifier

PROMPT = [3, 1, 4, 1, 5]


class Flaky:
    """A drafter that fails the calls `fails(n)` picks (n counts calls from 0): before doing
    anything, or after the real drafter has advanced its cache ("after": the router then
    believes the drafter is behind it, and the next call must rebuild)."""

    def __init__(self, drafter, fails, after: bool = False) -> None:
        self.drafter, self.fails, self.after = drafter, fails, after
        self.calls = 0
        self.released: list[str] = []

    async def propose(self, call):
        n, self.calls = self.calls, self.calls + 1
        if self.fails(n):
            if self.after:
                await self.drafter.propose(call)
            raise PoolUnavailable("drafter: UNAVAILABLE: injected")
        return await self.drafter.propose(call)

    async def release(self, request_id):
        self.released.append(request_id)
        await self.drafter.release(request_id)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(5)
    return target, noisy_copy(target, 0.2, seed=6)


def test_drafter_failures_are_logged_at_most_once_a_minute_with_the_count(monkeypatch):
    """docs/operations.md: a failing drafter is said in the router's log at most once a
    minute, with the count since."""
    assert DRAFT_FAILURES_LOGGED_EVERY_S == 60.0
    said = []
    monkeypatch.setattr(health.log, "warning", lambda message, *args: said.append(args))
    now = [0.0]
    failures = FailureLog("drafter", DRAFT_FAILURES_LOGGED_EVERY_S, clock=lambda: now[0])
    for at in (0.0, 1.0, 30.0, 59.0, 60.0):
        now[0] = at
        failures.failure(PoolUnavailable("down"))
    assert [count for _, count, _ in said] == [1, 4]


def test_backoff_skips_more_rounds_after_each_failure_and_resets():
    backoff = DraftBackoff()
    pattern = []
    for _ in range(7):
        backoff.failed()
        skipped = 0
        while not backoff.may_draft():
            skipped += 1
        pattern.append(skipped)
    assert pattern == [1, 2, 4, 8, 16, 32, MAX_SKIPPED_DRAFTS]
    backoff.succeeded()
    backoff.failed()
    assert not backoff.may_draft() and backoff.may_draft()


@pytest.mark.parametrize("after", [False, True], ids=["before", "after-advancing"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_greedy_output_is_the_targets_whatever_fails(pair, after, pipelined):
    target, draft = pair
    rng = random.Random(7)
    failing = {n for n in range(400) if rng.random() < 0.4}
    drafter = Flaky(ModelDrafter(draft), failing.__contains__, after)
    params = SamplingParams(temperature=0, max_tokens=40)
    out, state = run(drafter, ModelVerifier(target), PROMPT, params, k=3,
                     pipelined=pipelined)
    assert out == hf_greedy(target, PROMPT, 40)
    stats = state.stats
    assert stats.draft_fallback_rounds > 0 and stats.num_drafts > 0
    assert drafter.released == ["r"]  # released even though calls failed
    if after:
        assert stats.cache_misses > 0  # the drafter had moved on: it rebuilt, exactly


def test_a_dead_drafter_costs_a_few_calls_and_speculation_comes_back(pair):
    target, draft = pair
    # down for the first 5 calls, then up
    drafter = Flaky(ModelDrafter(draft), lambda n: n < 5)
    params = SamplingParams(temperature=0, max_tokens=120)
    out, state = run(drafter, ModelVerifier(target), PROMPT, params, k=2)
    assert out == hf_greedy(target, PROMPT, 120)
    stats = state.stats
    # 5 failures skip 1 + 2 + 4 + 8 + 16 rounds: 36 rounds by the target alone, less the
    # first, which is the target's anyway (its failed call was the prefill beside it)
    assert stats.draft_fallback_rounds == 4 + 1 + 2 + 4 + 8 + 16
    assert stats.num_drafts > 0 and drafter.calls > 5


def test_a_drafter_that_never_answers_still_gives_the_targets_output(pair):
    target, draft = pair
    drafter = Flaky(ModelDrafter(draft), lambda n: True)
    out, state = run(drafter, ModelVerifier(target), PROMPT,
                     SamplingParams(temperature=0, max_tokens=30), k=4)
    assert out == hf_greedy(target, PROMPT, 30)
    assert state.stats.num_drafts == 0 and state.stats.rounds == 30
    assert drafter.calls <= 5  # backoff: 1 + 2 + 4 + 8 + 16 rounds cover 30 after 5 calls


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_a_drafter_that_asks_for_the_whole_prefix_it_was_sent_fails_its_draft_only(pair,
                                                                                  pipelined):
    """A drafter that answers REBUILD even to a call carrying the whole prefix (a broken
    pool) costs the round its draft, as any failed draft does, not the request (the
    router's second StaleBase ended it)."""
    target, draft = pair

    class Rebuilding(Flaky):
        stale = False  # the last call was answered REBUILD: its resend gets the same

        async def propose(self, call):
            self.calls += 1
            if self.calls % 4 == 0 or self.stale:
                self.stale = not self.stale
                self.resends += call.sync.known_len == 0
                raise StaleBase("injected: asks for the full prefix")
            return await self.drafter.propose(call)

    drafter = Rebuilding(ModelDrafter(draft), None)
    drafter.resends = 0
    out, state = run(drafter, ModelVerifier(target), PROMPT,
                     SamplingParams(temperature=0, max_tokens=40), k=3, pipelined=pipelined)
    assert out == hf_greedy(target, PROMPT, 40)
    assert drafter.resends > 0 and state.stats.cache_misses == drafter.resends
    assert state.stats.draft_fallback_rounds > 0 and state.stats.num_drafts > 0
    assert drafter.released == ["r"]


def test_a_round_whose_draft_beside_the_verify_failed_is_no_cost_for_the_k_policy(pair):
    """Its time holds the failed call's wait (a missed deadline: up to the router's
    draft_timeout_s), which says nothing about what a K costs: the policy is not given it,
    as it is not given a round whose own draft failed or was skipped (draft_fallback_rounds).
    Pipelined rounds that restart fresh: every call runs beside a verify."""
    target, draft = pair

    class Recording(FixedK):
        costs = []

        def update(self, num_drafted, num_accepted, cost=None):
            self.costs.append(cost)

    failed = {3, 6}
    drafter = Flaky(ModelDrafter(draft), failed.__contains__)
    out, state = run(drafter, ModelVerifier(target), PROMPT,
                     SamplingParams(temperature=0, max_tokens=40), k=3, pipelined=True,
                     policy=Recording(3))
    assert out == hf_greedy(target, PROMPT, 40)
    stats = state.stats
    assert len(Recording.costs) == stats.rounds - stats.draft_fallback_rounds - len(failed)


def short_draft():
    """A draft model whose context (24 positions) ends before the target's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=24,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()


def test_a_draft_with_a_shorter_context_drafts_nothing_past_it():
    """A draft model whose context ends before the target's drafts nothing once the prefix
    passes it (the target runs those rounds alone): its KV pool, sized to its own context on
    the CPU's default attention (regions), refused the call's feed instead (KVCacheTooSmall:
    a failed draft each round served, a failed request in-process)."""
    target, short = tiny_llama(0), short_draft()
    prompt = list(range(1, 18))
    params = SamplingParams(temperature=0.0, max_tokens=16)
    ids, state = run(ModelDrafter(short), ModelVerifier(target), prompt, params, k=3)
    assert ids == hf_greedy(target, prompt, 16)
    assert state.stats.num_draft_tokens > 0 and state.stats.draft_fallback_rounds == 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_full_draft_context_ends_the_drafter_calls(pipelined):
    """Once the draft model's context is full, the drafter says so (context_full) and the
    request's later rounds are the target's alone, of plain_steps tokens each, with no
    call to the drafter: a pipelined request went on asking for a fresh draft beside each
    verify, so each of its rounds made one token, and a sequential one paid a drafter call
    for nothing every round."""
    target, short = tiny_llama(0), short_draft()
    prompt = list(range(1, 18))
    full = []

    class Counting:
        def __init__(self, drafter):
            self.drafter = drafter

        async def propose(self, call):
            block = await self.drafter.propose(call)
            full.append(block.context_full)
            return block

        async def release(self, request_id):
            await self.drafter.release(request_id)

    params = SamplingParams(temperature=0.0, max_tokens=40)
    ids, state = run(Counting(ModelDrafter(short)), ModelVerifier(target), prompt, params, k=3,
                     pipelined=pipelined, plain_steps=4)
    assert ids == hf_greedy(target, prompt, 40)
    assert full.count(True) == 1 and full[-1]  # said once; then no call
    assert state.stats.num_draft_tokens > 0
    # past the draft's context (24 positions), the 16 or more tokens left came 4 a round
    assert state.stats.plain_step_tokens >= 12


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined-drafts-first"])
def test_a_seeded_request_past_the_draft_context_does_not_depend_on_a_refused_prefill(
        pipelined):
    """The drafter's prefill beside a first verify (a call of 0 tokens) is not waited for
    when its pool is busy; had its word that the draft's context is full been taken, a
    seeded request whose prefill the pool refused (load) would draw a draft seed its
    unrefused twin does not, and sample other tokens."""
    from speculative.types import PoolBusy
    from tests.tiny import DraftsFirst

    target, short = tiny_llama(0), short_draft()
    prompt = list(range(1, 30))  # past the draft's 24 positions

    class BusyPrefill(Flaky):
        async def propose(self, call):
            if self.fails(call.num_speculative_tokens):
                raise PoolBusy("injected: no room now")
            return await self.drafter.propose(call)

    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    outputs = [run(BusyPrefill(ModelDrafter(short), lambda k, busy=busy: busy and k == 0),
                   ModelVerifier(target), prompt, params, k=3, pipelined=pipelined,
                   policy=DraftsFirst(3))[0] for busy in (False, True)]
    assert outputs[0] == outputs[1]
