"""The K policies: the adaptive K follows acceptance and cost the way the formula says."""

import pytest

from speculative.costs import ROOM_CHECK_EVERY, CostModel, Curve, RoundCost, expected_tokens
from speculative.fixed_k import FixedK
from speculative.frontend import RequestFrontEnd
from speculative.options import SpeculationDefaults
from speculative.policy import AdaptiveK, KBounds
from speculative.sampling import SamplingParams


def measured(verify_ms, draft_ms_per_token: float, overhead_ms: float = 0.0) -> CostModel:
    """A cost model that has seen verifies of each n in verify_ms (ms by n) many times."""
    costs = CostModel()
    for _ in range(200):
        for n, ms in verify_ms.items():
            costs.observe(RoundCost(n, ms / 1000, n - 1, (n - 1) * draft_ms_per_token / 1000,
                                    overhead_ms / 1000))
    return costs


def steady(policy: AdaptiveK, accept_first: int, rounds: int = 60) -> int:
    """Run the policy over rounds that accept the first `accept_first` tokens; its last K."""
    for _ in range(rounds):
        k = policy.num_speculative_tokens()
        policy.update(k, min(k, accept_first))
    return policy.chosen  # what it would run, not a neighbour it explores now


def test_fixed_k_never_moves_and_refuses_negative_k():
    policy = FixedK(3)
    policy.update(3, 0)
    assert policy.num_speculative_tokens() == 3
    with pytest.raises(ValueError):
        FixedK(-1)


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        KBounds(5, 2)
    with pytest.raises(ValueError):
        KBounds(-1, 2)


def test_expected_tokens_matches_the_closed_form():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_the_cost_model_learns_a_linear_verify_curve():
    costs = measured({2: 20.0, 5: 50.0}, 1.0)
    assert costs.forward_seconds(9) == pytest.approx(0.090, rel=1e-6)
    assert costs.draft_seconds(1) == pytest.approx(0.001)


def test_a_draft_that_is_always_accepted_on_free_verification_gets_the_largest_k():
    costs = measured({2: 10.0, 9: 10.0}, 0.1)
    policy = AdaptiveK(KBounds(1, 8), costs, pipelined=False, greedy=True)
    assert steady(policy, accept_first=99) == 8


def test_a_draft_that_is_never_accepted_gets_the_smallest_k():
    costs = measured({2: 10.0, 9: 10.0}, 2.0)
    policy = AdaptiveK(KBounds(1, 8), costs, pipelined=False, greedy=True)
    assert steady(policy, accept_first=0) == 1
    plain = AdaptiveK(KBounds(0, 8), costs, pipelined=False, greedy=True)
    ks = []
    for _ in range(80):
        ks.append(plain.num_speculative_tokens())
        plain.update(ks[-1], 0)
    # alone in its batches, K = 0 only once this request's draft is measured useless
    # (16 positions tested), then plain decoding with a probe of K = 1 every 8 rounds
    assert 0 not in ks[:16] and ks[40:].count(0) > 30 and 1 in ks[40:]


def test_k_follows_a_request_whose_predictability_changes():
    costs = measured({2: 10.0, 5: 12.0, 9: 16.0}, 1.0)
    policy = AdaptiveK(KBounds(1, 8), costs, pipelined=False, greedy=True)
    high = steady(policy, accept_first=99)
    low = steady(policy, accept_first=0)
    assert high >= 6 and low == 1


def test_pipelined_the_best_k_is_where_the_draft_costs_about_a_verify():
    # t(n) flat at 10 ms, 2.5 ms a draft token (c = 0.25), α = 0.95: sequentially every extra
    # token still pays (the peak is at the bound); pipelined, a draft longer than the verify
    # it hides behind is on the critical path, so the best K is where K c ≈ 1
    costs = measured({2: 10.0, 9: 10.0}, 2.5)
    sequential = AdaptiveK(KBounds(1, 8), costs, pipelined=False, greedy=True)
    pipelined = AdaptiveK(KBounds(1, 8), costs, pipelined=True, greedy=True)
    for policy in (sequential, pipelined):
        policy.own.accepted, policy.own.tested = 0.95 * 1e6, 1e6  # α = 0.95, held
    assert sequential.choose() == 8
    assert pipelined.choose() in (3, 4)
    assert all(pipelined.rate(k) > sequential.rate(k) for k in range(1, 9))


