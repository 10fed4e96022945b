"""`specserve bench`'s records: one flat dict per cell (pair, mode, K, temperature,
concurrency, q), summed over prompts in a `Tally`, with the formula's prediction and the
speedups over the anchors of the same run."""

import statistics
from dataclasses import dataclass, field

from bench.costs import expected_tokens_per_round, round_cost
from speculative.stats import SpecStats

MODES = ("target_only", "hf_assisted", "inprocess", "serve_off", "serve_sync",
         "serve_pipelined", "serve_adaptive")
FIELDS = ("pair", "mode", "k", "temperature", "draft_q", "concurrency", "requests", "tokens",
          "seconds", "tokens_per_s", "acceptance_rate", "mean_acceptance_length",
          "predicted_tokens_per_round", "predicted_speedup", "speedup",
          "speedup_vs_predicted", "c", "acceptance_by_position", "ms_draft", "ms_verify",
          "ms_transport", "ms_router", "ms_round", "overhead_ms_p50", "exposed_ms_p50",
          "wire_bytes_per_round", "mean_k",
          "greedy_matches_target", "greedy_departures_at_ties", "sampled_matches_inprocess",
          # the concurrency sweep's records (bench/sweep.py), None elsewhere
          "stream", "speedup_vs_off", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99",
          "batch_mean_verifier", "batch_mean_drafter", "draft_fallback_rounds")


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
    # greedy requests that departed from the reference first with a token tied with its
    # choice at the target dtype's rounding (runners.departs_at_tie): not in mismatches
    tie_departures: int = 0

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

    def compare(self, ids, reference, at_tie=None) -> None:
        """Count ids against the reference; at_tie(ids): whether they depart from it first
        where the reference's own choice was a tie at its dtype's rounding (greedy)."""
        differs = list(ids) != list(reference)
        if differs and at_tie is not None and at_tie(ids):
            self.tie_departures += 1
            differs = False
        self.mismatches = (self.mismatches or 0) + differs


def report_order(key: tuple) -> tuple:
    """Cells by temperature, mode (as in MODES), K ("auto" last), concurrency, dense q last."""
    mode, k, temperature, concurrency, draft_q = key
    return (temperature, MODES.index(mode), k if isinstance(k, int) else 99, concurrency,
            draft_q == "dense")


class Tallies:
    """One pair's cells, keyed (mode, k, temperature, concurrency, draft_q)."""

    def __init__(self, draft_q: str) -> None:
        self.draft_q = draft_q  # the q label of cells that name none: q as the drafter ships it
        self.cells: dict[tuple, Tally] = {}

    def cell(self, mode: str, k: int | str, temperature: float, concurrency: int = 1,
             q: str | None = None) -> Tally:
        key = (mode, k, temperature, concurrency, self.draft_q if q is None else q)
        return self.cells.setdefault(key, Tally())

    def records(self, pair: str, facts: dict) -> list[dict]:
        return [record(pair, mode, k, t, c, self.cells[(mode, k, t, c, q)], facts, q)
                for mode, k, t, c, q in sorted(self.cells, key=report_order)]


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
        if concurrency == 1:  # the formula is one stream's: a batch's rounds cost otherwise
            rec["predicted_speedup"] = round(tokens_per_round / round_cost(facts, fixed_k), 3)
    if tally.mismatches is not None:
        name = "greedy_matches_target" if temperature == 0 else "sampled_matches_inprocess"
        rec[name] = tally.mismatches == 0
        if temperature == 0:
            rec["greedy_departures_at_ties"] = tally.tie_departures
    return rec


def add_speedups(records: list[dict]) -> None:
    """speedup: over the target alone, one stream (of a cell of several requests at once,
    its aggregate's: batching's gain and speculation's together; none for the sweep's, whose
    requests are others); speedup_vs_off, of such a cell and of the sweep's: over
    serve_off's at the same load, speculation's own."""
    base = {(r["pair"], r["temperature"]): r["tokens_per_s"] for r in records
            if r["mode"] == "target_only"}

    def load(r: dict) -> tuple:
        return r["pair"], r["temperature"], r["concurrency"], bool(r["stream"])

    off = {load(r): r["tokens_per_s"] for r in records
           if r["mode"] == "serve_off" and (r["stream"] or r["concurrency"] > 1)}
    for r in records:
        if (r["stream"] or r["concurrency"] > 1) and load(r) in off:
            r["speedup_vs_off"] = round(r["tokens_per_s"] / off[load(r)], 3)
    for r in records:
        # not the sweep's: its cells run other prompts and lengths than the anchor's
        anchor = None if r["stream"] else base.get((r["pair"], r["temperature"]))
        if anchor:
            r["speedup"] = round(r["tokens_per_s"] / anchor, 3)
        if r["speedup"] is not None and r["predicted_speedup"]:
            r["speedup_vs_predicted"] = round(r["speedup"] / r["predicted_speedup"], 3)


def describe_q(options: dict) -> str:
    """The draft_q label of a drafter's q options, e.g. "mass0.99-float16"."""
    parts = []
    if options.get("draft_top_k"):
        parts.append(f"top{options['draft_top_k']}")
    if options.get("draft_q_mass", 1.0) < 1:
        parts.append(f"mass{options['draft_q_mass']:g}")
    parts.append(options.get("draft_q_dtype", "float32"))
    return "-".join(parts) if parts != ["float32"] else "dense"
