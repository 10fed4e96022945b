"""`specserve bench --soak`: many streams for minutes, with cancellations and disconnects.

Each client loops until the time is up: a random prompt and length, greedy or sampled, and
then either reads the stream to its end, disconnects after a few chunks (a cancellation), or
gives up on a short read timeout (a client that vanishes). Every few seconds it samples the
resident memory of every replica (router, drafter, verifier) and how many sessions the pools
hold. Errors are what no client asked for: a status other than 200, an error event, a stream
without [DONE]. At the end: requests, completed, cancelled, errors, latency p50 / p99 of the
completed, tokens/s, RSS per replica after warm-up / max / end, sessions left.
"""

import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

PROMPTS = ["import os\n", "def main():\n", "class Tree:\n", "for i in range(", "# parse the",
           "from collections import", "try:\n    ", "if __name__ ==", "with open(", "return "]
REPLICAS = {"router": ("router", "Router"), "drafter": ("drafter", "DrafterPool"),
            "verifier": ("verifier", "VerifierPool")}
POOLS = ("drafter", "verifier")  # the replica kinds that hold sessions
MIN_REQUESTS = 2  # per stream, however short the soak


DONE = "[DONE]"


def sse_events(response):
    """A streamed completion's server-sent events as they arrive: each data line parsed
    (a dict), and DONE for `data: [DONE]`."""
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            data = line[len(b"data: "):]
            yield DONE if data == b"[DONE]" else json.loads(data)


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    refused: int = 0  # 429: admission said no (not an error)
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def one_request(url: str, rng: random.Random, tally: Tally) -> None:
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 96), "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": rng.choice([0.0, 1.0]), "ignore_eos": True}
    mode = rng.choices(["read", "disconnect", "timeout"], weights=[7, 2, 1])[0]
    started = time.monotonic()
    outcome, tokens = "completed", 0
    try:
        timeout = (10, 0.02) if mode == "timeout" else (10, 120)
        with requests.post(url + "/v1/completions", json=body, stream=True,
                           timeout=timeout) as response:
            if response.status_code == 429:
                outcome = "refused"
            elif response.status_code != 200:
                outcome = f"status {response.status_code}: {response.text[:200]}"
            else:
                chunks, done = 0, False
                for event in sse_events(response):
                    if event == DONE:
                        done = True
                        break
                    if "error" in event:
                        outcome = f"error event: {event['error']['message']}"
                        break
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    chunks += 1
                    if mode == "disconnect" and chunks >= 3:
                        outcome = "cancelled"
                        break  # closing the response drops the connection
                if outcome == "completed" and not done:
                    outcome = "stream ended without [DONE]"
    except requests.RequestException as error:
        # a read timeout while streaming surfaces as a ConnectionError (requests wraps it)
        outcome = "cancelled" if mode == "timeout" else f"{type(error).__name__}: {error}"
    seconds = time.monotonic() - started
    with tally.lock:
        tally.requests += 1
        if outcome == "completed":
            tally.completed += 1
            tally.latencies.append(seconds)
            tally.tokens += tokens
        elif outcome == "cancelled":
            tally.cancelled += 1
        elif outcome == "refused":
            tally.refused += 1
        else:
            tally.errors.append(outcome)


def replica_stats() -> dict[str, dict]:
    """Per replica kind: the RSS (MB) and, for pools, sessions, of one replica of each."""
    from ray import serve

    stats = {}
    for kind, (app, deployment) in REPLICAS.items():
        stats[kind] = serve.get_deployment_handle(deployment, app).memory.remote().result(
            timeout_s=30)
    return stats


def settled_stats(timeout_s: float = 60) -> dict[str, dict]:
    """replica_stats once the pools hold no session (the releases of finished and cancelled
    requests run in the background), or whatever they hold after timeout_s: a leak."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = replica_stats()
        if time.monotonic() > deadline or not any(stats[kind].get("sessions") for kind in POOLS):
            return stats
        time.sleep(0.5)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def soak(url: str, seconds: float, streams: int, seed: int = 0,
         sample_every_s: float = 2.0) -> dict:
    """Run the soak against a running deployment (this process connected to its Ray)."""
    for prompt in PROMPTS[:2]:  # warm-up: the first requests pay for lazy start-up
        requests.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8},
                      timeout=120).raise_for_status()
    baseline = replica_stats()
    samples = [baseline]
    tally = Tally()
    deadline = time.monotonic() + seconds
    stop = threading.Event()

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        made = 0
        # at least MIN_REQUESTS each, so what a short soak checks does not hang on the speed
        while time.monotonic() < deadline or made < MIN_REQUESTS:
            one_request(url, rng, tally)
            made += 1

    def sampler() -> None:
        while not stop.wait(sample_every_s):
            samples.append(replica_stats())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    watcher = threading.Thread(target=sampler, daemon=True)
    started = time.monotonic()
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    stop.set()
    watcher.join()
    end = settled_stats()
    samples.append(end)
    rss = {kind: {"after_warmup_mb": baseline[kind]["rss_mb"],
                  "max_mb": max(s[kind]["rss_mb"] for s in samples),
                  "end_mb": end[kind]["rss_mb"]} for kind in REPLICAS}
    return {"seconds": round(elapsed, 1), "streams": streams, "requests": tally.requests,
            "completed": tally.completed, "cancelled": tally.cancelled,
            "refused_429": tally.refused, "errors": len(tally.errors),
            "error_kinds": sorted(set(tally.errors))[:10],
            "latency_s_p50": percentile(tally.latencies, 0.5),
            "latency_s_p99": percentile(tally.latencies, 0.99),
            "tokens_per_s": round(tally.tokens / elapsed, 1), "rss": rss,
            "sessions_left": {kind: end[kind].get("sessions") for kind in POOLS}}


def seconds_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"  # None: no request completed


def report(result: dict) -> str:
    lines = [f"soak: {result['streams']} streams for {result['seconds']} s: "
             f"{result['requests']} requests, {result['completed']} completed, "
             f"{result['cancelled']} cancelled, {result['refused_429']} refused (429), "
             f"{result['errors']} errors {result['error_kinds'] or ''}",
             f"latency of the completed: p50 {seconds_text(result['latency_s_p50'])}, p99 "
             f"{seconds_text(result['latency_s_p99'])}; {result['tokens_per_s']} tokens/s",
             f"sessions left in the pools: {result['sessions_left']}"]
    for kind, mb in result["rss"].items():
        lines.append(f"RSS {kind}: {mb['after_warmup_mb']:.0f} MB after warm-up, max "
                     f"{mb['max_mb']:.0f}, end {mb['end_mb']:.0f}")
    return "\n".join(lines)


def main(args) -> int:
    """Start cluster/config.yaml on a local Ray (free ports), soak it, stop it."""
    import ray
    from ray import serve

    from deployments.local import deploy, load_config, on_free_ports, start_serve

    config = on_free_ports(load_config())
    ray.init(address="local", include_dashboard=False, logging_level="error")
    try:
        start_serve(config)
        deploy(config, timeout_s=300)
        url = f"http://127.0.0.1:{config['http_options']['port']}"
        result = soak(url, args.soak_seconds, args.soak_streams, seed=args.seed)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(report(result))
    out = args.out or Path("bench/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}/soak.json")
    return 1 if result["errors"] else 0
