"""Sampling under penalties keeps the penalised target's law through the real engines.

Same pair, window and check as tests/stats/test_pipelined_distribution.py (the three tokens
after the first: the next round's two drafted positions and the one after them), with
presence, frequency and repetition penalties all on. The exact law penalises each position
by the prompt and every output token before it (tests/stats/laws.py); the verifier must
count the tokens drafted before a position, which are output by the time that position is
committed. A mutant verifier that penalises from the committed tokens only must fail the
same check at the same sample size. Chi-square at a false-failure rate of 1e-6 per case.
"""

import numpy as np
import pytest
import torch

from speculative.sampling import SamplingParams, penalize
from tests.stats.laws import law_after_first, sequence_law
from tests.stats.test_pipelined_distribution import (  # noqa: F401 (fixtures)
    PROMPT,
    SAMPLES,
    chi2_passes,
    draft,
    sample_counts,
    target,
)
from verifier import engine as verifier_engine

PARAMS = SamplingParams(temperature=1.0, max_tokens=5, presence_penalty=1.0,
                        frequency_penalty=0.5, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def penalised_law(target) -> np.ndarray:
    first = sequence_law(target, PROMPT, PARAMS, 1)
    return np.tensordot(first, law_after_first(target, PROMPT, PARAMS, 3), axes=1)


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_penalised_tokens_follow_the_penalised_law(target, draft, penalised_law, pipelined):
    counts, totals = sample_counts(target, draft, pipelined, params=PARAMS)
    passes, message = chi2_passes(counts, penalised_law)
    assert passes, f"{message}: a correct implementation fails with probability 1e-6"
    assert 0 < totals["accepted"] < totals["drafted"]
    assert (totals["pipelined_rounds"] > SAMPLES / 10) == pipelined


def penalised_from_the_committed_only(logits, params, prompt, output, drafted=()):
    """Mutant of the verifier's penalties: every drafted position counts the committed
    output only, not the tokens drafted before it."""
    return torch.cat([penalize(row[None], params, prompt, output) for row in logits])


@pytest.mark.slow
def test_the_check_catches_penalties_blind_to_drafted_tokens(target, draft, penalised_law,
                                                             monkeypatch):
    monkeypatch.setattr(verifier_engine, "penalize", penalised_from_the_committed_only)
    counts, _ = sample_counts(target, draft, False, stop_law=penalised_law, params=PARAMS)
    passes, message = chi2_passes(counts, penalised_law)
    assert not passes, f"the committed-only mutant passed: {message}"