def test_the_choice_is_the_argmax_of_the_rate():
    costs = measured({2: 10.0, 5: 25.0, 9: 45.0}, 1.0, overhead_ms=2.0)
    policy = AdaptiveK(KBounds(1, 8), costs, pipelined=True, greedy=False)
    rates = {k: policy.rate(k) for k in range(1, 9)}
    assert policy.choose() == max(rates, key=rates.get)


@pytest.mark.parametrize("logprobs", [None, 2], ids=["plain", "logprobs"])
def test_tokens_per_round_count_the_pre_drafted_token_at_the_bonus_position(logprobs):
    # a self-draft is always accepted. Sampled and pipelined, a round tests the pre-draft's
    # y1 at its bonus position against p(K+1) and keeps it: K + 1 tokens a round. With
    # logprobs the verifier cannot return p(K+1) (y1's logprob is unknown to it), so a round
    # hands its bonus position to the pre-draft: K tokens a round
    from drafter.model import ModelDrafter
    from speculative.sampling import SamplingParams
    from tests.tiny import run, tiny_llama
    from verifier.engine import ModelVerifier

    target = tiny_llama(3)
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=25, logprobs=logprobs)
    out, state = run(ModelDrafter(target), ModelVerifier(target), [1, 2, 3], params, 2,
                     pipelined=True)
    stats = state.stats
    assert stats.num_emitted_tokens == len(out) == 25
    assert stats.pipelined_rounds > 5 and stats.num_accepted_tokens == stats.num_draft_tokens
    if logprobs is None:  # 3 a round; the first verifies none beside the first draft
        assert stats.mean_acceptance_length > 2.5 and stats.rounds_by_k[0] == 1
    else:
        assert stats.mean_acceptance_length < 2.5  # 2 a pipelined round, 3 for the first


def loaded(batch_size: int, per_token_ms: float = 2.0, fixed_ms: float = 20.0) -> CostModel:
    """A verifier whose forward costs fixed + per_token x the tokens its batch feeds, seen
    serving batches of `batch_size` rounds with K from 0 to 8."""
    costs = CostModel()
    for _ in range(50):
        for k in range(9):
            tokens = batch_size * (k + 1)
            costs.observe(RoundCost(k + 1, (fixed_ms + per_token_ms * tokens) / 1000, k,
                                    k * 0.5 / 1000, 0.0, batch_size, tokens))
    return costs


def at_load(costs: CostModel, load: float, alpha: float = 0.65) -> AdaptiveK:
    policy = AdaptiveK(KBounds(0, 8), costs, pipelined=False, greedy=True)
    policy.own.accepted, policy.own.tested, policy.load = alpha * 100, 100.0, load
    return policy


def test_k_shrinks_as_the_verifier_batch_grows_turns_off_and_comes_back():
    """α = 0.65. Alone, the forward is mostly its fixed cost and a long K pays; in a batch of
    many, each drafted token costs batch_size tokens of forward and speculation stops."""
    ks = {b: at_load(loaded(b), b).choose(None) for b in (1, 4, 16, 64)}
    assert ks[1] > ks[4] > ks[16] >= 0 and ks[1] >= 3
    assert ks[64] == 0
    costs = loaded(64)  # the same router's costs; a request alone in its batches drafts
    assert at_load(costs, 1.0).choose(0) >= 3


def test_k_zero_is_entered_and_left_with_a_margin():
    costs = loaded(64)
    policy = at_load(costs, 64)
    plain = policy.rate(0)
    best = max(range(1, 9), key=policy.rate)
    assert plain > 1.1 * policy.rate(best) and policy.choose(best) == 0
    # between the margins the policy keeps what it runs
    policy.margin = plain / policy.rate(best)  # K = 0 wins by exactly the margin: not more
    assert policy.choose(best) == best and policy.choose(0) == 0


