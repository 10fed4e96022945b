"""`specserve bench`: every mode side by side, in one run, on the same prompts and pair.

Modes (the record field `mode`):
  target_only  HF `generate` with the target alone (the anchor every speedup is relative to)
  hf_assisted  HF assisted generation with the same draft (`generate(assistant_model=...)`)
  inprocess    specserve's round loop with both engines in this process
  serve_off    specserve through Serve (cluster/config.yaml on a local Ray), K = 0
  serve_sync   specserve through Serve with K drafted tokens per round, draft then verify
  serve_pipelined  the same, drafting block r+1 while the verifier scores block r
  serve_adaptive   K chosen per round by the router (num_speculative_tokens "auto", bounds
                   from cluster/config.yaml), pipelined as the router's default says (greedy
                   requests); the record's k is "auto"

The concurrency sweep (bench/sweep.py; records with `stream` true): 1, 4, 16 and 32 streaming
HTTP clients at once, greedy, serve_off against serve_adaptive, on the demo and scaled pairs:
aggregate tokens/s, TTFT and TPOT percentiles, the pools' mean batch sizes, the K chosen.

Sampled records carry `draft_q`: the draft distribution as shipped ("mass0.99-float16", the
default config's) or "dense" (HF assisted generation, and in-process records with dense q at
T > 0 for the comparison).

Prompts are interleaved: for each prompt every mode runs once before the next prompt, so
machine drift hits all modes alike. Everything runs with the same torch thread count (each pool
replica of cluster/config.yaml has 1 thread). Writes results.json (a flat list of records),
results.md and PNG plots (speedup_vs_k, acceptance_by_position, concurrency) into --out.

The `scaled` pair is a benchmark construct: the demo target grown function-preservingly to
~124M parameters (bench/scaled.py), so its predictions, and so the acceptance rate, are exactly
the demo target's while its forward costs what a model of that size costs. The `balanced` pair
adds the demo draft grown the same way until one draft token costs c = 0.15-0.25 of a target
token, as a 1B draft does for an 8B target. Both constructs run in the dtype whose target cost
curve t(n)/t(1) over n = 1..K+1 is flattest on this machine (measured at the start).
"""

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from bench import checks, sweep
from speculative.stats import SpecStats
from engine.models import DEMO_DRAFT, DEMO_TARGET

PROMPTS = [  # code prompts ending at a token boundary the tokenizer saw in training
    "import os\n",
    "def main():\n",
    "class Config:\n",
    "    def __init__(self",
    "for i in range(",
    'if __name__ == "__main__":\n',
    "from collections import",
    "        return self.",
]
SCALED_TARGET = str(Path(DEMO_TARGET).parent.parent / "scaled-target")
BALANCED_DRAFT = str(Path(DEMO_TARGET).parent.parent / "balanced-draft")
MODES = ("target_only", "hf_assisted", "inprocess", "serve_off", "serve_sync",
         "serve_pipelined", "serve_adaptive")
FIELDS = ("pair", "mode", "k", "temperature", "draft_q", "concurrency", "requests", "tokens",
          "seconds", "tokens_per_s", "acceptance_rate", "mean_acceptance_length",
          "predicted_tokens_per_round", "predicted_speedup", "speedup",
          "speedup_vs_predicted", "c", "acceptance_by_position", "ms_draft", "ms_verify",
          "ms_transport", "ms_router", "ms_round", "overhead_ms_p50", "exposed_ms_p50",
          "wire_bytes_per_round", "mean_k",
          "greedy_matches_target", "sampled_matches_inprocess",
          # the concurrency sweep's records (bench/sweep.py), None elsewhere
          "stream", "speedup_vs_off", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99",
          "batch_mean_verifier", "batch_mean_drafter", "draft_fallback_rounds")


@dataclass(frozen=True)
class Pair:
    name: str
    target: str
    target_dtype: str
    draft: str
    draft_dtype: str
    note: str


PAIRS = {
    "demo": Pair("demo", DEMO_TARGET, "float32", DEMO_DRAFT, "float32",
                 "the bundled demo pair (6.2M target, 0.95M draft)"),
    "scaled": Pair("scaled", SCALED_TARGET, "auto", DEMO_DRAFT, "float32",
                   "benchmark construct: the demo target grown function-preservingly to ~124M "
                   "parameters (same predictions, realistic forward cost), demo draft"),
    "balanced": Pair("balanced", SCALED_TARGET, "auto", BALANCED_DRAFT, "auto",
                     "benchmark construct: the scaled target, and the demo draft grown "
                     "function-preservingly until a draft token costs c = 0.15-0.25 of a target "
                     "token (same acceptance as the demo pair, the draft cost of a 1B draft for "
                     "an 8B target)"),
}


