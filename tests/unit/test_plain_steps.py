"""Rounds without a draft that ask the verifier for several tokens (verifier.steps): greedy
output equals the target's own, whatever the steps and the rounds with drafts between them;
the router's view of the verifier's prefix follows (no rebuilt cache); a stop id ends the
steps; bad steps are refused; the costs keep a pool call's overhead apart, and the
adaptive K's rate of K = 0 counts the steps."""

import asyncio
from dataclasses import replace

import pytest

from drafter.model import ModelDrafter
from engine.batch import UNFINISHED
from speculative.costs import CostModel, RoundCost
from speculative.driver import Generation
from speculative.fixed_k import FixedK
from speculative.policy import AdaptiveK, KBounds
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import SamplingParams
from speculative.state import Request, RequestState
from speculative.thinking import ThinkingBudget
from speculative.types import PoolUnavailable, PrefixSync, ScoreCall
from tests.tiny import Batched, decoded, noisy_copy, run, run_concurrently
from tests.unit.test_oracle import (  # noqa: F401 (fixtures)
    MAX_TOKENS,
    prompts,
    references,
    target,
)
from verifier.engine import ModelVerifier

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


class Alternating(FixedK):
    """K = 0, then 3, 0, 1, 0, 2 in turn: rounds of several steps between drafted ones."""

    CYCLE = (0, 3, 0, 1, 0, 2)

    def __init__(self) -> None:
        super().__init__(0)
        self.round = 0

    def num_speculative_tokens(self) -> int:
        return self.CYCLE[self.round % len(self.CYCLE)]

    def update(self, num_drafted, num_accepted, cost=None) -> None:
        self.round += 1


@pytest.mark.parametrize("steps", [1, 2, 3, 8])
def test_rounds_of_several_steps_equal_target_greedy(target, references, steps):
    verifier = ModelVerifier(target)
    for i, (prompt, expected) in enumerate(zip(prompts(), references)):
        out, state = run(ModelDrafter(target), verifier, prompt, GREEDY, 0, request_id=f"r{i}",
                         plain_steps=steps)
        assert out == expected, f"prompt {i}, {steps} steps"
        # the first token alone, then each round made `steps`
        assert state.stats.rounds == 1 + -(-(MAX_TOKENS - 1) // steps)
        assert state.stats.cache_misses == 0  # the router's view followed the verifier's
    assert len(verifier.sessions) == 0 and not verifier.steps.running


@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_steps_between_drafted_rounds_equal_target_greedy(target, references, pipelined):
    """Drafted rounds after rounds of steps: the drafter catches up on the tokens the
    verifier drew, and the verifier's prefix holds all of them but the last."""
    verifier = ModelVerifier(target)
    drafter = ModelDrafter(noisy_copy(target, 0.01, seed=1))
    accepted = 0
    for i, (prompt, expected) in enumerate(zip(prompts(), references)):
        out, state = run(drafter, verifier, prompt, GREEDY, 0, request_id=f"r{i}",
                         pipelined=pipelined, policy=Alternating(), plain_steps=4)
        assert out == expected, f"prompt {i}"
        assert state.stats.cache_misses == 0
        accepted += state.stats.num_accepted_tokens
    assert accepted > 0


def test_batched_rounds_of_steps_equal_target_greedy(target, references):
    """Requests of several steps share the verifier's batches with each other's steps."""
    verifier = Batched(ModelVerifier(target), max_batch_size=4)
    outputs = run_concurrently(ModelDrafter(target), verifier, prompts(), GREEDY, 0,
                               plain_steps=5)
    assert outputs == references
    assert max(verifier.batch_sizes) > 1


def test_a_stop_id_ends_the_steps(target, references):
    prompt, expected = prompts()[2], references[2]
    stop = expected[5]
    verifier = ModelVerifier(target)
    out, state = run(ModelDrafter(target), verifier, prompt, GREEDY, 0, stop=(stop,),
                     plain_steps=4)
    assert out == expected[:expected.index(stop) + 1] and state.finish_reason == "stop"
    # the verifier stopped at the stop id: its last call drew no token beyond it
    assert state.stats.rounds == 1 + -(-expected.index(stop) // 4)


def test_a_call_of_several_steps_draws_nothing_past_its_stop_id(target, references):
    """The verifier's own steps end at a stop id, however many more the call allows (the
    router's cut keeps the output, and the test above its rounds, the same either way:
    only the answer shows the forwards drawn for nothing)."""
    prompt, expected = prompts()[2], references[2]
    stop = expected[5]
    end = expected.index(stop)
    scores = ModelVerifier(target).score_now(ScoreCall(
        "s", PrefixSync(0, EMPTY_PREFIX_HASH, tuple(prompt)), (), GREEDY, steps=end + 4,
        stop_token_ids=(stop,)))
    assert [scores.target_token_ids[0], *scores.continued_token_ids] == expected[:end + 1]


def call(steps: int, **fields) -> ScoreCall:
    fields = {"draft_token_ids": (), "sampling": GREEDY, **fields}
    return ScoreCall("bad", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3)), steps=steps, **fields)


