"""speculative.tree by hand-built cases: the tree's structure, greedy acceptance, a chain equal
to Algorithm 1 draw for draw, one-hot targets equal to greedy, and siblings drawn distinct.
The law of sampled trees is tests/stats/test_tree_law.py's."""

import pytest
import torch

from speculative.rejection import rejection_sample
from speculative.tree import (
    allocate_siblings,
    ROOT,
    DraftTree,
    accept_tree,
    accept_tree_greedy,
    draw_children,
)

# root -> 3 (node 0) -> 1 (node 2)
# root -> 5 (node 1) -> 2 (node 3), 4 (node 4)
TREE = DraftTree(token_ids=(3, 5, 1, 2, 4), parents=(ROOT, ROOT, 0, 1, 1))


def test_structure():
    assert TREE.children(ROOT) == [0, 1] and TREE.children(1) == [3, 4]
    assert TREE.children(2) == [] and TREE.path(4) == [5, 4] and TREE.path(ROOT) == []
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree((1, 2), (1, ROOT))
    with pytest.raises(ValueError, match="one parent per token"):
        DraftTree((1, 2), (ROOT,))


def test_greedy_follows_the_targets_argmax_down_the_tree():
    # argmax at the root 5 (node 1), at node 1: 4 (node 4), at node 4 (a leaf): 0, the bonus
    argmax = [5, 9, 4, 9, 9, 0]  # rows: root, then nodes 0..4 (9: never read)
    outcome = accept_tree_greedy(TREE, argmax)
    assert outcome.round.output_token_ids == (5, 4, 0) and outcome.round.num_accepted == 2
    assert outcome.accepted_nodes == (1, 4)
    # at node 1 the target wants 7, no child: 7 is the recovered token
    missed = accept_tree_greedy(TREE, [5, 9, 7, 9, 9, 9])
    assert missed.round.output_token_ids == (5, 7) and missed.accepted_nodes == (1,)
    assert accept_tree_greedy(TREE, [6, 9, 9, 9, 9, 9]).round.output_token_ids == (6,)


def random_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(rows, vocab, generator=generator), -1)


@pytest.mark.parametrize("seed", range(40))
def test_a_chain_is_algorithm_1_draw_for_draw(seed):
    """A tree of one child per node takes the same coins and draws as rejection_sample."""
    k, vocab = 3, 5
    draft_probs, target_probs = random_rows(k + 1, vocab, seed), random_rows(k + 1, vocab,
                                                                              seed + 100)
    drafted = [int(torch.multinomial(draft_probs[i], 1, generator=torch.Generator()
                                     .manual_seed(seed * 10 + i))) for i in range(k)]
    chain = DraftTree(tuple(drafted), tuple(range(-1, k - 1)))
    tree = accept_tree(chain, draft_probs, target_probs, torch.Generator().manual_seed(seed))
    reference = rejection_sample(drafted, draft_probs[:k], target_probs,
                                 torch.Generator().manual_seed(seed))
    assert tree.round == reference
    assert tree.accepted_nodes == tuple(range(reference.num_accepted))


@pytest.mark.parametrize("seed", range(20))
def test_one_hot_targets_accept_as_greedy(seed):
    """With p one-hot at every node, any q that drew the tree gives the greedy path."""
    generator = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, 6, (1 + len(TREE.token_ids),), generator=generator)
    argmax[0] = TREE.token_ids[seed % 2]  # half the cases accept a first-level node
    target = torch.nn.functional.one_hot(argmax, 6).float()
    draft = random_rows(1 + len(TREE.token_ids), 6, seed)
    assert accept_tree(TREE, draft, target, generator) == accept_tree_greedy(TREE, argmax)


def test_siblings_are_distinct_and_end_with_the_support():
    q = torch.tensor([0.5, 0.0, 0.3, 0.2])
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        drawn = draw_children(q, 3, generator)
        assert sorted(drawn) == [0, 2, 3]  # all three of the support, each once
    assert len(draw_children(q, 5, generator)) == 3
    assert draw_children(torch.tensor([0.0, 1.0]), 2, generator) == [1]


def test_siblings_go_where_the_walk_arrives_unsure():
    # reach: 1, 0.9, 0.45; unsure: 0.1, 0.5, 0.8 -> values 0.1, 0.45, 0.36
    assert allocate_siblings([0.9, 0.5, 0.2], 2, 3) == [0, 2, 1]
    assert allocate_siblings([0.9, 0.5, 0.2], 1, 2) == [0, 1, 1]
    assert allocate_siblings([0.9, 0.5, 0.2], 2, 0) == [0, 0, 0]
    assert allocate_siblings([0.5, 0.5], 3, 99) == [3, 3]  # width everywhere
    assert allocate_siblings([1.0, 1.0], 1, 1) == [1, 0]  # a tie: the shallower


