"""Draft trees: several candidate continuations, verified by one target forward, accepted exactly.

A tree's nodes are drafted tokens. Node i follows parents[i] (ROOT: the request's last
committed token), and parents come before their children. The children of a node were
drawn one after another, without replacement, from the draft's law q at that node: the
first from q, each next one from q with the siblings drawn before it removed (renormalised).
A chain of K tokens is the tree whose nodes each have one child.

Acceptance walks down from the root (multi-draft speculative sampling: SpecInfer's
multi-step form, with the recursive rejection sampling of siblings drawn without
replacement). At a node, with r = p there (the target's law after the node's path) and q
its draft law, the children are tested in the order they were drawn: child x is accepted
with probability min(1, r(x) / q(x)), and the walk moves to it; a rejected x updates
r <- norm(max(0, r - q)) and q <- q without x, renormalised. When no child passes, the
output ends with a draw from r: the recovered token, or the bonus token at a leaf (r = p).
Each step is Algorithm 1 on one token with the law q the next child was really drawn from,
and a rejection leaves r(x) = 0 at the rejected x, so the output has the target's law
whatever the tree's shape.

Rows of target_probs: row 0 is the root's, row 1 + i node i's. Draft laws travel one row per
node: the law its parent's children were drawn from (before any of them was removed), so a
chain's rows are q1..qK as for Algorithm 1.

Served, the work splits as a chain's does (speculative.rejection.accept_drawn): the verifier,
which holds p, computes what the walk needs without the router's coins (`tree_scores`: each
child's acceptance probability given that its earlier siblings were rejected, and one draw
per row from what is left when all its children are rejected: the residual, or p at a
leaf); the router walks the tree with its coins (`accept_tree_drawn`). Whether a child is
tested depends on earlier coins only, and each draw is made independently of the coins, so
the walk has accept_tree's law.
"""

from dataclasses import dataclass

import torch

from speculative.rejection import RoundOutcome, residual, residual_rows
from speculative.sampling import sample, sample_rows

ROOT = -1


@dataclass(frozen=True)
class DraftTree:
    token_ids: tuple[int, ...]  # node i's token
    parents: tuple[int, ...]  # node i's parent: ROOT or an earlier node

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError("a tree needs one parent per token")
        if any(not ROOT <= parent < node for node, parent in enumerate(self.parents)):
            raise ValueError("a node's parent must be ROOT or an earlier node")

    def children(self, node: int) -> list[int]:
        """The children of node (ROOT or a node index), in the order they were drawn."""
        return [child for child, parent in enumerate(self.parents) if parent == node]

    def path(self, node: int) -> list[int]:
        """The tokens from the root's first child down to node (ROOT: none)."""
        tokens = []
        while node != ROOT:
            tokens.append(self.token_ids[node])
            node = self.parents[node]
        return tokens[::-1]


def tree_depths(parents) -> list[int]:
    """Each node's depth (a child of the root: 1)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent == ROOT else depths[parent] + 1)
    return depths


def main_chain_length(parents) -> int:
    """How many nodes, from the first, form a chain from the root (each the child of the one
    before): the drafter's main chain, whose slots stand where its tokens will if accepted."""
    return next((node for node, parent in enumerate(parents) if parent != node - 1),
                len(parents))


@dataclass(frozen=True)
class TreeOutcome:
    round: RoundOutcome  # the accepted path's tokens, then the recovered or bonus token
    accepted_nodes: tuple[int, ...]  # the nodes of the accepted path, root side first


def outcome_of(output: list[int], path: list[int]) -> TreeOutcome:
    """The walk's result; the main chain is nodes 0, 1, .. (each the first child of the one
    before: the drafter's layout)."""
    off = any(node != depth for depth, node in enumerate(path))
    return TreeOutcome(RoundOutcome(tuple(output), len(path), tree=1, off_main_chain=int(off)),
                       tuple(path))


def without(draft_probs: torch.Tensor, token: int) -> torch.Tensor:
    """q with a drawn sibling removed, renormalised: the law the next sibling was drawn from
    (all zeros when nothing is left, and then no sibling follows)."""
    rest = draft_probs.clone()
    rest[token] = 0
    total = rest.sum()
    return rest / total if total > 0 else rest


