"""Sampling over HTTP with pipelined drafting follows the target's own law.

A pair over 8 tokens (tests/conftest.py tiny8_pair_dir) served beside the default apps
(tests/integration/conftest.py `tiny8`), with
the drafter's q truncated to its top 3; requests draft K = 2 pipelined with max_tokens 5.
The first output token is the target's alone (the drafter prefills beside that round), so
the three tokens after it cover the next round's drafted positions and the position after
them (the first pre-drafted token when the block is accepted whole, else the recovered
token). Their exact law, the first token summed out, comes from the target's forwards in
this process, as in tests/stats/test_pipelined_distribution.py, whose mutants show why:
conditioned on the first token, the same samples spread over 8 times the cells and three of
its four mutants passed. Chi-square at a false-failure rate of 1e-6; requests seeded.
"""

import numpy as np
import pytest
from engine.models import load_causal_lm
from speculative.sampling import SamplingParams
from tests.stats.chisq import chi_square
from tests.stats.laws import law_after_first, sequence_law

PROMPT = [1, 5, 2]
REQUESTS, N = 200, 16
FALSE_FAILURE = 1e-6


def exact_law(target_dir) -> np.ndarray:
    """law[t2, t3, t4] = sum over t1 of p(t1) p(t2, t3, t4 | t1)."""
    model = load_causal_lm(str(target_dir / "target"))
    params = SamplingParams(temperature=1.0)
    first = sequence_law(model, PROMPT, params, 1)
    return np.tensordot(first, law_after_first(model, PROMPT, params, 3), axes=1)


@pytest.mark.slow
def test_three_tokens_over_http_follow_the_target_law(cluster, tiny8):
    counts = np.zeros((8, 8, 8))
    pipelined_rounds = 0
    bodies = [{"model": "tiny8", "prompt": PROMPT, "max_tokens": 5, "temperature": 1.0,
               "n": N, "seed": seed, "num_speculative_tokens": 2, "pipelined": True,
               "ignore_eos": True, "return_token_ids": True} for seed in range(REQUESTS)]
    for response in cluster.post_many("/tiny8/v1/completions", bodies):
        assert response.status_code == 200, response.text
        body = response.json()
        for choice in body["choices"]:
            counts[tuple(choice["token_ids"][1:4])] += 1
        pipelined_rounds += body["speculative"]["pipelined_rounds"]
    statistic, threshold, df = chi_square(counts, exact_law(tiny8), FALSE_FAILURE)
    assert statistic < threshold, (
        f"chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct implementation "
        f"fails this with probability {FALSE_FAILURE}")
    assert pipelined_rounds > REQUESTS * N / 10  # the pre-drafted path really ran
