"""The concurrency sweep of `specserve bench`: C streaming HTTP clients at once against the
served pair, greedy, with speculation on (num_speculative_tokens "auto", the router's default,
which may choose K = 0 under load) and off (K = 0: the target alone through the same batched
verifier).

Bounded: each client sends its share of the cell's prompts one after another (a distinct prompt
a request, each with a deadline) and stops. Loopback only; one thread a client, stdlib HTTP
(http.client reads the server-sent events line by line as they arrive).

Per cell (pair, mode, concurrency), over its requests:
  tokens_per_s    output tokens of all requests / the cell's wall time (first request sent to
                  last stream closed)
  ttft_ms_p50     time from sending a request to its first chunk with a choice
  tpot_ms_p50/p99 per request, (final chunk - first chunk) / (tokens - 1), the TPOT of vLLM's
                  serving benchmark: a chunk carries a whole round's tokens, so gaps between
                  chunks would time rounds, not tokens
  batch_mean_verifier / _drafter  the mean over requests of each response's
                  mean_batch_size_verifier / _drafter (calls in the pool batches that served
                  its rounds)
  draft_fallback_rounds  rounds of all requests that ran without a draft because the
                  drafter failed or missed the router's draft_timeout_s
"""

import http.client
import json
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

LEVELS = (1, 4, 16, 32)  # concurrent clients
SWEEP_MODES = (("serve_off", 0), ("serve_adaptive", "auto"))  # (mode, num_speculative_tokens)
TIMEOUT_S = 300.0  # a request's deadline, the whole stream included


@dataclass(frozen=True)
class Streamed:
    """One streamed request as its client saw it (seconds since it was sent)."""

    token_ids: list[int]
    first_chunk_s: float
    final_chunk_s: float  # the chunk with usage and speculative
    speculative: dict

    @property
    def tpot_s(self) -> float | None:
        tokens = len(self.token_ids)
        return (self.final_chunk_s - self.first_chunk_s) / (tokens - 1) if tokens > 1 else None


def stream_completion(url: str, prompt_ids, max_tokens: int, k: int | str,
                      timeout_s: float = TIMEOUT_S) -> Streamed:
    """POST /v1/completions with stream=True (greedy, exactly max_tokens tokens)."""
    body = json.dumps({"prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0,
                       "num_speculative_tokens": k, "ignore_eos": True, "return_token_ids": True,
                       "stream": True, "stream_options": {"include_usage": True}})
    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=timeout_s)
    started = time.perf_counter()
    first = token_ids = None
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read(500)!r}")
        for line in response:  # b"data: {...}\n", then a blank line
            now = time.perf_counter() - started
            if now > timeout_s:  # the socket's timeout bounds each read, this the whole stream
                raise TimeoutError(f"a streamed request took over {timeout_s} s")
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"]:  # a text delta, or the choice's last chunk with its ids
                first = now if first is None else first
                token_ids = chunk["choices"][0].get("token_ids", token_ids)
            else:  # the final chunk: usage and the speculative counters
                if token_ids is None or chunk["usage"]["completion_tokens"] != len(token_ids):
                    raise RuntimeError(f"the stream's token ids disagree with its usage: {chunk}")
                return Streamed(token_ids, first, now, chunk["speculative"])
    finally:
        connection.close()
    raise RuntimeError("the stream ended without its final chunk")


def run_cell(url: str, prompts: list, clients: int, max_tokens: int,
             k: int | str) -> tuple[list[Streamed], float]:
    """`clients` clients at once, client i sending prompts[i::clients] one after another: the
    results in prompt order, and the wall time."""
    def client(i: int) -> list[Streamed]:
        return [stream_completion(url, p, max_tokens, k) for p in prompts[i::clients]]

    with ThreadPoolExecutor(clients) as pool:
        started = time.perf_counter()
        per_client = list(pool.map(client, range(clients)))
        seconds = time.perf_counter() - started
    results: list = [None] * len(prompts)
    for i, streams in enumerate(per_client):
        results[i::clients] = streams
    return results, seconds


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def rounded(value: float | None, scale: float = 1.0, digits: int = 3) -> float | None:
    return None if value is None else round(value * scale, digits)