@pytest.mark.parametrize("bad, message", [
    (call(0), "steps must be in"), (call(65), "steps must be in"),
    (call(2, draft_token_ids=(4,)), "scores no draft"),
    (call(2, sampling=SamplingParams(temperature=0, logprobs=2)), "scores no draft"),
    (call(2, return_bonus_probs=True), "scores no draft"),
    (call(2, stop_token_ids=(64,)), "stop token ids out of range"),
    (call(2, stop_token_ids=(-1,)), "stop token ids out of range"),
    (call(2, draft_parents=()), "scores no draft"),
])
def test_bad_steps_are_refused(target, bad, message):
    verifier = ModelVerifier(target)
    with pytest.raises(ValueError, match=message):
        verifier.score_now(bad)
    assert len(verifier.sessions) == 0  # refused before the cache was touched


def test_a_released_request_forgets_its_steps(target):
    """A request that ends between two steps (its client gone) leaves nothing behind, and a
    new call of a request replaces a call that never finished."""
    verifier = ModelVerifier(target)
    first = call(4)
    assert verifier.score_batch([first]) == [UNFINISHED]  # its first step of four
    assert "bad" in verifier.steps.running
    asyncio.run(verifier.release("bad"))
    assert not verifier.steps.running and len(verifier.sessions) == 0
    assert verifier.score_batch([first]) == [UNFINISHED]
    scores = verifier.score_now(call(3))  # the request's next call: from its own start
    assert len(scores.continued_token_ids) == 2 and not verifier.steps.running


def test_calls_of_several_steps_end_together(target):
    """A call of several steps that joins a batch in which another's steps end ends with
    it (its tokens so far), so that the two come back in one group and their next calls
    share batches (the law tests check each step's tokens)."""
    verifier = ModelVerifier(target)
    early = ScoreCall("early", PrefixSync(0, EMPTY_PREFIX_HASH, (1, 2, 3)), (), GREEDY,
                      steps=4)
    late = ScoreCall("late", PrefixSync(0, EMPTY_PREFIX_HASH, (4, 5, 6)), (), GREEDY,
                     steps=4)
    assert verifier.score_batch([early]) == [UNFINISHED]
    assert verifier.score_batch([early]) == [UNFINISHED]
    assert verifier.score_batch([early, late]) == [UNFINISHED] * 2
    first, second = verifier.score_batch([early, late])  # early's fourth step, late's second
    assert len(first.continued_token_ids) == 3 and len(second.continued_token_ids) == 1
    assert not verifier.steps.running  # (a call alone runs all its steps: the tests above)


def alone_and_cut_short(target, drafter, k: int, pipelined: bool = False):
    """A seeded sampled request's (tokens, rounds) alone, and beside a greedy one it started
    three turns after, on one batched verifier (cohort_ends ends its calls of steps early)."""
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24)

    async def one(verifier, request_id, prompt, params, turns=0):
        for _ in range(turns):
            await asyncio.sleep(0)
        request = Request(request_id, tuple(prompt), params, (), plain_steps=4)
        generation = await decoded(drafter, verifier, Generation(request), k, pipelined)
        return generation.token_ids, generation.state.stats.rounds

    async def both():
        verifier = Batched(ModelVerifier(target))
        return await asyncio.gather(one(verifier, "s", [1, 2, 3], seeded, turns=3),
                                    one(verifier, "o", [5, 6, 7], GREEDY))

    alone = asyncio.run(one(Batched(ModelVerifier(target)), "s", [1, 2, 3], seeded))
    return alone, asyncio.run(both())[0]


def test_a_seeded_request_repeats_whatever_ends_its_steps(target):
    """A seeded sampled request of K = 0 whose calls of steps end with another request's
    draws the tokens it draws alone: its next call goes on with the seeds of the steps it
    was cut from (round_steps.round_seed)."""
    (alone, rounds), (together, cut_rounds) = alone_and_cut_short(target, ModelDrafter(target),
                                                                   0)
    assert cut_rounds > rounds  # its steps were cut short
    assert together == alone


class RefusingEveryOther(ModelDrafter):
    """A model drafter that refuses every other call: rounds with a draft and without one."""

    calls = 0

    async def propose(self, call):
        self.calls += 1
        if self.calls % 2 == 0:
            raise PoolUnavailable("drafter: OUT_OF_RANGE: injected")
        return await super().propose(call)