@dataclass(frozen=True)
class Plan:
    pairs: tuple[str, ...]
    ks: tuple[int, ...]
    temperatures: tuple[float, ...]
    num_prompts: int
    max_tokens: int
    serve_concurrency: int  # serve modes also run this many requests at once (K = 4), if > 1
    # the concurrency sweep: client counts (none: no sweep), tokens a request, the pairs swept
    sweep_levels: tuple[int, ...] = sweep.LEVELS
    sweep_tokens: int = 40
    sweep_requests_per_client: int = 1
    sweep_pairs: tuple[str, ...] = ("demo", "scaled")

    @classmethod
    def make(cls, quick: bool, pair: str, levels: tuple[int, ...] = sweep.LEVELS) -> "Plan":
        pairs = tuple(PAIRS) if pair == "all" else (pair,)
        if quick:
            return cls(pairs, (1, 4), (0.0, 1.0), 2, 32, 1, levels, sweep_tokens=12)
        return cls(pairs, (1, 2, 4, 6), (0.0, 1.0), 3, 48, 4, levels)


def expected_tokens_per_round(alpha: float | None, k: int) -> float | None:
    """E[N] = (1 - alpha^(K+1)) / (1 - alpha): tokens per round for i.i.d. acceptance."""
    if alpha is None:
        return None
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


# ---------------------------------------------------------------------------- the runs


@dataclass
class Tally:
    """One (pair, mode, k, temperature, concurrency) cell, summed over prompts."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    stats: SpecStats | None = None
    overhead_p50s: list[float] = field(default_factory=list)
    exposed_p50s: list[float] = field(default_factory=list)  # round time beyond the verify
    # requests whose ids differ from the reference: greedy, target_only's; sampled serve_sync,
    # inprocess's with the same seed (None: not compared)
    mismatches: int | None = None

    def add(self, tokens: int, seconds: float, stats: SpecStats | None = None,
            overhead_p50: float | None = None, exposed_p50: float | None = None) -> None:
        self.requests += 1
        self.tokens += tokens
        self.seconds += seconds
        if stats is not None:
            self.stats = self.stats or SpecStats()
            self.stats.add(stats)
        if overhead_p50 is not None:
            self.overhead_p50s.append(overhead_p50)
        if exposed_p50 is not None:
            self.exposed_p50s.append(exposed_p50)

    def compare(self, ids, reference) -> None:
        self.mismatches = (self.mismatches or 0) + (list(ids) != list(reference))


def sampling_kwargs(temperature: float) -> dict:
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def hf_generate(model, prompt_ids, max_tokens: int, temperature: float, seed: int,
                assistant=None, k: int = 0) -> tuple[list[int], float]:
    ids = torch.tensor([prompt_ids])
    extra = {}
    if assistant is not None:
        extra = {"assistant_model": assistant, "num_assistant_tokens": k,
                 "num_assistant_tokens_schedule": "constant",
                 "assistant_confidence_threshold": 0.0}
    torch.manual_seed(seed)
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, pad_token_id=0,
                         **sampling_kwargs(temperature), **extra)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - started


class InProcess:
    """The pair's models in this process: HF generate, assisted generation, our loop."""

    def __init__(self, pair: Pair, q_options: dict) -> None:
        from drafter.model import ModelDrafter
        from engine.models import load_causal_lm
        from verifier.engine import ModelVerifier

        self.target = load_causal_lm(pair.target, pair.target_dtype)
        self.draft = load_causal_lm(pair.draft, pair.draft_dtype)
        # q as the served drafter ships it (exact either way, but it changes α), and dense
        self.drafter = ModelDrafter(self.draft, **q_options)
        self.dense_drafter = ModelDrafter(self.draft)
        self.verifier = ModelVerifier(self.target)

    def loop(self, prompt_ids, max_tokens: int, temperature: float, seed: int, k: int,
             dense_q: bool = False):
        from speculative.driver import Generation
        from speculative.loop import Request
        from speculative.policy import FixedK
        from speculative.sampling import SamplingParams, derive_seeds

        # the seed the router gives choice 0 of an HTTP request with this seed: the same draws
        params = SamplingParams(temperature=temperature, seed=derive_seeds(seed, 1)[0],
                                max_tokens=max_tokens)
        generation = Generation(Request(uuid.uuid4().hex, tuple(prompt_ids), params))
        started = time.perf_counter()
        drafter = self.dense_drafter if dense_q else self.drafter
        asyncio.run(generation.run(drafter, self.verifier, FixedK(k)))
        return generation.token_ids, time.perf_counter() - started, generation.stats


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
    from engine.models import load_causal_lm

    curves = {dtype: cost_curve(load_causal_lm(path, dtype), (1, max_n), repeats)
              for dtype in ("float32", "bfloat16")}
    ratio = lambda dtype: curves[dtype][str(max_n)] / curves[dtype]["1"]  # noqa: E731
    return min(curves, key=ratio), curves


