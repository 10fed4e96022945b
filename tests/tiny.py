"""Tiny randomly initialised causal LMs built from a config, for tests that need no language."""

import asyncio
import contextlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from speculative.loop import Request, RequestState, decode
from speculative.policy import FixedK
from speculative.sampling import SamplingParams


def tiny_llama(seed: int, *, vocab_size: int = 64, layers: int = 2, hidden: int = 32):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper than the default init, so distributions are not flat
        model.lm_head.weight.mul_(8.0)
    return model


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
        min_new_tokens=max_tokens, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def run(drafter, verifier, prompt, params: SamplingParams, k: int, request_id="r", stop=()):
    """Decode one request in-process; returns (output ids, state)."""
    state = RequestState(Request(request_id, tuple(prompt), params, tuple(stop)))

    async def main():
        async with contextlib.aclosing(decode(state, drafter, verifier, FixedK(k))) as rounds:
            async for _ in rounds:
                pass

    asyncio.run(main())
    return state.output_token_ids, state


def noisy_copy(model, scale: float, seed: int):
    """A draft that agrees with `model` often but not always: its weights plus noise."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return draft