@pytest.mark.parametrize("k, drafter", [(0, ModelDrafter), (4, RefusingEveryOther)])
def test_a_seeded_request_draws_the_same_tokens_with_logprobs_asked(target, k, drafter):
    """A call with logprobs runs one step: a seeded request asking them goes on with the
    seeds of the steps it would have asked without them (round_steps.seed_steps), so asking
    logprobs changes none of its tokens, as vLLM's (K = 4: the rounds without a draft among
    its sequential rounds too)."""
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24)
    outs = [run(drafter(target), ModelVerifier(target), [1, 2, 3], params, k,
                plain_steps=4)[0] for params in (seeded, replace(seeded, logprobs=1))]
    assert outs[0] == outs[1]


class Refusing:
    """A drafter that refuses every call, as a pool the prompt outgrows does (OUT_OF_RANGE)."""

    async def propose(self, call):
        raise PoolUnavailable("drafter: OUT_OF_RANGE: injected")

    async def release(self, request_id):
        pass


@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_a_seeded_request_whose_drafter_fails_repeats_whatever_ends_its_steps(target,
                                                                                pipelined):
    """As above at K = 4 with a drafter that refuses every call: the rounds run the target
    alone, of several steps, and the round that goes on with a cut call's steps draws no
    draft seed (a round alone never made), so the tokens are those drawn alone."""
    (alone, rounds), (together, cut_rounds) = alone_and_cut_short(target, Refusing(), 4,
                                                                   pipelined)
    assert together == alone
    assert cut_rounds > rounds  # its steps were cut short


def test_the_steps_of_a_request_never_released_go_with_its_session(target):
    """A request that ends between two steps and whose release never comes (its router
    gone): its session goes by the store's bound (or its TTL), and the progress of its
    steps with it at the next batch (it stayed for good: nothing else dropped it)."""
    verifier = ModelVerifier(target, max_cached_requests=1)
    assert verifier.score_batch([call(4)]) == [UNFINISHED]  # its first step of four
    for other in ("a", "b"):  # a's call takes the store's one place, b's batch comes next
        verifier.score_now(ScoreCall(other, PrefixSync(0, EMPTY_PREFIX_HASH, (5, 6)), (),
                                     GREEDY))
    assert "bad" not in verifier.sessions and not verifier.steps.running


def test_rounds_of_several_steps_leave_a_pool_calls_overhead_alone():
    """A round of several steps teaches the verify line one forward's time, and its time
    beyond the forwards (which includes its waits between steps) is not taken for the
    overhead of a pool call, which every kind of round pays."""
    costs = CostModel()
    for _ in range(20):  # a plain round: a 10 ms forward, 4 ms beside it
        costs.observe(RoundCost(1, 0.010, 0, 0.0, 0.004, kind="plain"))
    for _ in range(40):  # rounds of 4 steps: 8 ms forwards, 9 ms beyond them
        costs.observe(RoundCost(1, 0.008, 0, 0.0, 0.009, kind="plain", steps=4))
    assert costs.overhead_seconds(0) == pytest.approx(0.004)
    assert costs.forward_seconds(1) == pytest.approx(0.008)


def test_the_adaptive_rate_of_no_draft_counts_the_steps():
    """rate(0) = M / (M t + h): M forwards of t, the round's overhead h once; so under batch
    load, where K = 0 may be chosen, the steps make it the choice sooner."""
    costs = CostModel()
    for _ in range(20):  # a plain round at batch 16: a 10 ms forward, 4 ms beside it
        costs.observe(RoundCost(1, 0.010, 0, 0.0, 0.004, batch_size=16, batch_tokens=16,
                                kind="plain"))
    policies = {steps: AdaptiveK(KBounds(0, 8), costs, False, True, load=16.0,
                                 plain_steps=steps) for steps in (1, 4)}
    assert policies[1].rate(0) == pytest.approx(1 / 0.014)
    assert policies[4].rate(0) == pytest.approx(4 / (4 * 0.010 + 0.004))


