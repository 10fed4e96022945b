"""Exact laws of a tiny target's next tokens, computed from its forwards (vocabularies of 8).

A request's first round is the target's alone (the drafter prefills the prompt beside it), so
the speculative positions begin at the second output token: the law tests condition on the
first token and test the law of the tokens after it.
"""

import itertools

import numpy as np
import torch

from speculative.sampling import SamplingParams, logits_to_probs


@torch.no_grad()
def next_probs(model, prefix: list[int], params: SamplingParams) -> np.ndarray:
    logits = model(input_ids=torch.tensor([prefix])).logits[0, -1]
    return logits_to_probs(logits, params).numpy()


def sequence_law(model, prompt: list[int], params: SamplingParams, length: int) -> np.ndarray:
    """law[t1, ..., t_length] of the next `length` tokens after the prompt."""
    vocab = model.config.vocab_size
    law = np.zeros((vocab,) * length)
    for head in itertools.product(range(vocab), repeat=length - 1):
        weight = 1.0
        for i in range(length - 1):
            weight *= next_probs(model, prompt + list(head[:i]), params)[head[i]]
        if weight > 0:
            law[head] = weight * next_probs(model, prompt + list(head), params)
    return law


def law_after_first(model, prompt: list[int], params: SamplingParams,
                    length: int) -> np.ndarray:
    """law[t1, ...]: the law of the `length` tokens after the first, given the first t1
    (each row sums to 1)."""
    vocab = model.config.vocab_size
    return np.stack([sequence_law(model, prompt + [t1], params, length) for t1 in range(vocab)])