@pytest.mark.parametrize("greedy", [True, False])
def test_a_drafted_tree_keeps_its_budget_and_its_main_chain(greedy):
    """The main chain is the chain the same seed drafts; the siblings are distinct from the
    main token and each other, within the node budget, one q row per node (its parent's)."""
    from drafter.model import ModelDrafter
    from speculative.sampling import SamplingParams
    from speculative.types import EMPTY_PREFIX_HASH, PrefixSync, ProposeCall
    from tests.tiny import tiny_llama

    drafter = ModelDrafter(tiny_llama(8, layers=1))
    sampling = SamplingParams(temperature=0.0 if greedy else 1.0)
    sync = PrefixSync(0, EMPTY_PREFIX_HASH, (3, 1, 4))
    chain = drafter.propose_now(ProposeCall("c", sync, 4, sampling, 5))
    tree = drafter.propose_now(ProposeCall("t", sync, 4, sampling, 5, tree_width=3,
                                           tree_nodes=7))
    assert tree.token_ids[:4] == chain.token_ids and tree.parents[:4] == (-1, 0, 1, 2)
    assert len(tree.token_ids) == 7
    for node in range(4, 7):
        parent = tree.parents[node]
        siblings = [tree.token_ids[n] for n, p in enumerate(tree.parents) if p == parent]
        assert len(siblings) == len(set(siblings)) <= 3
    if not greedy:
        assert len(tree.draft_probs) == 7
        for node, parent in enumerate(tree.parents):
            main = parent + 1  # the main chain's node at that depth drew from the same row
            assert torch.equal(tree.draft_probs.weights[node], tree.draft_probs.weights[main])


def test_a_tree_too_wide_is_refused_before_the_drafters_sessions_move():
    from drafter.model import ModelDrafter
    from speculative.sampling import SamplingParams
    from speculative.types import EMPTY_PREFIX_HASH, PrefixSync, ProposeCall
    from tests.tiny import tiny_llama

    drafter = ModelDrafter(tiny_llama(8, layers=1), max_cached_requests=1)
    sync, greedy = PrefixSync(0, EMPTY_PREFIX_HASH, (3, 1, 4)), SamplingParams(temperature=0)
    drafter.propose_now(ProposeCall("kept", sync, 2, greedy, 0))
    with pytest.raises(ValueError, match="tree_width"):
        drafter.propose_now(ProposeCall("wide", sync, 2, greedy, 0, tree_width=99))
    assert drafter.sessions.get("kept") is not None and drafter.sessions.get("wide") is None


def test_a_tree_never_outgrows_the_outputs_room():
    """The verifier's slots hold committed + nodes: a tree keeps to the output's room less
    one (within the context whenever the output is), and becomes a chain at the end."""
    from speculative.loop import tree_shape
    from speculative.state import Request, RequestState
    from speculative.sampling import SamplingParams

    def shape(max_tokens, k, width=3, nodes=0, beside=False, context=None):
        request = Request("r", (1, 2), SamplingParams(max_tokens=max_tokens),
                          tree_width=width, tree_nodes=nodes, context_limit=context)
        return tree_shape(RequestState(request), k, beside)

    assert shape(100, 4) == (3, 12)
    assert shape(100, 4, nodes=6) == (3, 6)
    assert shape(8, 4) == (3, 7)  # 7 slots left after the committed tokens
    assert shape(5, 4) == (1, 0)  # no room beside the main chain: a chain
    assert shape(5, 4, context=100) == (3, 12)  # a known context: its room counts
    assert shape(100, 4, context=10) == (3, 7)
    # a draft beside a verify (a pre-draft, or a fresh one beside a verify of none) is
    # continued as the next round's chain: a chain
    assert shape(100, 4, beside=True) == (1, 0) and shape(100, 0) == (1, 0)
    assert shape(100, 4, width=1) == (1, 0)


def test_a_tree_budget_no_deeper_than_the_chain_leaves_the_requests_k():
    """A router-default tree whose node budget leaves no room beside a request's own, deeper
    K drafts that K as a chain; a request tree must have nodes beyond its depth."""
    from deployments.router_args import SpeculativeTree
    from speculative.frontend import RequestFrontEnd
    from speculative.options import SpeculationDefaults, TreeShape
    from speculative.sampling import SamplingParams

    front_end = RequestFrontEnd(SpeculationDefaults(tree=TreeShape(2, 6, 8)))
    plan = front_end.plan("r", (1,), SamplingParams(temperature=0), num_speculative_tokens=16)
    assert plan.num_speculative_tokens == 16 and plan.choices[0].request.tree_width == 1
    plan = front_end.plan("r", (1,), SamplingParams(temperature=0), num_speculative_tokens=4)
    assert (plan.choices[0].request.tree_width, plan.choices[0].request.tree_nodes) == (2, 8)
    with pytest.raises(ValueError, match="must exceed depth"):
        SpeculativeTree(width=2, depth=6, nodes=6)


