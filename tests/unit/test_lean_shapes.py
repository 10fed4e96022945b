"""The lean forward on shapes the tiny models of test_batch do not have, each against a fresh
transformers forward: q/k/v biases that are not zero (Qwen2 checkpoints; the tiny Qwen2's are
initialised to zero), GQA ratios other than 4 heads over 2, a draft tree deeper than a
sliding window with a sibling above its deepest node (a node's key then sits at a slot past
its depth's position), and pools whose uninitialised memory holds NaN (torch.empty promises
nothing: recycled CUDA memory, or pages an allocator reused).
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.kv import SessionStore
from engine.runner import serving_runner
from speculative.tree import DraftTree
from tests.tiny import tiny_sliding
from tests.unit.test_batch import ATOL, PLANS, batched_rounds_error, full_logits, served, sync
from tests.unit.test_tree_attention import node_references

BACKENDS = list(PLANS)


def lean_runner(model, backend: str):
    return serving_runner(model, "paged", backend, kv_cache_tokens=4096)


def prefill_then_decode_error(runner, ids: list[int], split: int) -> float:
    """The largest gap to a fresh forward over a prefill of ids[:split], then a verify of the
    rest in one call."""
    store = SessionStore(2)
    first = store.apply("r", sync([], ids[:split]))
    [head] = runner.forward([first.segment(runner, [], split)])
    second = store.apply("r", sync(ids[:split], ids[split:]))
    [tail] = runner.forward([second.segment(runner, [], len(ids) - split)])
    reference = full_logits(runner.model, ids)
    return max(float((head - reference[:split]).abs().max()),
               float((tail - reference[split:]).abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_qkv_biases_are_added_as_the_checkpoint_has_them(backend):
    """A Qwen2 checkpoint's q/k/v biases (random here, seeded): fused into one bias, and the
    model's own modules (the reference) keep theirs."""
    model = tiny_sliding(3, mixed=True)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                bias = getattr(layer.self_attn, name).bias
                bias.copy_(torch.randn(bias.shape, generator=generator))
    runner = lean_runner(model, backend)
    ids = [(7 * i + 2) % 60 for i in range(14)]
    assert prefill_then_decode_error(runner, ids, 9) < ATOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_heads", [1, 4])  # multi-query, and no GQA at all
def test_every_gqa_ratio_answers_as_transformers(backend, kv_heads):
    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, max_position_embeddings=512)
    runner = lean_runner(LlamaForCausalLM(config).eval(), backend)
    ids = [(5 * i + 1) % 60 for i in range(12)]
    assert prefill_then_decode_error(runner, ids, 8) < ATOL
    assert batched_rounds_error(runner) < ATOL


# node 1 is the root's second child: each node below it sits in the slot after its depth's
# position, and node 9 (depth 9) must not see node 1 (depth 1) through a window of 8
DEEP = DraftTree(token_ids=tuple(range(10, 20)), parents=(-1, -1, 1, 2, 3, 4, 5, 6, 7, 8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tree_deeper_than_the_window_slides_by_the_nodes_depths(backend):
    runner = served("qwen2-mixed", backend)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    sequence = SessionStore(2).apply("tree", sync([], prompt))
    [logits] = runner.forward([sequence.segment(runner, list(DEEP.token_ids),
                                                len(DEEP.token_ids) + 1, parents=DEEP.parents)])
    assert (logits - node_references(runner.model, DEEP, prompt)).abs().max() < ATOL


def nan_empty(empty):
    """torch.empty whose floating tensors come back full of NaN."""
    def empty_of_nan(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out
    return empty_of_nan


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama", "mistral-sliding"])
def test_a_pool_allocated_over_nan_answers_exactly(name, backend, monkeypatch):
    """Every position a batch reads is written or zeroed first (paged: the zero block its
    padding reads; regions: each region up to the batch's end), whatever the memory held."""
    monkeypatch.setattr(torch, "empty", nan_empty(torch.empty))
    runner = served(name, backend)
    monkeypatch.undo()
    assert batched_rounds_error(runner) < ATOL
