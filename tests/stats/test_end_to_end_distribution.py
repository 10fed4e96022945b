"""End to end in sampling mode: sequences from the speculative loop over real engines (tiny
random models, KV caches, rollback) follow the target's own distribution.

Target-only sampling draws t1 ~ p(.|prompt), t2 ~ p(.|prompt, t1) with the same temperature /
top-k / top-p processing; with a vocabulary of 8 that law is computed exactly from 1 + 8 target
forwards, which is a sharper reference than a second sample. Chi-square at a false-failure
rate of 1e-6 per case, samples seeded.
"""

import numpy as np
import pytest
import torch

from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from speculative.sampling import SamplingParams, logits_to_probs
from tests.stats.chisq import chi_square
from tests.tiny import noisy_copy, run, tiny_llama
from verifier.engine import ModelVerifier

VOCAB = 8
PROMPT = [1, 5, 2, 1, 5]  # repeats: the n-gram drafter finds [1, 5] and proposes 2
SAMPLES = 6000
FALSE_FAILURE = 1e-6


@pytest.fixture(scope="module")
def target():
    model = tiny_llama(21, vocab_size=VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # flatter: every cell is likely enough to be seen
    return model


@torch.no_grad()
def exact_pairs(model, params: SamplingParams) -> np.ndarray:
    first = logits_to_probs(model(input_ids=torch.tensor([PROMPT])).logits[0, -1], params)
    rows = [model(input_ids=torch.tensor([PROMPT + [t]])).logits[0, -1] for t in range(VOCAB)]
    second = logits_to_probs(torch.stack(rows), params)
    return (first[:, None] * second).numpy()


def make_drafter(target, kind: str):
    """Drafters of each kind; "padded-*": a draft whose embedding has fewer or more rows than
    the target's (as Qwen2.5 sizes differ), its q fitted to the target's vocabulary."""
    if kind == "ngram":
        return NgramDrafter(VOCAB)
    if kind.startswith("padded"):
        rows = VOCAB - 2 if kind == "padded-smaller" else VOCAB + 3
        return ModelDrafter(tiny_llama(9, vocab_size=rows), vocab_size=VOCAB)
    return ModelDrafter(noisy_copy(target, 0.3, seed=2))


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0, max_tokens=2),
     SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=2)],
    ids=["T1", "T0.7-k5-p0.9"],
)
@pytest.mark.parametrize("drafter_kind", ["model", "ngram", "padded-smaller", "padded-larger"])
def test_two_token_sequences_match_target_only_sampling(target, params, drafter_kind):
    drafter = make_drafter(target, drafter_kind)
    verifier = ModelVerifier(target)
    counts = np.zeros((VOCAB, VOCAB))
    accepted = 0
    for i in range(SAMPLES):
        seeded = SamplingParams(**{**params.__dict__, "seed": i})
        out, state = run(drafter, verifier, PROMPT, seeded, k=1, request_id=str(i))
        counts[tuple(out)] += 1
        accepted += state.stats.num_accepted_tokens
    statistic, threshold, df = chi_square(counts, exact_pairs(target, params), FALSE_FAILURE)
    assert statistic < threshold, (
        f"chi2 = {statistic:.1f} > {threshold:.1f} (df {df}); a correct implementation "
        f"fails this with probability {FALSE_FAILURE}"
    )
    assert 0 < accepted < SAMPLES  # both the accepted and the recovered paths ran