def latency_fields(streams: list[Streamed]) -> dict:
    """The cell's TTFT, TPOT and pool batch sizes (the record fields of the module doc)."""
    tpots = [s.tpot_s for s in streams if s.tpot_s is not None]
    spec = [s.speculative for s in streams]
    return {
        "ttft_ms_p50": rounded(percentile([s.first_chunk_s for s in streams], 0.5), 1000),
        "tpot_ms_p50": rounded(percentile(tpots, 0.5), 1000),
        "tpot_ms_p99": rounded(percentile(tpots, 0.99), 1000),
        "batch_mean_verifier": rounded(mean(s.get("mean_batch_size_verifier") for s in spec)),
        "batch_mean_drafter": rounded(mean(s.get("mean_batch_size_drafter") for s in spec)),
        # rounds the target ran alone because a draft failed or missed its deadline
        "draft_fallback_rounds": sum(s.get("draft_fallback_rounds", 0) for s in spec),
    }


# ---------------------------------------------------------------------------- reports


def section(records: list[dict], plan: dict, fmt, same_tokens) -> list[str]:
    """The sweep's part of results.md: how it ran, a row per pair, concurrency and mode, and
    what the columns mean (fmt and same_tokens: bench.report's cells)."""
    lines = ["## Concurrency sweep", "",
             f"{', '.join(map(str, plan['concurrency']))} streaming HTTP clients at once "
             f"(loopback), {plan['requests_per_client']} request(s) of {plan['max_tokens']} "
             "tokens each (distinct prompts, greedy, ignore_eos): speculation off "
             "(`num_speculative_tokens` 0) against the router's adaptive K (\"auto\"), at each "
             "concurrency off then on. The clients run on the same cores as the pools.", "",
             "| pair | mode | conc. | requests | tokens/s | on/off | TPOT p50 / p99 ms "
             "| TTFT p50 ms | batch verifier / drafter | mean K | α | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['pair']} | {r['mode']} | {r['concurrency']} | {r['requests']} "
            f"| {fmt(r['tokens_per_s'], 1)} | {fmt(r['speedup_vs_off'], 2, 'x')} "
            f"| {fmt(r['tpot_ms_p50'], 1)} / {fmt(r['tpot_ms_p99'], 1)} "
            f"| {fmt(r['ttft_ms_p50'], 1)} "
            f"| {fmt(r['batch_mean_verifier'])} / {fmt(r['batch_mean_drafter'])} "
            f"| {fmt(r['mean_k'])} | {fmt(r['acceptance_rate'])} "
            f"| {same_tokens(r)} |")
    return lines + ["", NOTE, ""]


NOTE = ("tokens/s: output tokens of all the cell's requests over its wall time. on/off: "
        "serve_adaptive's tokens/s over serve_off's at the same concurrency. TPOT: per request, "
        "(final chunk - first chunk) / (tokens - 1) (vLLM's definition; a chunk carries a "
        "round's tokens); p50 / p99 over the cell's requests. TTFT: sending to the first "
        "chunk. batch: the mean over requests of the mean number of calls in the pool batches "
        "that served a request's rounds (drafter: – when no round drafted). mean K: tokens "
        "drafted per round, over all the cell's rounds (as the router chose them). same "
        "tokens: every request's tokens equal the target's greedy tokens for its prompt, or "
        "depart from them first with a token tied with the target's own at its dtype's "
        "rounding (\"at ties\", as in the tables above).")


def plot(records: list[dict], out: Path) -> None:
    """concurrency.png: aggregate tokens/s against concurrent clients, a line per pair and
    mode (off dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    pairs = list(dict.fromkeys(r["pair"] for r in records))
    for colour, pair in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], pairs):
        for mode, style in (("serve_off", "s--"), ("serve_adaptive", "o-")):
            pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in records
                         if r["pair"] == pair and r["mode"] == mode)
            if pts:
                ax.plot(*zip(*pts), style, color=colour, label=f"{pair}, {mode}")
    levels = sorted({r["concurrency"] for r in records})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent streaming clients")
    ax.set_ylabel("tokens/s (all requests)")
    ax.set_title("throughput under load, greedy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=110)
    plt.close(fig)