def pair_facts(pair: Pair, models: InProcess, ks, repeats: int) -> dict:
    """Parameter counts, the target's cost curve t(n) for n = 1..K+1 and its ratio to t(1),
    and c = t_draft(1) / t_target(1) for the formula."""
    curve = cost_curve(models.target, sorted({1, *(k + 1 for k in ks)}), repeats)
    draft_1 = forward_ms(models.draft, 64, 1, repeats)
    return {
        "note": pair.note,
        "target": {"path": Path(pair.target).name, "dtype": pair.target_dtype,
                   "parameters": sum(p.numel() for p in models.target.parameters())},
        "draft": {"path": Path(pair.draft).name, "dtype": pair.draft_dtype,
                  "parameters": sum(p.numel() for p in models.draft.parameters())},
        "target_forward_ms": curve,
        "verify_cost": {n: round(ms / curve["1"], 3) for n, ms in curve.items()},
        "draft_forward_ms": round(draft_1, 2),
        "c": round(draft_1 / curve["1"], 4),
    }


class Served:
    """cluster/config.yaml on this process's Ray instance (free ports), serving one pair."""

    def __init__(self) -> None:
        from deployments.local import load_config, on_free_ports, start_serve

        self.config = on_free_ports(load_config())
        self.url = f"http://127.0.0.1:{self.config['http_options']['port']}"
        start_serve(self.config)

    def use(self, pair: Pair) -> None:
        """Deploy the pair (the same apps and resources, other model paths)."""
        from deployments.local import app_config, deploy

        config = self.config
        app_config(config, "drafter")["args"].update(model=pair.draft, target=pair.target,
                                                     dtype=pair.draft_dtype)
        app_config(config, "verifier")["args"].update(model=pair.target, dtype=pair.target_dtype)
        app_config(config, "router")["args"].update(model=pair.target)
        deploy(config, timeout_s=300)

    def complete(self, prompt_ids, max_tokens: int, temperature: float, seed: int, k: int | str,
                 pipelined: bool | None = False):
        import requests

        body = {"prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": temperature,
                "seed": seed, "num_speculative_tokens": k, "ignore_eos": True,
                "return_token_ids": True, "pipelined": pipelined}  # None: the router's default
        started = time.perf_counter()
        response = requests.post(self.url + "/v1/completions", json=body, timeout=600)
        seconds = time.perf_counter() - started
        response.raise_for_status()
        answer = response.json()
        return answer["choices"][0]["token_ids"], seconds, answer["speculative"]

    def concurrent(self, prompt_ids, max_tokens, temperature, seed, k, concurrency: int):
        with ThreadPoolExecutor(concurrency) as pool:
            started = time.perf_counter()
            results = list(pool.map(lambda i: self.complete(prompt_ids, max_tokens, temperature,
                                                            seed + i, k), range(concurrency)))
            return results, time.perf_counter() - started


def stats_from_http(spec: dict) -> SpecStats:
    rounds, ms = spec["rounds"], spec["ms_per_round"] or {}
    seconds = lambda name: ms.get(name, 0) * rounds / 1000  # noqa: E731
    return SpecStats(
        rounds=rounds, num_drafts=spec["num_drafts"], num_draft_tokens=spec["num_draft_tokens"],
        num_accepted_tokens=spec["num_accepted_tokens"],
        num_emitted_tokens=spec["num_emitted_tokens"],
        accepted_per_position=list(spec["accepted_per_position"]),
        draft_compute_seconds=seconds("draft"), verify_compute_seconds=seconds("verify"),
        draft_seconds=seconds("draft") + seconds("transport"), verify_seconds=seconds("verify"),
        round_seconds=seconds("total"),
        wire_bytes=round((spec["wire_bytes_per_round"] or 0) * rounds))


# ---------------------------------------------------------------------------- records


