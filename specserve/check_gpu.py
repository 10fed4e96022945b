"""`specserve check-gpu`: the engine's acceptance run on one device (a GPU, or the CPU with
`--device cpu --small`), with models built from configs (random weights: no hub).

What it checks and measures, per model shape:
- greedy identity: the speculative loop (fixed K, the model drafting for itself) against
  transformers' own `generate` on the same weights; in float32 they must agree, in bfloat16
  a divergence is reported with the logit gap where it happened (a near-tie);
- sampling at T = 1 through both pools on the device (the draws run there);
- one request alone against the same request in a batch of 32: the largest logit
  difference and the argmax flips;
- verify forward time at 1, 8 and 32 requests x the context x K of 4 and 8, and the draft
  step (1 token) at the same batch sizes;
- memory at peak, and what happens when the KV pool is full (a clear KVCacheFull);
- the bundled demo pair on the device: greedy identity with its own draft, a sampled run,
  in-process tokens/s at K = 0 and 4.

On a GPU every runner replays CUDA graphs where a batch fits a bucket (engine.graphs), so the
checks and times above are the graphed forward's; `cuda_graphs` reports how many buckets
were recorded (`python -m bench.graphs` times eager against graphs).

It prints one JSON report (and writes it with --out); `ok` is false when a check fails.
"""

import argparse
import asyncio
import gc
import json
import math
import time
import traceback
from dataclasses import dataclass

import torch

from engine.runner import serving_runner
from specserve.cli_args import FlagError, file_path, unwritable
from specserve.gpu_measures import (
    alone_vs_batch,
    forward_times,
    full_pool,
    prompts,
    sync_device,
)


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False


FULL = [Shape("llama-3.2-1b", 2048, 8192, 16, 32, 8, 128_256, tied=True),
        Shape("llama-3.1-8b", 4096, 14_336, 32, 32, 8, 128_256)]
ENGINE_TOKENS = 4096  # KV positions of each engine a check builds beside the measured runner
SMALL = [Shape("small-1b-like", 128, 512, 2, 8, 2, 1024, tied=True),
         Shape("small-8b-like", 256, 896, 4, 8, 2, 1024)]


def build(shape: Shape, dtype, device, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         max_position_embeddings=8192, tie_word_embeddings=shape.tied,
                         rope_theta=500_000.0, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # sharper than the default init: fewer exact near-ties
        model.lm_head.weight.mul_(8.0)
    return model


def greedy_identity(runner, prompt: list[int], max_tokens: int, k: int, draft=None) -> dict:
    """The speculative loop (fixed K; `draft` drafting, else the model for itself) against
    HF generate; runners (engine.runner) or models."""
    from drafter.model import ModelDrafter
    from speculative.sampling import SamplingParams
    from verifier.engine import ModelVerifier

    model = getattr(runner, "model", runner)
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad(), any_attention():  # the reference may take any kernel
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                   pad_token_id=0, output_scores=True,
                                   return_dict_in_generate=True)
    expected = reference.sequences[0, len(prompt):].tolist()
    drafter, verifier = (ModelDrafter(draft or runner, kv_cache_tokens=ENGINE_TOKENS),
                         ModelVerifier(runner, kv_cache_tokens=ENGINE_TOKENS))
    # generate's min_new_tokens masks the end tokens at every position: the loop the same
    ends = model.generation_config.eos_token_id
    ends = () if ends is None else tuple(ends) if isinstance(ends, list) else (ends,)
    output = run_request(drafter, verifier, prompt, SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, min_tokens_end_ids=ends), k)
    report = {"tokens": max_tokens, "identical": output == expected}
    if output != expected:
        at = next(i for i, (a, b) in enumerate(zip(output, expected)) if a != b)
        top = reference.scores[at][0].float().topk(2).values
        report.update(first_divergence=at, logit_gap_there=round(float(top[0] - top[1]), 6),
                      top_logit_there=round(float(top[0]), 6))
    return report


def sampled_run(runner, prompt: list[int], max_tokens: int, k: int, draft=None) -> dict:
    from drafter.model import ModelDrafter
    from speculative.sampling import SamplingParams
    from verifier.engine import ModelVerifier

    drafter = ModelDrafter(draft or runner, draft_q_mass=0.99, draft_q_dtype="float16",
                           kv_cache_tokens=ENGINE_TOKENS)
    verifier = ModelVerifier(runner, kv_cache_tokens=ENGINE_TOKENS)
    vocab_size = verifier.model.config.vocab_size
    started = time.perf_counter()
    output = run_request(drafter, verifier, prompt, SamplingParams(temperature=1.0, seed=7,
                         max_tokens=max_tokens), k)
    return {"tokens": len(output), "asked": max_tokens,
            "in_vocabulary": all(0 <= t < vocab_size for t in output),
            "seconds": round(time.perf_counter() - started, 3)}


