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

Sampled records carry `draft_q`: the draft distribution as shipped (cluster/config.yaml ships
q whole in float32: "dense"; a truncated one reads e.g. "mass0.99-float16") or "dense" (HF
assisted generation, and in-process records with dense q at T > 0 for the comparison where
the shipped q is not).

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

The pieces: the pairs and prompts (bench/pairs.py), the ways tokens are produced
(bench/runners.py), forward costs and the formula (bench/costs.py), tallies and records
(bench/records.py), results.md and the plots (bench/report.py); this module plans the run,
runs every pair's cells and writes the results.
"""

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from bench import checks, sweep
from bench.costs import flattest_dtype, pair_facts
from bench.pairs import BALANCED_DRAFT, PAIRS, PROMPTS, SCALED_TARGET, Pair
from bench.records import Tallies, Tally, add_speedups, describe_q, record
from bench.report import markdown, plot
from bench.runners import InProcess, Served, departs_at_tie, hf_generate, stats_from_http
from engine.models import load_tokenizer
from specserve.cli_args import FlagError, positive_float, positive_int, unwritable


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
    draft_timeout_s: float | None = None  # the served router's wait for a draft (None: the config's)

    @classmethod
    def make(cls, quick: bool, pair: str, levels: tuple[int, ...] = sweep.LEVELS) -> "Plan":
        pairs = tuple(PAIRS) if pair == "all" else (pair,)
        if quick:
            return cls(pairs, (1, 4), (0.0, 1.0), 2, 32, 1, levels, sweep_tokens=12)
        return cls(pairs, (1, 2, 4, 6), (0.0, 1.0), 3, 48, 4, levels)


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
# bench.scaled is imported where a construct is built, not above: it loads transformers' Llama
# classes, and every `specserve` command imports this module for its parser


def ensure_scaled_target() -> None:
    if not (Path(SCALED_TARGET) / "config.json").exists():
        from bench.scaled import build

        print(f"building the scaled target into {SCALED_TARGET} (once)")
        build(SCALED_TARGET)


def resolve(pair: Pair, plan: Plan, repeats: int) -> tuple[Pair, dict]:
    """The pair with "auto" dtypes chosen on this machine (the flattest target cost curve;
    the balanced draft follows the target) and the balanced draft built to c in range."""
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


class PairBench:
    """One pair's cells: on each prompt, every mode runs once before the next prompt."""

    def __init__(self, plan: Plan, models: InProcess, served: Served, draft_q: str) -> None:
        self.plan, self.models, self.served = plan, models, served
        self.tallies = Tallies(draft_q)

    def warm_up(self, ids) -> None:
        """First forwards, channels, lazy imports (not measured)."""
        self.models.loop(ids, 8, 0.0, 0, 2)
        hf_generate(self.models.target, ids, 4, 0.0, 0, self.models.draft, 2)
        for k in (0, 2):
            self.served.complete(ids, 8, 0.0, 0, k)

    def prompt(self, ids, temperature: float, seed: int) -> None:
        """Every mode on one prompt; target_only's tokens are the greedy reference."""
        reference, seconds = hf_generate(self.models.target, ids, self.plan.max_tokens,
                                         temperature, seed)
        self.tallies.cell("target_only", 0, temperature).add(len(reference), seconds)
        at_tie = functools.partial(departs_at_tie, self.models.target, ids, reference)
        inprocess = self.in_process(ids, temperature, seed, reference, at_tie)
        self.one_at_a_time(ids, temperature, seed, reference, inprocess, at_tie)
        if self.plan.serve_concurrency > 1:
            self.concurrent(ids, temperature, seed)

    def in_process(self, ids, temperature: float, seed: int, reference, at_tie
                   ) -> dict[int, list]:
        """hf_assisted and inprocess at each K; returns inprocess's tokens by K."""
        models, n, greedy = self.models, self.plan.max_tokens, temperature == 0
        inprocess = {}
        for k in self.plan.ks:
            out, seconds = hf_generate(models.target, ids, n, temperature, seed, models.draft, k)
            tally = self.tallies.cell("hf_assisted", k, temperature, q="dense")
            tally.add(len(out), seconds)
            if greedy:
                tally.compare(out, reference, at_tie)
            out, seconds, stats = models.loop(ids, n, temperature, seed, k)
            tally = self.tallies.cell("inprocess", k, temperature)
            tally.add(len(out), seconds, stats, stats.overhead_ms_p50)
            inprocess[k] = out
            if greedy:
                tally.compare(out, reference, at_tie)
            elif self.tallies.draft_q != "dense":  # the same draws with dense q: what the
                # shipped q costs in acceptance (nothing to compare when it ships dense)
                out, seconds, stats = models.loop(ids, n, temperature, seed, k, dense_q=True)
                self.tallies.cell("inprocess", k, temperature, q="dense").add(
                    len(out), seconds, stats, stats.overhead_ms_p50)
        return inprocess

    def one_at_a_time(self, ids, temperature: float, seed: int, reference, inprocess,
                      at_tie) -> None:
        """The serve modes, one request at a time: off, sync and pipelined at each K, and
        serve_adaptive, the default request: pipelined as the router's default says, and
        sampled without a seed (a seeded request runs the router's seeded fixed K, which is
        reproducible, not the adaptive K)."""
        fixed = [(k, pipelined) for k in self.plan.ks for pipelined in (False, True)]
        runs = [(0, False)] + fixed + [("auto", None)]
        for k, pipelined in runs:
            unseeded = k == "auto" and temperature > 0
            out, seconds, spec = self.served.complete(ids, self.plan.max_tokens, temperature,
                                                      None if unseeded else seed, k, pipelined)
            mode = "serve_off" if k == 0 else "serve_adaptive" if k == "auto" else \
                "serve_pipelined" if pipelined else "serve_sync"
            tally = self.tallies.cell(mode, k, temperature)
            tally.add(len(out), seconds, stats_from_http(spec), spec["overhead_ms_p50"],
                      spec.get("exposed_ms_p50"))
            if temperature == 0:
                tally.compare(out, reference, at_tie)
            elif k in inprocess and not pipelined:  # same seed, same draws: same tokens
                tally.compare(out, inprocess[k])

    def concurrent(self, ids, temperature: float, seed: int) -> None:
        """serve_off and serve_sync at K = 4 with serve_concurrency requests at once."""
        c = self.plan.serve_concurrency
        for k in (0, 4):
            results, seconds = self.served.concurrent(ids, self.plan.max_tokens, temperature,
                                                      seed, k, c)
            tally = self.tallies.cell("serve_off" if k == 0 else "serve_sync", k, temperature, c)
            for out, _, spec in results:
                tally.add(len(out), 0.0, stats_from_http(spec), spec["overhead_ms_p50"])
            tally.seconds += seconds