def test_a_round_without_a_draft_is_charged_one_hop_not_two():
    """Pools' compute is cheap beside the hops: a draft call's hop costs more than the draft
    saves. Alone in its batches a request still drafts (K = 0 cannot be entered from costs
    that may be cold); under batch load K = 0 wins once that is known."""
    costs = CostModel()
    for _ in range(100):
        for k in (1, 2, 4):
            costs.observe(RoundCost(k + 1, (5 + 0.5 * k) / 1000, k, k * 1.5 / 1000, 6 / 1000,
                                    draft_hop_seconds=3 / 1000))
    assert costs.overhead_seconds(0) == pytest.approx(0.003)
    assert at_load(costs, 1.0, alpha=0.4).choose(None) >= 1
    assert at_load(costs, 2.0, alpha=0.4).choose(None) == 0
    for _ in range(40):
        costs.observe(RoundCost(1, 5 / 1000, 0, 0.0, 20 / 1000))  # measured: use that instead
    assert costs.overhead_seconds(0) > 0.003


def test_cold_and_incomparable_rounds_are_not_costs():
    costs = CostModel()
    costs.observe(RoundCost(5, 2.0, 4, 1.0, 1.0, comparable=False))  # a first round
    assert not costs.verify and not costs.drafts and not costs.overhead
    costs.observe(RoundCost(2, 0.01, 1, 0.2, 0.001, draft_catch_up=9))  # a catch-up draft
    assert costs.verify and not costs.drafts
    for _ in range(5):
        costs.observe(RoundCost(2, 0.01, 1, 0.001, 0.001))
    costs.observe(RoundCost(2, 0.2, 1, 0.02, 0.02))  # one stray round 20x too slow
    assert costs.forward_seconds(2) == pytest.approx(0.01)
    assert costs.draft_seconds(1) == pytest.approx(0.001)
    assert costs.overhead_seconds(1) == pytest.approx(0.001)


@pytest.mark.parametrize("initial", [0, 2])
def test_a_requests_first_round_is_no_cost_whatever_its_k(initial):
    """The first round's verify is the prompt's prefill, with or without a draft beside it
    (an adaptive K may start at 0 under load): the verify line never learns it."""
    from speculative.types import BatchLoad, DraftBlock, TargetScores
    from tests.tiny import run

    class Prefilling:
        calls = 0

        async def propose(self, call):
            return DraftBlock((1,) * call.num_speculative_tokens, None, compute_seconds=0.001)

        async def score(self, call):
            self.calls += 1
            n = len(call.draft_token_ids) + 1
            return TargetScores(target_token_ids=(1,) * n, load=BatchLoad(1, n),
                                compute_seconds=0.5 if self.calls == 1 else 0.01)

        async def release(self, request_id):
            pass

    costs, pair = CostModel(), Prefilling()
    policy = AdaptiveK(KBounds(0, 8, initial=initial), costs, pipelined=False, greedy=True)
    run(pair, pair, [5, 6, 7], SamplingParams(temperature=0, max_tokens=6), "auto",
        policy=policy)
    learnt = [v for point in costs.verify.points.values() for v in point.values]
    assert learnt and max(learnt) < 0.1  # the prefill's 0.5 s left out


def test_the_verify_line_weights_sizes_by_how_often_they_are_seen():
    costs = CostModel()
    for _ in range(40):
        costs.observe(RoundCost(1, 0.0072, 0, 0.0, 0.002))
        for n in (4, 5, 6):
            costs.observe(RoundCost(n, (7.2 + 0.7 * (n - 1)) / 1000, n - 1, 0.001, 0.004))
    costs.observe(RoundCost(64, 0.5, 0, 0.0, 0.002))  # a one-off: a long prompt's rebuild
    assert costs.forward_seconds(1) == pytest.approx(0.0072)  # the measured t(1)
    # the one-off's slope weighs once against the common sizes' 39 (decayed counts)
    assert costs.forward_seconds(5) == pytest.approx(0.0072 + 4 * 0.0007, rel=0.1)