def any_attention():
    """SDPA with every kernel, math included: for transformers' own generate, the reference.
    Its unbatched calls pass `enable_gqa` without a mask, which on CUDA in float32 only the
    math kernel takes (flash has no float32, the efficient kernel no GQA): measured on an
    H200, torch 2.11, where no_math_attention made that reference raise."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])


def no_math_attention(device: str):
    """SDPA without its math kernel: a call that would fall back to it raises instead. On
    CUDA the kernels a runner keeps (flash and memory-efficient, no cuDNN:
    engine.runner.keep_attention_kernels), so the check times what serves."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if torch.device(device).type == "cuda":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def check_shape(shape: Shape, device: str, small: bool, dtype) -> dict:
    """One shape on the device, every attention call under no_math_attention."""
    length = 64 if small else 2048
    kv_tokens = 34 * (length + 16) + 64
    model = build(shape, dtype, device)
    runner = serving_runner(model, "paged", "auto", kv_cache_tokens=kv_tokens, max_sequences=64)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    prompt = prompts(1, 16, shape.vocab, seed=3)[0]
    with no_math_attention(device):
        report = {"dtype": str(dtype).removeprefix("torch."), "attention": runner.attention,
                  "greedy": greedy_identity(runner, prompt, 16 if small else 64, 4),
                  "sampled": sampled_run(runner, prompt, 16 if small else 64, 4),
                  "alone_vs_batch": alone_vs_batch(runner, 32, length // 2)}
        report["forward_ms"] = forward_times(runner, [1, 8, 32], length, [4, 8],
                                             3 if small else 5)
    if device.startswith("cuda"):
        report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if runner.graphs is not None:  # the buckets its batches replayed (engine.graphs)
        report["cuda_graphs"] = len(runner.graphs.recorded)
    report["when_full"] = full_pool(runner)
    return report


def check_demo_pair(device: str, small: bool) -> dict:
    """The bundled demo pair on the device, float32: greedy identity with its own draft at
    K = 4, a sampled run through both pools, and greedy tokens/s in-process at K = 0 and 4."""
    from engine.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm
    from speculative.sampling import SamplingParams
    from drafter.model import ModelDrafter
    from verifier.engine import ModelVerifier

    target, draft = (serving_runner(load_causal_lm(path, "float32", device), "paged",
                                    kv_cache_tokens=ENGINE_TOKENS, max_sequences=8)
                     for path in (DEMO_TARGET, DEMO_DRAFT))
    prompt = prompts(1, 16, target.model.config.vocab_size, seed=5)[0]
    tokens = 32 if small else 96
    report = {"dtype": "float32", "greedy": greedy_identity(target, prompt, tokens, 4, draft),
              "sampled": sampled_run(target, prompt, tokens, 4, draft), "tokens_per_s": {}}
    drafter, verifier = ModelDrafter(draft), ModelVerifier(target)
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    for k in (0, 4):
        run_request(drafter, verifier, prompt, params, k)  # warm
        sync_device(device)
        started = time.perf_counter()
        made = run_request(drafter, verifier, prompt, params, k)
        sync_device(device)
        report["tokens_per_s"][f"K={k}"] = round(len(made) / (time.perf_counter() - started), 1)
    return report


# bfloat16 is not exact, but its rounding moves a logit by a small fraction of the logits'
# scale. Measured clean: on an H200, the 8B shape's batch moved a logit by 1.75 (about 4 % of
# its top logits' scale) and its greedy output departed where the top two were one bfloat16
# unit apart; on a CPU, under 1 % at the small shapes, where a leak between requests moves
# them by 6-140 %. The bounds leave clean runs room (a false failure sends an operator after
# a defect that is not there): a gross leak or a divergence far from a near-tie fails.
BF16_BATCH_TOLERANCE = 0.25  # of max_abs_logit
BF16_GAP_UNITS = 16  # bfloat16 units (2**-7 of the top logit's power of two)


def sampled_ok(sampled: dict) -> bool:
    return sampled["in_vocabulary"] and sampled["tokens"] == sampled["asked"]


def bf16_near_tie(greedy: dict) -> bool:
    """A bfloat16 greedy divergence at a gap of at most BF16_GAP_UNITS of its top logit."""
    if greedy["identical"]:
        return True
    top = abs(greedy["top_logit_there"])
    unit = 2.0 ** (math.floor(math.log2(top)) - 7) if top > 0 else 2.0 ** -133
    return greedy["logit_gap_there"] <= BF16_GAP_UNITS * unit


def passed(report: dict) -> bool:
    """fp32 greedy identical, a bf16 divergence only at a near-tie; a batch changes logits by
    reassociation only; the pool refuses cleanly; sampling returned its tokens; the demo pair
    is exact."""
    demo = report.get("demo_pair")
    entries = [*report["models"].values(), *([demo] if demo is not None else [])]
    if any("error" in entry for entry in entries):
        return False
    if demo is not None and not (demo["greedy"]["identical"] and sampled_ok(demo["sampled"])):
        return False
    for entry in report["models"].values():
        exact = entry["dtype"] == "float32"
        batched = entry["alone_vs_batch"]
        if exact and not entry["greedy"]["identical"]:
            return False
        if exact and batched["max_logit_difference"] > 1e-3:
            return False
        if not exact and (not bf16_near_tie(entry["greedy"]) or batched["max_logit_difference"]
                          > BF16_BATCH_TOLERANCE * batched["max_abs_logit"]):
            return False
        if not entry["when_full"]["refused"] or not sampled_ok(entry["sampled"]):
            return False
    return True


def guarded(check, *args) -> dict:
    """check(*args), or {"error": the exception and where it was raised}: one check that
    raises fails the run without losing the others' measurements (a GPU is lent for
    minutes)."""
    try:
        return check(*args)
    except Exception as error:  # noqa: BLE001 - reported, and the run fails
        where = traceback.extract_tb(error.__traceback__)[-1]
        return {"error": f"{type(error).__name__}: {error} ({where.filename}:{where.lineno})"}


def run(device: str, small: bool) -> dict:
    shapes = SMALL if small else FULL
    report = {"device": device, "small": small, "torch": torch.__version__, "models": {}}
    if device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(device)
    for shape in shapes:
        dtypes = [torch.float32] if small else [torch.bfloat16]
        if not small and shape.name == "llama-3.2-1b":
            dtypes = [torch.float32, torch.bfloat16]  # exact in fp32, near-ties in bf16
        for dtype in dtypes:
            name = f"{shape.name} {str(dtype).removeprefix('torch.')}"
            report["models"][name] = guarded(check_shape, shape, device, small, dtype)
            if device.startswith("cuda"):
                gc.collect()  # a graphed runner's buckets and owner refer to each other
                torch.cuda.empty_cache()
    report["demo_pair"] = guarded(check_demo_pair, device, small)
    report["ok"] = passed(report)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--small", action="store_true",
                        help="small shapes and a 64-token context (what CI runs on a CPU)")
    parser.add_argument("--out", type=file_path, default=None,
                        help="also write the JSON here (a file)")


def main(args) -> int:
    """The run and its report; FlagError, before the run, for flags it cannot use."""
    if args.out is not None and not args.out.parent.is_dir():
        raise FlagError(f"--out {args.out}: its folder does not exist")
    if args.out is not None and args.out.is_dir():  # found before the run, not after it
        raise FlagError(f"--out {args.out} is a folder: name a file")
    problem = None if args.out is None else unwritable(args.out.parent)
    if problem:  # a read-only or virtual folder (/proc): its write raised after the run
        raise FlagError(f"--out {args.out}: cannot write there ({problem})")
    from engine.models import check_device

    try:  # no torch device, none visible, or cuda:N past the visible ones
        check_device(args.device)
    except ValueError as error:
        raise FlagError(f"--{error} (on a CPU: --device cpu --small)") from None
    kind = torch.device(args.device).type  # cpu:0 is a CPU too
    if kind not in ("cuda", "cpu"):  # mps, meta, xpu: no checks were written for them
        raise FlagError(f"--device {args.device!r}: cuda, cuda:N or cpu")
    if kind == "cpu" and not args.small:  # the 8B shape alone is 32 GB in float32
        raise FlagError("--device cpu runs the small shapes only: add --small")
    report = run(args.device, args.small)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0 if report["ok"] else 1


def run_request(drafter, verifier, prompt, params, k: int) -> list[int]:
    """One request through the request front end and the in-process loop with a fixed K;
    its output ids."""
    from speculative.driver import Generation
    from speculative.frontend import RequestFrontEnd
    from speculative.options import SpeculationDefaults

    front_end = RequestFrontEnd(SpeculationDefaults(k, pipelined_drafting="off"))
    plan = front_end.plan("check", prompt, params)
    [choice] = plan.choices
    generation = Generation(choice.request, None)
    asyncio.run(generation.run(drafter, verifier, choice.policy, plan.pipelined))
    return generation.token_ids
