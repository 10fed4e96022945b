"""Families the lean forward does not run, in transformers' modeling with packed attention
(engine.batch), against a fresh full forward of each request by the model as transformers
builds it. Models whose modeling refuses SDPA (`_supports_sdpa = False`) keep its eager
attention: Gemma-2 soft-caps its attention scores (SDPA raises on `softcap`), gpt-oss adds a
learnt sink to each head's softmax (SDPA drops `s_aux` without a word). Qwen2-MoE and PhiMoE
slide their window by the model's mask alone, passing no `sliding_window` to attention.
"""

import copy

import pytest
import torch

from engine.kv import SessionStore
from engine.runner import serving_runner
from speculative.prefixes import prefix_hash
from speculative.types import PrefixSync

ATOL = 1e-4  # float reassociation only; a dropped sink, cap or window moves logits by O(0.1)
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, sliding_window=8, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)


def tiny_gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(**SHAPE, attn_logit_softcapping=0.5, query_pre_attn_scalar=16)
    return Gemma2ForCausalLM(config)


def tiny_gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    model = GptOssForCausalLM(GptOssConfig(**SHAPE, num_local_experts=4,
                                           num_experts_per_tok=2))
    with torch.no_grad():  # sinks initialised far from zero, as trained ones are
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def tiny_qwen2_moe():  # the first layer slides, the second attends to the whole context
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **SHAPE, use_sliding_window=True, max_window_layers=2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32))


def tiny_phimoe():
    from transformers import PhimoeConfig, PhimoeForCausalLM

    return PhimoeForCausalLM(PhimoeConfig(**SHAPE, num_local_experts=4,
                                          num_experts_per_tok=2))


MODELS = {"gemma2": tiny_gemma2, "gpt-oss": tiny_gpt_oss, "qwen2-moe-sliding": tiny_qwen2_moe,
          "phimoe-sliding": tiny_phimoe}
EAGER = {"gemma2", "gpt-oss"}  # transformers' own choice: SDPA cannot compute them


def rounds_error(runner, reference) -> float:
    """Three requests (two past the window), three rounds of verify-then-rollback in one
    packed forward each; the largest gap to the reference's fresh forward."""
    store, worst = SessionStore(4), 0.0
    committed = [[3, 1, 4], list(range(5, 16)), [9] * 20]
    known = [[] for _ in committed]
    for round_ in range(3):
        segments, wanted = [], []
        for i, ids in enumerate(committed):
            new = ids[len(known[i]):]
            sequence = store.apply(f"r{i}", PrefixSync(len(known[i]), prefix_hash(known[i]),
                                                       tuple(new)))
            known[i] = list(ids)
            drafted = [(7 * i + round_ + j) % 60 for j in range(1 + (i + round_) % 3)]
            segments.append(sequence.segment(runner, drafted, num_logits=len(drafted) + 1))
            wanted.append(ids + drafted)
        for logits, ids, segment in zip(runner.forward(segments), wanted, segments):
            with torch.no_grad():
                fresh = reference(input_ids=torch.tensor([ids])).logits[0]
            worst = max(worst, float((logits - fresh[-segment.num_logits:]).abs().max()))
        for i, ids in enumerate(committed):  # accept part of the block, reject the rest
            ids.extend(wanted[i][len(ids):len(ids) + round_ % 2] + [(11 * i + round_) % 60])
    return worst


@pytest.mark.parametrize("name", MODELS)
def test_a_packed_batch_equals_each_request_in_the_models_own_forward(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    reference = copy.deepcopy(model)
    assert (reference.config._attn_implementation == "eager") == (name in EAGER)
    runner = serving_runner(model)
    assert runner.lean is None  # transformers' modeling
    assert rounds_error(runner, reference) < ATOL
