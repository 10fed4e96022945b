"""The committed demo pair loads like a hub model and stays exact."""

import pytest

from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from engine.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm, load_tokenizer
from speculative.sampling import SamplingParams
from tests.tiny import hf_greedy, run
from verifier.engine import ModelVerifier

# one worker runs the module: spread over both, each built its pair and references (1.7 CPU s)
pytestmark = pytest.mark.xdist_group("tests/unit/test_demo_pair.py")

PROMPTS = ["import os\n", "def main():\n", "class Config:\n", "    def __init__(self"]


@pytest.fixture(scope="module")
def pair():
    tokenizer = load_tokenizer(DEMO_TARGET)
    assert load_tokenizer(DEMO_DRAFT).get_vocab() == tokenizer.get_vocab()
    return tokenizer, load_causal_lm(DEMO_TARGET), load_causal_lm(DEMO_DRAFT)


@pytest.fixture(scope="module")
def references(pair):
    """Each prompt's ids and the target's own 48 greedy tokens after them (transformers'
    generate: 0.4 s a prompt, so once for the module, not once per K and drafter)."""
    tokenizer, target, _ = pair
    ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in PROMPTS]
    return [(prompt_ids, hf_greedy(target, prompt_ids, 48)) for prompt_ids in ids]


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_on_the_demo_pair_equals_the_target_alone(pair, references, k):
    tokenizer, target, draft = pair
    greedy = SamplingParams(temperature=0, max_tokens=48)
    for drafter in (ModelDrafter(draft), NgramDrafter(len(tokenizer))):
        accepted = 0
        for i, (ids, reference) in enumerate(references):
            out, state = run(drafter, ModelVerifier(target), ids, greedy, k, request_id=str(i))
            assert out == reference, f"{PROMPTS[i]!r}, K={k}"
            accepted += state.stats.num_accepted_tokens
        assert accepted > 0


def test_the_tokenizer_round_trips_python_source(pair):
    tokenizer = pair[0]
    text = "def f(x):\n    return {'a': [x, 1.5]}  # ok\n"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
