"""Sampling through drafter failures: rounds that fall back to the target alone (the drafter
failed before or after advancing its cache) mixed with drafted ones keep the target's law
(of the tokens after the first, given the first: see tests/stats/laws.py)."""

import random

import numpy as np
import pytest

from drafter.model import ModelDrafter
from speculative.sampling import SamplingParams
from tests.stats.chisq import conditional_chi_square
from tests.stats.laws import law_after_first
from tests.stats.test_end_to_end_distribution import (  # noqa: F401 (fixture)
    FALSE_FAILURE,
    PROMPT,
    SAMPLES,
    VOCAB,
    target,
)
from tests.tiny import Batched, noisy_copy, run_seeded
from tests.unit.test_draft_fallback import Flaky
from verifier.engine import ModelVerifier


@pytest.mark.slow
def test_two_token_sequences_through_a_failing_drafter(target):
    params = SamplingParams(temperature=1.0, max_tokens=4)
    draft = ModelDrafter(noisy_copy(target, 0.3, seed=2))
    rng = random.Random(11)
    drafter = Flaky(Batched(draft), lambda n: rng.random() < 0.5, after=True)
    verifier = Batched(ModelVerifier(target))
    counts = np.zeros((VOCAB,) * 3)
    fallbacks = drafted = 0
    for out, state in run_seeded(drafter, verifier, PROMPT, params, 1, SAMPLES):
        counts[tuple(out[:3])] += 1
        fallbacks += state.stats.draft_fallback_rounds
        drafted += state.stats.num_drafts
    law = law_after_first(target, PROMPT, params, 2)
    statistic, threshold, df = conditional_chi_square(counts, law, FALSE_FAILURE)
    assert statistic < threshold, (
        f"chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct implementation "
        f"fails this with probability {FALSE_FAILURE}")
    assert fallbacks > SAMPLES // 4 and drafted > SAMPLES // 4  # both kinds of round ran
