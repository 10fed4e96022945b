"""The K policies: the adaptive K follows acceptance and cost the way the formula says, and under
batch load every request runs the router's K (its trials: test_batch_trials; the cost model:
test_policy_costs; the closed loop on a simulated served pair: test_policy_closed_loop)."""

import pytest

from speculative.costs import CostModel, RoundCost, expected_tokens
from speculative.fixed_k import FixedK
from speculative.policy import AdaptiveK, KBounds


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


def test_a_round_reported_without_its_cost_under_load_is_no_trial():
    """KPolicy.update's cost is optional: a loaded request's rounds without one move the
    batch's K as any round does, recording no trial (one raised on its second round)."""
    policy = AdaptiveK(KBounds(0, 8), loaded(16), False, True, load=16)
    for _ in range(3):
        policy.update(policy.k, 1)
    assert policy.loaded and policy.k == policy.costs.trials_at(16).k
