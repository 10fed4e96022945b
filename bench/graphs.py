"""How much of a GPU forward is the host's: the lean forward eager, against its device work
recorded as a CUDA graph and replayed, and against the runner's own graphs (engine.graphs).

`python -m bench.graphs [--out F]` on a CUDA device: for check-gpu's Llama-3.2-1B and 3.1-8B
shapes (bfloat16, random weights from configs) and the demo pair (float32), B requests x
(K + 1) new tokens over a context of C cached positions, four times per case:

- `eager`: the lean forward kernel by kernel (`LeanForward`: the plan's host work, then the
  device work);
- `device`: its device work alone (`LeanForward.run`, the plan built once beforehand);
- `graph`: that device work recorded as one CUDA graph, replayed (a replay rewrites the same
  keys and values, so it can be repeated): the floor of a graphed step;
- `served`: the runner's forward as a pool runs it, through engine.graphs (the batch padded
  to its bucket, the host's inputs copied in, the bucket's graph replayed, the wanted logits
  copied out).

`graph_difference` (the replay against the device work: same kernels, same inputs) must be 0;
`served_difference` (the bucketed forward against the eager one) is float reassociation over
the bucket's padded keys. `--device cpu --small` runs the eager parts at small shapes.
"""

import argparse
import gc
import json
from pathlib import Path

import torch

from engine.graphs import recorded
from engine.kv import SessionStore
from engine.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm
from engine.runner import serving_runner
from specserve.check_gpu import FULL, SMALL, build, guarded, no_math_attention
from specserve.gpu_measures import prefill, prompts, sync_device, timed_ms

CASES = [(1, 0), (1, 4), (8, 0), (8, 4), (32, 0), (32, 4)]  # (requests, K)


def case(runner, batch: int, k: int, context: int, repeats: int, graphs: bool) -> dict:
    """One batch shape: the four timings and the two differences (module doc)."""
    model, lean = runner.model, runner.lean
    store = SessionStore(batch + 1)
    sequences = [prefill(runner, store, f"g{i}", text) for i, text in
                 enumerate(prompts(batch, context, model.config.vocab_size, seed=4))]

    def segments():
        return [s.segment(runner, [5] * k, k + 1) for s in sequences]

    with torch.inference_mode():
        row = {"eager_ms": timed_ms(lambda: lean(segments()), model.device, repeats)}
        if runner.graphs is not None:
            row["served_ms"] = timed_ms(lambda: runner.forward(segments()), model.device,
                                        repeats)
            eager, served = torch.cat(lean(segments())), torch.cat(runner.forward(segments()))
            row["served_difference"] = float((eager.float() - served.float()).abs().max())
            row["eager_over_served"] = round(row["eager_ms"] / row["served_ms"], 2)
        plan = lean.attention.plan(segments())
        ids = torch.full((batch * (k + 1),), 5, dtype=torch.long, device=model.device)
        keep = torch.arange(ids.numel(), device=model.device)
        work = lambda: lean.run(ids, plan, keep)  # noqa: E731
        row["device_ms"] = timed_ms(work, model.device, repeats)
        if graphs:
            expected = work().clone()
            output = torch.empty_like(expected)
            graph = recorded(lambda: output.copy_(work()), model.device)
            # the recording's eager warm-ups wrote the output already: only a replay that
            # writes it clears the NaN (else the difference reads NaN, not a false 0)
            output.fill_(float("nan"))
            row["graph_ms"] = timed_ms(graph.replay, model.device, repeats)
            row["graph_difference"] = float((output.float() - expected.float()).abs().max())
            del graph, output
    store.clear()
    sync_device(model.device)
    return row


def models(device: str, small: bool):
    """(name, model, context) of each measured model."""
    for shape in SMALL if small else FULL:
        dtype = torch.float32 if small else torch.bfloat16
        yield f"{shape.name} {str(dtype).removeprefix('torch.')}", \
            build(shape, dtype, device), 64 if small else 2048
    for name, path in (("demo target", DEMO_TARGET), ("demo draft", DEMO_DRAFT)):
        yield f"{name} float32", load_causal_lm(path, "float32", device), 64 if small else 512


def run(device: str, small: bool, repeats: int) -> dict:
    graphs = torch.device(device).type == "cuda"
    report = {"device": device, "torch": torch.__version__, "rows": []}
    if graphs:
        report["gpu"] = torch.cuda.get_device_name(device)
    for name, model, context in models(device, small):
        runner = serving_runner(model, "paged", "paged", kv_cache_tokens=34 * (context + 16),
                                max_sequences=40)
        with no_math_attention(device):
            for batch, k in CASES:
                row = {"model": name, "context": context, "batch": batch, "k": k,
                       **guarded(case, runner, batch, k, context, repeats, graphs)}
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
        del runner, model
        if graphs:
            gc.collect()  # a graphed runner's buckets and owner refer to each other
            torch.cuda.empty_cache()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="small shapes, short contexts")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    report = run(args.device, args.small, args.repeats)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
