"""What a forward costs on this machine, and what speculation should gain from it.

Measured: forward times over a cached context, the target's cost curve t(n) for n tokens, the
dtype whose curve is flattest, c = t_draft(1) / t_target(1). The formula: E[N] tokens per round
for an acceptance rate α, over a sequential round's cost t(K+1)/t(1) + K c in target forwards.
"""

import functools
import statistics
import time
from pathlib import Path

import torch

from bench.pairs import Pair
from engine.models import load_causal_lm


def forward_ms(model, context: int, new_tokens: int, repeats: int) -> float:
    """Median time of a forward of `new_tokens` tokens over a cached context."""
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (1, context + new_tokens),
                        generator=torch.Generator().manual_seed(0))
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            cache = DynamicCache(config=model.config)
            model(ids[:, :context], past_key_values=cache, use_cache=True)
            started = time.perf_counter()
            model(ids[:, context:], past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def cost_curve(model, ns, repeats: int) -> dict[str, float]:
    """Forward ms of n tokens over a 64-token cache, for each n."""
    return {str(n): round(forward_ms(model, 64, n, repeats), 2) for n in ns}


@functools.cache  # the scaled and balanced pairs share their target: measured once a run
def flattest_dtype(path: str, max_n: int, repeats: int) -> tuple[str, dict]:
    """The dtype in which the target's t(max n) / t(1) is smallest on this machine, and the
    curves measured: verification is nearly free where the forward is memory-bound (native
    bf16, a GPU) and costs K + 1 times more where it is compute-bound (emulated bf16)."""
    curves = {dtype: cost_curve(load_causal_lm(path, dtype), (1, max_n), repeats)
              for dtype in ("float32", "bfloat16")}
    ratio = lambda dtype: curves[dtype][str(max_n)] / curves[dtype]["1"]  # noqa: E731
    return min(curves, key=ratio), curves


def pair_facts(pair: Pair, target, draft, ks, repeats: int) -> dict:
    """Parameter counts, the target's cost curve t(n) for n = 1..K+1 and its ratio to t(1),
    and c = t_draft(1) / t_target(1) for the formula (`target`, `draft`: the loaded models)."""
    curve = cost_curve(target, sorted({1, *(k + 1 for k in ks)}), repeats)
    draft_1 = forward_ms(draft, 64, 1, repeats)
    return {
        "note": pair.note,
        "target": {"path": Path(pair.target).name, "dtype": pair.target_dtype,
                   "parameters": sum(p.numel() for p in target.parameters())},
        "draft": {"path": Path(pair.draft).name, "dtype": pair.draft_dtype,
                  "parameters": sum(p.numel() for p in draft.parameters())},
        "target_forward_ms": curve,
        "verify_cost": {n: round(ms / curve["1"], 3) for n, ms in curve.items()},
        "draft_forward_ms": round(draft_1, 2),
        "c": round(draft_1 / curve["1"], 4),
    }


def expected_tokens_per_round(alpha: float | None, k: int) -> float | None:
    """E[N] = (1 - alpha^(K+1)) / (1 - alpha): tokens per round for i.i.d. acceptance."""
    if alpha is None:
        return None
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def round_cost(facts: dict, k: int) -> float:
    """A sequential round in target forwards: t(K+1)/t(1) + K c (1 + K c if t(K+1) is not
    measured: a free verification)."""
    return facts.get("verify_cost", {}).get(str(k + 1), 1.0) + k * facts["c"]
