"""Exact laws of a tiny target's next tokens, computed from its forwards (vocabularies of 8).

A request's first round is the target's alone (the drafter prefills the prompt beside it), so
the speculative positions begin at the second output token: the law tests condition on the
first token and test the law of the tokens after it.
"""

import itertools

import numpy as np
import torch

from speculative.sampling import SamplingParams, logits_to_probs, penalize


@torch.no_grad()
def next_probs(model, prefix: list[int], params: SamplingParams, prompt_len: int) -> np.ndarray:
    """The next token's law after prefix, whose first prompt_len tokens are the prompt (the
    rest is output, which penalties and min_tokens count, and a grammar follows: ALLOWED),
    shaped as the request says, written out here apart from the product's shape_logits."""
    logits = model(input_ids=torch.tensor([prefix])).logits[0, -1]
    if params.grammar is not None:
        logits = logits.masked_fill(~ALLOWED[0](params.grammar, prefix[prompt_len:]),
                                    float("-inf"))
    for token, bias in params.logit_bias:  # OpenAI's: added to the raw logits, first
        logits[token] += bias
    logits = penalize(logits[None], params, prefix[:prompt_len], prefix[prompt_len:])[0]
    if len(prefix) - prompt_len < params.min_tokens:  # an end may not come yet
        logits[list(params.min_tokens_end_ids)] = float("-inf")
    return logits_to_probs(logits, params).numpy()


# allowed(grammar, output) -> [V] bool, for laws under a grammar (set by the tests using them)
ALLOWED: list = [None]


def sequence_law(model, prompt: list[int], params: SamplingParams, length: int,
                 prompt_len: int | None = None) -> np.ndarray:
    """law[t1, ..., t_length] of the next `length` tokens after the prompt (of which the
    first prompt_len tokens are the request's prompt: default all)."""
    vocab = model.config.vocab_size
    prompt_len = len(prompt) if prompt_len is None else prompt_len
    law = np.zeros((vocab,) * length)
    for head in itertools.product(range(vocab), repeat=length - 1):
        weight = 1.0
        for i in range(length - 1):
            weight *= next_probs(model, prompt + list(head[:i]), params, prompt_len)[head[i]]
        if weight > 0:
            law[head] = weight * next_probs(model, prompt + list(head), params, prompt_len)
    return law


def law_after_first(model, prompt: list[int], params: SamplingParams,
                    length: int) -> np.ndarray:
    """law[t1, ...]: the law of the `length` tokens after the first, given the first t1
    (each row sums to 1)."""
    vocab = model.config.vocab_size
    return np.stack([sequence_law(model, prompt + [t1], params, length, len(prompt))
                     for t1 in range(vocab)])