def record(pair: str, mode: str, k: int | str, temperature: float, concurrency: int,
           tally: Tally, facts: dict, draft_q: str | None = None) -> dict:
    """One cell's record. k is "auto" for serve_adaptive; draft_q is set on sampled records
    of modes that draft."""
    rec = dict.fromkeys(FIELDS)
    rec.update(pair=pair, mode=mode, k=k, temperature=temperature, concurrency=concurrency,
               requests=tally.requests, tokens=tally.tokens, seconds=round(tally.seconds, 3),
               tokens_per_s=round(tally.tokens / tally.seconds, 2))
    if temperature > 0 and k != 0:
        rec["draft_q"] = draft_q
    fixed_k = k if isinstance(k, int) else 0
    stats = tally.stats
    if stats is not None and stats.rounds:
        alpha = stats.acceptance_rate
        rec["acceptance_rate"] = None if alpha is None else round(alpha, 4)
        rec["mean_acceptance_length"] = round(stats.mean_acceptance_length, 3)
        rec["mean_k"] = round(stats.mean_num_speculative_tokens, 3)
        if stats.num_drafts:
            positions = fixed_k or len(stats.accepted_per_position)
            rec["acceptance_by_position"] = [round(n / stats.num_drafts, 4)
                                             for n in stats.accepted_per_position[:positions]]
        ms = stats.ms_per_round()
        rec.update(ms_draft=ms["draft"], ms_verify=ms["verify"], ms_transport=ms["transport"],
                   ms_router=ms["router"], ms_round=ms["total"])
        if stats.wire_bytes:
            rec["wire_bytes_per_round"] = round(stats.wire_bytes / stats.rounds, 1)
    if tally.overhead_p50s:
        rec["overhead_ms_p50"] = round(statistics.median(tally.overhead_p50s), 3)
    if tally.exposed_p50s:
        rec["exposed_ms_p50"] = round(statistics.median(tally.exposed_p50s), 3)
    if k != 0:
        rec["c"] = facts["c"]
    if rec["acceptance_rate"] is not None and fixed_k > 0:
        tokens_per_round = expected_tokens_per_round(rec["acceptance_rate"], fixed_k)
        rec["predicted_tokens_per_round"] = round(tokens_per_round, 3)
        rec["predicted_speedup"] = round(tokens_per_round / round_cost(facts, fixed_k), 3)
    if tally.mismatches is not None:
        name = "greedy_matches_target" if temperature == 0 else "sampled_matches_inprocess"
        rec[name] = tally.mismatches == 0
    return rec


def round_cost(facts: dict, k: int) -> float:
    """A sequential round in target forwards: t(K+1)/t(1) + K c (1 + K c if t(K+1) is not
    measured: a free verification)."""
    return facts.get("verify_cost", {}).get(str(k + 1), 1.0) + k * facts["c"]


def add_speedups(records: list[dict]) -> None:
    base = {(r["pair"], r["temperature"]): r["tokens_per_s"] for r in records
            if r["mode"] == "target_only"}
    off = {(r["pair"], r["concurrency"]): r["tokens_per_s"] for r in records
           if r["stream"] and r["mode"] == "serve_off"}
    for r in records:
        if r["stream"] and (r["pair"], r["concurrency"]) in off:
            r["speedup_vs_off"] = round(r["tokens_per_s"] / off[(r["pair"], r["concurrency"])], 3)
    for r in records:
        anchor = base.get((r["pair"], r["temperature"]))
        if anchor:
            r["speedup"] = round(r["tokens_per_s"] / anchor, 3)
        if r["speedup"] is not None and r["predicted_speedup"]:
            r["speedup_vs_predicted"] = round(r["speedup"] / r["predicted_speedup"], 3)


def machine(plan: Plan, threads: int, argv: list[str]) -> dict:
    import ray
    import transformers

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip() or None
    except OSError:
        commit = None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "specserve " + " ".join(argv),
        "commit": commit, "cpu": cpu, "cores": os.cpu_count(), "gpu": None,
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "ray": ray.__version__,
        "torch_threads": threads, "prompts": plan.num_prompts, "max_tokens": plan.max_tokens,
        "ks": list(plan.ks), "temperatures": list(plan.temperatures),
        "sweep": {"concurrency": list(plan.sweep_levels), "max_tokens": plan.sweep_tokens,
                  "requests_per_client": plan.sweep_requests_per_client,
                  "pairs": [p for p in plan.pairs if p in plan.sweep_pairs]},
    }


# ---------------------------------------------------------------------------- the run


