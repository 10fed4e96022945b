"""The verifier's side of draft trees (speculative.tree): which trees it refuses, and a
sampled tree's scores, on the device until the batch's transfer (verifier.host)."""

from speculative.checks import check_tree
from speculative.sampling import sample_rows, seeded_generator
from speculative.tree import DraftTree, tree_scores
from speculative.types import ScoreCall, TargetScores
from verifier import host


def matched(call: ScoreCall) -> bool:
    """A sampled tree without q (a model-free drafter's): no rejection test, the walk
    follows the target's own draw at each row (speculative.accept)."""
    return call.draft_parents is not None and call.draft_probs is None and \
        not call.sampling.greedy


def check_tree_call(call: ScoreCall) -> None:
    """Refuse a draft tree the verifier cannot score: parents that are no tree, or with a
    grammar or logit shaping (their masks and counts follow one chain of drafted tokens)."""
    check_tree(call.draft_parents, len(call.draft_token_ids))
    if call.sampling.grammar is not None or call.sampling.shapes_logits:
        raise ValueError("a draft tree does not combine with structured outputs, penalties, "
                         "logit_bias, min_tokens, allowed_token_ids or bad_words: draft a "
                         "chain")


def tree_scores_of(call: ScoreCall, target_probs, draft_probs) -> TargetScores:
    """A sampled tree's acceptance probabilities and row draws, or, for a tree without q,
    the target's own draw at every row (the walk follows it)."""
    drafted = list(call.draft_token_ids)
    if not matched(call):
        return draw_tree(target_probs, drafted, call.draft_parents, draft_probs, call.seed)
    ids = sample_rows(target_probs, seeded_generator(call.seed, target_probs.device))
    return TargetScores(target_token_ids=ids if host.deferred() else tuple(ids.tolist()))


def draw_tree(target_probs, drafted: list[int], parents, draft_probs, seed: int
              ) -> TargetScores:
    """A sampled tree's scores (speculative.tree.tree_scores): each node's acceptance
    probability and one draw per row, on the device until the batch's transfer."""
    generator = seeded_generator(seed, target_probs.device)
    tree = DraftTree(tuple(drafted), tuple(parents))
    accept, draws = tree_scores(tree, draft_probs, target_probs, generator)
    scores = TargetScores(accept_probs=accept, recovered_token_ids=draws)
    return scores if host.deferred() else host.to_host([scores])[0]