def test_no_tree_passes_the_nodes_a_verifier_scores():
    from speculative.loop import tree_shape
    from speculative.state import Request, RequestState
    from speculative.sampling import SamplingParams

    request = Request("r", (1, 2), SamplingParams(max_tokens=1000), tree_width=8)
    assert tree_shape(RequestState(request), 16, False) == (8, 64)


@pytest.mark.parametrize("seed", range(6))
def test_sampled_siblings_are_drawn_without_the_main_token_or_each_other(seed):
    """Sampled siblings come from q with the main token (and the siblings before) removed:
    with q cut to its top 2, each level has at most one sibling, never the main token."""
    from drafter.model import ModelDrafter
    from speculative.sampling import SamplingParams
    from speculative.types import EMPTY_PREFIX_HASH, PrefixSync, ProposeCall
    from tests.tiny import tiny_llama

    drafter = ModelDrafter(tiny_llama(8, layers=1), draft_top_k=2)
    sync = PrefixSync(0, EMPTY_PREFIX_HASH, (3, 1, 4))
    tree = drafter.propose_now(ProposeCall("t", sync, 3, SamplingParams(temperature=1.0),
                                           seed, tree_width=3, tree_nodes=6))
    assert tree.parents is not None
    for parent in set(tree.parents):
        children = [tree.token_ids[n] for n, p in enumerate(tree.parents) if p == parent]
        assert len(children) == len(set(children)) <= 2, (parent, children)


def test_tree_scores_test_each_sibling_against_the_residual_of_those_before():
    """tree_scores' acceptance probabilities and the rows it draws from, against the rule
    worked through by hand: at a node, child x is accepted with min(1, r(x) / q(x)); a
    rejection takes r <- norm(max(0, r - q)) and q <- q without x; the row a node's draw
    comes from is what is left once all its children are rejected (p at a leaf)."""
    import speculative.tree as tree_module
    from speculative.rejection import residual
    from speculative.tree import tree_scores, without

    target = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1],
                           [0.1, 0.1, 0.1, 0.7]])
    q_root = torch.tensor([0.05, 0.6, 0.3, 0.05])
    tree = DraftTree(token_ids=(1, 2, 0), parents=(ROOT, ROOT, 0))
    q_node0 = torch.tensor([0.5, 0.2, 0.2, 0.1])
    draft = torch.stack([q_root, q_root, q_node0])
    drawn_rows = []
    real = tree_module.sample_rows
    tree_module.sample_rows = lambda rows, generator: (drawn_rows.append(rows.clone()),
                                                       real(rows, generator))[1]
    try:
        accept, _ = tree_scores(tree, draft, target, torch.Generator().manual_seed(0))
    finally:
        tree_module.sample_rows = real
    r, q = target[0], q_root
    expected = [min(1.0, float(r[1] / q[1]))]
    r, q = residual(r, q), without(q, 1)
    expected.append(min(1.0, float(r[2] / q[2])))
    root_row = residual(r, q)
    expected.append(min(1.0, float(target[1][0] / q_node0[0])))
    node0_row = residual(target[1], q_node0)
    assert accept.tolist() == pytest.approx(expected, abs=1e-6)
    [rows] = drawn_rows
    torch.testing.assert_close(rows[0], root_row, atol=1e-6, rtol=0)
    torch.testing.assert_close(rows[1], node0_row, atol=1e-6, rtol=0)
    torch.testing.assert_close(rows[2:], target[2:], atol=0, rtol=0)  # leaves: p


def test_tree_scores_reads_nothing_back_to_the_host():
    """tree_scores runs on the verifier's device with no host sync (its docstring): no op
    reads a value back, such as the .item() that indexing by a 0-dim tensor makes (torch's
    TensorIndexing.h: a 0-dim integer index is applied as tensor.item(), on a GPU a
    device-to-host copy and a wait for the forward, twice per node)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from speculative.tree import tree_scores

    class HostReads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    vocab = 8
    draft = torch.softmax(torch.arange(5 * vocab, dtype=torch.float).view(5, vocab) % 7, -1)
    target = torch.softmax(torch.arange(6 * vocab, dtype=torch.float).view(6, vocab) % 5, -1)
    with HostReads() as reads:  # (outside inference mode, where CPU reads skip the mode)
        accept, draws = tree_scores(TREE, draft, target, torch.Generator().manual_seed(0))
    assert reads.count == 0
    assert accept.shape == (5,) and draws.shape == (6,)
