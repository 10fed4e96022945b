"""Edges of the K controller's contracts (speculative.policy, costs, yields, meter, fixed_k):
K within its bounds, a named K kept, K = 0 entered and left by the margin, a batch's K moved
only by the margin, estimates learnt from the right fields and nothing divided by an empty
sum. Driven by synthetic measurements (rates and costs set by hand), never by timing."""

import asyncio
from collections import deque

import pytest

from speculative.costs import (Acceptance, CostModel, Recent, RoundCost, load_band,
                               load_bucket, nearest, nearest_bucket)
from speculative.policy import AdaptiveK, KBounds, k_policy
from speculative.rejection import RoundOutcome
from speculative.stats import SpecStats
from speculative.types import BatchLoad, DraftBlock, TargetScores
from speculative.yields import BatchTrials
from tests.unit.test_meter import clock_for
from tests.unit.test_policy import measured


def with_rates(policy: AdaptiveK, rates: dict[int, float]) -> AdaptiveK:
    """The policy with its expected tokens per second at each K set by hand."""
    policy.rate = rates.__getitem__
    return policy


def ks_run(policy: AdaptiveK, accept_first: int, rounds: int) -> list[int]:
    """The Ks the policy runs over rounds that accept the first `accept_first` tokens (as
    test_policy's steady rounds)."""
    ks = []
    for _ in range(rounds):
        ks.append(policy.num_speculative_tokens())
        policy.update(ks[-1], min(ks[-1], accept_first))
    return ks


def test_an_initial_k_outside_the_bounds_is_brought_within_them():
    costs = measured({2: 10.0, 9: 10.0}, 0.1)
    assert AdaptiveK(KBounds(1, 4, initial=9), costs, False, True).num_speculative_tokens() == 4
    assert AdaptiveK(KBounds(2, 4, initial=0), costs, False, True).num_speculative_tokens() == 2


def test_exploration_never_runs_a_k_above_the_bounds_max():
    """A request at its max explores one up every other time: that K is the max again."""
    costs = measured({2: 10.0, 9: 10.0}, 0.1)  # free verification: the max is best
    policy = AdaptiveK(KBounds(1, 4), costs, pipelined=False, greedy=True)
    ks = ks_run(policy, 4, 40)
    assert max(ks) == 4 and policy.chosen == 4


def test_under_load_a_request_runs_the_routers_k_within_its_own_bounds():
    costs = CostModel()
    costs.trials_at(16).switch(8)  # another request's bounds allowed 8
    policy = with_rates(AdaptiveK(KBounds(0, 2), costs, False, True, load=16),
                        {k: 1.0 for k in range(9)})
    ks = [policy.batch_k()[0] for _ in range(AdaptiveK.batch_rounds * 8)]
    assert max(ks) == 2 and min(ks) >= 0


def test_k_zero_is_left_only_when_drafting_wins_by_the_margin():
    """Between the margins the policy keeps what it runs: drafting 5 % better than K = 0
    neither enters K = 0 from K = 3 nor leaves it; 15 % better leaves it."""
    policy = AdaptiveK(KBounds(0, 4), CostModel(), False, True, load=4)
    with_rates(policy, {0: 100.0, 1: 90.0, 2: 95.0, 3: 105.0, 4: 101.0})
    assert policy.choose(0) == 0 and policy.choose(3) == 3
    with_rates(policy, {0: 100.0, 1: 90.0, 2: 95.0, 3: 115.0, 4: 101.0})
    assert policy.choose(0) == 3
    with_rates(policy, {0: 100.0, 1: 80.0, 2: 85.0, 3: 89.0, 4: 88.0})
    assert policy.choose(3) == 0  # K = 0 beats the best K by more than 10 %


@pytest.mark.parametrize("gain, k", [(1.05, 4), (1.2, 3)])
def test_before_a_trial_is_judged_the_model_moves_the_batch_only_for_the_margin(gain, k):
    """The model may lower the batch's K before a trial is judged, but only where the lower
    K promises `margin` (10 %) more: a change costs every request a round of transition."""
    costs = CostModel()
    trials = costs.trials_at(16)
    trials.switch(4)
    policy = AdaptiveK(KBounds(0, 8), costs, False, True, load=16)
    with_rates(policy, {0: 10.0, 1: 50.0, 2: 60.0, 3: 100.0 * gain, 4: 100.0}
               | {n: 90.0 for n in range(5, 9)})
    policy.batch_k()
    assert not trials.judged and trials.k == k


