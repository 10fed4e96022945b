"""A compute-realistic target whose predictions are exactly the demo target's (a benchmark
construct, not a better model).

The demo target is so small that per-call overhead dominates. `scale_up` grows it function-
preservingly: more attention heads, a wider MLP and extra decoder layers, where every new unit
writes to the residual stream through output weights that are zero (o_proj columns of new
heads, down_proj columns of new MLP units, o_proj and down_proj of new layers). The new input
weights are random, so each forward does the full dense work of the large shape, while the
residual stream, and so every logit, is the demo target's: adding exact zeros changes nothing.

    python -m bench.scaled [--out models/scaled-target]   # ~120M parameters, bf16 on disk
"""

import argparse
import copy
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.costs import forward_ms
from engine.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm


def widen(old: torch.Tensor, new: torch.Tensor, generator) -> torch.Tensor:
    """`new`'s shape, holding `old` in its leading corner and small random values elsewhere."""
    out = torch.randn(new.shape, generator=generator, dtype=old.dtype) * 0.02
    out[tuple(slice(0, n) for n in old.shape)] = old
    return out


def zero_beyond(old: torch.Tensor, new_shape) -> torch.Tensor:
    """`new_shape` holding `old` in its leading corner and zeros elsewhere (output weights)."""
    out = torch.zeros(new_shape, dtype=old.dtype)
    out[tuple(slice(0, n) for n in old.shape)] = old
    return out


@torch.no_grad()
def scale_up(model, num_layers: int, num_heads: int, intermediate_size: int, seed: int = 0):
    """A copy of a Llama model with more layers, heads and MLP units, same function."""
    old = model.config
    assert old.num_attention_heads == old.num_key_value_heads, "MHA models only"
    config = copy.deepcopy(old)
    config.num_hidden_layers, config.num_attention_heads = num_layers, num_heads
    config.num_key_value_heads, config.intermediate_size = num_heads, intermediate_size
    config.head_dim = getattr(old, "head_dim", old.hidden_size // old.num_attention_heads)
    big = LlamaForCausalLM(LlamaConfig.from_dict(config.to_dict())).to(model.dtype).eval()
    generator = torch.Generator().manual_seed(seed)
    state, new_state = model.state_dict(), big.state_dict()
    for name, tensor in new_state.items():
        source = state.get(name)
        is_output = name.endswith(("o_proj.weight", "down_proj.weight"))
        if source is None:  # a whole new layer: only its output weights must be zero
            new_state[name] = torch.zeros_like(tensor) if is_output else tensor
        elif is_output:
            new_state[name] = zero_beyond(source, tensor.shape)
        else:
            new_state[name] = widen(source, tensor, generator)
    big.load_state_dict(new_state)
    return big


# 36 layers: a 1-token bf16 forward of ~38 ms on one core of this machine (28 layers: 30 ms)
SHAPE = {"num_layers": 36, "num_heads": 16, "intermediate_size": 3072}


def build(out: str, dtype: str = "bfloat16", **shape) -> int:
    """Write the scaled demo target (and the demo tokenizer) to `out`; returns its parameters."""
    from transformers import AutoTokenizer

    big = scale_up(load_causal_lm(DEMO_TARGET), **{**SHAPE, **shape})
    big.to(getattr(torch, dtype)).save_pretrained(out)
    AutoTokenizer.from_pretrained(DEMO_TARGET).save_pretrained(out)
    return sum(p.numel() for p in big.parameters())


# the balanced draft: the demo draft with the scaled target's head count and MLP width, and as
# many layers as bring one draft token to c = 0.15-0.25 of a target token on this machine
DRAFT_SHAPE = {"num_heads": 16, "intermediate_size": 3072}
C_RANGE = (0.15, 0.25)


def build_balanced_draft(out: str, target_ms: float, dtype: str, repeats: int = 9) -> dict:
    """Write (or keep, if its c is still in range here) the balanced draft; returns its facts.

    target_ms: the target's measured 1-token forward in `dtype` on this machine.

    The layer count comes from the measured cost of two trial depths (a token's cost is close
    to linear in the layers), aiming at c = 0.2, since c depends on the machine and dtype.
    """
    if (Path(out) / "config.json").exists():
        draft = load_causal_lm(out, dtype)
        c = forward_ms(draft, 64, 1, repeats) / target_ms
        if C_RANGE[0] <= c <= C_RANGE[1]:
            return facts_of(draft, c, target_ms)
    demo = load_causal_lm(DEMO_DRAFT)
    trial = {layers: forward_ms(scale_up(demo, layers, **DRAFT_SHAPE).to(getattr(torch, dtype)),
                                64, 1, repeats) for layers in (2, 8)}
    per_layer = (trial[8] - trial[2]) / 6
    fixed = trial[2] - 2 * per_layer
    layers = max(2, round((0.2 * target_ms - fixed) / max(per_layer, 1e-6)))
    draft = scale_up(demo, layers, **DRAFT_SHAPE).to(getattr(torch, dtype))
    draft.save_pretrained(out)
    c = forward_ms(draft, 64, 1, repeats) / target_ms
    return facts_of(draft, c, target_ms)


def facts_of(draft, c: float, target_ms: float) -> dict:
    return {"layers": draft.config.num_hidden_layers, "c": round(c, 4),
            "parameters": sum(p.numel() for p in draft.parameters()),
            "target_forward_ms": round(target_ms, 2), "in_range": C_RANGE[0] <= c <= C_RANGE[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="models/scaled-target")
    parser.add_argument("--layers", type=int, default=SHAPE["num_layers"])
    parser.add_argument("--heads", type=int, default=SHAPE["num_heads"])
    parser.add_argument("--intermediate-size", type=int, default=SHAPE["intermediate_size"])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    parameters = build(args.out, args.dtype, num_layers=args.layers, num_heads=args.heads,
                       intermediate_size=args.intermediate_size)
    print(f"{parameters / 1e6:.1f}M parameters -> {args.out}")


if __name__ == "__main__":
    main()
