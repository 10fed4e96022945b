"""Sampling through HTTP follows the target's own distribution.

The first two tokens after a prompt, sampled through the whole distributed path (router,
gRPC, both pools, rejection sampling), against their exact law computed from the demo target
in this process with the same temperature / top-k / top-p processing. Chi-square at a
false-failure rate of 1e-6; requests seeded.
"""

import numpy as np
import pytest
import torch

from engine.models import DEMO_TARGET, load_causal_lm, load_tokenizer
from speculative.sampling import SamplingParams, logits_to_probs
from tests.stats.chisq import chi_square

PROMPT = "def "
PARAMS = SamplingParams(temperature=0.8, top_k=6)
REQUESTS, N = 120, 16
FALSE_FAILURE = 1e-6


@torch.no_grad()
def exact_pairs(prompt_ids) -> dict[tuple[int, ...], float]:
    model = load_causal_lm(DEMO_TARGET)
    first = logits_to_probs(model(input_ids=torch.tensor([prompt_ids])).logits[0, -1], PARAMS)
    law = {}
    for t1 in first.nonzero().flatten().tolist():
        if t1 == model.config.eos_token_id:  # the output stops at EOS
            law[(t1,)] = float(first[t1])
            continue
        logits = model(input_ids=torch.tensor([prompt_ids + [t1]])).logits[0, -1]
        second = logits_to_probs(logits, PARAMS)
        for t2 in second.nonzero().flatten().tolist():
            law[(t1, t2)] = float(first[t1] * second[t2])
    return law


@pytest.mark.slow
def test_sampled_pairs_through_http_match_the_target(cluster):
    prompt_ids = load_tokenizer(DEMO_TARGET)(PROMPT, add_special_tokens=False)["input_ids"]
    law = exact_pairs(prompt_ids)
    cells = {pair: i for i, pair in enumerate(law)}
    counts = np.zeros(len(cells) + 1)  # last cell: outside the support (must stay empty)
    accepted = 0
    for seed in range(REQUESTS):
        response = cluster.post("/v1/completions", {
            "prompt": PROMPT, "max_tokens": 2, "temperature": PARAMS.temperature,
            "top_k": PARAMS.top_k, "seed": seed, "n": N, "num_speculative_tokens": 3,
            "return_token_ids": True})
        assert response.status_code == 200, response.text
        body = response.json()
        accepted += body["speculative"]["num_accepted_tokens"]
        for choice in body["choices"]:
            counts[cells.get(tuple(choice["token_ids"]), len(cells))] += 1
    expected = np.append(np.array(list(law.values())), 0.0)
    statistic, threshold, df = chi_square(counts, expected, FALSE_FAILURE)
    assert statistic < threshold, (
        f"chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct implementation fails "
        f"this with probability {FALSE_FAILURE}")
    assert accepted > 0
