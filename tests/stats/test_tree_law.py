"""Draft trees accepted by speculative.tree.accept_tree keep the target's law, whatever the shape.

A target law p and a draft law q over 6 tokens for every prefix (fixed random tables, some
truncated as top-p would, with supports that differ between p and q). Each sample drafts a
tree from q the way the module's docstring says (siblings drawn one after another without
replacement, written here apart from the product's draw_children), verifies it, and extends
the output to the tree's depth + 1 tokens with draws from p, as the next rounds would. Those
tokens must follow p's exact law of a sequence of that length: chi-square at a false-failure
rate of 1e-6 per case, samples seeded.

Each case runs the reference walk (accept_tree, p in hand) and the served split (the
verifier's tree_scores, the router's accept_tree_drawn). Mutants that must fail at the same
sample size, in both forms: a sibling tested against the unreduced p after a rejection, a
sibling tested against the q its earlier siblings were drawn from (the removal forgotten),
the children of a node tested against the q of the node's parent, (the truncated case's) a
residual kept to q's support, and (the uneven case's) a node's children found by a full tree's
layout.
"""

import itertools

import numpy as np
import pytest
import torch

from speculative import tree as tree_module
from speculative.tree import ROOT, DraftTree, accept_tree, accept_tree_drawn, tree_scores
from tests.stats.test_pipelined_distribution import FALSE_FAILURE, chi2_passes as passes

VOCAB = 6
SAMPLES = 8_000  # a case's, unless CASES says: the mutants below fail by 1,000-4,000
CHUNK = 1_000  # a mutant's counts are checked after every CHUNK samples


class Laws:
    """p and q after every prefix: fixed random tables (seeded by the prefix), q a noisy
    copy of p; truncated: each keeps its smallest entries at zero (a top-p cut)."""

    def __init__(self, truncated: bool) -> None:
        self.truncated, self.cache, self.q_lists = truncated, {}, {}

    def at(self, prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if prefix not in self.cache:
            rng = np.random.default_rng([len(prefix), *prefix])
            logits = rng.normal(0, 1.2, VOCAB)
            laws = [self.normalised(logits), self.normalised(logits + rng.normal(0, 0.8, VOCAB))]
            self.cache[prefix] = tuple(torch.tensor(law, dtype=torch.float32) for law in laws)
        return self.cache[prefix]

    def q_list(self, prefix: tuple[int, ...]) -> list[float]:
        """q after prefix as a fresh list of floats (a draft removes its drawn tokens)."""
        if prefix not in self.q_lists:
            self.q_lists[prefix] = self.at(prefix)[1].double().tolist()
        return list(self.q_lists[prefix])

    def normalised(self, logits: np.ndarray) -> np.ndarray:
        probs = np.exp(logits - logits.max())
        if self.truncated:
            probs[np.argsort(probs)[:2]] = 0  # the two least likely tokens cut
        return probs / probs.sum()

    def sequence_law(self, length: int) -> np.ndarray:
        law = np.zeros((VOCAB,) * length)
        for tokens in itertools.product(range(VOCAB), repeat=length):
            law[tokens] = np.prod([float(self.at(tokens[:i])[0][t])
                                   for i, t in enumerate(tokens)])
        return law


def draft_tree(laws: Laws, widths: tuple[int, ...], rng: np.random.Generator) -> DraftTree:
    """A tree drafted from q: widths[d] children per node at depth d, each drawn from q
    with its earlier siblings removed (an inverted cumulative sum on the host: numpy's
    choice with p took a third of the test's time)."""
    tokens, parents, frontier = [], [], [(ROOT, ())]  # (node, its path)
    for width in widths:
        next_frontier = []
        for node, path in frontier:
            q = laws.q_list(path)
            for _ in range(width):
                total = sum(q)
                if total <= 0:
                    break
                token = inverted(q, rng.random() * total)
                q[token] = 0.0
                tokens.append(token)
                parents.append(node)
                next_frontier.append((len(tokens) - 1, (*path, token)))
        frontier = next_frontier
    return DraftTree(tuple(tokens), tuple(parents))


def inverted(weights: list[float], u: float) -> int:
    """The token whose slice of the cumulative weights holds u (in [0, sum)); a token of
    weight 0 is never drawn."""
    for token, weight in enumerate(weights):
        if weight > 0:
            u -= weight
            last = token
            if u < 0:
                return token
    return last  # rounding left u at the very top


def rows(laws: Laws, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft_probs, target_probs): [1 + nodes, V], the root's row, then each node's."""
    paths = [()]  # the root's, then each node's: its parent's and its token (parents first)
    for token, parent in zip(tree.token_ids, tree.parents):
        paths.append((*paths[parent + 1], token))
    at = [laws.at(path) for path in paths]
    return torch.stack([q for _, q in at]), torch.stack([p for p, _ in at])


def parents_q(tree: DraftTree, draft_probs: torch.Tensor) -> torch.Tensor:
    """Mutant input: every node's children tested against the q of the node's parent."""
    shifted = draft_probs.clone()
    for node, parent in enumerate(tree.parents):
        shifted[node + 1] = draft_probs[parent + 1]
    return shifted


def residual_over_q_support(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """Mutant input: the residual max(p - q, 0) kept only where q > 0 (as a sparse q's ids
    alone would give it), p where that leaves nothing: tokens p has and q lacks are never
    drawn. Exact where q has every token, so only the truncated case can see it."""
    diff = (target - draft).clamp_min(0) * (draft > 0)
    total = diff.sum(-1, keepdim=True)
    return torch.where(total > 1e-12, diff / total.clamp_min(1e-12), target)


def children_of_a_full_tree(tree: DraftTree, node: int) -> list[int]:
    """Mutant of DraftTree.children: the children found by a full tree's layout (every node
    with as many as the root, numbered level by level), not by the parents. Exact where each
    level's nodes have as many children as the root's, so only an uneven tree can see it."""
    width = tree.parents.count(ROOT)
    first = width * (node + 1)
    return list(range(first, min(first + width, len(tree.parents))))


CASES = {  # name: (widths per depth, truncated[, samples])
    # q-of-the-parent fails at 2.8 (walked) and 3.2 (served) times the threshold at 4,000
    "width2-depth2": ((2, 2), False, 4_000),
    "width5-depth1": ((5,), False),  # a sibling against q with the rejected: 1.9 at 8,000
    "uneven-3-1": ((3, 1), False),
    "width2-depth2-truncated": ((2, 2), True),
}


def accept_split(tree: DraftTree, draft_probs, target_probs, generator):
    """accept_tree as served: the verifier's tree_scores (one q row per node: its parent's),
    then the router's walk."""
    node_rows = draft_probs[[parent + 1 for parent in tree.parents]]
    accept, draws = tree_scores(tree, node_rows, target_probs, generator)
    return accept_tree_drawn(tree, accept.tolist(), draws.tolist(), generator)