def test_alone_the_steps_may_turn_drafting_off_once_the_acceptance_is_measured():
    """With several steps a round without a draft rivals drafting even alone: a request
    whose own acceptance is measured (16 positions) turns to K = 0 where its steps beat the
    best K by the margin, and explores K = 1 from there; with one step, or before its
    acceptance is measured, it drafts."""
    costs = CostModel()
    for _ in range(40):  # about the demo pair served alone: t(1) 3.5 ms, a draft 1.5 ms
        costs.observe(RoundCost(1, 0.0035, 0, 0.0, 0.002, kind="plain"))
        for k in (1, 2, 3, 4):
            costs.observe(RoundCost(k + 1, (3.5 + 0.3 * k) / 1000, k, (0.5 + 1.5 * k) / 1000,
                                    0.003, kind="sequential"))

    def alone(steps: int, alpha: float, tested: int) -> AdaptiveK:
        policy = AdaptiveK(KBounds(0, 8), costs, False, False, plain_steps=steps)
        policy.own.accepted, policy.own.tested = alpha * 100, 100.0
        policy.positions_tested = tested
        return policy

    assert alone(4, 0.5, 16).choose(None) == 0  # 250 tokens/s against 170 drafting
    assert alone(4, 0.5, 15).choose(None) >= 1  # its acceptance not measured yet
    assert alone(1, 0.5, 16).choose(None) >= 1  # one step: 182 against 170, within margin
    assert alone(4, 0.85, 16).choose(None) >= 3  # a good draft still pays: 261 against 250
    assert alone(4, 0.5, 16).explore(0) == 1


@pytest.mark.parametrize("newer_first", [False, True])
def test_a_newer_call_of_the_request_in_the_batch_ends_the_steps_of_the_one_before(
        target, references, newer_first):
    """A call of four steps between two of them, and another call of its request in the
    same batch (a retry): the first answers the steps it ran, each the target's own (its
    progress was dropped before, and its next step taken for its first: tokens lost; or,
    behind the newer call in the batch, it restarted its steps)."""
    prompt, expected = prompts()[3], references[3]
    verifier = ModelVerifier(target)
    start = PrefixSync(0, EMPTY_PREFIX_HASH, tuple(prompt))
    first = verifier.score_now(ScoreCall("r", start, (), GREEDY)).target_token_ids[0]
    committed = PrefixSync(0, EMPTY_PREFIX_HASH, (*prompt, first))
    stepped = ScoreCall("r", committed, (), GREEDY, steps=4)
    assert verifier.score_batch([stepped]) == [UNFINISHED]  # its first step run
    batch = [stepped, ScoreCall("r", committed, (), GREEDY)]
    answers = verifier.score_batch(batch[::-1] if newer_first else batch)
    answer, retried = answers[::-1] if newer_first else answers
    tokens = [first, answer.target_token_ids[0], *answer.continued_token_ids]
    assert tokens == expected[:len(tokens)] and len(tokens) == 3  # its two steps
    assert retried.target_token_ids == (expected[1],)
    assert not verifier.steps.running


def test_no_two_draws_of_a_requests_calls_share_a_cpu_generators_stream():
    """torch's CPU generator keys its stream by a seed's low 32 bits alone, so the seeds of a
    request's calls, and of their steps, take distinct low bits: drawn at random, two of a
    long request's calls shared a stream within ~2**16 calls (calls 65,487 and 92,022 of
    seed 0's request drew the same tokens)."""
    import torch

    from speculative.round_steps import draw_seed
    from speculative.options import MAX_PLAIN_STEPS
    from speculative.state import Request, RequestState
    from verifier.steps import step_seed

    low = (1 << 32) - 1
    same = [torch.rand(4, generator=torch.Generator().manual_seed(s)) for s in (5, 5 + 2**40)]
    assert torch.equal(*same)  # the premise: the high bits change nothing on a CPU
    state = RequestState(Request("r", (1,), SamplingParams(seed=0, max_tokens=10**9)))
    seeds = [draw_seed(state) for _ in range(100_000)]
    assert len({seed & low for seed in seeds}) == len(seeds)
    assert len({seed >> 32 for seed in seeds}) > 99_000  # CUDA's bits still drawn
    stepped = [step_seed(seed, step) & low for seed in seeds[:2_000]
               for step in range(MAX_PLAIN_STEPS)]
    assert len(set(stepped)) == len(stepped) and step_seed(seeds[0], 0) == seeds[0]


def test_a_call_of_steps_makes_no_more_than_the_context_max_tokens_and_budget_allow():
    """steps_room: a call makes its tokens and feeds all but the last, so it may make one
    more than the context has room for (committed + fed within context_limit); within
    max_tokens; and no more than the free reasoning tokens + 1 (the forced end id's place)."""
    room = RequestState(Request("r", (5,) * 6, replace(GREEDY, max_tokens=100),
                                context_limit=10))
    assert room.steps_room() == 5  # 4 fed: the context's 10 tokens, the 5th made
    room.commit((2, 2))
    assert room.steps_room() == 3
    assert RequestState(Request("r", (5,) * 6, replace(GREEDY, max_tokens=2),
                                context_limit=10)).steps_room() == 2
    budget = ThinkingBudget(3, (1,), (8,))  # the prompt opened the reasoning: 3 tokens free
    thinking = RequestState(Request("r", (5, 1), replace(GREEDY, max_tokens=100,
                                                         thinking_budget=budget)))
    assert thinking.thinking.free() == 3 and thinking.steps_room() == 4
