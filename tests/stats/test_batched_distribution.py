"""Sampling through batched pools keeps the target's law: requests decode concurrently, join
and leave the pools' batches at different rounds (their lengths differ), and each one's first
three tokens after the first still follow the exact law of test_pipelined_distribution. A mutant that hands a
request its batch-mate's logits must fail the same check.
"""

import asyncio

import numpy as np
import pytest

from drafter.model import ModelDrafter
from speculative.sampling import SamplingParams
from tests.stats.test_pipelined_distribution import (  # noqa: F401 (fixtures)
    DRAFT_TOP_K,
    K,
    PARAMS,
    PROMPT,
    VOCAB,
    chi2_passes,
    draft,
    exact_law,
    target,
)
from tests.tiny import Batched, run_concurrently
from verifier import engine as verifier_engine
from verifier.engine import ModelVerifier

SAMPLES, GROUP = 3000, 16  # 16 requests at a time; lengths 5..8 so they leave unevenly


def batched_counts(target, draft, pipelined: bool) -> tuple[np.ndarray, list[int]]:
    drafter = Batched(ModelDrafter(draft, draft_top_k=DRAFT_TOP_K))
    verifier = Batched(ModelVerifier(target))
    counts = np.zeros((VOCAB,) * 3)
    for start in range(0, SAMPLES, GROUP):
        params = SamplingParams(**{**PARAMS.__dict__, "seed": 7_000_000 + start})
        lengths = [5 + (start + i) % 4 for i in range(GROUP)]
        for out in run_concurrently(drafter, verifier, [PROMPT] * GROUP, params, K, lengths,
                                    pipelined):
            counts[tuple(out[1:4])] += 1
    return counts, verifier.batch_sizes


@pytest.mark.slow
def test_sampling_in_batches_follows_the_target_law(target, draft, exact_law):
    """Sequential rounds (pipelined ones are batched by the same code: the greedy batched
    oracle covers them, test_pipelined_distribution their law)."""
    counts, batch_sizes = batched_counts(target, draft, pipelined=False)
    assert max(batch_sizes) == GROUP and min(batch_sizes) < GROUP  # joined and left
    passed, detail = chi2_passes(counts, exact_law)
    assert passed, detail


@pytest.mark.slow
def test_the_check_sees_logits_handed_to_a_batch_mate(target, draft, exact_law, monkeypatch):
    real = verifier_engine.forward_packed

    def swapped(model, segments):
        """Each request gets the logits of the next one with as many positions."""
        out = real(model, segments)
        by_shape: dict[int, list[int]] = {}
        for index, rows in enumerate(out):
            by_shape.setdefault(rows.shape[0], []).append(index)
        swapped_out = list(out)
        for indices in by_shape.values():
            for a, b in zip(indices, indices[1:] + indices[:1]):
                swapped_out[a] = out[b]
        return swapped_out

    monkeypatch.setattr(verifier_engine, "forward_packed", swapped)
    counts, _ = batched_counts(target, draft, pipelined=False)
    passed, detail = chi2_passes(counts, exact_law)
    assert not passed, detail