def bench_pair(pair: Pair, plan: Plan, served: Served) -> tuple[list[dict], dict]:
    """The pair's records (every mode, then the concurrency sweep) and its facts."""
    repeats = 5 if plan.num_prompts <= 2 else 15
    pair, choices = resolve(pair, plan, repeats)
    tokenizer = load_tokenizer(pair.target)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"]
               for p in PROMPTS[: plan.num_prompts]]
    q_options = served.draft_q_options()
    draft_q = describe_q(q_options)
    models = InProcess(pair, q_options)
    facts = pair_facts(pair, models.target, models.draft, plan.ks, repeats)
    facts |= choices | {"draft_q": draft_q}
    served.use(pair)
    bench = PairBench(plan, models, served, draft_q)
    bench.warm_up(prompts[0])
    steps = [(t, i) for t in plan.temperatures for i in range(len(prompts))]
    for temperature, index in tqdm(steps, desc=f"{pair.name} pair", unit="prompt"):
        bench.prompt(prompts[index], temperature, seed=1000 + index)
    records = bench.tallies.records(pair.name, facts)
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
        for streamed, prompt, reference in zip(streams, cell_prompts, references):
            spec = streamed.speculative
            tally.add(len(streamed.token_ids), 0.0, stats_from_http(spec),
                      spec["overhead_ms_p50"], spec.get("exposed_ms_p50"))
            tally.compare(streamed.token_ids, reference,
                          functools.partial(departs_at_tie, models.target, prompt, reference))
        tally.seconds = seconds  # the cell's wall time: the clients ran at once
        rec = record(name, mode, k, 0.0, clients, tally, facts)
        rec.update(stream=True, **sweep.latency_fields(streams))
        records.append(rec)
    return records


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
        served = Served(plan.draft_timeout_s)
        for name in plan.pairs:
            records, facts = bench_pair(PAIRS[name], plan, served)
            results["pairs"][name] = facts
            results["results"].extend(records)
    finally:
        serve.shutdown()
        ray.shutdown()
    add_speedups(results["results"])
    if "demo" in plan.pairs:  # the methods beside the default chain, in process
        from bench import methods

        results["methods"] = methods.run(plan.num_prompts, plan.max_tokens,
                                         quick=plan.max_tokens < 48)
    results["checks"] = checks.adaptive_checks(results["results"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    plot(results, out)
    return results


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--quick", action="store_true",
                        help="2 prompts x 32 tokens, K in {1, 4}; the sweep's requests 12 "
                             "tokens: a few minutes")
    parser.add_argument("--pair", choices=[*PAIRS, "all"], default="all")
    parser.add_argument("--out", type=Path, default=None,
                        help="where results go (default bench/results, the committed full "
                             "run; with --quick bench/results/quick, not committed)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads here (each replica of cluster/config.yaml has 1)")
    parser.add_argument("--concurrency", type=client_counts, default=sweep.LEVELS,
                        help="the sweep's concurrent streaming clients, comma-separated "
                             "(default 1,4,16,32; none: no sweep)")
    parser.add_argument("--draft-timeout-s", type=positive_float, default=None,
                        help="the served router's wait for a draft before a round runs "
                             "without one (default: cluster/config.yaml's)")
    parser.add_argument("--soak", action="store_true",
                        help="instead of the suite: streams for minutes with cancellations "
                             "and disconnects; errors, latency and every replica's RSS "
                             "(bench/soak.py)")
    parser.add_argument("--soak-seconds", type=positive_float, default=300)
    parser.add_argument("--soak-streams", type=positive_int, default=32)
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


SUITE_FLAGS, SOAK_FLAGS = ("--quick", "--pair", "--concurrency", "--draft-timeout-s"), \
    ("--soak-seconds", "--soak-streams", "--seed")


def given(argv: list[str], flags) -> list[str]:
    return [flag for flag in flags if any(a == flag or a.startswith(flag + "=") for a in argv)]


def main(args, argv: list[str]) -> int:
    """The suite or the soak; FlagError, before either runs, for flags it cannot use."""
    wrong = given(argv, SUITE_FLAGS) if args.soak else given(argv, SOAK_FLAGS)
    if wrong:
        raise FlagError(f"{', '.join(wrong)} {'does' if len(wrong) == 1 else 'do'} not apply "
                        f"{'to --soak' if args.soak else 'without --soak'}")
    out = args.out or Path("bench/results/quick" if args.quick else "bench/results")
    problem = unwritable(out)
    if problem:  # before the run, not at its end (the soak writes there too)
        raise FlagError(f"--out {out}: cannot write there ({problem})")
    if args.soak:
        from bench import soak

        return soak.main(args)
    plan = replace(Plan.make(args.quick, args.pair, args.concurrency),
                   draft_timeout_s=args.draft_timeout_s)
    results = run(plan, out, args.threads, argv)
    print(markdown(results))
    print(f"wrote {out}/results.json, results.md, speedup_vs_k.png, "
          "acceptance_by_position.png"
          + (", concurrency.png" if any(r["stream"] for r in results["results"]) else ""))
    return 0


if __name__ == "__main__":
    parser = build_parser(argparse.ArgumentParser(allow_abbrev=False))
    try:
        sys.exit(main(parser.parse_args(), sys.argv[1:]))
    except FlagError as error:
        parser.error(str(error))
