"""Rounds without a draft that ask the verifier for several tokens (verifier.steps) keep the
target's law: the three tokens after the first (a request's first token comes alone) of
K = 0 requests whose next call draws four, with every shaping on (the penalties, min_tokens
and the logit_bias of tests/stats/test_shaping_law.py: each step's law counts the tokens
of the steps before it), follow the shaped target's exact law (tests/stats/laws.py). A
verifier that draws every step with the call's one seed must fail the same check.
Chi-square at a false-failure rate of 1e-6 per case; samples seeded.
"""

import numpy as np
import pytest

from drafter.model import ModelDrafter
from tests.stats.laws import law_after_first, sequence_law
from tests.stats.test_pipelined_distribution import (  # noqa: F401 (fixtures)
    PROMPT,
    VOCAB,
    chi2_passes,
    target,
)
from tests.stats.test_shaping_law import PARAMS, SAMPLES  # the mutant here fails by 23x
from tests.tiny import Batched, run_seeded
from verifier import steps as verifier_steps
from verifier.engine import ModelVerifier

STEPS = 4


@pytest.fixture(scope="module")
def exact_law(target) -> np.ndarray:
    first = sequence_law(target, PROMPT, PARAMS, 1)
    return np.tensordot(first, law_after_first(target, PROMPT, PARAMS, 3), axes=1)


def step_counts(target, stop_law=None) -> tuple[np.ndarray, int]:
    """Counts of the three tokens after the first over SAMPLES seeded requests, and how
    many requests drew all three in one call; with stop_law, stops early once the counts
    fail the check against it (a mutant's run)."""
    verifier = Batched(ModelVerifier(target))
    counts, in_one_call = np.zeros((VOCAB,) * 3), 0
    for i, (out, state) in enumerate(run_seeded(Batched(ModelDrafter(target)), verifier,
                                                PROMPT, PARAMS, 0, SAMPLES,
                                                plain_steps=STEPS)):
        counts[tuple(out[1:4])] += 1
        in_one_call += state.stats.rounds == 2  # the first token alone, then one call
        if stop_law is not None and (i + 1) % 500 == 0 and not chi2_passes(counts,
                                                                          stop_law)[0]:
            break
    return counts, in_one_call


@pytest.mark.slow
def test_steps_follow_the_shaped_target_law(target, exact_law):
    counts, in_one_call = step_counts(target)
    passes, message = chi2_passes(counts, exact_law)
    assert passes, f"{message}: a correct implementation fails with probability 1e-6"
    # five tokens a request (max_tokens): the first alone, then a call of four steps, cut
    # short where it joined a batch whose other calls' steps ended first (verifier.steps
    # cohort_ends: 100 requests take two batches of at most 64)
    assert in_one_call >= SAMPLES // 2


@pytest.mark.slow
def test_a_verifier_reusing_the_call_seed_fails(target, exact_law, monkeypatch):
    monkeypatch.setattr(verifier_steps, "step_seed", lambda seed, step: seed)
    counts, _ = step_counts(target, stop_law=exact_law)
    assert not chi2_passes(counts, exact_law)[0], "the one-seed mutant passed the check"
