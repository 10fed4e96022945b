"""The data path's cost per round: Serve's gRPC proxy for every call, against the direct path.

    python -m bench.serve_overhead [--pair demo] [--max-tokens 64] [--k 4]

One run on a local Ray: cluster/config.yaml serving the pair, first with every pool call through
Serve's gRPC proxy (`direct_data_path: false`, the natural design), then with the direct data
path (Serve places a request; later calls go to the chosen replica's own port). The same prompts,
one request at a time, greedy and sampled. Prints tokens/s, the round time split (the pools'
own compute, transport, router), the per-round overhead p50 (round less the pools' compute) and
bytes per round, side by side.
"""

import argparse
import statistics

import torch

from bench.pairs import PAIRS, PROMPTS
from bench.records import Tally
from bench.runners import Served, stats_from_http


def main() -> None:
    import ray
    from ray import serve

    from deployments.local import app_config
    from engine.models import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="demo")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = PAIRS[args.pair]
    tokenizer = load_tokenizer(pair.target)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    tallies: dict[tuple, Tally] = {}
    ray.init(address="local", include_dashboard=False, logging_level="error", log_to_driver=False)
    try:
        served = Served()
        for path, direct in (("proxy", False), ("direct", True)):
            app_config(served.config, "router")["args"]["direct_data_path"] = direct
            served.use(pair)
            served.complete(prompts[0], 8, 0.0, 0, args.k)  # warm-up
            for temperature in (0.0, 1.0):
                for k in (0, args.k):
                    tally = tallies.setdefault((path, temperature, k), Tally())
                    for index, ids in enumerate(prompts):
                        out, seconds, spec = served.complete(ids, args.max_tokens, temperature,
                                                             index, k)
                        tally.add(len(out), seconds, stats_from_http(spec),
                                  spec["overhead_ms_p50"])
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"\n{pair.name} pair, {len(prompts)} prompts x {args.max_tokens} tokens, one request "
          "at a time; ms per round (mean); overhead = round less the pools' compute\n")
    print("| path | T | K | tokens/s | tokens/round | draft | verify | transport | router "
          "| round | overhead p50 | bytes/round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (path, temperature, k), tally in tallies.items():
        stats = tally.stats
        ms = stats.ms_per_round()
        overhead = statistics.median(tally.overhead_p50s)
        print(f"| {path} | {temperature:g} | {k} | {tally.tokens / tally.seconds:.1f} "
              f"| {stats.mean_acceptance_length:.2f} | {ms['draft']:.2f} | {ms['verify']:.2f} "
              f"| {ms['transport']:.2f} | {ms['router']:.2f} | {ms['total']:.2f} "
              f"| {overhead:.2f} | {stats.wire_bytes / stats.rounds:.0f} |")


if __name__ == "__main__":
    main()
