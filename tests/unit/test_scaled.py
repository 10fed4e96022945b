"""The scaled benchmark target predicts exactly what the demo target predicts."""

import copy

import pytest
import torch

from bench.scaled import SHAPE, scale_up
from engine.models import DEMO_TARGET, load_causal_lm, load_tokenizer
from tests.tiny import hf_greedy

PROMPTS = ["def main():\n", "import os\n"]


@pytest.fixture(scope="module")
def scaled_pair():
    """The demo target and its scaled copy, float32: built once for both dtypes (scale_up
    took about 1.2 CPU s a test; a copy cast to bfloat16, a fraction of that)."""
    demo = load_causal_lm(DEMO_TARGET)
    return demo, scale_up(demo, **SHAPE)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_target_greedy_equals_the_demo_target(scaled_pair, dtype):
    demo, scaled = scaled_pair
    if dtype != torch.float32:  # copies cast: Module.to casts in place, and both tests
        demo, scaled = (copy.deepcopy(model).to(dtype) for model in scaled_pair)  # share it
    assert sum(p.numel() for p in scaled.parameters()) > 90e6  # compute of a ~100M model
    tokenizer = load_tokenizer(DEMO_TARGET)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reference = hf_greedy(demo, ids, 24)
        # the scaled target's greedy tokens are the demo's exactly when, at every position of
        # the demo's continuation, its top token is the demo's next one: one forward over the
        # continuation checks that (the scaled target's own generate: 1.4-1.7 s a prompt)
        with torch.no_grad():
            logits = scaled(input_ids=torch.tensor([ids + reference])).logits[0]
        assert logits[len(ids) - 1:-1].argmax(-1).tolist() == reference, prompt


def test_new_units_write_nothing_to_the_residual_stream():
    demo = load_causal_lm(DEMO_TARGET)
    scaled = scale_up(demo, num_layers=8, num_heads=8, intermediate_size=1024)
    old_layers = demo.config.num_hidden_layers
    for i, layer in enumerate(scaled.model.layers):
        if i >= old_layers:
            assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        else:
            assert not layer.self_attn.o_proj.weight[:, 256:].any()
            assert not layer.mlp.down_proj.weight[:, 768:].any()
    ids = torch.tensor([[5, 60, 700, 9]])
    with torch.no_grad():
        torch.testing.assert_close(scaled(input_ids=ids).logits, demo(input_ids=ids).logits,
                                   atol=1e-4, rtol=0)