def test_the_sizes_weigh_as_counts_decayed_on_every_add_across_rescales():
    """Curve weighs each add 1 / (1 - decay) times the one before instead of decaying every
    count on every add: the same ratios, through the rescale that keeps them finite; and a
    fit is kept until the next add."""
    curve, decayed = Curve(), {}
    for i in range(13000):  # past 1e100 (about 11,400 adds at decay 0.02): rescaled
        size = (1, 2, 2, 5, 9)[i % 5] if i < 12000 else 3
        for n in decayed:
            decayed[n] *= 1 - curve.decay
        decayed[size] = decayed.get(size, 0.0) + 1.0
        curve.add(size, 0.001 * size)
        if i in (10, 11500, 12999):
            total, kept = sum(decayed.values()), sum(curve.seen.values())
            assert all(curve.seen[n] / kept == pytest.approx(decayed[n] / total, rel=1e-9)
                       for n in decayed)
    assert curve.weight < 1e100
    fitted = curve.fit(0.1)
    assert curve.fit(0.1) is fitted
    curve.add(3, 0.004)
    assert curve.fit(0.1) is not fitted


def test_a_size_whose_weight_underflowed_leaves_the_fit():
    """One size for ~45,000 adds (an adaptive K with min = max, requests ending on their end
    token): the other sizes' weights underflow to 0.0 at a rescale, and the fit must not
    divide by their sum (it failed the request that asked)."""
    curve = Curve()
    for size in (3, 4, 3, 4):
        curve.add(size, 0.001 * size)
    for _ in range(46000):
        curve.add(5, 0.005)
    assert curve.seen[3] == curve.seen[4] == 0.0
    assert curve.fit(0.1) == (pytest.approx(0.005 / 1.4), pytest.approx(0.005 * 0.1 / 1.4))


def test_a_draft_that_turns_dear_later_is_warned_of_within_a_check(caplog):
    costs = measured({1: 2.0, 5: 3.0}, draft_ms_per_token=1.0)  # 200 draft costs, cheap
    assert not caplog.records
    for _ in range(ROOM_CHECK_EVERY):  # the drafter now costs 5 verifies a token
        for n in (2, 5):
            costs.observe(RoundCost(n, 0.002, n - 1, (n - 1) * 0.01, 0.0))
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_draft_cost_has_a_per_call_part():
    costs = CostModel()
    for _ in range(20):
        for n in (2, 4, 6):
            costs.observe(RoundCost(n + 1, 0.01, n, (0.5 + 1.2 * n) / 1000, 0.004))
    assert costs.draft_seconds(1) == pytest.approx(0.0017)
    assert costs.draft_seconds(8) == pytest.approx(0.0101)


def test_a_lone_request_after_a_burst_drafts_at_the_lone_draft_costs():
    """A draft call's time is its batch's. Measured on the demo pair's served drafter: 2 ms
    for one token alone, 18-38 ms for 1 to 9 tokens among a burst's calls. A burst's short
    drafts (K = 0 and 1 rounds pre-drafting beside the verify) must not stand for a lone
    request's: on one line they made drafts look dear per call and free per token, and a
    lone pipelined request at an acceptance of 0.38 drafted K = 8."""
    costs = CostModel()
    for _ in range(40):
        for n in (3, 4, 5, 6):  # alone: 0.5 ms a call, 1.5 ms a token, beside the verify
            costs.observe(RoundCost(n - 1, (6.8 + 0.9 * (n - 2)) / 1000, n, (0.5 + 1.5 * n)
                                    / 1000, 0.002, kind="carried", draft_batch_size=1))
        for n in (1, 2):  # among 16 calls
            costs.observe(RoundCost(n, 0.03, n, 0.025, 0.006, batch_size=16, batch_tokens=24,
                                    kind="fresh", draft_batch_size=16))
    assert costs.draft_seconds(1) == pytest.approx(0.002)
    assert costs.draft_seconds(9) == pytest.approx(0.014)
    assert costs.draft_seconds(1, load=16) == pytest.approx(0.025)
    policy = AdaptiveK(KBounds(0, 8), costs, pipelined=True, greedy=True)
    policy.own.accepted, policy.own.tested = 38.0, 100.0
    assert 1 <= policy.choose(None) <= 3


# The closed loop: the policy drives a simulated served pair. Measured on the demo pair
# served on this project's 2-core machines: a verify costs 7.2 ms at 1 token and 0.7 ms per
# extra token, a draft 1.2 ms a token plus a per-call part, each pool hop about 2 ms.
VERIFY_MS, VERIFY_PER_TOKEN_MS = 7.2, 0.7
DRAFT_CALL_MS, DRAFT_PER_TOKEN_MS, HOP_MS = 0.4, 1.2, 2.0


