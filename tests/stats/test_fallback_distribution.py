"""Sampling through drafter failures: rounds that fall back to the target alone (the drafter
failed before or after advancing its cache) mixed with drafted ones keep the target's law
(of the tokens after the first, given the first: see tests/stats/laws.py). A router whose
fallback rounds verify with the seed of the round before (each draw from p, but tied to the
one before it) must fail the same check at the same sample size. (A fallback round drawing
uniformly over p's support passes: the flattened target is near uniform; and a drafter left
behind its cache drafts from the wrong prefix, which rejection sampling keeps exact.)"""

import random
from functools import partial

import numpy as np
import pytest

import speculative.loop as loop
from drafter.model import ModelDrafter
from speculative.sampling import SamplingParams
from tests.stats.chisq import conditional_chi_square
from tests.stats.laws import law_after_first
from tests.stats.test_end_to_end_distribution import (  # noqa: F401 (fixture)
    CHUNK,
    FALSE_FAILURE,
    PROMPT,
    SAMPLES,
    VOCAB,
    target,
)
from tests.tiny import Batched, noisy_copy, run_seeded
from tests.unit.test_draft_fallback import Flaky
from verifier.engine import ModelVerifier

PARAMS = SamplingParams(temperature=1.0, max_tokens=4)


def fallback_counts(target, stop_law=None) -> tuple[np.ndarray, int, int]:
    """(counts of the first three tokens, fallback rounds, drafts) over SAMPLES seeded
    requests whose drafter fails half its calls; with stop_law, stops early once the counts
    fail the check against it, looking every CHUNK (a mutant's run)."""
    draft = ModelDrafter(noisy_copy(target, 0.3, seed=2))
    rng = random.Random(11)
    drafter = Flaky(Batched(draft), lambda n: rng.random() < 0.5, after=True)
    verifier = Batched(ModelVerifier(target))
    counts = np.zeros((VOCAB,) * 3)
    fallbacks = drafted = 0
    for i, (out, state) in enumerate(run_seeded(drafter, verifier, PROMPT, PARAMS, 1,
                                                SAMPLES)):
        counts[tuple(out[:3])] += 1
        fallbacks += state.stats.draft_fallback_rounds
        drafted += state.stats.num_drafts
        if stop_law is not None and (i + 1) % CHUNK == 0 and not check(counts, stop_law)[0]:
            break
    return counts, fallbacks, drafted


def check(counts, law) -> tuple[bool, str]:
    statistic, threshold, df = conditional_chi_square(counts, law, FALSE_FAILURE)
    return statistic < threshold, (
        f"chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct implementation "
        f"fails this with probability {FALSE_FAILURE}")


@pytest.mark.slow
def test_two_token_sequences_through_a_failing_drafter(target):
    counts, fallbacks, drafted = fallback_counts(target)
    passes, message = check(counts, law_after_first(target, PROMPT, PARAMS, 2))
    assert passes, message
    assert fallbacks > SAMPLES // 4 and drafted > SAMPLES // 4  # both kinds of round ran


real_round_seed = loop.round_seed


def seed_of_the_round_before(seeds: dict, state, block, beside):
    """Mutant of loop.round_seed: a round without a draft after the request's first (a
    fallback round) verifies with the seed the request's round before verified with."""
    seed, held = real_round_seed(state, block, beside)
    request_id = state.request.request_id
    if not block.token_ids and request_id in seeds:
        seed = seeds[request_id]
    seeds[request_id] = seed
    return seed, held


@pytest.mark.slow
def test_fallback_rounds_reusing_a_seed_fail(target, monkeypatch):
    """The check rejects the mutant: the fallback round after a request's first draws the
    window's second token with the first token's uniform (each draw p's, the pair not)."""
    monkeypatch.setattr(loop, "round_seed", partial(seed_of_the_round_before, {}))
    law = law_after_first(target, PROMPT, PARAMS, 2)
    counts, fallbacks, _ = fallback_counts(target, stop_law=law)
    assert not check(counts, law)[0], "the seed-reusing mutant passed"
    assert fallbacks > 0
