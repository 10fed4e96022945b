"""The K policies: the adaptive K follows acceptance and cost the way the formula says."""

import pytest

from speculative.policy import AdaptiveK, CostModel, FixedK, KBounds, RoundCost, expected_tokens


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
    return policy.num_speculative_tokens()


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
    assert costs.verify_seconds(9) == pytest.approx(0.090, rel=1e-6)
    assert costs.draft_seconds_per_token() == pytest.approx(0.001)


def test_a_draft_that_is_always_accepted_on_free_verification_gets_the_largest_k():
    costs = measured({2: 10.0, 9: 10.0}, 0.1)
    policy = AdaptiveK(KBounds(1, 8), costs, pipelined=False, greedy=True)
    assert steady(policy, accept_first=99) == 8


def test_a_draft_that_is_never_accepted_gets_the_smallest_k():
    costs = measured({2: 10.0, 9: 10.0}, 0.5)
    policy = AdaptiveK(KBounds(1, 8), costs, pipelined=False, greedy=True)
    assert steady(policy, accept_first=0) == 1
    plain = AdaptiveK(KBounds(0, 8), costs, pipelined=False, greedy=True)
    ks = []
    for _ in range(40):
        ks.append(plain.num_speculative_tokens())
        plain.update(ks[-1], 0)
    assert ks.count(0) > 30 and 1 in ks[5:]  # plain decoding, with a probe every 8 rounds


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
        policy.accepted, policy.tested = 0.95 * 1e6, 1e6  # α = 0.95, held
    assert sequential.choose() == 8
    assert pipelined.choose() in (3, 4)
    assert all(pipelined.rate(k) > sequential.rate(k) for k in range(1, 9))


def test_the_choice_is_the_argmax_of_the_rate():
    costs = measured({2: 10.0, 5: 25.0, 9: 45.0}, 1.0, overhead_ms=2.0)
    policy = AdaptiveK(KBounds(1, 8), costs, pipelined=True, greedy=False)
    rates = {k: policy.rate(k) for k in range(1, 9)}
    assert policy.choose() == max(rates, key=rates.get)


def test_tokens_per_round_counts_what_rounds_emit_when_a_sampled_bonus_is_given_up():
    # a self-draft is always accepted; sampled and pipelined, each round hands its bonus
    # position to the pre-draft, so a round emits K tokens, not K + 1
    from drafter.model import ModelDrafter
    from speculative.sampling import SamplingParams
    from tests.tiny import run, tiny_llama
    from verifier.engine import ModelVerifier

    target = tiny_llama(3)
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=25)
    out, state = run(ModelDrafter(target), ModelVerifier(target), [1, 2, 3], params, 2,
                     pipelined=True)
    stats = state.stats
    assert stats.num_emitted_tokens == len(out) == 25
    assert stats.pipelined_rounds > 5 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.mean_acceptance_length < 2.5  # 2 a pipelined round, 3 only for the first


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


def test_k_shrinks_as_the_verifier_batch_grows_turns_off_and_comes_back():
    """α = 0.8. Alone, the forward is mostly its fixed cost and a long K pays; in a batch of
    many, each drafted token costs batch_size tokens of forward and speculation stops."""
    ks = {}
    for batch_size in (1, 4, 16, 64):
        policy = AdaptiveK(KBounds(0, 8), loaded(batch_size), pipelined=False, greedy=True)
        policy.accepted, policy.tested = 80.0, 100.0
        ks[batch_size] = policy.choose()
    assert ks[1] > ks[4] > ks[16] >= 0 and ks[1] >= 4
    assert ks[64] == 0
    costs = loaded(64)  # the same router's costs, as load falls again
    for _ in range(200):
        costs.observe(RoundCost(3, (20 + 2 * 3) / 1000, 2, 1 / 1000, 0.0, 1, 3))
    policy = AdaptiveK(KBounds(0, 8), costs, pipelined=False, greedy=True)
    policy.accepted, policy.tested = 80.0, 100.0
    assert policy.choose() >= 4


def test_a_mutant_that_ignores_the_batch_keeps_drafting_under_load(monkeypatch):
    monkeypatch.setattr(CostModel, "batch_size", lambda self: 1.0)
    policy = AdaptiveK(KBounds(0, 8), loaded(64), pipelined=False, greedy=True)
    policy.accepted, policy.tested = 80.0, 100.0
    assert policy.choose() > 0


def test_a_round_without_a_draft_is_charged_one_hop_not_two():
    """Pools' compute is cheap beside the hops (the demo pair served): a draft call's hop
    costs more than the draft saves, and K = 0 wins once that is known."""
    costs = CostModel()
    for _ in range(100):
        for k in (1, 2, 4):
            costs.observe(RoundCost(k + 1, (5 + 0.5 * k) / 1000, k, k * 1.5 / 1000, 6 / 1000,
                                    draft_hop_seconds=3 / 1000))
    assert costs.overhead_seconds(0) == pytest.approx(0.003)
    policy = AdaptiveK(KBounds(0, 8), costs, pipelined=False, greedy=True)
    policy.accepted, policy.tested = 50.0, 100.0
    assert policy.choose() == 0
    costs.observe(RoundCost(1, 5 / 1000, 0, 0.0, 20 / 1000))  # measured: use that instead
    assert costs.overhead_seconds(0) > 0.003