def sample_counts(case: str, mutate_q=None, stop_law=None, accept=accept_tree
                  ) -> tuple[np.ndarray, dict]:
    widths, truncated, *size = CASES[case]
    laws, length = Laws(truncated), len(widths) + 1
    rng, generator = np.random.default_rng(7), torch.Generator().manual_seed(11)
    counts = np.zeros((VOCAB,) * length)
    totals = {"accepted": 0, "after_a_rejected_sibling": 0, "samples": (size or [SAMPLES])[0]}
    for i in range(totals["samples"]):
        tree = draft_tree(laws, widths, rng)
        draft_probs, target_probs = rows(laws, tree)
        if mutate_q is not None:
            draft_probs = mutate_q(tree, draft_probs)
        outcome = accept(tree, draft_probs, target_probs, generator)
        output = list(outcome.round.output_token_ids)
        totals["accepted"] += outcome.round.num_accepted
        first = tree.children(ROOT)
        totals["after_a_rejected_sibling"] += bool(outcome.accepted_nodes) and \
            outcome.accepted_nodes[0] != first[0]
        while len(output) < length:  # the next rounds: the target alone
            output.append(int(torch.multinomial(laws.at(tuple(output))[0], 1,
                                                generator=generator)))
        counts[tuple(output[:length])] += 1
        if stop_law is not None and (i + 1) % CHUNK == 0 and not passes(counts, stop_law)[0]:
            break
    return counts, totals


ACCEPTS = {"reference": accept_tree, "served": accept_split}


@pytest.mark.slow
@pytest.mark.parametrize("accept", list(ACCEPTS))
@pytest.mark.parametrize("case", list(CASES))
def test_tree_output_follows_the_target_law(case, accept):
    counts, totals = sample_counts(case, accept=ACCEPTS[accept])
    widths, truncated, *_ = CASES[case]
    ok, message = passes(counts, Laws(truncated).sequence_law(len(widths) + 1))
    assert ok, f"{message}: a correct implementation fails with probability {FALSE_FAILURE}"
    # the paths the case is about ran: accepted nodes, and acceptances after a sibling failed
    samples = totals["samples"]
    assert totals["accepted"] > samples / 4 and totals["after_a_rejected_sibling"] > samples / 20


MUTANTS = {  # name: (case, patch of the module, mutation of q's rows)
    "sibling-against-unreduced-p": ("width5-depth1",
                                    lambda mp: mp.setattr(tree_module, "residual",
                                                          lambda target, draft: target), None),
    "sibling-against-q-with-the-rejected": ("width5-depth1",
                                            lambda mp: mp.setattr(tree_module, "without",
                                                                  lambda q, token: q), None),
    "q-of-the-parent": ("width2-depth2", None, parents_q),
    # the verifier's half (tree_scores), walked by the router
    "served-sibling-against-unreduced-p": (
        "width5-depth1", lambda mp: mp.setattr(tree_module, "residual_rows",
                                               lambda target, draft: target), None),
    "served-sibling-against-q-with-the-rejected": (
        "width5-depth1", lambda mp: mp.setattr(tree_module, "without_rows",
                                               lambda q, token: q), None),
    "served-q-of-the-parent": ("width2-depth2", None, parents_q),
    # the truncated case's own (supports that differ), in both forms
    "residual-over-q-support": ("width2-depth2-truncated", lambda mp: mp.setattr(
        tree_module, "residual", residual_over_q_support), None),
    "served-residual-over-q-support": ("width2-depth2-truncated", lambda mp: mp.setattr(
        tree_module, "residual_rows", residual_over_q_support), None),
    # the uneven case's own (levels of different widths), in both forms
    "children-of-a-full-tree": ("uneven-3-1", lambda mp: mp.setattr(
        DraftTree, "children", children_of_a_full_tree), None),
    "served-children-of-a-full-tree": ("uneven-3-1", lambda mp: mp.setattr(
        DraftTree, "children", children_of_a_full_tree), None),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTANTS))
def test_the_check_catches_a_wrong_tree_acceptance(monkeypatch, name):
    case, patch, mutate_q = MUTANTS[name]
    if patch is not None:
        patch(monkeypatch)
    widths, truncated, *_ = CASES[case]
    law = Laws(truncated).sequence_law(len(widths) + 1)
    accept = accept_split if name.startswith("served") else accept_tree
    counts, _ = sample_counts(case, mutate_q, stop_law=law, accept=accept)
    assert not passes(counts, law)[0], f"the {name} mutant passed"
