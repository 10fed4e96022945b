"""The packed forward of each engine, side by side, against the machine's floor.

`python -m bench.engine` (one thread by default, as a pool replica runs): for the demo target
and draft, the forward of B requests x n new tokens over a context of C cached positions,
with transformers' modeling (a DynamicCache per request, attention per request) and with the
paged lean forward (engine.lean). Each time is set against its floor on this machine: the
bytes it must read (weights, and the batch's cached keys and values) over the measured memory
bandwidth, and its matmul FLOPs over the measured peak; the larger of the two is the floor.
Medians of repeated runs; ratios from one run.
"""

import argparse
import json
import time

import torch

from engine.kv import SessionStore
from engine.memory import kv_bytes_per_token
from engine.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm
from engine.runner import serving_runner
from specserve.gpu_measures import prefill

CASES = [(1, 1), (1, 5), (8, 1), (8, 5), (16, 1), (32, 1), (32, 5)]  # (requests, new each)
BACKENDS = ("transformers", "paged", "regions")  # the default CPU backend last


def median_s(work, repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def memory_bandwidth() -> float:
    """Bytes per second a sum over 256 MB reads."""
    data = torch.ones(64 << 20)
    return data.numel() * 4 / median_s(lambda: data.sum(), 5)


def peak_flops(dtype) -> float:
    a, b = torch.randn(1024, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
    return 2 * 1024**3 / median_s(lambda: a @ b, 5)


def forward_ms(runner, batch: int, new: int, context: int, repeats: int) -> float:
    """The median forward of `batch` requests x `new` tokens after `context` cached ones."""
    store = SessionStore(batch + 1)
    sequences = [prefill(runner, store, f"r{b}", [(7 * b + i) % 4000 + 1 for i in range(context)])
                 for b in range(batch)]
    took = 1e3 * median_s(lambda: runner.forward(
        [s.segment(runner, [5] * (new - 1), new) for s in sequences]), repeats)
    store.clear()
    return took


def runner_for(path: str, backend: str, dtype: str, tokens: int):
    if backend == "transformers":
        return serving_runner(load_causal_lm(path, dtype), "transformers")
    # regions: as many as the memory budget holds (each a whole context, backed as written)
    return serving_runner(load_causal_lm(path, dtype), "paged", backend, max_sequences=64,
                          kv_cache_tokens=tokens if backend == "paged" else None)


def floor_ms(model, batch: int, new: int, context: int, bandwidth: float, flops: float) -> float:
    parameters = sum(p.numel() for p in model.parameters())
    weight_bytes = parameters * next(model.parameters()).element_size()
    kv_bytes = batch * (context + new) * kv_bytes_per_token(model)
    matmul_flops = 2 * parameters * batch * new
    return 1e3 * max((weight_bytes + kv_bytes) / bandwidth, matmul_flops / flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    bandwidth, flops = memory_bandwidth(), peak_flops(dtype)
    print(f"measured: {bandwidth / 1e9:.1f} GB/s read, {flops / 1e9:.1f} GFLOP/s "
          f"({args.dtype} matmul), {args.threads} thread(s); context {args.context}")
    print("| model | requests x new | " + " | ".join(f"{b} ms" for b in BACKENDS)
          + " | regions / paged | floor ms | regions / floor |")
    print("|---" * (len(BACKENDS) + 5) + "|")
    rows = []
    for name, path in (("target", DEMO_TARGET), ("draft", DEMO_DRAFT)):
        for batch, new in CASES:
            tokens = (batch + 1) * (args.context + 16)
            times = {}
            for backend in BACKENDS:
                runner = runner_for(path, backend, args.dtype, tokens)
                times[backend] = forward_ms(runner, batch, new, args.context, args.repeats)
            floor = floor_ms(runner.model, batch, new, args.context, bandwidth, flops)
            rows.append({"model": name, "batch": batch, "new": new, "floor_ms": floor,
                         **{f"{b}_ms": t for b, t in times.items()}})
            print(f"| {name} | {batch} x {new} | "
                  + " | ".join(f"{times[b]:.2f}" for b in BACKENDS)
                  + f" | {times['regions'] / times['paged']:.2f}x | {floor:.2f} | "
                  f"{times['regions'] / floor:.1f}x |", flush=True)
    print(json.dumps({"bandwidth_gb_s": bandwidth / 1e9, "gflops": flops / 1e9, "rows": rows}))


if __name__ == "__main__":
    main()
