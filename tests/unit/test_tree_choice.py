"""speculative_tree "auto": the adaptive K chooses, round by round, between its chain of K and a
tree of K nodes, by the yields their sequential rounds measured (AdaptiveK.round_shape)."""

import pytest

from speculative.costs import CostModel, RoundCost
from speculative.yields import ShapeYields
from speculative.frontend import RequestFrontEnd
from speculative.options import SpeculationDefaults, TreeShape
from speculative.policy import AdaptiveK, KBounds
from speculative.sampling import SamplingParams


def test_a_shape_yield_is_trusted_after_a_few_rounds_and_follows_recent_ones():
    yields = ShapeYields()
    for _ in range(ShapeYields.least - 1):
        yields.record(4, True, 5, 0.01)
    assert yields.rate(4, True) is None and yields.rate(4, False) is None
    yields.record(4, True, 5, 0.01)
    assert yields.rate(4, True) == pytest.approx(500)
    for _ in range(200):
        yields.record(4, True, 2, 0.01)
    assert yields.rate(4, True) == pytest.approx(200, rel=1e-3)


def policy(trees: bool = True, k: int = 8) -> AdaptiveK:
    return AdaptiveK(KBounds(1, 8, initial=k), CostModel(), pipelined=False, greedy=True,
                     trees=trees)


def with_yields(chosen: AdaptiveK, chain: float, tree: float) -> AdaptiveK:
    for _ in range(20):
        chosen.costs.shapes.record(chosen.k, False, chain, 1.0)
        chosen.costs.shapes.record(chosen.k, True, tree, 1.0)
    return chosen


def shapes_over(chosen: AdaptiveK, rounds: int) -> list:
    """round_shape over `rounds` rounds, the round counter moving as update moves it."""
    shapes = []
    for _ in range(rounds):
        shapes.append(chosen.round_shape(True))
        chosen.rounds += 1
    return shapes


def test_the_shape_that_yields_more_runs_and_the_other_is_explored():
    chain_wins = shapes_over(with_yields(policy(), chain=400, tree=300), 16)
    assert chain_wins.count(None) == 14 and chain_wins.count((7, 8)) == 2
    tree_wins = shapes_over(with_yields(policy(), chain=300, tree=400), 16)
    assert tree_wins.count((7, 8)) == 14 and tree_wins.count(None) == 2
    # within the margin the chain stays
    close = shapes_over(with_yields(policy(), chain=400, tree=420), 16)
    assert close.count(None) == 14


def test_no_tree_without_trees_at_k_below_two_or_under_load():
    assert shapes_over(policy(trees=False), 16) == [None] * 16
    assert shapes_over(policy(k=1), 16) == [None] * 16
    loaded = policy()
    loaded.loaded = True
    assert shapes_over(loaded, 16) == [None] * 16


def sequential(tokens: int, batch_size: int = 1, kind: str = "sequential") -> RoundCost:
    return RoundCost(5, 0.005, 4, 0.004, 0.001, batch_size, kind=kind, wall_seconds=0.01,
                     tokens=tokens)


def test_a_round_is_recorded_under_the_shape_and_k_it_was_given():
    chosen = policy()
    for _ in range(ShapeYields.least):
        chosen.k, chosen.rounds = 8, 4  # K = 8, on the round that explores: a tree
        assert chosen.round_shape(True) == (7, 8)
        chosen.update(4, 3, sequential(5))  # its draft cut short: still the tree of 8
    for _ in range(ShapeYields.least):
        chosen.k, chosen.rounds = 8, 1  # the chain's yield unknown: the chain
        assert chosen.round_shape(True) is None
        chosen.update(4, 3, sequential(4))  # the chain of 8, cut short
    assert chosen.costs.shapes.rate(8, True) == pytest.approx(500)
    assert chosen.costs.shapes.rate(8, False) == pytest.approx(400)
    assert chosen.costs.shapes.rate(4, False) is None  # filed by K, not by what was drafted


@pytest.mark.parametrize("free, cost", [
    (False, sequential(9)),  # a carried or clipped round: the shape was not the policy's
    (True, sequential(9, batch_size=16)),  # under batch load: the batch cycle's time
    (True, sequential(9, kind="carried")),  # pipelined
])
def test_rounds_whose_shape_was_not_chosen_alone_are_not_recorded(free, cost):
    chosen = policy()
    for _ in range(8):
        chosen.round_shape(free)
        chosen.update(8, 4, cost)
    assert chosen.costs.shapes.sums == {}


@pytest.mark.parametrize("k, pipelined, sampling, trees", [
    ("auto", False, SamplingParams(temperature=0), True),
    ("auto", True, SamplingParams(temperature=0), False),  # a pre-draft continues a chain
    (4, False, SamplingParams(temperature=0), False),  # a fixed K learns nothing
    ("auto", False, SamplingParams(temperature=1, seed=3), False),  # seeded: a fixed K
    ("auto", False, SamplingParams(temperature=0, presence_penalty=1.0), False),  # shaping
])
def test_auto_trees_need_an_adaptive_k_sequential_rounds_and_no_shaping(k, pipelined, sampling,
                                                                        trees):
    front_end = RequestFrontEnd(SpeculationDefaults(num_speculative_tokens=k,
                                                    tree=TreeShape(auto=True)))
    plan = front_end.plan("r", (1, 2, 3), sampling, pipelined=pipelined)
    [choice] = plan.choices
    assert choice.request.tree_width == 1  # the policy chooses each round's shape
    assert getattr(choice.policy, "trees", False) is trees


def test_a_request_that_starts_under_load_drafts_the_batchs_chain_uncut():
    """Under batch load every request drafts the router's K as a chain, with no confidence
    cut (the batch's one K): from its first round, not from its second (its first drafted
    the tree and cut the block that its costs chose alone)."""
    costs = CostModel()
    for _ in range(8):
        costs.shapes.record(4, True, 6, 0.01)
        costs.shapes.record(4, False, 4, 0.01)
    for _ in range(50):
        costs.confidence.observe([0.01] * 6, 1)
    costs.trials_at(16).switch(4)
    alone = AdaptiveK(KBounds(0, 8, initial=4), costs, False, True, trees=True,
                      confidence="auto")
    assert alone.round_shape(True) is not None and alone.draft_confidence() > 0
    policy = AdaptiveK(KBounds(0, 8), costs, False, True, load=16, trees=True,
                       confidence="auto")
    assert policy.k == 4 and policy.round_shape(True) is None
    assert policy.draft_confidence() == 0.0