def without_rows(draft_probs: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """`without` of a [1, V] row and a token on the device, with no host sync."""
    rest = draft_probs.index_fill(1, token[None], 0)
    return rest / rest.sum(-1, keepdim=True).clamp_min(1e-30)


def accept_tree(tree: DraftTree, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                generator: torch.Generator) -> TreeOutcome:
    """The accepted path of a sampled tree (module docstring). draft_probs, target_probs:
    [1 + nodes, V], each row the law at the root or after a node (leaves' q rows unused)."""
    node, output, path = ROOT, [], []
    while True:
        target, draft = target_probs[node + 1], draft_probs[node + 1]
        chosen = None
        for child in tree.children(node):
            token = tree.token_ids[child]
            draft_p, target_p = float(draft[token]), float(target[token])
            coin = float(torch.rand((), generator=generator))
            if draft_p > 0 and coin * draft_p < target_p:  # u < r/q without dividing
                chosen = child
                break
            target, draft = residual(target, draft), without(draft, token)
        if chosen is None:
            output.append(sample(target, generator))
            return outcome_of(output, path)
        output.append(tree.token_ids[chosen])
        path.append(chosen)
        node = chosen


def accept_tree_greedy(tree: DraftTree, target_token_ids) -> TreeOutcome:
    """Greedy: follow the child equal to the target's argmax at each node (target_token_ids:
    [1 + nodes], the root's then each node's), then emit the argmax where none is."""
    node, output, path = ROOT, [], []
    while True:
        wanted = int(target_token_ids[node + 1])
        output.append(wanted)
        chosen = next((child for child in tree.children(node)
                       if tree.token_ids[child] == wanted), None)
        if chosen is None:
            return outcome_of(output, path)
        path.append(chosen)
        node = chosen


def draw_children(draft_probs: torch.Tensor, width: int, generator: torch.Generator
                  ) -> list[int]:
    """Up to width distinct tokens drawn one after another from [V] q without replacement
    (each from q with the ones before removed), as accept_tree expects of siblings."""
    tokens, rest = [], draft_probs
    for _ in range(width):
        if not rest.sum() > 0:
            break
        tokens.append(sample(rest, generator))
        rest = without(rest, tokens[-1])
    return tokens


def tree_scores(tree: DraftTree, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(accept [nodes]: min(1, r(x) / q(x)) of each node as accept_tree tests it, draws
    [1 + nodes]: a token from each row's law once all its children are rejected). draft_probs:
    [nodes, V], node i's row the law its parent's children were drawn from; target_probs:
    [1 + nodes, V]. On their device, with no host sync; the draws are one sample_rows."""
    device = target_probs.device
    accept = torch.zeros(len(tree.token_ids), device=device)
    rows = target_probs.clone()
    tokens = torch.tensor(tree.token_ids, dtype=torch.long, device=device)
    for parent in [ROOT, *range(len(tree.token_ids))]:
        children = tree.children(parent)
        if not children:
            continue
        target, draft = target_probs[parent + 1][None], draft_probs[children[0]][None]
        for child in children:
            token = tokens[child]
            # indexed by [1], not by the 0-dim token: torch applies a 0-dim index as .item()
            drafted, held = draft[0, token[None]], target[0, token[None]]  # [1]
            accept[child] = torch.where(drafted > 0, (held / drafted.clamp_min(1e-30))
                                        .clamp_max(1), 0.0)[0]
            target, draft = residual_rows(target, draft), without_rows(draft, token)
        rows[parent + 1] = target[0]
    return accept, sample_rows(rows, generator)


def accept_tree_drawn(tree: DraftTree, accept_probs, draws, generator: torch.Generator
                      ) -> TreeOutcome:
    """The router's walk over tree_scores' answer: at each node its children in drawn order,
    each taken iff its coin u < its acceptance probability; none taken, the row's draw."""
    node, output, path = ROOT, [], []
    while True:
        chosen = None
        for child in tree.children(node):
            coin = float(torch.rand((), generator=generator))
            if coin < accept_probs[child]:
                chosen = child
                break
        if chosen is None:
            output.append(int(draws[node + 1]))
            return outcome_of(output, path)
        output.append(tree.token_ids[chosen])
        path.append(chosen)
        node = chosen


def allocate_siblings(main_probs: list[float], per_level: int, budget: int) -> list[int]:
    """How many siblings each level of a main chain gets: up to `per_level` each, `budget`
    in all, to the levels with the most to gain by the draft's own estimate: the chance the
    walk reaches the level (the main tokens before it all accepted) times the chance its
    main token is not (main_probs[l]: its probability under q). Ties: the shallower."""
    counts, reach, values = [0] * len(main_probs), 1.0, []
    for level, prob in enumerate(main_probs):
        values.append((-reach * (1 - prob), level))
        reach *= prob
    for _, level in sorted(values):
        if budget <= 0:
            break
        counts[level] = min(per_level, budget)
        budget -= counts[level]
    return counts


def check_confidences(confidences: tuple[float, ...] | None, parents: tuple[int, ...] | None,
                      num_tokens: int) -> None:
    """Raise ValueError unless a block that reports confidences (None: it reports none)
    reports one in [0, 1] per token of its main chain (a pool's bad answer must not skew
    the router's cut)."""
    if confidences is None:
        return
    chain = num_tokens if parents is None else main_chain_length(parents)
    if len(confidences) != chain or not all(0 <= c <= 1 for c in confidences):
        raise ValueError(f"a draft must report one confidence in [0, 1] per token of its "
                         f"main chain ({chain}), got {list(confidences)[:8]}")
