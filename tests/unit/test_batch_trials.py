"""The router's K under batch load (speculative.yields.BatchTrials, AdaptiveK.batch_k): a
tried K is judged against the phases around it, a drift does not pass for a better K, a K
whose trials keep losing is tried less often until it wins again, and each load band keeps
its own K."""

from speculative.costs import CostModel, RoundCost
from speculative.frontend import RequestFrontEnd
from speculative.options import SpeculationDefaults
from speculative.policy import AdaptiveK, KBounds
from speculative.sampling import SamplingParams
from speculative.yields import BatchTrials
from tests.unit.test_policy import at_load, loaded


def test_a_tried_k_is_judged_against_the_phases_around_it():
    trials = BatchTrials()
    trials.switch(2)
    yields = {2: 50.0, 0: 60.0}  # tokens per second of a request in a phase at this K
    drift = 1.0
    for phase in range(40):
        k = 0 if phase % 4 == 0 else 2
        drift *= 1.05  # the load falls: every K's yield rises, 5 % a phase
        for _ in range(16):
            trials.record(phase, k, 3, 3 / (yields[k] * drift))
    # every trial of K = 0 beat the phases around it by 1.2 / the drift's 1.0006
    assert len(trials.ratios[0]) == 4 and all(1.19 < r < 1.21 for r in trials.ratios[0])
    assert trials.better(margin=0.1) == 0 and trials.better(margin=0.25) is None
    trials.switch(0)
    assert not trials.ratios and trials.k == 0


def test_a_drift_does_not_pass_for_a_better_k():
    """The load rises through a run (every K's yield falls 5 % a phase) while the K tried
    is worse by 5 %: against its neighbours it loses, where an average of each K's phases
    over time would credit it with the drift (its phases come first in every four)."""
    trials = BatchTrials()
    trials.switch(2)
    drift = 1.0
    for phase in range(40):
        k = 3 if phase % 4 == 0 else 2
        drift *= 0.95
        for _ in range(16):
            trials.record(phase, k, 3, 3 / ((47.5 if k == 3 else 50.0) * drift))
    assert trials.better(margin=0.0) is None


def run_phases(policies: list[AdaptiveK], yields: dict[int, float], phases: int) -> list[int]:
    """The policies' rounds under load, in turn, for `phases` more phases of the router,
    each round recorded at its K's yield (tokens per second): the K of each phase."""
    trials = policies[0].costs.trials_at(policies[0].load)
    by_phase: dict[int, int] = {}
    end = trials.phase + phases
    while trials.phase < end:
        for policy in policies:
            before = trials.k
            k, phase = policy.batch_k()
            if trials.k == before:  # a phase mixes K only where the K in force changes
                assert by_phase.setdefault(phase, k) == k
            by_phase[phase] = k
            trials.record(phase, k, 4, 4 / yields[k])
    return [by_phase[phase] for phase in sorted(by_phase)][-phases:]


def test_a_k_whose_trials_keep_losing_is_tried_less_until_it_wins():
    """K = 0 in force under load: every exploring phase (one in four) is a turn of K = 1,
    its one neighbour. While K = 1 loses, it runs one turn in four; once it wins, more
    turns, and the batch moves to it."""
    costs = loaded(64)  # where the model puts the batch at K = 0
    policies = [at_load(costs, 64) for _ in range(2)]
    explore = AdaptiveK.batch_explore_every
    ks = run_phases(policies, {0: 60.0, 1: 45.0}, phases=48)
    assert costs.trials_at(64).k == 0 and costs.trials_at(64).losses[1] >= 2
    late = ks[-24:]  # 6 exploring phases, all turns of K = 1: one or two of them run
    assert 1 <= late.count(1) <= 24 // explore // 2 ** BatchTrials.most_losses + 1
    # K = 1 turns better: its next trial wins, it runs every turn, and the batch moves
    ks = run_phases(policies, {0: 60.0, 1: 80.0, 2: 70.0}, phases=64)
    assert costs.trials_at(64).k == 1
    moved = next(i for i in range(len(ks)) if ks[i:i + explore] == [1] * explore)
    assert moved <= 48


def test_from_k_zero_the_trials_also_try_the_k_the_batch_drafted_at():
    """K = 0 in force after K = 4 (the model lowered it): its rounds of plain steps beat
    K = 1 but lose to K = 4. Trying K = 1 alone, the batch stayed at K = 0 for good."""
    costs = loaded(64)  # where the model puts the batch at K = 0
    trials = costs.trials_at(64)
    trials.switch(4)
    trials.switch(0)
    yields = {0: 60.0, 1: 45.0, 2: 55.0, 3: 70.0, 4: 90.0, 5: 75.0, 6: 70.0, 7: 65.0,
              8: 60.0}
    ks = run_phases([at_load(costs, 64) for _ in range(2)], yields, phases=64)
    assert {0, 1, 4} <= set(ks) and trials.k == 4