class ServedPair:
    """Rounds of a sequential draft-then-verify request, with i.i.d. Bernoulli acceptance."""

    def __init__(self, alpha: float, seed: int, per_token_ms: float = VERIFY_PER_TOKEN_MS):
        import random

        self.alpha, self.random = alpha, random.Random(seed)
        self.per_token_ms = per_token_ms
        self.batch = 1
        self.slow = 0  # how many of the next comparable rounds are 20x too slow (cold)

    def round(self, policy, first: bool) -> tuple[int, float]:
        """Run one round of the policy's K: (tokens committed, seconds)."""
        k = policy.num_speculative_tokens()
        accepted = 0
        while accepted < k and self.random.random() < self.alpha:
            accepted += 1
        tokens = self.batch * (k + 1)
        verify = (VERIFY_MS + self.per_token_ms * (tokens - 1)) / 1000
        draft = (DRAFT_CALL_MS + DRAFT_PER_TOKEN_MS * k) / 1000 if k else 0.0
        overhead = HOP_MS * (2 if k else 1) / 1000
        scale = 20.0 if self.slow and not first else 1.0
        self.slow -= scale > 1
        policy.update(k, accepted, RoundCost(k + 1, scale * verify, k, scale * draft,
                                             scale * overhead, self.batch, tokens,
                                             HOP_MS / 1000 if k else 0.0, comparable=not first))
        return accepted + 1, verify + draft + overhead


def serve_requests(pair: ServedPair, costs: CostModel, requests: int, tokens: int = 96,
                   bounds: KBounds = KBounds(0, 8)) -> list[list[int]]:
    """The K of every round of `requests` requests in turn, sharing one cost model."""
    trace = []
    for _ in range(requests):
        policy = AdaptiveK(bounds, costs, pipelined=False, greedy=True)
        ks, done = [], 0
        while done < tokens:
            ks.append(policy.num_speculative_tokens())
            done += pair.round(policy, first=not ks[:-1])[0]
        trace.append(ks)
    return trace


def tokens_per_second(pair: ServedPair, policy) -> float:
    tokens = seconds = 0.0
    for i in range(2000):
        n, s = pair.round(policy, first=i == 0)
        tokens, seconds = tokens + n, seconds + s
    return tokens / seconds


def mean(values) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize("slow_rounds", [0, 1], ids=["warm", "first-sample-cold"])
def test_from_cold_the_controller_settles_where_speculation_pays(slow_rounds):
    pair = ServedPair(alpha=0.75, seed=slow_rounds)
    pair.slow = slow_rounds  # the first comparable rounds 20x too slow (cold pools)
    trace = serve_requests(pair, CostModel(), requests=4)
    assert mean([mean(ks) for ks in trace]) >= 1.5
    settled = [k for ks in trace[1:] for k in ks[8:]]
    assert mean(settled) >= 2 and settled.count(0) == 0
    # exploration ran the neighbours of what it chose
    assert {min(settled), max(settled)} != {mean(settled)}


def test_the_controller_is_within_a_tenth_of_the_best_fixed_k():
    rates = {k: tokens_per_second(ServedPair(0.75, seed=k), FixedK(k)) for k in range(0, 9)}
    best = max(rates.values())
    costs = CostModel()
    serve_requests(ServedPair(0.75, seed=20), costs, requests=2)
    adaptive = tokens_per_second(ServedPair(0.75, seed=21),
                                 AdaptiveK(KBounds(0, 8), costs, pipelined=False, greedy=True))
    assert adaptive >= 0.9 * best, (adaptive, rates)
    assert rates[0] < 0.75 * best  # speculation pays here: K = 0 would be a trap


def under_load(pair: ServedPair, costs: CostModel) -> tuple[list[int], list[int]]:
    """One request's K in a batch of 16, then alone again; and a new request's after."""
    policy = AdaptiveK(KBounds(0, 8), costs, pipelined=False, greedy=True)
    loaded_ks, alone_ks = [], []
    pair.batch = 16
    for i in range(120):
        loaded_ks.append(policy.num_speculative_tokens())
        pair.round(policy, first=i == 0)
    pair.batch = 1
    for _ in range(10):
        alone_ks.append(policy.num_speculative_tokens())
        pair.round(policy, first=False)
    fresh = AdaptiveK(KBounds(0, 8), costs, pipelined=False, greedy=True)
    return loaded_ks, alone_ks + [fresh.num_speculative_tokens()]


