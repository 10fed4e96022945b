"""bad_words read the output's last tokens from two places: a pool's committed output
(`recent`, or the end of `output` when nothing is counted) and what follows it (a draft's
assumed and drafted tokens). These cases pin the order and the length of that tail, which
the law tests do not reach: a word whose other tokens all lie in the committed output, and a
drafter's step whose word straddles the committed output and its own tokens. Either read
wrong changes the target's own law (p), or leaves q shaped unlike p (exact, but the drafts
are rejected where the target bans them)."""

from types import SimpleNamespace

import pytest
import torch

from speculative.sampling import SamplingParams
from speculative.shaping import (
    SeenTokens,
    Shaping,
    committed_history,
    shape_batch,
    shape_logits,
)

INF = float("-inf")
PROMPT = [1, 2, 3]


def pool_sequence(committed: list[int]) -> SimpleNamespace:
    """What committed_history reads of a pool's engine.kv.Sequence."""
    seen = SeenTokens(len(PROMPT), with_prompt=False)
    return SimpleNamespace(committed=committed,
                           counted=lambda prompt_len, with_prompt: seen.of(committed))


@pytest.mark.parametrize("penalty", [0.0, 0.5], ids=["listed", "counted"])
def test_a_word_begun_wholly_in_the_committed_output_is_banned_in_the_first_row(penalty):
    """Word (7, 8, 5) after the committed output 9, 7, 8: the first row (no drafted token
    yet) bans 5; the row after a drafted 4 does not. The pool's history (the committed
    output's last tokens, counted or listed) shapes as the whole lists do."""
    params = SamplingParams(bad_words_ids=((7, 8, 5),), frequency_penalty=penalty)
    output = [9, 7, 8]
    logits = torch.zeros(2, 10)
    listed = shape_logits(logits, params, PROMPT, output, [4])
    assert listed[:, 5].tolist() == [INF, 0.0]
    history = committed_history(params, len(PROMPT), pool_sequence(PROMPT + output))
    pooled = shape_batch(logits, [Shaping(0, 2, params, drafted=[4], **history)])
    assert torch.equal(pooled, listed)


@pytest.mark.parametrize("penalty", [0.0, 0.5], ids=["listed", "counted"])
def test_a_drafters_step_reads_the_committed_output_before_its_own_tokens(penalty):
    """A drafter's step shapes one row after the committed output 9, 7 and its drafted 8
    (committed_history's `extra`): word (7, 8, 5) bans 5 there, as the verifier's row after
    the drafted 8 does, so q is shaped as p."""
    params = SamplingParams(bad_words_ids=((7, 8, 5),), presence_penalty=penalty)
    output = [9, 7]
    logits = torch.zeros(1, 10)
    history = committed_history(params, len(PROMPT), pool_sequence(PROMPT + output), [8])
    step = shape_batch(logits, [Shaping(0, 1, params, **history)])
    verifier = shape_logits(torch.zeros(2, 10), params, PROMPT, output, [8])
    assert step[0, 5] == INF and torch.equal(step[0], verifier[1])