def test_a_round_without_wall_time_adds_nothing_to_a_phases_yield():
    """A phase's yield is its timed rounds' tokens over their seconds: a round that reports
    no time adds no tokens, and a phase of such rounds alone is never judged (no 0 / 0)."""
    trials = BatchTrials()
    trials.switch(2)
    for phase, k in enumerate([2, 3, 2, 2, 2]):
        for _ in range(4):
            trials.record(phase, k, 4, 0.1)
        if k == 3:
            trials.record(phase, k, 4, 0.0)
    assert list(trials.ratios[3]) == [pytest.approx(1.0)]
    untimed = BatchTrials()
    untimed.switch(2)
    for phase in range(4):
        untimed.record(phase, 2, 4, 0.1 if phase else 0.0)
    assert not untimed.judged


def test_a_trial_is_judged_only_against_phases_at_the_k_in_force():
    """Phases that close after a switch ran at the old K: a trial between two of them says
    nothing about the new K in force, and is not judged."""
    trials = BatchTrials()
    trials.switch(2)
    trials.record(0, 2, 4, 0.1)
    trials.switch(4)
    for phase, k in enumerate([2, 3, 2, 4, 4], start=1):
        trials.record(phase, k, 8 if k == 3 else 4, 0.1)
    assert not trials.judged and not trials.ratios


def test_the_gain_of_a_tried_k_is_the_geometric_mean_of_its_trials():
    """One lucky trial does not move the batch: 1.5 and 0.8 are 1.095 together, short of
    the margin; 1.5 and 0.85 (1.129) beat it."""
    trials = BatchTrials()
    trials.switch(2)
    trials.ratios[3] = deque([1.5, 0.8])
    assert trials.better(0.1) is None
    trials.ratios[3] = deque([1.5, 0.85])
    assert trials.better(0.1) == 3
    trials.ratios[1] = deque([1.3])  # one trial alone is not enough
    assert trials.better(0.1) == 3


def test_alone_at_k_zero_every_exploration_runs_k_one():
    """Alone, a request whose draft is measured useless runs K = 0 and still drafts K = 1
    every `explore_every` rounds, so drafting stays measured."""
    policy = AdaptiveK(KBounds(0, 8), measured({2: 10.0, 9: 10.0}, 2.0), False, True)
    late = ks_run(policy, 0, 96)[48:]
    assert late.count(1) == len(late) // AdaptiveK.explore_every
    assert late.count(0) == len(late) - late.count(1)


def test_k_zero_alone_needs_min_tested_positions_of_this_requests_own():
    policy = AdaptiveK(KBounds(0, 8), CostModel(), pipelined=False, greedy=True)
    for _ in range(AdaptiveK.min_tested - 1):
        policy.update(1, 0)  # each round tests one position, none accepted
    assert not policy.zero_allowed()
    policy.update(1, 0)
    assert policy.positions_tested == AdaptiveK.min_tested and policy.zero_allowed()


def test_the_draft_line_is_kept_by_the_drafters_batch_not_the_verifiers():
    """A round's draft ran in the drafter's batch (draft_batch_size), which may hold other
    calls than the verifier's: a lone draft beside a loaded verify is a lone draft's cost."""
    costs = CostModel()
    for _ in range(10):
        for n in (1, 2):
            costs.observe(RoundCost(n + 1, 0.01, n, n * 0.001, 0.0, batch_size=16,
                                    draft_batch_size=1))
            costs.observe(RoundCost(n + 1, 0.01, n, n * 0.010, 0.0, batch_size=1,
                                    draft_batch_size=16))
    assert costs.draft_seconds(1, load=1.0) == pytest.approx(0.001)
    assert costs.draft_seconds(2, load=16.0) == pytest.approx(0.020)


def test_a_draft_after_the_usual_catch_up_is_a_draft_cost_and_after_more_is_not():
    """A drafter feeds its last draft token and the bonus before drafting (two tokens): that
    draft's time is a draft cost; one that first caught up on three is not."""
    usual, caught_up = CostModel(), CostModel()
    usual.observe(RoundCost(3, 0.01, 2, 0.002, 0.0, draft_catch_up=2))
    caught_up.observe(RoundCost(3, 0.01, 2, 0.002, 0.0, draft_catch_up=3))
    assert usual.draft_seconds(2) == pytest.approx(0.002)
    assert not caught_up.drafts and caught_up.verify