def test_under_batch_load_k_zero_wins_and_speculation_returns_when_the_load_falls():
    # a compute-bound forward (CPU): 1.5 ms per token fed, 16 rounds per batch, α = 0.6: a
    # drafted token costs the batch 16 tokens of forward and speculation does not pay
    pair = ServedPair(alpha=0.6, seed=3, per_token_ms=1.5)
    costs = CostModel()
    serve_requests(pair, costs, requests=1)  # learnt alone first
    loaded_ks, alone_ks = under_load(pair, costs)
    assert loaded_ks[60:].count(0) >= 50  # off, with a probe every 8 rounds
    assert all(k >= 1 for k in alone_ks[5:])  # on again within a few rounds
    assert alone_ks[-1] >= 1  # and a request that starts after the burst drafts at once


def test_a_mutant_that_cannot_turn_off_under_load_fails_the_load_check(monkeypatch):
    monkeypatch.setattr(AdaptiveK, "zero_allowed", lambda self: False)
    pair = ServedPair(alpha=0.6, seed=3, per_token_ms=1.5)
    costs = CostModel()
    serve_requests(pair, costs, requests=1)
    loaded_ks, _ = under_load(pair, costs)
    assert loaded_ks[60:].count(0) < 50


def test_a_mutant_that_keeps_cold_samples_traps_itself(monkeypatch):
    """The trap this controller avoids: a mean that keeps its first, cold value, and K = 0
    reachable alone. The same closed loop then stops speculating."""
    from speculative import costs as module

    class FirstValue(module.Recent):
        def add(self, value):
            if not self.values:
                super().add(value)

    monkeypatch.setattr(module, "Recent", FirstValue)
    monkeypatch.setattr(AdaptiveK, "zero_allowed", lambda self: self.bounds.min == 0)
    pair = ServedPair(alpha=0.75, seed=1)
    pair.slow = 1
    trace = serve_requests(pair, CostModel(), requests=4)
    assert mean([mean(ks) for ks in trace]) < 1.5


class SharedCores:
    """Pipelined rounds (carried, fresh, plain: speculative.policy) where the pre-draft does
    not run beside the verify for free: both pools share the cores, so a round takes the
    verify's time plus the draft's, which the pools' own timings cannot show."""

    def __init__(self, alpha: float, seed: int, batch: int):
        import random

        self.alpha, self.random, self.batch = alpha, random.Random(seed), batch
        self.carried = 0  # the length of the block pre-drafted for the next round

    def verify(self, k: int) -> float:
        return (VERIFY_MS + VERIFY_PER_TOKEN_MS * (self.batch * (k + 1) - 1)) / 1000

    def round(self, policy, first: bool) -> tuple[int, float]:
        k = policy.num_speculative_tokens()
        draft = (DRAFT_CALL_MS + DRAFT_PER_TOKEN_MS * (k + 1)) / 1000 if k else 0.0
        if self.carried:
            kind, block = ("carried" if k else ""), self.carried
            accepted = 0
            while accepted < block and self.random.random() < self.alpha:
                accepted += 1
            tested, tokens, self.carried = block, accepted + 1, 0
            if accepted == block and k:  # y1 of the pre-draft is tested at the bonus
                tested += 1
                if self.random.random() < self.alpha:
                    accepted, self.carried = accepted + 1, k
        elif k:
            kind, block, tested, tokens = "fresh", 0, 1, 1
            accepted = int(self.random.random() < self.alpha)
            self.carried = k if accepted else 0
        else:
            kind, block, tested, tokens, accepted = "plain", 0, 0, 1, 0
        verify = self.verify(block)
        wall = verify + draft + HOP_MS / 1000  # the shared cores: nothing overlaps
        # the round's time beyond compute as speculative.meter reports it: beyond the longer
        # part (a draft beside the verify is not waited for), the shorter part's time with it
        overhead = wall - max(verify, draft)
        policy.update(tested, accepted, RoundCost(
            block + 1, verify, k + 1 if k else 0, draft, overhead, self.batch,
            self.batch * (block + 1), comparable=not first, kind=kind, wall_seconds=wall,
            tokens=tokens))
        return tokens, wall


