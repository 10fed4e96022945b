"""A round's acceptance from the pools' answers: a chain's (Algorithm 1, speculative.rejection)
or a draft tree's (speculative.tree), one entry point for the round loop."""

from dataclasses import replace

from speculative.rejection import RoundOutcome, accept_drawn, accept_greedy
from speculative.tree import DraftTree, accept_tree_drawn, accept_tree_greedy, tree_depths
from speculative.types import DraftBlock, TargetScores


def accept(block: DraftBlock, scores: TargetScores, greedy: bool, generator
           ) -> tuple[RoundOutcome, TargetScores]:
    """The round's outcome, and the scores whose logprobs are a chain's (a tree's taken along
    the accepted path)."""
    if block.parents is None:
        return accept_chain(block, scores, greedy, generator), scores
    tree = DraftTree(block.token_ids, block.parents)
    outcome = accept_tree_greedy(tree, scores.target_token_ids) if greedy else \
        accept_tree_drawn(tree, scores.accept_probs, scores.recovered_token_ids, generator)
    if scores.logprobs is not None:
        scores = replace(scores, logprobs=scores.logprobs.along(outcome.accepted_nodes))
    return outcome.round, scores


def accept_chain(block: DraftBlock, scores: TargetScores, greedy: bool, generator
                 ) -> RoundOutcome:
    if greedy:
        return accept_greedy(block.token_ids, scores.target_token_ids)
    drafted = block.token_ids
    draft_at_draft = block.draft_probs.at(drafted) if drafted else ()  # q_i(x_i), gathered
    return accept_drawn(drafted, draft_at_draft, scores.draft_target_probs,
                        scores.recovered_token_ids, scores.bonus_token_id, generator)


def depth(block: DraftBlock) -> int:
    """The tokens a block may add to the output: its length, a tree's depth."""
    return len(block.token_ids) if block.parents is None else max(tree_depths(block.parents))
