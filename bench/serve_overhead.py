"""Per-round cost of the distributed path, side by side with the same loop in-process.

    python -m bench.serve_overhead [--max-tokens 64] [--k 4]

One run: the demo pair in-process (1 torch thread, as each replica of cluster/config.yaml
has), then cluster/config.yaml on a local Ray instance, first with every call through Serve's
gRPC proxy, then with the direct data path (the proxy places a request, later calls go to the
chosen replica's own port); the same prompts one request at a time. Prints tokens/s and the
mean round time split into draft / verify / router; the difference per round from in-process
is what transport and Serve add.
"""

import argparse
import asyncio
import time
import uuid

import requests
import torch

from bench.inprocess import PROMPTS
from deployments.local import app_config, deploy, load_config, on_free_ports, start_serve
from drafter.model import ModelDrafter
from specserve.cli import decode_text
from speculative.loop import Request, SpecStats
from speculative.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm, load_tokenizer
from speculative.sampling import SamplingParams
from verifier.engine import ModelVerifier


def in_process(k: int, max_tokens: int) -> tuple[float, dict]:
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(DEMO_TARGET)
    drafter = ModelDrafter(load_causal_lm(DEMO_DRAFT))
    verifier = ModelVerifier(load_causal_lm(DEMO_TARGET))
    total, tokens, seconds = SpecStats(), 0, 0.0
    for prompt in PROMPTS:
        ids = tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        request = Request(uuid.uuid4().hex, ids, SamplingParams(temperature=0, max_tokens=max_tokens))
        started = time.perf_counter()
        _, out, state = asyncio.run(decode_text(request, drafter, verifier, k, tokenizer))
        seconds += time.perf_counter() - started
        tokens += len(out)
        total.add(state.stats)
    return tokens / seconds, total.as_dict()


def distributed(base_url: str, k: int, max_tokens: int) -> tuple[float, dict]:
    total, tokens, seconds = SpecStats(), 0, 0.0
    for prompt in PROMPTS:
        started = time.perf_counter()
        body = requests.post(base_url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "num_speculative_tokens": k}).json()
        seconds += time.perf_counter() - started
        tokens += body["usage"]["completion_tokens"]
        spec, ms = body["speculative"], body["speculative"]["ms_per_round"]
        rounds = spec["rounds"]
        total.add(SpecStats(rounds=rounds, num_draft_tokens=spec["num_draft_tokens"],
                            num_accepted_tokens=spec["num_accepted_tokens"],
                            draft_seconds=ms["draft"] * rounds / 1000,
                            verify_seconds=ms["verify"] * rounds / 1000,
                            round_seconds=ms["total"] * rounds / 1000))
    return tokens / seconds, total.as_dict()


def main() -> None:
    import ray
    from ray import serve

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()

    local = {k: in_process(k, args.max_tokens) for k in (0, args.k)}
    config = on_free_ports(load_config())
    ray.init(include_dashboard=False, logging_level="error")
    try:
        start_serve(config)
        url = f"http://127.0.0.1:{config['http_options']['port']}"
        paths = {}
        for name, direct in (("serve proxy", False), ("direct gRPC", True)):
            app_config(config, "router")["args"]["direct_data_path"] = direct
            deploy(config)
            distributed(url, args.k, 8)  # warm-up: channels, first forwards
            paths[name] = {k: distributed(url, k, args.max_tokens) for k in (0, args.k)}
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"\ndemo pair, greedy, {len(PROMPTS)} prompts x {args.max_tokens} tokens, one request "
          "at a time; ms per round (mean)\n")
    print("| path | K | tokens/s | tokens/round | draft | verify | router | round |")
    print("|---|---|---|---|---|---|---|---|")
    for name, results in (("in-process", local), *paths.items()):
        for k, (rate, stats) in results.items():
            ms = stats["ms_per_round"]
            print(f"| {name} | {k} | {rate:.1f} | {stats['mean_acceptance_length']:.2f} | "
                  f"{ms['draft']:.2f} | {ms['verify']:.2f} | {ms['router']:.2f} | "
                  f"{ms['total']:.2f} |")
    print()
    for name, remote in paths.items():
        for k in (0, args.k):
            round_ms = remote[k][1]["ms_per_round"]["total"]
            extra = round_ms - local[k][1]["ms_per_round"]["total"]
            print(f"{name}, K = {k}: +{extra:.2f} ms per round over in-process "
                  f"({extra / round_ms:.0%} of its round); tokens/s "
                  f"{remote[k][0] / local[k][0]:.2f}x in-process")


if __name__ == "__main__":
    main()