def test_a_band_that_starts_at_k_zero_tries_the_k_the_model_drafts_best_by(monkeypatch):
    """The band's first choice is K = 0 (measured: a prediction's requests at 16 streams, the
    model's costs from the first loaded rounds) while the drafts are nearly all accepted:
    plain steps beat K = 1 and lose to K = 4. Its trials try the K the model drafts best by
    (4 here), not K = 1 alone, and the batch leaves K = 0; the mutant that tries K = 1 alone
    keeps the batch at K = 0 for good."""
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, current=None: 0)
    yields = {0: 60.0, 1: 45.0, 2: 55.0, 3: 70.0, 4: 90.0, 5: 75.0, 6: 70.0, 7: 65.0,
              8: 60.0}

    def run() -> tuple[list[int], int]:
        costs = loaded(16)
        policies = [at_load(costs, 16, alpha=0.95) for _ in range(2)]
        ks = run_phases(policies, yields, phases=64)
        return ks, costs.trials_at(16).k

    assert at_load(loaded(16), 16, alpha=0.95).best_drafting() == 4
    ks, k = run()
    assert ks[0] == 0 and 4 in ks and k == 4
    monkeypatch.setattr(AdaptiveK, "best_drafting", lambda self: 1)
    ks, k = run()
    assert set(ks) == {0, 1} and k == 0


def test_without_the_back_off_losing_trials_keep_their_share(monkeypatch):
    """The mutant that never backs off (no losses kept) fails the check above."""
    monkeypatch.setattr(BatchTrials, "most_losses", 0)
    costs = loaded(64)
    policies = [at_load(costs, 64) for _ in range(2)]
    late = run_phases(policies, {0: 60.0, 1: 45.0}, phases=48)[-24:]
    assert late.count(1) == 24 // AdaptiveK.batch_explore_every


def test_one_win_does_not_end_the_back_off():
    """A K that lost three trials runs one turn in four; one win (noise, as often as not:
    one trial's ratio ranged 0.48-1.05 for K = 1 at 16 streams) brings it to one in two,
    a second to every turn. A gain within the margin a switch asks for is no win."""
    assert BatchTrials.margin == AdaptiveK.margin
    trials = BatchTrials()
    trials.switch(0)

    def trial(phase: int, tried_yield: float) -> int:
        for p, k, y in ((phase, 0, 50.0), (phase + 1, 1, tried_yield), (phase + 2, 0, 50.0)):
            trials.close(p, k, y)
        return trials.skips[1]

    assert [trial(0, 40.0), trial(3, 40.0), trial(6, 40.0)] == [1, 3, 3]
    assert [trial(9, 60.0), trial(12, 60.0)] == [1, 0]
    assert [trial(15, 54.0), trial(18, 54.0)] == [1, 3]  # 8 % more: losses


def test_each_load_band_keeps_its_own_k(monkeypatch):
    """The trials at 4 calls a batch move the K from the model's 2 to 3; at 16 the batch
    starts from the model's K there (1), not from 4's, and back at 4 a request starts at
    the 3 learnt there. The mutant with one band for every load carries 3 to 16."""
    from speculative import costs as module

    def run(one_band: bool) -> tuple[int, int, int]:
        if one_band:
            monkeypatch.setattr(module, "load_band", lambda load: 0)
        costs = loaded(64)
        assert at_load(costs, 4).choose(None) == 2 and at_load(costs, 16).choose(None) == 1
        yields = {0: 30.0, 1: 40.0, 2: 50.0, 3: 65.0, 4: 55.0}
        run_phases([at_load(costs, 4) for _ in range(2)], yields, phases=64)
        at_4 = costs.trials_at(4).k
        at_16 = at_load(costs, 16).batch_k()[0]
        return at_4, at_16, AdaptiveK(KBounds(0, 8), costs, False, True, load=4).k

    assert run(one_band=False) == (3, 1, 3)
    assert run(one_band=True) == (3, 3, 3)


def test_before_a_trial_is_judged_the_model_may_only_lower_the_batch_k(monkeypatch):
    """Until the band's first trial is judged the model moves the batch's K, and only down:
    a model that says 8, then 0, then 6 (as its costs move) leaves the batch at 0. The
    mutant that takes the model's K either way moves the batch back to 6."""
    assert ks_run(monkeypatch) == [8, 0, 0]
    monkeypatch.setattr(AdaptiveK, "lowered", lambda self, k: self.choose(k))
    assert ks_run(monkeypatch) == [8, 0, 6]


