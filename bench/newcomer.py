"""What a newcomer sees of the default deployment: `serve run cluster/config.yaml`, fresh.

    python -m bench.newcomer [--prompts 6] [--max-tokens 96]

Starts `serve run` (its own local Ray, free ports), sends the README's request as soon as it
answers, then, with nothing warmed by hand:
1. four 96-token greedy default requests: the mean K of each (the controller must not trap
   itself at K = 0 from a cold start);
2. held-out prompts, one request at a time, interleaved prompt by prompt: the default request
   against K = 0 and fixed K in {1, 2, 4, 6}, at T = 0 and (unseeded) T = 1: seconds per
   request and the ratios;
3. a burst of 16 concurrent default requests, then one request alone: its mean K;
4. a seeded sampled default request twice: the same tokens.
Prints a table of ratios from this one run; stops `serve run` by its process group.
"""

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import yaml

from deployments.local import load_config, on_free_ports

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ["import json\n", "def parse(self", "class Reader:\n", "    return self.",
            "if __name__ ==", "with open(path) as f:\n", "try:\n    import", "    for key in"]
FIXED = (0, 1, 2, 4, 6)


def start(config_path: Path, port: int) -> tuple[subprocess.Popen, float]:
    serve = Path(sys.executable).parent / "serve"
    started = time.monotonic()
    process = subprocess.Popen([str(serve), "run", "--address", "local", str(config_path)],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    while time.monotonic() - started < 300 and process.poll() is None:
        try:
            if complete(port, "def ", max_tokens=4, temperature=0).get("choices"):
                return process, time.monotonic() - started
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError("serve run never answered")


@contextlib.contextmanager
def fresh_serve_run(config: dict | None = None):
    """(port, seconds until it answered) of `serve run cluster/config.yaml` (or of `config`)
    on free ports, started fresh and stopped after by its process group."""
    config = on_free_ports(config or load_config())
    port = config["http_options"]["port"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        process, ready_s = start(path, port)
        try:
            yield port, ready_s
        finally:
            stop_group(process)


def stop_group(process: subprocess.Popen) -> None:
    """Stop a server started in its own session, by its process group."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def complete(port: int, prompt: str, **fields) -> dict:
    response = requests.post(f"http://127.0.0.1:{port}/v1/completions",
                             json={"prompt": prompt, **fields}, timeout=120)
    response.raise_for_status()
    return response.json()


def timed(port: int, prompt: str, **fields) -> tuple[float, dict]:
    started = time.perf_counter()
    body = complete(port, prompt, **fields)
    return time.perf_counter() - started, body


def compare(port: int, prompts: list[str], n: int, temperature: float) -> dict:
    """Seconds per request of the default and each fixed K, interleaved prompt by prompt."""
    seconds: dict = {}
    ks: list[float] = []
    for prompt in prompts:
        for k in ("default", *FIXED):
            fields = {"max_tokens": n, "temperature": temperature, "ignore_eos": True}
            if k != "default":
                fields["num_speculative_tokens"] = k
            elapsed, body = timed(port, prompt, **fields)
            seconds.setdefault(k, []).append(elapsed)
            if k == "default":
                ks.append(body["speculative"]["mean_num_speculative_tokens"])
    total = {k: sum(v) for k, v in seconds.items()}
    best = min((k for k in FIXED if k), key=total.get)
    return {"seconds": total, "best_fixed": best, "mean_k": statistics.mean(ks),
            "vs_best": total["default"] / total[best], "vs_off": total["default"] / total[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=len(HELD_OUT))
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    with fresh_serve_run() as (port, ready_s):
        print(f"serve run answered the README's request after {ready_s:.1f} s")
        first = [complete(port, p, max_tokens=args.max_tokens, temperature=0,
                          ignore_eos=True)["speculative"]["mean_num_speculative_tokens"]
                 for p in HELD_OUT[:4]]
        print(f"1. the first four default requests: mean K {[round(k, 2) for k in first]}"
              f" (mean {statistics.mean(first):.2f}; goal >= 1.5)")
        prompts = HELD_OUT[: args.prompts]
        for temperature, goal in ((0.0, 0.75), (1.0, 0.9)):
            r = compare(port, prompts, args.max_tokens, temperature)
            cells = ", ".join(f"K={k}: {s:.2f}" for k, s in r["seconds"].items())
            print(f"2. T = {temperature:g}, {len(prompts)} prompts x {args.max_tokens} "
                  f"tokens, seconds: {cells}; default mean K {r['mean_k']:.2f}; default / "
                  f"best fixed (K={r['best_fixed']}) {r['vs_best']:.2f}x (goal <= 1.1), "
                  f"default / K=0 {r['vs_off']:.2f}x (goal <= {goal})")
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: complete(port, HELD_OUT[i % len(HELD_OUT)],
                                             max_tokens=48, temperature=0,
                                             ignore_eos=True), range(16)))
        after = complete(port, HELD_OUT[0], max_tokens=args.max_tokens, temperature=0,
                         ignore_eos=True)["speculative"]["mean_num_speculative_tokens"]
        print(f"3. one request right after a burst of 16: mean K {after:.2f}")
        seeded = [complete(port, "def ", max_tokens=48, temperature=1, seed=7)["choices"][0]
                  ["text"] for _ in range(2)]
        print(f"4. a seeded sampled request twice: same tokens: {seeded[0] == seeded[1]}")


if __name__ == "__main__":
    main()