def test_load_bands_are_a_factor_of_four_wide_from_one_and_a_half():
    """[1.5, 6), [6, 24), [24, 96), ... calls a batch; 4 and 16 streams never share a K."""
    bands = {load: load_band(load) for load in (1.5, 5.9, 6, 23.9, 24, 95.9, 96)}
    assert bands == {1.5: 1, 5.9: 1, 6: 2, 23.9: 2, 24: 3, 95.9: 3, 96: 4}
    assert load_band(1.0) == load_band(1.4) == 0
    costs = CostModel()
    assert costs.trials_at(4) is costs.trials_at(2) is not costs.trials_at(16)


def test_a_load_between_two_measured_buckets_reads_the_lower():
    """Load buckets are powers of two (rounded); a load whose own is not measured reads the
    nearest, the lower on a tie, and nothing measured reads nothing."""
    assert [load_bucket(n) for n in (1, 1.4, 2, 3, 6, 12)] == [0, 0, 1, 2, 3, 4]
    assert nearest_bucket([0, 2], 2.0) == 0 and nearest_bucket([0, 3], 4.0) == 3
    assert nearest_bucket([], 4.0) is None and nearest({}, 4.0) is None


def test_a_draft_of_no_tokens_costs_nothing_whatever_the_draft_line():
    """draft_seconds(0): no call at all, not the fitted line's per-call part."""
    costs = CostModel()
    for _ in range(5):
        for n in (1, 4):
            costs.observe(RoundCost(n + 1, 0.01, n, 0.002 + n * 0.001, 0.0))
    assert costs.draft_seconds(1) == pytest.approx(0.003)
    assert costs.draft_seconds(0) == 0.0 and CostModel().draft_seconds(0) == 0.0


def test_nothing_measured_reads_as_unknown_or_a_prior_never_a_division_by_zero():
    costs = CostModel()
    assert costs.alpha.value is None and Acceptance(0.9).value is None
    assert costs.forward_seconds(9) == 1.0 and costs.overhead_seconds(3, 16.0) == 0.0
    assert costs.beside(4.0) is None and costs.exposed_share(4.0) is None
    assert costs.no_room_for_speculation() is None and costs.draft_call_seconds() == 0.0
    assert costs.shapes.rate(4, True) is None and BatchTrials().better(0.1) is None
    policy = AdaptiveK(KBounds(0, 8), costs, pipelined=True, greedy=False)
    assert 1 <= policy.num_speculative_tokens() <= 8 and policy.rate(0) > 0


@pytest.mark.parametrize("k", [0, 3])
def test_a_named_k_is_run_every_round_whatever_the_rounds_say(k):
    """A request that names its K keeps it: no cut learnt ("auto" leaves the pool's own), no
    tree, and a pipelined round without candidates runs fresh."""
    policy = k_policy(k, pipelined=True, greedy=False, bounds=KBounds(0, 1), confidence="auto",
                      trees=True, load=64.0)
    for accepted in (0, k, 0, k):
        assert policy.num_speculative_tokens() == k
        policy.update(k, accepted, RoundCost(k + 1, 0.5, k, 0.5, 0.0, batch_size=64))
    assert policy.num_speculative_tokens() == k and policy.draft_confidence() is None
    assert policy.round_shape(True) is None and policy.restarts_fresh()


def metered_round(committed: int, carried: bool = False, beside: int | None = None):
    """One sequential round's RoundCost, as the meter reports it: a draft of two tokens in a
    drafter batch of 2 calls, scored in a verifier batch of 16 calls (48 tokens), the
    request's drafter having seen 4 of its `committed` tokens."""
    clock = clock_for(SpecStats(), carried, committed=committed)
    drafted = DraftBlock((5, 6), None, compute_seconds=0.001, load=BatchLoad(2, 4))
    block = clock.drafted(DraftBlock((), None) if beside is not None else drafted)
    scores = clock.verified(TargetScores(target_token_ids=(5, 6, 7), compute_seconds=0.004,
                                         load=BatchLoad(16, 48)))
    if carried or beside is not None:
        asyncio.run(clock.settled(asyncio.sleep(0, drafted)))
    outcome = RoundOutcome((5, 6, 7), 2) if block.token_ids else RoundOutcome((5,), 0)
    return clock.finish(block, scores, outcome, beside)


def test_a_rounds_cost_keeps_the_drafters_batch_apart_from_the_verifiers():
    cost = metered_round(committed=6)
    assert (cost.batch_size, cost.batch_tokens, cost.draft_batch_size) == (16, 48, 2)
    assert (cost.verify_tokens, cost.draft_tokens, cost.kind) == (3, 2, "sequential")