@pytest.mark.parametrize("batch,alpha", [(1, 0.7), (4, 0.7), (16, 0.6)])
def test_pipelined_rounds_on_shared_cores_are_chosen_by_their_measured_time(batch, alpha):
    rates = {k: tokens_per_second(SharedCores(alpha, k, batch), FixedK(k)) for k in range(9)}
    best = max(rates.values())
    policy = AdaptiveK(KBounds(0, 8), CostModel(), pipelined=True, greedy=True)
    adaptive = tokens_per_second(SharedCores(alpha, 99, batch), policy)
    assert adaptive >= 0.95 * best, (adaptive, rates)
    # what the model alone believes (a pre-draft beside the verify is free) is far off
    assert rates[8] < 0.8 * best


def test_a_mutant_that_trusts_the_model_over_measured_rounds_fails(monkeypatch):
    monkeypatch.setattr(CostModel, "beside", lambda self, load: None)
    rates = {k: tokens_per_second(SharedCores(0.6, k, 16), FixedK(k)) for k in range(9)}
    policy = AdaptiveK(KBounds(0, 8), CostModel(), pipelined=True, greedy=True)
    adaptive = tokens_per_second(SharedCores(0.6, 99, 16), policy)
    assert adaptive < 0.93 * max(rates.values())  # measured: 0.90 (the rounds: 0.98)


def test_the_overlap_of_pipelined_rounds_is_measured_by_load():
    """A pipelined round's time beyond its longer part is h + λ x, x its shorter part: rounds
    at two Ks tell λ from h (speculative.overlap)."""
    costs = CostModel()
    # verifies of 10 ms beside drafts of 4 and 6 tokens (4 and 6 ms): λ 0.75, h 2 ms
    for tokens in (4, 6) * 3:
        draft = tokens / 1000
        beyond = 0.002 + 0.75 * draft
        costs.observe(RoundCost(4, 0.010, tokens, draft, beyond, batch_size=4, batch_tokens=16,
                                kind="carried", wall_seconds=0.010 + beyond))
    assert costs.exposed_share(4) == pytest.approx(0.75)
    assert costs.exposed_share(16) == pytest.approx(0.75)  # the nearest load measured
    verify, draft = costs.forward_seconds(12), costs.draft_seconds(3)
    assert costs.round_seconds("carried", 2, 4) == pytest.approx(
        max(verify, draft) + 0.75 * min(verify, draft) + 0.002)
    # no plain round ran: a verify call's time beyond compute is the pipelined rounds' h
    assert costs.overhead_seconds(0, 4) == pytest.approx(0.002)
    # rounds beside a draft are not plain rounds: their time beyond holds λ x
    for _ in range(3):
        costs.observe(RoundCost(1, 0.005, 0, 0.0, 0.002, kind="plain", wall_seconds=0.007))
        costs.observe(RoundCost(1, 0.005, 4, 0.004, 0.006, kind="fresh", wall_seconds=0.011))
    assert costs.overhead_seconds(0, 1) == pytest.approx(0.002)
    # rounds of one kind alone cannot tell λ from h: their time beyond, right at their K
    alone = CostModel()
    for _ in range(3):
        alone.observe(RoundCost(4, 0.010, 6, 0.006, 0.0065, kind="carried",
                                wall_seconds=0.0165))
    assert alone.exposed_share(1) is None and alone.beside(1) == (pytest.approx(0.0065), None)
    assert alone.round_seconds("carried", 5, 1) == pytest.approx(
        max(alone.forward_seconds(6), alone.draft_seconds(6)) + 0.0065)
    assert CostModel().exposed_share(1) is None


