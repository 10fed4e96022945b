"""Sampling through drafter failures: rounds that fall back to the target alone (the drafter
failed before or after advancing its cache) mixed with drafted ones keep the target's law."""

import random

import numpy as np
import pytest

from drafter.model import ModelDrafter
from speculative.sampling import SamplingParams
from tests.stats.chisq import chi_square
from tests.stats.test_end_to_end_distribution import (  # noqa: F401 (fixture)
    FALSE_FAILURE,
    PROMPT,
    SAMPLES,
    VOCAB,
    exact_pairs,
    target,
)
from tests.tiny import noisy_copy, run
from tests.unit.test_draft_fallback import Flaky
from verifier.engine import ModelVerifier


@pytest.mark.slow
def test_two_token_sequences_through_a_failing_drafter(target):
    params = SamplingParams(temperature=1.0, max_tokens=3)
    draft = ModelDrafter(noisy_copy(target, 0.3, seed=2))
    rng = random.Random(11)
    drafter = Flaky(draft, lambda n: rng.random() < 0.5, after=True)
    verifier = ModelVerifier(target)
    counts = np.zeros((VOCAB, VOCAB))
    fallbacks = drafted = 0
    for i in range(SAMPLES):
        seeded = SamplingParams(**{**params.__dict__, "seed": i})
        out, state = run(drafter, verifier, PROMPT, seeded, k=1, request_id=str(i))
        counts[tuple(out[:2])] += 1
        fallbacks += state.stats.draft_fallback_rounds
        drafted += state.stats.num_drafts
    law = exact_pairs(target, SamplingParams(temperature=1.0, max_tokens=2))
    statistic, threshold, df = chi_square(counts, law, FALSE_FAILURE)
    assert statistic < threshold, (
        f"chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct implementation "
        f"fails this with probability {FALSE_FAILURE}")
    assert fallbacks > SAMPLES // 4 and drafted > SAMPLES // 4  # both kinds of round ran