def test_a_rounds_catch_up_is_what_its_drafter_had_not_seen():
    assert metered_round(committed=6).draft_catch_up == 2
    assert metered_round(committed=13).draft_catch_up == 9
    assert metered_round(committed=13, carried=True).draft_catch_up == 0  # drafted before


def test_only_a_real_draft_beside_a_verify_makes_a_fresh_round():
    """beside = 0: the drafter's prefill beside a first verify, no draft; a round of no kind."""
    assert metered_round(committed=6, beside=2).kind == "fresh"
    assert metered_round(committed=6, beside=0).kind == ""
    assert metered_round(committed=6, carried=True).kind == "carried"


def test_a_requests_load_follows_its_recent_batches_by_halves():
    """The load is its recent rounds' batches, each round weighing half: one round in a
    batch of 4 keeps a request under load for the next round alone too; a batch that
    reports no size (0) counts as one call."""
    policy = AdaptiveK(KBounds(0, 8), CostModel(), pipelined=False, greedy=True)
    loads = []
    for batch in (4, 1, 1, 0):
        policy.update(1, 1, RoundCost(2, 0.01, 1, 0.001, 0.0, batch_size=batch))
        loads.append(policy.load)
    assert loads == [2.5, 1.75, 1.375, 1.1875]


def test_a_cost_is_the_lower_median_of_its_recent_values():
    """Of two values the lower (cold and stray values are slow ones)."""
    recent = Recent()
    for value in (0.02, 0.01):
        recent.add(value)
    assert recent.value == 0.01
    for value in (0.04, 0.03):
        recent.add(value)
    assert recent.value == 0.02
    costs = CostModel()
    costs.observe(RoundCost(1, 0.012, 0, 0.0, 0.0))
    costs.observe(RoundCost(1, 0.010, 0, 0.0, 0.0))
    assert costs.forward_seconds(1) == 0.010


def test_under_batch_load_a_request_weighs_the_routers_acceptance_not_its_own():
    costs = CostModel()
    costs.alpha.add(90, 100)
    policy = AdaptiveK(KBounds(0, 8), costs, pipelined=False, greedy=True, load=16)
    policy.own.accepted, policy.own.tested = 10.0, 100.0
    assert policy.alpha == pytest.approx(0.9)
    policy.load = 1.0
    assert policy.alpha == pytest.approx(0.1)


def test_a_carried_rounds_yield_counts_for_the_phase_and_k_its_block_was_drafted_at():
    """A pipelined round verifies the block pre-drafted beside the round before's verify:
    its tokens are that round's phase's and K's, not those of the phase it ran in."""
    costs = CostModel()
    trials = costs.trials_at(16)
    trials.switch(2)
    policy = with_rates(AdaptiveK(KBounds(0, 8), costs, False, True, load=16),
                        {k: 1.0 for k in range(9)})
    policy.loaded, policy.trials, policy.phase, policy.k = True, trials, 0, 2
    policy.update(2, 2, RoundCost(3, 0.01, 2, 0.002, 0.0, batch_size=16, kind="sequential",
                                  wall_seconds=0.1, tokens=3))
    policy.phase, policy.k = 1, 3  # the next round runs in a trial of K = 3...
    policy.update(3, 3, RoundCost(4, 0.01, 3, 0.003, 0.0, batch_size=16, kind="carried",
                                  wall_seconds=0.1, tokens=4, carried=True))
    assert trials.open == {0: [2, 7, pytest.approx(0.2)]}  # ...its block drafted at K = 2


def test_the_verify_line_goes_through_a_measured_t1_and_never_slopes_down():
    """t(1) measured (if rarer than another size) anchors the line; noise that makes more
    tokens look cheaper gives a flat line, not a falling one."""
    costs = CostModel()
    for n, seconds, times in ((1, 0.010, 2), (3, 0.014, 10), (5, 0.022, 2)):
        for _ in range(times):
            costs.observe(RoundCost(n, seconds, 0, 0.0, 0.0))
    assert costs.forward_seconds(1) == pytest.approx(0.010)
    noisy = CostModel()
    for n, seconds in ((1, 0.010), (5, 0.008)) * 2:
        noisy.observe(RoundCost(n, seconds, 0, 0.0, 0.0))
    assert noisy.forward_seconds(9) == pytest.approx(0.010) == noisy.forward_seconds(1)