def test_the_overlap_fit_takes_each_kinds_median():
    """Mostly rounds at the K in force, a few at its neighbours (exploration), one stray:
    λ and h as the kinds' medians say, the stray round moving nothing."""
    from speculative.overlap import Overlap

    overlap = Overlap()
    for i in range(40):
        tokens = 6 if i % 8 == 0 else 4 if i % 8 == 4 else 5  # K + 1 of 5, 3, 4
        beyond = 0.002 + 0.5 * tokens / 1000 + (0.05 if i == 13 else 0.0)
        overlap.add(("carried", 5, tokens), tokens / 1000, beyond)
    h, share = overlap.fit()
    assert share == pytest.approx(0.5) and h == pytest.approx(0.002)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_routers_acceptance_is_per_position_tested_at_any_k(k):
    """What every request's K under load is chosen by (and a new request's prior): rounds of
    i.i.d. acceptance 0.7 give 0.7 at any K. A mean of each round's accepted / tested,
    which weighs a round that rejects its first token as much as one that tests K, gives
    0.52 at K = 4 (and 0.7 only at K = 1): the mutant below."""
    import random

    draws = random.Random(k)
    costs = CostModel()
    policy = AdaptiveK(KBounds(0, 8), costs, pipelined=False, greedy=True)
    values = []
    for i in range(3000):
        accepted = 0
        while accepted < k and draws.random() < 0.7:
            accepted += 1
        policy.update(k, accepted)
        if i >= 100:
            values.append(costs.alpha.value)
    assert sum(values) / len(values) == pytest.approx(0.7, abs=0.02)


def test_a_mean_of_round_ratios_fails_the_acceptance_check(monkeypatch):
    from speculative import costs as module

    class MeanOfRatios(module.Acceptance):
        def add(self, accepted, tested):
            super().add(accepted / tested, 1)

    monkeypatch.setattr(module, "Acceptance", MeanOfRatios)
    with pytest.raises(AssertionError):
        test_the_routers_acceptance_is_per_position_tested_at_any_k(4)


def test_under_load_every_request_runs_the_routers_k_and_explores_zero_and_its_neighbours():
    costs = CostModel()
    first, second = at_load(costs, 16), at_load(costs, 16)
    seen, by_phase = [], {}
    for _ in range(AdaptiveK.batch_rounds * AdaptiveK.batch_explore_every * 3 // 2):
        for policy in (first, second):
            k, phase = policy.batch_k()
            assert by_phase.setdefault(phase, k) == k  # a phase never mixes K
            seen.append(k)
    chosen = costs.trials_at(16).k
    assert chosen >= 2
    explored = set(seen) - {chosen}
    assert explored == {chosen + 1, chosen - 1, 0} - {chosen}
    # most rounds run the chosen K
    assert seen.count(chosen) >= 0.7 * len(seen)


def test_the_router_warns_once_when_a_draft_step_costs_as_much_as_a_verify(caplog):
    costs = measured({1: 2.0, 5: 3.0}, draft_ms_per_token=1.0)
    assert costs.no_room_for_speculation() is None and not caplog.records
    dear = measured({1: 2.0, 5: 3.0}, draft_ms_per_token=2.5)
    assert dear.no_room_for_speculation() >= 1.0
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_a_request_that_starts_under_load_runs_the_batch_k_from_its_first_round():
    """A new request that joins 15 running ones starts at the router's K in force (K = 0: it
    never calls the drafter), not at the K the model expects alone; one that starts alone
    drafts."""
    pair = ServedPair(alpha=0.6, seed=3, per_token_ms=1.5)
    costs = CostModel()
    serve_requests(pair, costs, requests=1)
    costs.trials_at(16).switch(0)
    assert AdaptiveK(KBounds(0, 8), costs, False, True, load=16).num_speculative_tokens() == 0
    assert AdaptiveK(KBounds(0, 8), costs, False, True, load=1).num_speculative_tokens() >= 1
    front_end = RequestFrontEnd(SpeculationDefaults(adaptive_bounds=KBounds(0, 8)))
    front_end.costs[(None, True)] = costs
    plans = {running: front_end.plan("r", [1, 2], SamplingParams(temperature=0),
                                     running=running) for running in (0, 15)}
    assert plans[15].choices[0].policy.num_speculative_tokens() == 0
    assert plans[0].choices[0].policy.num_speculative_tokens() >= 1


def test_a_round_reported_without_its_cost_under_load_is_no_trial():
    """KPolicy.update's cost is optional: a loaded request's rounds without one move the
    batch's K as any round does, recording no trial (one raised on its second round)."""
    policy = AdaptiveK(KBounds(0, 8), loaded(16), False, True, load=16)
    for _ in range(3):
        policy.update(policy.k, 1)
    assert policy.loaded and policy.k == policy.costs.trials_at(16).k
