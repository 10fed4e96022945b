"""A pool's checks of a call (speculative.checks) at their bounds: the largest values they
let through and the first they refuse, each refused as a ValueError before a pool changes."""

from types import SimpleNamespace

import pytest

from speculative.checks import (check_call, check_confidence, check_prompt_len, check_tree,
                                check_tree_width)
from speculative.options import MAX_SPECULATIVE_TOKENS, MAX_TREE_WIDTH


def test_a_prompt_len_is_refused_outside_the_committed_prefix():
    check_prompt_len(0, 0)
    check_prompt_len(5, 5)
    for prompt_len in (-1, 6):
        with pytest.raises(ValueError, match="prompt_len"):
            check_prompt_len(prompt_len, 5)


def test_a_tree_parent_must_come_before_its_node():
    check_tree([-1, 0, 0, 1], 4)
    for parents in ([-1, 1], [0, 0], [-2, 0]):  # itself, a later node, below the prefix
        with pytest.raises(ValueError, match="parent"):
            check_tree(parents, 2)
    with pytest.raises(ValueError, match="one parent per"):
        check_tree([-1], 2)


def tree_call(width=2, nodes=4, assumed=(), grammar=None, shapes_logits=False):
    sampling = SimpleNamespace(grammar=grammar, shapes_logits=shapes_logits)
    return SimpleNamespace(tree_width=width, tree_nodes=nodes, assumed_token_ids=assumed,
                           sampling=sampling)


def test_a_tree_at_the_widest_and_largest_is_drafted_one_beyond_is_not():
    check_tree_width(tree_call(MAX_TREE_WIDTH, MAX_SPECULATIVE_TOKENS))
    with pytest.raises(ValueError, match="tree_width"):
        check_tree_width(tree_call(width=MAX_TREE_WIDTH + 1))
    with pytest.raises(ValueError, match="tree_nodes"):
        check_tree_width(tree_call(nodes=MAX_SPECULATIVE_TOKENS + 1))


@pytest.mark.parametrize("laws", [dict(assumed=(7,)), dict(grammar=object()),
                                  dict(shapes_logits=True)])
def test_a_tree_is_refused_where_the_laws_follow_one_chain(laws):
    """A pre-draft's assumed tokens, a grammar, logit shaping: each alone refuses a tree."""
    with pytest.raises(ValueError, match="draft a chain"):
        check_tree_width(tree_call(**laws))


def test_token_ids_and_k_at_their_bounds():
    check_call([0, 9], 10, MAX_SPECULATIVE_TOKENS)
    with pytest.raises(ValueError, match="out of range"):
        check_call([10], 10)
    with pytest.raises(ValueError, match="out of range"):
        check_call([-1], 10)
    for k in (-1, MAX_SPECULATIVE_TOKENS + 1):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            check_call([1], 10, k)


def test_a_draft_confidence_is_unset_or_in_zero_to_one():
    for threshold in (None, 0.0, 0.99):
        check_confidence(threshold)
    for threshold in (-0.1, 1.0):
        with pytest.raises(ValueError, match="draft_confidence"):
            check_confidence(threshold)
