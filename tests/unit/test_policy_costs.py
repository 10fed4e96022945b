"""The cost model the adaptive K reads: which rounds it learns from, how its verify and draft
curves weigh what they saw, the overlap of pipelined rounds, and its warnings when a draft
step costs as much as a verify."""

import pytest

from speculative.costs import ROOM_CHECK_EVERY, CostModel, Curve, RoundCost
from speculative.policy import AdaptiveK, KBounds
from speculative.sampling import SamplingParams
from tests.unit.test_policy import measured


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


def test_the_router_warns_once_when_a_draft_step_costs_as_much_as_a_verify(caplog):
    costs = measured({1: 2.0, 5: 3.0}, draft_ms_per_token=1.0)
    assert costs.no_room_for_speculation() is None and not caplog.records
    dear = measured({1: 2.0, 5: 3.0}, draft_ms_per_token=2.5)
    assert dear.no_room_for_speculation() >= 1.0
    assert [r.levelname for r in caplog.records] == ["WARNING"]
