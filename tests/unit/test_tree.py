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
    main_chain_length,
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


def test_the_main_chain_is_the_leading_nodes_each_under_the_one_before():
    """main_chain_length by hand: the tokens a refused tree keeps as its chain (loop.
    verify_tree_or_chain) and the confidences a block reports; one node more took a
    sibling, drawn from another law, for the chain's next token. A node cannot be its own
    parent (it would be a child of itself, never reached, its depth undefined)."""
    assert main_chain_length((ROOT, 0, 1, ROOT, 0, 1)) == 3
    assert main_chain_length((ROOT, ROOT)) == 1 and main_chain_length((ROOT, 0)) == 2
    assert main_chain_length(TREE.parents) == 1 and main_chain_length(()) == 0
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree((1, 2), (ROOT, 1))


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
    from speculative.prefixes import EMPTY_PREFIX_HASH
    from speculative.sampling import SamplingParams
    from speculative.types import PrefixSync, ProposeCall
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
    from speculative.prefixes import EMPTY_PREFIX_HASH
    from speculative.sampling import SamplingParams
    from speculative.types import PrefixSync, ProposeCall
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
    plan = RequestFrontEnd(SpeculationDefaults(tree=TreeShape(2))).plan(
        "r", (1,), SamplingParams(temperature=0), num_speculative_tokens=64)
    assert plan.num_speculative_tokens == 64 and plan.choices[0].request.tree_width == 1
    with pytest.raises(ValueError, match="must exceed depth"):
        SpeculativeTree(width=2, depth=6, nodes=6)


@pytest.mark.parametrize("tree, k, message", [
    # the 64 nodes a tree holds at most are all the main chain's
    ({"width": 2}, 64, "64 nodes leave none beside a main chain of 64"),
    ({"width": 2, "nodes": 6}, 8, "6 nodes leave none beside a main chain of 8"),
])
def test_a_requested_tree_with_no_node_beside_its_chain_is_refused(tree, k, message):
    """A request's own tree whose depth is its K drafted that K as a chain, silently, where
    an explicit depth as deep was refused (and the CLI refuses the same flags): a 400
    (the router answers a plan's ValueError so) naming the fields."""
    from deployments.openai_api import ChatCompletionRequest
    from deployments.router_args import tree_shape
    from speculative.frontend import RequestFrontEnd
    from speculative.sampling import SamplingParams

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                 speculative_tree=tree, num_speculative_tokens=k)
    with pytest.raises(ValueError, match=f"speculative_tree: {message}"):
        RequestFrontEnd().plan("r", (1,), SamplingParams(temperature=0),
                               num_speculative_tokens=k, tree=tree_shape(body.speculative_tree))


def test_a_tree_as_deep_as_its_k_allows_is_served_whether_its_depth_is_given_or_its_k():
    """Depth up to 63 (a node beside the chain, of 64), as a K of 63 under a tree of width 2
    was served and the CLI's -k 63 --tree-width 2 is: one bound for both."""
    from deployments.router_args import SpeculativeTree
    from speculative.frontend import RequestFrontEnd
    from speculative.options import TreeShape
    from speculative.sampling import SamplingParams

    assert SpeculativeTree(width=2, depth=63).shape() == TreeShape(2, 63)
    with pytest.raises(ValueError, match="depth"):
        SpeculativeTree(width=2, depth=64)
    front_end = RequestFrontEnd()
    for tree, k in ((TreeShape(2, 63), None), (TreeShape(2), 63)):
        request = front_end.plan("r", (1,), SamplingParams(temperature=0), tree=tree,
                                 num_speculative_tokens=k).choices[0].request
        assert (request.tree_width, request.tree_nodes) == (2, 64)


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
    from speculative.prefixes import EMPTY_PREFIX_HASH
    from speculative.sampling import SamplingParams
    from speculative.types import PrefixSync, ProposeCall
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


