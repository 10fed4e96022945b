"""Exact laws of a tiny target's next tokens, computed from its forwards (vocabularies of 8).

A request's first round is the target's alone (the drafter prefills the prompt beside it), so
the speculative positions begin at the second output token: the law tests condition on the
first token and test the law of the tokens after it.
"""

import numpy as np
import torch

from speculative.sampling import SamplingParams, logits_to_probs
from speculative.shaping import penalize


@torch.no_grad()
def next_probs(model, prefixes: list[list[int]], params: SamplingParams,
               prompt_len: int) -> np.ndarray:
    """[len(prefixes), V]: the next token's law after each prefix (all of one length, so one
    forward of the whole batch needs no padding), whose first prompt_len tokens are the
    prompt (the rest is output, which penalties, min_tokens and bad words read, and a
    grammar follows: ALLOWED), masked and shaped as the request says, written out here apart
    from the product's shape_logits."""
    batch = model(input_ids=torch.tensor(prefixes)).logits[:, -1]
    rows = []
    for prefix, logits in zip(prefixes, batch):
        if params.grammar is not None:
            logits = logits.masked_fill(~ALLOWED[0](params.grammar, prefix[prompt_len:]),
                                        float("-inf"))
        if params.allowed_token_ids:  # vLLM's: every other id masked
            others = torch.ones_like(logits, dtype=torch.bool)
            others[list(params.allowed_token_ids)] = False
            logits = logits.masked_fill(others, float("-inf"))
        output = prefix[prompt_len:]
        for word in params.bad_words_ids:  # vLLM's: the last id, after the others
            if len(output) >= len(word) - 1 and \
                    tuple(output[len(output) - len(word) + 1:]) == word[:-1]:
                logits[word[-1]] = float("-inf")
        for token, bias in params.logit_bias:  # OpenAI's: added to the raw logits, first
            logits[token] += bias
        logits = penalize(logits[None], params, prefix[:prompt_len], prefix[prompt_len:])[0]
        if len(prefix) - prompt_len < params.min_tokens:  # an end may not come yet
            logits[list(params.min_tokens_end_ids)] = float("-inf")
        rows.append(logits_to_probs(logits, params).numpy())
    return np.stack(rows)


# allowed(grammar, output) -> [V] bool, for laws under a grammar (set by the tests using them)
ALLOWED: list = [None]


def sequence_law(model, prompt: list[int], params: SamplingParams, length: int,
                 prompt_len: int | None = None) -> np.ndarray:
    """law[t1, ..., t_length] of the next `length` tokens after the prompt (of which the
    first prompt_len tokens are the request's prompt: default all): the chain rule, one
    forward per position over every head of positive probability so far."""
    vocab = model.config.vocab_size
    prompt_len = len(prompt) if prompt_len is None else prompt_len
    law = np.ones(())  # law of the empty head
    for _ in range(length):
        heads = [tuple(head) for head in np.argwhere(law > 0)]
        probs = next_probs(model, [prompt + list(head) for head in heads], params, prompt_len)
        longer = np.zeros((vocab,) * (law.ndim + 1))
        for head, row in zip(heads, probs):
            longer[head] = law[head] * row
        law = longer
    return law


def law_after_first(model, prompt: list[int], params: SamplingParams,
                    length: int) -> np.ndarray:
    """law[t1, ...]: the law of the `length` tokens after the first, given the first t1
    (each row sums to 1)."""
    vocab = model.config.vocab_size
    return np.stack([sequence_law(model, prompt + [t1], params, length, len(prompt))
                     for t1 in range(vocab)])