def ensure_scaled_target() -> None:
    if not (Path(SCALED_TARGET) / "config.json").exists():
        from bench.scaled import build

        print(f"building the scaled target into {SCALED_TARGET} (once)")
        build(SCALED_TARGET)


def resolve(pair: Pair, plan: Plan, repeats: int) -> tuple[Pair, dict]:
    """The pair with "auto" dtypes chosen on this machine (the flattest target cost curve;
    the balanced draft follows the target) and the balanced draft built to c in range."""
    from dataclasses import replace

    facts: dict = {}
    if pair.target_dtype == "auto":
        dtype, curves = flattest_dtype(pair.target, max(plan.ks) + 1, repeats)
        pair = replace(pair, target_dtype=dtype)
        facts["dtype_choice"] = {"chosen": dtype, "target_forward_ms": curves}
    if pair.draft_dtype == "auto":
        pair = replace(pair, draft_dtype=pair.target_dtype)
    if pair.draft == BALANCED_DRAFT:
        from bench.scaled import build_balanced_draft

        target_ms = curves[pair.target_dtype]["1"]  # the balanced pair's target is "auto"
        facts["balanced_draft"] = build_balanced_draft(
            BALANCED_DRAFT, target_ms, pair.target_dtype, repeats=repeats)
    return pair, facts


def bench_pair(pair: Pair, plan: Plan, served: Served) -> tuple[list[dict], dict]:
    from deployments.local import app_config
    from engine.models import load_tokenizer

    repeats = 5 if plan.num_prompts <= 2 else 15
    pair, choices = resolve(pair, plan, repeats)
    tokenizer = load_tokenizer(pair.target)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"]
               for p in PROMPTS[: plan.num_prompts]]
    args = app_config(served.config, "drafter")["args"]
    q_options = {name: args[name] for name in ("draft_top_k", "draft_q_mass", "draft_q_dtype")
                 if name in args}
    draft_q = describe_q(q_options)
    models = InProcess(pair, q_options)
    facts = pair_facts(pair, models, plan.ks, repeats) | choices | {"draft_q": draft_q}
    served.use(pair)
    tallies: dict[tuple, Tally] = {}

    def cell(mode, k, temperature, concurrency=1, q=draft_q) -> Tally:
        return tallies.setdefault((mode, k, temperature, concurrency, q), Tally())

    # warm-up: first forwards, channels, lazy imports (not measured)
    models.loop(prompts[0], 8, 0.0, 0, 2)
    hf_generate(models.target, prompts[0], 4, 0.0, 0, models.draft, 2)
    for k in (0, 2):
        served.complete(prompts[0], 8, 0.0, 0, k)

    steps = [(t, i) for t in plan.temperatures for i in range(len(prompts))]
    n = plan.max_tokens
    for temperature, index in tqdm(steps, desc=f"{pair.name} pair", unit="prompt"):
        ids, seed = prompts[index], 1000 + index
        reference, seconds = hf_generate(models.target, ids, n, temperature, seed)
        inprocess = {}
        cell("target_only", 0, temperature).add(len(reference), seconds)
        greedy = temperature == 0
        for k in plan.ks:
            out, seconds = hf_generate(models.target, ids, n, temperature, seed, models.draft, k)
            tally = cell("hf_assisted", k, temperature, q="dense")
            tally.add(len(out), seconds)
            if greedy:
                tally.compare(out, reference)
            out, seconds, stats = models.loop(ids, n, temperature, seed, k)
            tally = cell("inprocess", k, temperature)
            tally.add(len(out), seconds, stats, stats.overhead_ms_p50)
            inprocess[k] = out
            if greedy:
                tally.compare(out, reference)
            else:  # the same draws with dense q: what the shipped q costs in acceptance
                out, seconds, stats = models.loop(ids, n, temperature, seed, k, dense_q=True)
                cell("inprocess", k, temperature, q="dense").add(
                    len(out), seconds, stats, stats.overhead_ms_p50)
        # serve_adaptive: pipelined as the router's default says (greedy requests only)
        runs = [(0, False)] + [(k, p) for k in plan.ks for p in (False, True)] + [("auto", None)]
        for k, pipelined in runs:
            out, seconds, spec = served.complete(ids, n, temperature, seed, k, pipelined)
            mode = "serve_off" if k == 0 else "serve_adaptive" if k == "auto" else \
                "serve_pipelined" if pipelined else "serve_sync"
            tally = cell(mode, k, temperature)
            tally.add(len(out), seconds, stats_from_http(spec), spec["overhead_ms_p50"],
                      spec.get("exposed_ms_p50"))
            if greedy:
                tally.compare(out, reference)
            elif k in inprocess and not pipelined:  # same seed, same draws: same tokens
                tally.compare(out, inprocess[k])
        if plan.serve_concurrency > 1:
            c = plan.serve_concurrency
            for k in (0, 4):
                results, seconds = served.concurrent(ids, n, temperature, seed, k, c)
                tally = cell("serve_off" if k == 0 else "serve_sync", k, temperature, c)
                for out, _, spec in results:
                    tally.add(len(out), 0.0, stats_from_http(spec), spec["overhead_ms_p50"])
                tally.seconds += seconds
    order = lambda key: (key[2], MODES.index(key[0]), key[1] if isinstance(key[1], int)  # noqa
                         else 99, key[3], key[4] == "dense")
    records = [record(pair.name, mode, k, t, c, tallies[(mode, k, t, c, q)], facts, q)
               for mode, k, t, c, q in sorted(tallies, key=order)]
    if pair.name in plan.sweep_pairs and plan.sweep_levels:
        records += sweep_pair(pair.name, plan, served, models, tokenizer, facts)
    return records, facts