def test_the_served_walk_ends_with_the_draw_of_the_row_it_stopped_at():
    """accept_tree_drawn's last token is draws[1 + node] of the node the walk stopped at
    (draws[0]: the root's): the recovered token there, or the bonus at a leaf (a draw read
    from the row before, or always the root's, passed every unit test)."""
    from speculative.tree import accept_tree_drawn

    draws = [100, 101, 102, 103, 104, 105]  # rows: root, then nodes 0..4
    cases = [  # (acceptance probability per node, output, accepted nodes): coins in [0, 1)
        ((0, 0, 0, 0, 0), (100,), ()),
        ((1, 0, 0, 0, 0), (3, 101), (0,)),
        ((1, 0, 1, 0, 0), (3, 1, 103), (0, 2)),
        ((0, 1, 0, 0, 0), (5, 102), (1,)),
        ((0, 1, 0, 1, 0), (5, 2, 104), (1, 3)),
        ((0, 1, 0, 0, 1), (5, 4, 105), (1, 4)),
    ]
    for accept, output, nodes in cases:
        outcome = accept_tree_drawn(TREE, accept, draws, torch.Generator().manual_seed(0))
        assert (outcome.round.output_token_ids, outcome.accepted_nodes) == (output, nodes)


# root -> 0 (node 0) -> 2 (node 2), 3 (node 3), 1 (node 4); root -> 1 (node 1) -> 0 (node 5)
WIDE = DraftTree(token_ids=(0, 1, 2, 3, 1, 0), parents=(ROOT, ROOT, 0, 0, 0, 1))


@pytest.mark.parametrize("seed", range(30))
def test_the_served_walk_takes_the_reference_walks_path_coin_for_coin(seed):
    """The verifier's tree_scores and the router's accept_tree_drawn, given accept_tree's
    coins, accept the same nodes: each sibling tested against the residual of those before
    it with q less them, and the first whose coin passes taken (a reference that kept q
    whole after a rejected sibling, or a walk that went on past a passed sibling, passed
    every unit test)."""
    from speculative.tree import accept_tree_drawn, tree_scores

    nodes, vocab = len(WIDE.token_ids), 4
    target = random_rows(1 + nodes, vocab, seed)
    law_at = random_rows(1 + nodes, vocab, seed + 50)  # q at the root, then after each node
    per_node = torch.stack([law_at[parent + 1] for parent in WIDE.parents])  # tree_scores'
    reference = accept_tree(WIDE, law_at, target, torch.Generator().manual_seed(seed))
    accept, draws = tree_scores(WIDE, per_node, target, torch.Generator().manual_seed(0))
    served = accept_tree_drawn(WIDE, accept.tolist(), draws.tolist(),
                               torch.Generator().manual_seed(seed))
    assert served.accepted_nodes == reference.accepted_nodes
    assert served.round.output_token_ids[:-1] == reference.round.output_token_ids[:-1]


@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_tree_scores_give_the_targets_law_over_the_drafts_draws_of_the_siblings(width, seed,
                                                                                monkeypatch):
    """The exact law, enumerated: siblings drawn from q without replacement (every ordered
    draw, weighted by its probability), each tested with tree_scores' acceptance
    probability, the row's draw taken when all are rejected, give the first token p's law
    exactly (one of q's entries 0 in the last case; three siblings take all of V)."""
    import itertools

    import speculative.tree as tree_module
    from speculative.tree import tree_scores

    vocab = 3
    p = random_rows(1, vocab, seed)[0]
    q = random_rows(1, vocab, seed + 20)[0]
    if seed == 2:
        q[1] = 0.0
        q = q / q.sum()
    drawn_rows = []
    real = tree_module.sample_rows
    monkeypatch.setattr(tree_module, "sample_rows", lambda rows, generator: (
        drawn_rows.append(rows.clone()), real(rows, generator))[1])
    law = torch.zeros(vocab, dtype=torch.float64)
    for tokens in itertools.permutations(range(vocab), width):
        weight, rest = 1.0, q.double()
        for token in tokens:
            if rest.sum() == 0:
                break
            weight, rest = weight * float(rest[token] / rest.sum()), rest.clone()
            rest[token] = 0
        if weight == 0:
            continue
        tree = DraftTree(tokens, (ROOT,) * width)
        target = torch.cat([p[None], random_rows(width, vocab, seed + 40)])
        accept, _ = tree_scores(tree, q.repeat(width, 1), target, torch.Generator())
        reach = weight
        for child, token in enumerate(tokens):
            law[token] += reach * float(accept[child])
            reach *= 1 - float(accept[child])
        law += reach * drawn_rows[-1][0].double()
    torch.testing.assert_close(law, p.double(), atol=1e-6, rtol=0)
