"""A round's acceptance from the pools' answers: a chain's (Algorithm 1, speculative.rejection)
or a draft tree's (speculative.tree), one entry point for the round loop.

A tree without q (a model-free drafter's candidates, not drawn from any law) is verified by
matching: the verifier draws the target's own token at every row, and the walk follows the
child equal to it, ending with the first draw no child matches. Each emitted token is then
the target's own draw after the path so far, so the output has the target's law (greedy:
the argmax, as for any tree)."""

from dataclasses import replace

from speculative.rejection import RoundOutcome, accept_drawn, accept_greedy
from speculative.tree import DraftTree, accept_tree_drawn, accept_tree_greedy, tree_depths
from speculative.types import LAWLESS, DraftBlock, PoolUnavailable, TargetScores


def accept(block: DraftBlock, scores: TargetScores, greedy: bool, generator
           ) -> tuple[RoundOutcome, TargetScores]:
    """The round's outcome, and the scores whose logprobs are a chain's (a tree's taken along
    the accepted path)."""
    if block.parents is None:
        return lawful(accept_chain(block, scores, greedy, generator)), scores
    rows = len(scores.target_token_ids) if greedy or block.draft_probs is None else \
        len(scores.recovered_token_ids)
    if scores.tree_nodes != len(block.token_ids) or rows != len(block.token_ids) + 1:
        raise PoolUnavailable("verifier: scored a draft tree as a chain (a version without "
                              "draft trees?): serve both pools from one version")
    tree = DraftTree(block.token_ids, block.parents)
    if greedy or block.draft_probs is None:  # the argmax, or a target's draw, at each row
        outcome = accept_tree_greedy(tree, scores.target_token_ids)
    else:
        outcome = accept_tree_drawn(tree, scores.accept_probs, scores.recovered_token_ids,
                                    generator)
    if scores.logprobs is not None:
        scores = replace(scores, logprobs=scores.logprobs.along(outcome.accepted_nodes))
    return lawful(outcome.round), scores


def lawful(outcome: RoundOutcome) -> RoundOutcome:
    """The outcome, unless it takes a draw the verifier marked LAWLESS: the target's law at
    a row this round reached holds NaN, and no token stands for it. A row past the round's
    end may hold one (its drafts made the target's logits overflow) and fails nothing."""
    if LAWLESS in outcome.output_token_ids:
        raise PoolUnavailable("verifier: the target's probabilities at a sampled position "
                              "are not finite (NaN or inf logits)")
    return outcome


def accept_chain(block: DraftBlock, scores: TargetScores, greedy: bool, generator
                 ) -> RoundOutcome:
    check_chain_scores(len(block.token_ids), scores, greedy)
    if greedy:
        return accept_greedy(block.token_ids, scores.target_token_ids)
    drafted = block.token_ids
    draft_at_draft = block.draft_probs.at(drafted) if drafted else ()  # q_i(x_i), gathered
    return accept_drawn(drafted, draft_at_draft, scores.draft_target_probs,
                        scores.recovered_token_ids, scores.bonus_token_id, generator)


def check_chain_scores(k: int, scores: TargetScores, greedy: bool) -> None:
    """ValueError unless the scores of a chain of k drafted tokens hold an entry per position:
    greedy, k + 1 argmaxes; sampled, k values of p_i(x_i) and k residual draws, and the bonus
    draw. Read as they came, more were cut to k (rows of another block taken for this one's)
    and fewer decided the round until the coins reached a missing one (then an IndexError),
    a missing bonus committed as the token None."""
    if greedy:
        counts, wanted = {"argmaxes": len(scores.target_token_ids)}, k + 1
    else:
        counts, wanted = {"target probabilities": len(scores.draft_target_probs),
                          "residual draws": len(scores.recovered_token_ids)}, k
        if scores.bonus_token_id is None:
            raise ValueError("verifier: sampled scores without their bonus draw")
    for what, count in counts.items():
        if count != wanted:
            raise ValueError(f"verifier: {count} {what} for a chain of {k} drafted tokens "
                             f"(want {wanted})")


def depth(block: DraftBlock) -> int:
    """The tokens a block may add to the output: its length, a tree's depth."""
    return len(block.token_ids) if block.parents is None else max(tree_depths(block.parents))
