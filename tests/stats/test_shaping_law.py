"""Sampling under logit_bias, min_tokens and penalties keeps the shaped target's law through
the real engines.

Same pair, window and check as tests/stats/test_pipelined_distribution.py (the three tokens
after the first: the next round's two drafted positions and the one after them), with every
shaping on at once: a bias that favours one token and one that bans another, min_tokens = 3
holding back an end token (so the window's first two positions mask it and its third does
not), and presence, frequency and repetition penalties. The exact law shapes each position
by the prompt and every output token before it (tests/stats/laws.py, written apart from the
product's shaping); the verifier must count the tokens drafted before a position, which
are output by the time that position is committed. Each mutant must fail the same check at
the same sample size. Chi-square at a false-failure rate of 1e-6 per case.
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

BANNED, FAVOURED, END = 6, 3, 2
# Sized by its mutants: at 1,500 samples the committed-only one fails at 2.5 times the
# threshold, the others outright (samples where p has none); 3,000 cost twice the time
SAMPLES = 1500
PARAMS = SamplingParams(temperature=1.0, max_tokens=5, presence_penalty=1.0,
                        frequency_penalty=0.5, repetition_penalty=1.3,
                        logit_bias=((FAVOURED, 1.5), (BANNED, -100.0)), min_tokens=3,
                        min_tokens_end_ids=(END,))


@pytest.fixture(scope="module")
def shaped_law(target) -> np.ndarray:
    first = sequence_law(target, PROMPT, PARAMS, 1)
    return np.tensordot(first, law_after_first(target, PROMPT, PARAMS, 3), axes=1)


def test_the_shaped_law_bans_and_holds_back(shaped_law):
    """The reference itself: the banned token has no mass to speak of anywhere (a bias of
    -100 leaves e^-100 of its odds, as OpenAI's), the end token none in the window's first
    two positions (output lengths 1 and 2) and some in its third."""
    law = shaped_law  # of the module's target, tiny_llama(31) over 8 tokens
    assert max(law[BANNED].sum(), law[:, BANNED].sum(), law[:, :, BANNED].sum()) < 1e-40
    assert law[END].sum() == law[:, END].sum() == 0 < law[:, :, END].sum()


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_shaped_tokens_follow_the_shaped_law(target, draft, shaped_law, pipelined):
    assert_follows(shaped_law, target, draft, pipelined, SAMPLES, PARAMS)


real_shape_batch = verifier_engine.shape_batch


def shaped_from_the_committed_only(logits, shapings, in_place=False):
    """Mutant of the verifier's shaping: every drafted position counts the committed output
    only, not the tokens drafted before it (penalties and min_tokens both go wrong)."""
    return real_shape_batch(logits, [Shaping(s.start + row, 1, s.params, s.prompt, s.output,
                                             seen=s.seen)
                                     for s in shapings for row in range(s.rows)], in_place)


def shaped_without_the_bias(logits, shapings, in_place=False):
    """Mutant: the verifier leaves logit_bias out (the drafter still applies it)."""
    return real_shape_batch(logits, [replace(s, params=replace(s.params, logit_bias=()))
                                     for s in shapings], in_place)


def shaped_without_min_tokens(logits, shapings, in_place=False):
    """Mutant: the verifier leaves min_tokens out (the drafter still holds the end back)."""
    return real_shape_batch(logits, [replace(s, params=replace(s.params, min_tokens=0))
                                     for s in shapings], in_place)


@pytest.mark.slow
@pytest.mark.parametrize("mutant", [shaped_from_the_committed_only, shaped_without_the_bias,
                                    shaped_without_min_tokens],
                         ids=["committed-only", "bias-left-out", "min-tokens-left-out"])
def test_the_check_catches_wrong_shaping(target, draft, shaped_law, monkeypatch, mutant):
    monkeypatch.setattr(verifier_engine, "shape_batch", mutant)
    assert_caught(shaped_law, target, draft, SAMPLES, PARAMS, mutant.__name__)
