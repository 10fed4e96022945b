"""Sampling over HTTP with pipelined drafting follows the target's own law.

The shared deployment's demo pair, its q shipped as the default config ships it, with
top-k 3: then the law of a few tokens is enumerable (3^4 paths) from the target's forwards in
this process. Requests draft K = 2 pipelined with max_tokens 5. The first output token is the
target's alone (the drafter prefills beside that round), so the three tokens after it cover
the next round's drafted positions and the position after them (the first pre-drafted token
when the block is accepted whole, else the recovered token). Their exact law, the first token
summed out, as in tests/stats/test_pipelined_distribution.py, whose mutants show why:
conditioned on the first token, the same samples spread over more cells and three of its four
mutants passed. Chi-square at a false-failure rate of 1e-6; requests seeded.

A path's top 3 must be the served verifier's too: each enumerated position's third and fourth
logits stand more than TIE_MARGIN apart (a property of the bundled demo target and this
prompt, checked here), far beyond the float rounding a batch's make-up moves a logit by.

Against the product's mutants, served (2026-12-03; not kept: each costs a deployment): a
pre-draft committed untested failed outright (a token outside the top 3), a rejected
pre-draft replaced from p(K+1) instead of the residual at chi2 516 against a threshold of 147.
"""

import numpy as np
import pytest
import torch

from engine.models import DEMO_TARGET, load_causal_lm, load_tokenizer
from speculative.sampling import SamplingParams, logits_to_probs
from tests.stats.chisq import chi_square

PROMPT = "class "
PARAMS = SamplingParams(temperature=1.0, top_k=3)
REQUESTS, N = 100, 16
FALSE_FAILURE = 1e-6
TIE_MARGIN = 1e-3


@torch.no_grad()
def exact_law(prompt_ids) -> dict[tuple[int, int, int], float]:
    """{(t2, t3, t4): sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2) p(t4 | t1, t2, t3)}."""
    model = load_causal_lm(DEMO_TARGET)

    def next_probs(ids) -> dict[int, float]:
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, PARAMS.top_k + 1).values
        assert top[-2] - top[-1] > TIE_MARGIN, f"a near tie at the top-k edge after {ids}"
        probs = logits_to_probs(logits, PARAMS)
        return {t: float(probs[t]) for t in probs.nonzero().flatten().tolist()}

    law: dict[tuple[int, int, int], float] = {}
    paths = [((), 1.0)]
    for _ in range(4):  # t1, then t2, t3, t4 after it
        paths = [(path + (t,), p * q) for path, p in paths
                 for t, q in next_probs(prompt_ids + list(path)).items()]
    for path, p in paths:
        law[path[1:]] = law.get(path[1:], 0.0) + p
    return law


@pytest.mark.slow
def test_three_tokens_over_http_follow_the_target_law(cluster):
    tokenizer = load_tokenizer(DEMO_TARGET)
    law = exact_law(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    cells = {path: i for i, path in enumerate(law)}
    counts = np.zeros(len(law) + 1)  # last cell: outside the support (stays empty)
    pipelined_rounds = 0
    bodies = [{"prompt": PROMPT, "max_tokens": 5, "temperature": PARAMS.temperature,
               "top_k": PARAMS.top_k, "n": N, "seed": seed, "num_speculative_tokens": 2,
               "pipelined": True, "ignore_eos": True, "return_token_ids": True}
              for seed in range(REQUESTS)]
    for response in cluster.post_many("/v1/completions", bodies):
        assert response.status_code == 200, response.text
        body = response.json()
        for choice in body["choices"]:
            counts[cells.get(tuple(choice["token_ids"][1:4]), len(law))] += 1
        pipelined_rounds += body["speculative"]["pipelined_rounds"]
    # (a sample outside the support, in the last cell, fails outright: chisq looks for
    # samples in cells of probability 0 before it pools the small cells)
    statistic, threshold, df = chi_square(counts, [*law.values(), 0.0], FALSE_FAILURE)
    assert statistic < threshold, (
        f"chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct implementation "
        f"fails this with probability {FALSE_FAILURE}")
    assert pipelined_rounds > REQUESTS * N / 10  # the pre-drafted path really ran
