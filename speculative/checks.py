"""A pool's checks of a call, each a ValueError naming what is wrong, made before the call
touches a cache or a model (bad input is refused, never half applied)."""

from speculative.options import MAX_SPECULATIVE_TOKENS, MAX_TREE_WIDTH
from speculative.types import ProposeCall


def check_prompt_len(prompt_len: int, committed_len: int) -> None:
    """A call's prompt is a prefix of what it commits (checked before a pool changes)."""
    if not 0 <= prompt_len <= committed_len:
        raise ValueError(f"prompt_len {prompt_len} is beyond the committed prefix "
                         f"({committed_len} tokens)")


def check_tree(parents, nodes: int) -> None:
    """Raise ValueError unless parents make a tree of `nodes` nodes, parents first."""
    if len(parents) != nodes:
        raise ValueError(f"a draft tree needs one parent per drafted token: {len(parents)} "
                         f"for {nodes}")
    if any(not -1 <= parent < node for node, parent in enumerate(parents)):
        raise ValueError("a draft tree's parent must be -1 (the committed prefix) or an "
                         "earlier node")


def check_tree_width(call: ProposeCall) -> None:
    """Refuse a tree the drafter cannot draft: too wide, or where its laws follow one chain
    (a pre-draft's assumed tokens, a grammar, logit shaping)."""
    if call.tree_width > MAX_TREE_WIDTH:
        raise ValueError(f"tree_width must be at most {MAX_TREE_WIDTH}, got {call.tree_width}")
    if call.tree_nodes > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"tree_nodes must be at most {MAX_SPECULATIVE_TOKENS}, got "
                         f"{call.tree_nodes}")
    if call.assumed_token_ids or call.sampling.grammar is not None or \
            call.sampling.shapes_logits:
        raise ValueError("a draft tree does not combine with pre-drafting, structured "
                         "outputs, penalties, logit_bias, min_tokens, allowed_token_ids or "
                         "bad_words: draft a chain")


def check_call(token_ids, vocab_size: int, num_speculative_tokens: int = 0) -> None:
    """Raise ValueError for ids outside the vocabulary or an unreasonable K (bad input must
    be refused before it touches a cache or a model)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    if not 0 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                         f"got {num_speculative_tokens}")


def check_confidence(threshold: float | None) -> None:
    """Raise ValueError unless a draft_confidence is None (unset) or in [0, 1)."""
    if threshold is not None and not 0 <= threshold < 1:
        raise ValueError(f"draft_confidence must be in [0, 1), got {threshold}")
