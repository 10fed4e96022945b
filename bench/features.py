"""What each request feature costs speculation: acceptance and speed with and without it.

    python -m bench.features [--max-tokens 64] [--repeats 2]

The demo pair in this process (the served drafter's q options), the held-out prompts at a
fixed K = 4 against K = 0 (the target alone), greedy and sampled (seeded), for the plain
request and the same request with each feature. Runs are interleaved prompt by prompt, so
drift hits every row alike. Prints a markdown table: acceptance rate, tokens/s at K = 4, and
the speedup over K = 0 with the same feature.
"""

import argparse
import asyncio
import time

from bench.newcomer import HELD_OUT

FEATURES = {
    "plain": {},
    "presence_penalty 1.0": {"presence_penalty": 1.0},
    "frequency_penalty 0.5": {"frequency_penalty": 0.5},
    "repetition_penalty 1.2": {"repetition_penalty": 1.2},
    "logprobs 5": {"logprobs": 5},
    "json schema": {"grammar": ("json", {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "items": {"type": "array", "maxItems": 4,
                                                   "items": {"type": "integer"}}},
        "required": ["name", "items"]})},
    "regex": {"grammar": ("regex", r"(def|class) [a-z_]{1,16}\((self)?(, [a-z]{1,8}){0,3}\):")},
    "choice": {"grammar": ("choice", ["import os", "import sys", "from typing import List",
                                      "from collections import defaultdict"])},
}
K = 4
END = 0  # the demo tokenizer's end token: a constrained output ends there when complete


def pools(grammar_tokenizer):
    from deployments.local import app_config, load_config
    from drafter.model import ModelDrafter
    from engine.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm
    from verifier.engine import ModelVerifier

    args = app_config(load_config(), "drafter")["args"]
    q_options = {name: args[name] for name in ("draft_top_k", "draft_q_mass", "draft_q_dtype")
                 if name in args}
    return (ModelDrafter(load_causal_lm(DEMO_DRAFT), grammar_tokenizer=grammar_tokenizer,
                         **q_options),
            ModelVerifier(load_causal_lm(DEMO_TARGET), grammar_tokenizer=grammar_tokenizer))


def feature_fields(name: str, grammar_tokenizer) -> dict:
    """The SamplingParams fields of a feature (a constraint compiled to its grammar)."""
    from speculative.grammar import compile_spec

    fields = dict(FEATURES[name])
    if "grammar" in fields:
        fields["grammar"] = compile_spec(*fields["grammar"], grammar_tokenizer)
    return fields


def decode(drafter, verifier, prompt_ids, params, k: int) -> tuple[int, float, object]:
    from speculative.driver import Generation
    from speculative.state import Request
    from speculative.policy import KBounds, k_policy

    generation = Generation(Request(f"r{time.perf_counter_ns()}", tuple(prompt_ids), params,
                                    stop_token_ids=(END,)))
    policy = k_policy(k, False, params.greedy, KBounds(1, 8, initial=k or 1))
    started = time.perf_counter()
    asyncio.run(generation.run(drafter, verifier, policy, False))
    return len(generation.token_ids), time.perf_counter() - started, generation.stats


def measure(max_tokens: int, repeats: int) -> list[dict]:
    from engine.models import DEMO_TARGET, load_tokenizer
    from speculative.sampling import SamplingParams

    from speculative.grammar import ll_tokenizer

    tokenizer = load_tokenizer(DEMO_TARGET)
    grammar_tokenizer = ll_tokenizer(tokenizer, len(tokenizer))
    drafter, verifier = pools(grammar_tokenizer)
    fields = {name: feature_fields(name, grammar_tokenizer) for name in FEATURES}
    rows = {(name, temperature): {"tokens": [0, 0], "seconds": [0.0, 0.0], "accepted": 0,
                                  "drafted": 0}
            for name in FEATURES for temperature in (0.0, 1.0)}
    for repeat in range(repeats):
        for index, prompt in enumerate(HELD_OUT):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            for (name, temperature), row in rows.items():
                params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                        seed=1000 * repeat + index, **fields[name])
                for slot, k in enumerate((0, K)):
                    tokens, seconds, stats = decode(drafter, verifier, ids, params, k)
                    row["tokens"][slot] += tokens
                    row["seconds"][slot] += seconds
                row["accepted"] += stats.num_accepted_tokens
                row["drafted"] += stats.num_draft_tokens
    return [{"feature": name, "temperature": temperature,
             "acceptance": row["accepted"] / max(row["drafted"], 1),
             "tokens_per_s": row["tokens"][1] / row["seconds"][1],
             "speedup": (row["tokens"][1] / row["seconds"][1])
             / (row["tokens"][0] / row["seconds"][0])}
            for (name, temperature), row in rows.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"| feature | T | acceptance | tok/s at K = {K} | speedup over K = 0 |")
    print("|---|---|---|---|---|")
    for row in measure(args.max_tokens, args.repeats):
        print(f"| {row['feature']} | {row['temperature']:g} | {row['acceptance']:.2f} | "
              f"{row['tokens_per_s']:.0f} | {row['speedup']:.2f}x |")


if __name__ == "__main__":
    main()
