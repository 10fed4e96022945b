"""Edges of speculative.sampling that its other tests left open (each found by a mutant
that changed the law and passed them): top-k one below the vocabulary, a small weight after
a large one in a draw's cumulative sum, and the draws of a generator that serves several
rows (the verifier's K + 1 rows of one chain)."""

import torch

from speculative.sampling import (SamplingParams, inverted, logits_to_probs, sample_each,
                                  sample_rows, seeded_generator)


def test_top_k_one_below_the_vocabulary_drops_the_least_likely_token():
    """top_k = V - 1 truncates (only top_k >= V keeps every token): a check off by one at
    the vocabulary's size kept the least likely token at every top_k = V - 1 request."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, -1.0, 2.0, 0.5]])
    probs = logits_to_probs(logits, SamplingParams(top_k=3))
    assert probs[0, 0] == 0 and probs[1, 1] == 0
    torch.testing.assert_close(probs[0, 1:], logits[0, 1:].softmax(-1))
    torch.testing.assert_close(probs[1, [0, 2, 3]], logits[1, [0, 2, 3]].softmax(-1))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(top_k=4)),
                               logits.softmax(-1))


def test_a_small_weight_after_a_large_one_keeps_its_share_of_the_draws():
    """The cumulative sum runs in float64: in float32, 1 + 1e-9 rounds to 1, and any weight
    under half a float32 step of the sum before it (3e-8 once that sum passes 0.5: a long
    vocabulary's tail) was never drawn, its mass moved to its neighbours. A uniform whose
    share of the total falls inside the weight's interval must draw it."""
    weights = torch.tensor([[1.0, 1e-9, 1.0]], dtype=torch.float64)
    total = 2.0 + 1e-9
    inside = torch.tensor([[(1.0 + 0.5e-9) / total]], dtype=torch.float64)
    assert inverted(weights, inside).tolist() == [1]
    # either side of it: the weights around
    assert inverted(weights, inside * 0.9).tolist() == [0]
    assert inverted(weights, inside * 1.1).tolist() == [2]


def test_a_generator_serving_several_rows_draws_each_as_sample_rows_of_them_alone():
    """sample_each with rows_each = K + 1 (the verifier's residual and bonus rows of one
    chain): each generator draws its rows as sample_rows of those rows alone would (the
    docstring's contract, what keeps a seeded chain's draws independent of the batch),
    one uniform a row, not one uniform shared by its rows."""
    weights = torch.rand(6, 9, generator=torch.Generator().manual_seed(5))
    weights[weights < 0.3] = 0.0
    for trial in range(50):
        seeds = [100 * trial + g for g in range(3)]
        together = sample_each(weights, [seeded_generator(s, "cpu") for s in seeds], 2)
        alone = torch.cat([sample_rows(weights[2 * g:2 * g + 2], seeded_generator(s, "cpu"))
                           for g, s in enumerate(seeds)])
        assert torch.equal(together, alone), f"trial {trial}"
