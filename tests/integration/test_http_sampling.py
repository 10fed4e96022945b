"""Sampling through HTTP follows the target's own distribution.

The two tokens after the first, sampled through the whole distributed path (router, gRPC,
both pools, rejection sampling), against their exact law given the first, computed from the
demo target in this process with the same temperature / top-k / top-p processing. The first
token is the target's alone (the drafter prefills beside that round), tested against its own
law; the next round drafts the second and scores the third (its bonus). Chi-square of the
first token, and of the two after it conditioned on it, each at a false-failure rate of 5e-7
(1e-6 in all); requests seeded.
"""

import numpy as np
import pytest
import torch

from engine.models import DEMO_TARGET, load_causal_lm, load_tokenizer
from speculative.sampling import SamplingParams, logits_to_probs
from tests.stats.chisq import chi_square, conditional_chi_square

PROMPT = "def "
PARAMS = SamplingParams(temperature=0.8, top_k=6)
REQUESTS, N = 120, 16
FALSE_FAILURE = 1e-6


@torch.no_grad()
def exact_law(prompt_ids) -> tuple[np.ndarray, dict[int, dict[tuple[int, ...], float]]]:
    """(the first token's law [V], {t1: {(t2, t3) or (t2,) when t2 ends the output: its
    probability given t1}})."""
    model = load_causal_lm(DEMO_TARGET)
    eos = model.config.eos_token_id

    def next_probs(ids):
        return logits_to_probs(model(input_ids=torch.tensor([ids])).logits[0, -1], PARAMS)

    law, first = {}, next_probs(prompt_ids)
    for t1 in first.nonzero().flatten().tolist():
        if t1 == eos:  # the output stops at EOS: nothing after it to test
            continue
        second, given = next_probs(prompt_ids + [t1]), {}
        for t2 in second.nonzero().flatten().tolist():
            if t2 == eos:
                given[(t2,)] = float(second[t2])
                continue
            third = next_probs(prompt_ids + [t1, t2])
            for t3 in third.nonzero().flatten().tolist():
                given[(t2, t3)] = float(second[t2] * third[t3])
        law[t1] = given
    return first.double().numpy(), law


@pytest.mark.slow
def test_sampled_pairs_through_http_match_the_target(cluster):
    tokenizer = load_tokenizer(DEMO_TARGET)
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    first_law, law = exact_law(prompt_ids)
    first_counts = np.zeros(len(first_law))
    groups = {t1: i for i, t1 in enumerate(law)}
    cells = [{rest: i for i, rest in enumerate(law[t1])} for t1 in law]
    width = max(len(c) for c in cells) + 1  # last cell: outside the support (stays empty)
    counts, expected = np.zeros((len(law), width)), np.zeros((len(law), width))
    for t1, row in groups.items():
        expected[row, : len(law[t1])] = list(law[t1].values())
    accepted = 0
    bodies = [{"prompt": PROMPT, "max_tokens": 3, "temperature": PARAMS.temperature,
               "top_k": PARAMS.top_k, "seed": seed, "n": N, "num_speculative_tokens": 3,
               "return_token_ids": True} for seed in range(REQUESTS)]
    for response in cluster.post_many("/v1/completions", bodies):
        assert response.status_code == 200, response.text
        body = response.json()
        accepted += body["speculative"]["num_accepted_tokens"]
        for choice in body["choices"]:
            first, *rest = choice["token_ids"]
            first_counts[first] += 1
            if not rest:  # EOS first: the output ended at the target's own token
                assert first == tokenizer.eos_token_id, f"one token, not an end: {choice}"
                continue
            assert first in groups, f"a first token outside the target's support: {first}"
            row = groups[first]
            counts[row, cells[row].get(tuple(rest), width - 1)] += 1
    statistic, threshold, df = chi_square(first_counts, first_law, FALSE_FAILURE / 2)
    assert statistic < threshold, (
        f"first token: chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct "
        f"implementation fails this with probability {FALSE_FAILURE / 2}")
    # (a sample outside the support, in the last cell, fails outright: chisq looks for
    # samples in cells of probability 0 before it pools the small cells)
    statistic, threshold, df = conditional_chi_square(counts, expected, FALSE_FAILURE / 2)
    assert statistic < threshold, (
        f"chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct implementation fails "
        f"this with probability {FALSE_FAILURE / 2}")
    assert accepted > 0
