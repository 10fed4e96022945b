"""draft_confidence: a block ends once its drafted tokens' probabilities multiplied, under the
draft's own law, fall below the threshold; at least one token; greedy and sampled alike.
(Greedy output stays the target's: tests/unit/test_oracle.py, the "confident" drafter.)"""

import pytest
import torch

from drafter.model import ModelDrafter
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ProposeCall
from tests.tiny import tiny_llama

PROMPT = (3, 1, 4, 1, 5)


def block(drafter: ModelDrafter, params: SamplingParams, k: int = 6):
    call = ProposeCall("r", PrefixSync(0, EMPTY_PREFIX_HASH, PROMPT), k, params, seed=3)
    result = drafter.propose_now(call)
    drafter.sessions.release("r")
    return result


def probs_of_block(model, tokens) -> list[float]:
    """The draft's probability of each drafted token, from fresh forwards (temperature 1)."""
    probs, prefix = [], list(PROMPT)
    for token in tokens:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prefix])).logits[0, -1]
        probs.append(float(logits.softmax(-1)[token]))
        prefix.append(token)
    return probs


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1)],
                         ids=["greedy", "sampled"])
def test_a_block_ends_where_its_confidence_falls_below_the_threshold(params):
    model = tiny_llama(7)
    full = block(ModelDrafter(model), params).token_ids
    assert len(full) == 6
    probs = probs_of_block(model, full)
    running = torch.tensor(probs).cumprod(0).tolist()
    threshold = (running[1] + running[2]) / 2  # between the second and third products
    cut = block(ModelDrafter(model, draft_confidence=threshold), params)
    # the same tokens (same seed), ending at the first token whose product fell below
    assert cut.token_ids == full[:3]
    if not params.greedy:
        assert cut.draft_probs.dense(torch.device("cpu")).shape[0] == 3  # q of each token
    # a threshold no token reaches still drafts one token
    assert len(block(ModelDrafter(model, draft_confidence=0.999), params).token_ids) == 1


def test_the_threshold_is_checked():
    with pytest.raises(ValueError, match="draft_confidence"):
        ModelDrafter(tiny_llama(7), draft_confidence=1.0)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1)],
                         ids=["greedy", "sampled"])
def test_a_calls_threshold_overrides_the_pools_and_is_reported(params):
    model = tiny_llama(7)
    drafter = ModelDrafter(model, draft_confidence=0.999)  # the pool's: one token a block
    call = ProposeCall("r", PrefixSync(0, EMPTY_PREFIX_HASH, PROMPT), 6, params, seed=3,
                       draft_confidence=0.0)
    reported = drafter.propose_now(call)
    drafter.sessions.release("r")
    assert reported.token_ids == block(ModelDrafter(model), params).token_ids  # no cut
    running = torch.tensor(probs_of_block(model, reported.token_ids)).cumprod(0).tolist()
    assert reported.confidences == pytest.approx(running, rel=1e-4)
    assert block(drafter, params).confidences is None  # unset: the pool's, not reported
    with pytest.raises(ValueError, match="draft_confidence"):
        drafter.propose_now(ProposeCall("r", PrefixSync(0, EMPTY_PREFIX_HASH, PROMPT), 6, params,
                                        seed=3, draft_confidence=1.5))
