"""Sampling under allowed_token_ids and bad_words keeps the masked target's law through the
real engines.

Same pair, window and check as tests/stats/test_shaping_law.py (the three tokens after the
first: the next round's two drafted positions and the one after them): the allowed ids
leave one token out, a one-token bad word bans another everywhere, and two two-token words
ban a token only right after their first one, which the window's second and third
positions follow from a drafted token. The exact law masks each position by the output
before it (tests/stats/laws.py, written apart from the product's shaping). Each mutant must
fail the same check at the same sample size. Chi-square at a false-failure rate of 1e-6 per
case.
"""

from dataclasses import replace

import numpy as np
import pytest

from speculative.sampling import SamplingParams
from speculative.shaping import Shaping
from tests.stats.laws import law_after_first, sequence_law
from tests.stats.test_pipelined_distribution import (  # noqa: F401 (fixtures)
    PROMPT,
    assert_caught,
    assert_follows,
    draft,
    target,
)
from verifier import engine as verifier_engine

LEFT_OUT, BANNED = 6, 0
PAIRS = ((2, 3), (5, 4))  # the target's likelier pairs (2, 3: 12 % of the window's pairs)
# as tests/stats/test_shaping_law.py's; each mutant here fails at its first check (500)
SAMPLES = 1500
PARAMS = SamplingParams(temperature=1.0, max_tokens=5,
                        allowed_token_ids=tuple(t for t in range(8) if t != LEFT_OUT),
                        bad_words_ids=((BANNED,), *PAIRS))


@pytest.fixture(scope="module")
def masked_law(target) -> np.ndarray:
    first = sequence_law(target, PROMPT, PARAMS, 1)
    return np.tensordot(first, law_after_first(target, PROMPT, PARAMS, 3), axes=1)


def test_the_masked_law_leaves_out_bans_and_bans_after(masked_law):
    """The reference itself: no mass on the id left out or the banned word anywhere, none
    on a pair's second token right after its first, and some on that token elsewhere."""
    law = masked_law  # of the module's target, tiny_llama(31) over 8 tokens
    for token in (LEFT_OUT, BANNED):
        assert law[token].sum() == law[:, token].sum() == law[:, :, token].sum() == 0
    for first, then in PAIRS:
        assert law[first, then].sum() == law[:, first, then].sum() == 0
        assert law[:, :, then].sum() > 0.05
    assert law[2].sum() > 0.1  # the pair's first token opens the window often


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_masked_tokens_follow_the_masked_law(target, draft, masked_law, pipelined):
    assert_follows(masked_law, target, draft, pipelined, SAMPLES, PARAMS)


real_shape_batch = verifier_engine.shape_batch


def masked_after_the_committed_only(logits, shapings, in_place=False):
    """Mutant of the verifier's masks: every drafted position reads the committed output
    only, not the tokens drafted before it (a pair begun in the draft goes through)."""
    return real_shape_batch(logits, [Shaping(s.start + row, 1, s.params, s.prompt, s.output,
                                             seen=s.seen, recent=s.recent)
                                     for s in shapings for row in range(s.rows)], in_place)


def masked_without_the_allowed_ids(logits, shapings, in_place=False):
    """Mutant: the verifier leaves allowed_token_ids out (the drafter still applies it)."""
    return real_shape_batch(logits, [replace(s, params=replace(s.params, allowed_token_ids=()))
                                     for s in shapings], in_place)


def masked_without_the_words(logits, shapings, in_place=False):
    """Mutant: the verifier leaves bad_words out (the drafter still bans them)."""
    return real_shape_batch(logits, [replace(s, params=replace(s.params, bad_words_ids=()))
                                     for s in shapings], in_place)


@pytest.mark.slow
@pytest.mark.parametrize("mutant", [masked_after_the_committed_only,
                                    masked_without_the_allowed_ids, masked_without_the_words],
                         ids=["committed-only", "allowed-left-out", "words-left-out"])
def test_the_check_catches_wrong_masks(target, draft, masked_law, monkeypatch, mutant):
    monkeypatch.setattr(verifier_engine, "shape_batch", mutant)
    assert_caught(masked_law, target, draft, SAMPLES, PARAMS, mutant.__name__)