def sweep_pair(name: str, plan: Plan, served: Served, models: InProcess, tokenizer,
               facts: dict) -> list[dict]:
    """The concurrency sweep's records (bench/sweep.py): at each level, off then on."""
    n, per_client = plan.sweep_tokens, plan.sweep_requests_per_client
    # distinct prompts: the code prompts behind a numbered comment line
    prompts = [tokenizer(f"# {i}\n" + PROMPTS[i % len(PROMPTS)], add_special_tokens=False)
               ["input_ids"] for i in range(max(plan.sweep_levels) * per_client)]
    references = [hf_generate(models.target, ids, n, 0.0, 0)[0]
                  for ids in tqdm(prompts, desc=f"{name} sweep references", unit="prompt")]
    records = []
    cells = [(c, mode, k) for c in plan.sweep_levels for mode, k in sweep.SWEEP_MODES]
    for clients, mode, k in tqdm(cells, desc=f"{name} sweep", unit="cell"):
        cell_prompts = prompts[: clients * per_client]
        streams, seconds = sweep.run_cell(served.url, cell_prompts, clients, n, k)
        tally = Tally()
        for streamed, reference in zip(streams, references):
            spec = streamed.speculative
            tally.add(len(streamed.token_ids), 0.0, stats_from_http(spec),
                      spec["overhead_ms_p50"], spec.get("exposed_ms_p50"))
            tally.compare(streamed.token_ids, reference)
        tally.seconds = seconds  # the cell's wall time: the clients ran at once
        rec = record(name, mode, k, 0.0, clients, tally, facts)
        rec.update(stream=True, **sweep.latency_fields(streams))
        records.append(rec)
    return records


def describe_q(options: dict) -> str:
    """The draft_q label of a drafter's q options, e.g. "mass0.99-float16"."""
    parts = []
    if options.get("draft_top_k"):
        parts.append(f"top{options['draft_top_k']}")
    if options.get("draft_q_mass", 1.0) < 1:
        parts.append(f"mass{options['draft_q_mass']:g}")
    parts.append(options.get("draft_q_dtype", "float32"))
    return "-".join(parts) if parts != ["float32"] else "dense"