def test_a_drafter_the_router_runs_itself_lets_the_model_move_the_batch_k_either_way(
        monkeypatch):
    """Prompt lookup (a request's named drafter, a prediction's) has no pool to contend for
    the cores and no catch-up after rounds without a draft: before a trial is judged the
    model moves its batch back up (served, 4 streams of predicted requests: a batch the first
    rounds lowered to K = 0 stayed there at 0.6-0.7x of a fixed K = 4)."""
    assert ks_run(monkeypatch, router_side=True) == [8, 0, 6]
    front = RequestFrontEnd(SpeculationDefaults(num_speculative_tokens="auto"))
    greedy = SamplingParams(temperature=0, max_tokens=8)
    for kind, router_side in (("ngram", True), (None, False), ("model", False)):
        [choice] = front.plan("r", (1, 2), greedy, drafter_kind=kind).choices
        assert choice.policy.costs.router_side is router_side


def ks_run(monkeypatch, router_side: bool = False) -> list[int]:
    """The batch K of a policy under load whose model says 8, then 0, then 6 (as its costs
    move), before any trial is judged."""
    said = [8, 0, 6]
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, current=None: said[0])
    costs = loaded(64)
    costs.router_side = router_side  # (loaded's CostModel is a pool drafter's)
    policy = at_load(costs, 64)
    ks = []
    for _ in range(3):
        for _ in range(AdaptiveK.choose_every * 2):
            k, _phase = policy.batch_k()
        ks.append(k)
        if len(said) > 1:
            said.pop(0)  # the model's costs moved
    assert not costs.trials_at(64).judged
    return ks


def run_pipelined(policies: list[AdaptiveK], yields: dict[int, float], rounds: int) -> None:
    """Loaded pipelined rounds of the policies in turn, as the round loop runs them: a round
    verifies the block pre-drafted beside the request's round before, at the K in force
    then (after a round at K = 0, which pre-drafts nothing, one drafted at its own K), and
    yields at the K it verified."""
    block = {id(policy): None for policy in policies}  # K of the pre-drafted block
    for _ in range(rounds):
        for policy in policies:
            carried = block[id(policy)] is not None
            ran = block[id(policy)] if carried else policy.k
            block[id(policy)] = policy.k or None  # pre-drafted beside this round
            policy.update(ran, ran, RoundCost(
                ran + 1, 0.01, 0, 0.0, 0.0, 32, 32 * (ran + 1), comparable=True,
                kind="carried" if carried else "sequential", wall_seconds=4 / yields[ran],
                tokens=4, carried=carried))


def test_many_streams_judge_each_k_by_the_rounds_that_ran_it():
    """128 pipelined requests at K = 4, the best: every trial loses, and the batch stays.
    A phase of 96 rounds held no request's second round, so each phase's yield was its
    neighbour's K's, every trial judged inverted (a worse K won), and the batch left the
    best K (measured served: it settled at K = 0, 0.6x of a fixed K = 4's tokens)."""
    costs = CostModel()
    policies = [at_load(costs, 32) for _ in range(128)]
    trials = costs.trials_at(32)
    trials.switch(4)
    trials.judged = True  # the trials decide, not the cost model
    yields = {0: 40.0, 1: 45.0, 2: 50.0, 3: 55.0, 4: 60.0, 5: 58.0, 6: 56.0, 7: 54.0,
              8: 52.0}
    for policy in policies:
        policy.k = 4  # (its first update joins the batch: under load from the start)
    run_pipelined(policies, yields, rounds=160)
    assert trials.k == 4 and trials.phase >= 20
    assert trials.ratios and all(r < 1 for ratios in trials.ratios.values() for r in ratios)


def test_a_full_pools_load_stays_in_one_band():
    """A pool's max_batch_size (8, 16, 32, 64, ...) is no band's edge: the load of requests
    at a full pool of 32 calls read 27.5-32.3 served, and split between two bands' trials
    when 32 was an edge. 4 and 16 calls a batch keep their own bands."""
    from speculative.costs import load_band

    for cap in (8, 16, 32, 64, 128):
        assert load_band(cap * 0.85) == load_band(cap) == load_band(cap * 1.05), cap
    assert len({load_band(load) for load in (1.0, 4, 16, 64)}) == 4


def test_short_requests_do_not_lengthen_the_phases():
    """16 streams, each a request of 3 rounds after another: a phase is 96 rounds, 6 of
    each of the 16 running. Counting every request that ran in the phase before (48 in 96
    rounds, more in a longer one), each phase was twice the one before, and the batch ran
    one K, a trial's too, for ever longer."""
    costs = loaded(64)
    trials = costs.trials_at(16)
    streams = [at_load(costs, 16) for _ in range(16)]
    for i in range(AdaptiveK.batch_rounds * 20):
        if i // 16 % 3 == 0:  # each stream's request ends after 3 rounds: a new one
            streams[i % 16] = at_load(costs, 16)
        streams[i % 16].batch_k()
    assert trials.phase >= 18  # (counting the ended ones: 7, the phases doubling)
    # many requests running keep their clean rounds: 6 of each of 128 a phase
    many = [at_load(costs, 32) for _ in range(128)]
    for _ in range(30):
        for policy in many:
            policy.batch_k()
    assert costs.trials_at(32).phase <= 8  # 768 rounds a phase from the third on (96: 40)