def run(plan: Plan, out: Path, threads: int, argv: list[str]) -> dict:
    import ray
    from ray import serve

    torch.set_num_threads(threads)
    if {"scaled", "balanced"} & set(plan.pairs):
        ensure_scaled_target()
    results: dict = {"machine": machine(plan, threads, argv), "pairs": {}, "results": []}
    ray.init(address="local", include_dashboard=False, logging_level="error",
             log_to_driver=False)
    try:
        served = Served()
        for name in plan.pairs:
            records, facts = bench_pair(PAIRS[name], plan, served)
            results["pairs"][name] = facts
            results["results"].extend(records)
    finally:
        serve.shutdown()
        ray.shutdown()
    add_speedups(results["results"])
    results["checks"] = checks.adaptive_checks(results["results"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    plot(results, out)
    return results


# ---------------------------------------------------------------------------- reports


def fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def same_tokens(r: dict) -> bool | None:
    if r["greedy_matches_target"] is not None:
        return r["greedy_matches_target"]
    return r["sampled_matches_inprocess"]


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = ["# specserve bench results", "",
             f"`{m['command']}` at commit {m['commit']}, {m['date']}: {m['cpu']}, {m['cores']} "
             f"cores, no GPU, torch {m['torch']} with {m['torch_threads']} thread(s) per process, "
             f"transformers {m['transformers']}, ray {m['ray']}. {m['prompts']} prompts x "
             f"{m['max_tokens']} tokens per cell, modes interleaved prompt by prompt.", ""]
    lines += ["Each pool replica has one torch thread: the drafter and the verifier have a core "
              "each, as two GPUs would; the router and Serve's proxies share what is left "
              "(on a 2-core machine, the same two cores).", ""]
    for name, facts in results["pairs"].items():
        lines += [f"## {name} pair", "", facts["note"] + ".", ""] + pair_lines(facts) + [
            "", "| T | mode | K | q | conc. | tokens/s | speedup | formula | measured/formula "
            "| α | tokens/round | E[N] | mean K | ms/round: draft / verify / transport / router "
            "| overhead p50 ms | exposed p50 ms | bytes/round | same tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["results"]:
            if r["pair"] != name or r["stream"]:
                continue
            split = "–" if r["ms_round"] is None else " / ".join(
                fmt(r[f"ms_{p}"], 1) for p in ("draft", "verify", "transport", "router"))
            lines.append(
                f"| {r['temperature']:g} | {r['mode']} | {r['k']} | {fmt(r['draft_q'])} "
                f"| {r['concurrency']} | {fmt(r['tokens_per_s'], 1)} "
                f"| {fmt(r['speedup'], 2, 'x')} "
                f"| {fmt(r['predicted_speedup'], 2, 'x')} | {fmt(r['speedup_vs_predicted'])} "
                f"| {fmt(r['acceptance_rate'])} | {fmt(r['mean_acceptance_length'])} "
                f"| {fmt(r['predicted_tokens_per_round'])} | {fmt(r['mean_k'])} | {split} "
                f"| {fmt(r['overhead_ms_p50'])} | {fmt(r['exposed_ms_p50'])} "
                f"| {fmt(r['wire_bytes_per_round'], 0)} "
                f"| {fmt(same_tokens(r))} |")
        lines.append("")
    lines += ["speedup: tokens/s over `target_only` of the same pair and temperature. formula: "
              "E[N] / (t(K+1)/t(1) + K c) with E[N] = (1 - α^(K+1)) / (1 - α) from the measured "
              "α and the target's measured cost curve. q: the draft distribution as shipped "
              "(sampled records). mean K: tokens drafted per round (serve_adaptive: as chosen). "

              "overhead: the median over rounds of the round time less the pools' own compute "
              "(transport and router work; the median of per-request medians). exposed: the "
              "same less only the verifier's compute (what a round waits beyond the verify: "
              "the draft on the critical path, hops, router work). bytes/round: "
              "serialised gRPC messages of the round's two calls. same tokens: greedy, every "
              "request's tokens equal `target_only`'s; sampled serve_sync, equal to `inprocess`'s "
              "with the same seed (the same draws end to end).", ""]
    lines += checks.section(results.get("checks", []))
    streamed = [r for r in results["results"] if r["stream"]]
    if streamed:
        lines += sweep.section(streamed, m["sweep"], fmt)
    return "\n".join(lines)


def pair_lines(facts: dict) -> list[str]:
    """The pair's sizes, dtypes, cost curve and c, with a warning where verifying is costly."""
    curve, costs = facts["target_forward_ms"], facts["verify_cost"]
    widest = max(curve, key=int)
    lines = [f"Target {facts['target']['parameters'] / 1e6:.1f}M parameters "
             f"({facts['target']['dtype']}), draft {facts['draft']['parameters'] / 1e6:.2f}M "
             f"({facts['draft']['dtype']}). Target forward over a 64-token cache: "
             + ", ".join(f"{n} token(s) {ms} ms" for n, ms in curve.items())
             + "; t(n)/t(1) = " + ", ".join(str(costs[n]) for n in curve)
             + f". Draft 1 token {facts['draft_forward_ms']} ms; c = {facts['c']}. "
             f"Draft q as shipped: {facts['draft_q']} (exact: the drafter samples from the q "
             "it ships; HF assisted generation uses the full q)."]
    if "dtype_choice" in facts:
        choice = facts["dtype_choice"]
        lines.append("Dtype chosen on this machine: " + choice["chosen"] + " (flattest curve; "
                     + "; ".join(f"{dtype}: " + ", ".join(f"{n} -> {ms} ms" for n, ms in c.items())
                                 for dtype, c in choice["target_forward_ms"].items()) + ").")
    if "balanced_draft" in facts:
        draft = facts["balanced_draft"]
        lines.append(f"Balanced draft: {draft['layers']} layers, c = {draft['c']} when built"
                     + ("" if draft["in_range"] else " (OUTSIDE 0.15-0.25)") + ".")
    if costs[widest] > 1.5:
        lines.append(f"**Verification is far from free on this machine**: {widest} tokens cost "
                     f"{costs[widest]}x one token (compute-bound), so every drafted token also "
                     "costs verifier time and speculation gains less than on a GPU.")
    return lines


def plot(results: dict, out: Path) -> None:
    """speedup_vs_k.png and acceptance_by_position.png: one panel per pair and temperature;
    concurrency.png (bench/sweep.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streamed = [r for r in results["results"] if r["stream"]]
    if streamed:
        sweep.plot(streamed, out)
    records = [r for r in results["results"] if not r["stream"] and (
               r["concurrency"] == 1 and isinstance(r["k"], int) and r["draft_q"] != "dense"
               or r["mode"] == "hf_assisted")]
    cells = [(p, t) for p in results["pairs"] for t in results["machine"]["temperatures"]]

    def speedups(ax, rows):
        for mode, style in (("inprocess", "o-"), ("serve_sync", "s-"), ("serve_pipelined", "D-"),
                            ("hf_assisted", "^-")):
            pts = sorted((r["k"], r["speedup"]) for r in rows if r["mode"] == mode)
            if pts:
                ax.plot(*zip(*pts), style, label=mode)
        pts = sorted((r["k"], r["predicted_speedup"]) for r in rows
                     if r["mode"] == "inprocess" and r["predicted_speedup"])
        if pts:
            ax.plot(*zip(*pts), "k--", label="formula")
        ax.axhline(1.0, color="grey", linewidth=0.8)

    def acceptance(ax, rows):
        rows = [r for r in rows if r["mode"] == "inprocess" and r["acceptance_by_position"]]
        for r in sorted(rows, key=lambda r: r["k"]):
            ax.plot(range(1, len(r["acceptance_by_position"]) + 1), r["acceptance_by_position"],
                    "o-", label=f"K = {r['k']}")
        ax.set_ylim(0, 1)

    for name, draw, xlabel, ylabel in (
            ("speedup_vs_k.png", speedups, "K (drafted tokens per round)",
             "speedup over target alone"),
            ("acceptance_by_position.png", acceptance, "draft position",
             "fraction of rounds accepted")):
        fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 3.6), squeeze=False)
        for ax, (pair, temperature) in zip(axes[0], cells):
            draw(ax, [r for r in records if r["pair"] == pair and r["temperature"] == temperature])
            ax.set_title(f"{pair} pair, T = {temperature:g}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--quick", action="store_true",
                        help="2 prompts x 32 tokens, K in {1, 4}; the sweep's requests 12 "
                             "tokens: a few minutes")
    parser.add_argument("--pair", choices=[*PAIRS, "all"], default="all")
    parser.add_argument("--out", type=Path, default=None,
                        help="where results go (default bench/results, the committed full "
                             "run; with --quick bench/results/quick, not committed)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads here (each replica of cluster/config.yaml has 1)")
    parser.add_argument("--concurrency", type=client_counts, default=sweep.LEVELS,
                        help="the sweep's concurrent streaming clients, comma-separated "
                             "(default 1,4,16,32; none: no sweep)")
    parser.add_argument("--soak", action="store_true",
                        help="instead of the suite: streams for minutes with cancellations "
                             "and disconnects; errors, latency and every replica's RSS "
                             "(bench/soak.py)")
    parser.add_argument("--soak-seconds", type=float, default=300)
    parser.add_argument("--soak-streams", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="the soak's clients' seed")
    return parser


def client_counts(text: str) -> tuple[int, ...]:
    if text == "none":
        return ()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of client counts: {text!r}") from None
    if not all(v >= 1 for v in values):
        raise argparse.ArgumentTypeError("client counts are at least 1")
    return values


def main(args, argv: list[str]) -> int:
    if args.soak:
        from bench import soak

        return soak.main(args)
    plan = Plan.make(args.quick, args.pair, args.concurrency)
    out = args.out or Path("bench/results/quick" if args.quick else "bench/results")
    results = run(plan, out, args.threads, argv)
    print(markdown(results))
    print(f"wrote {out}/results.json, results.md, speedup_vs_k.png, "
          "acceptance_by_position.png"
          + (", concurrency.png" if any(r["stream"] for r in results["results"]) else ""))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(build_parser(argparse.ArgumentParser()).parse_args(), sys.argv[1:]))
