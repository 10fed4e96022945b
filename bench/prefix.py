"""Prefix caching: the time to first token of a prompt whose prefix a previous request used.

    python -m bench.prefix [--prefix-tokens 512] [--repeats 5]

The demo target in this process, as its verifier pool runs it (one thread, the default
attention backend): a prompt's first verify (its prefill and first token) on a fresh replica
(no prefix cached), then a second request with the same prefix and a different last token,
after the first was released. Prints both times, their ratio and the cached tokens the
second reported, medians over repeats (each with fresh prefixes).
"""

import argparse
import statistics
import time

import torch

from engine.models import DEMO_TARGET, load_causal_lm
from speculative.prefixes import EMPTY_PREFIX_HASH
from speculative.sampling import SamplingParams
from speculative.types import PrefixSync, ScoreCall
from verifier.engine import ModelVerifier

GREEDY = SamplingParams(temperature=0.0)


def first_token_s(verifier: ModelVerifier, request_id: str, prompt: list[int]):
    """(seconds to score the prompt's first position, cached tokens reported)."""
    call = ScoreCall(request_id, PrefixSync(0, EMPTY_PREFIX_HASH, tuple(prompt)), (), GREEDY,
                     prompt_len=len(prompt))  # cached_tokens counts the prompt's
    started = time.perf_counter()
    scores = verifier.score_now(call)
    return time.perf_counter() - started, scores.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    verifier = ModelVerifier(load_causal_lm(DEMO_TARGET), max_batch_tokens=None)
    print(f"attention backend: {verifier.runner.attention}")
    first_times, hit_times, cached = [], [], []
    for repeat in range(args.repeats + 1):  # the first repeat warms up
        prefix = [(repeat * 131 + 7 * i) % 4000 + 1 for i in range(args.prefix_tokens)]
        first, _ = first_token_s(verifier, f"a{repeat}", prefix + [11])
        verifier.sessions.release(f"a{repeat}")
        hit, tokens = first_token_s(verifier, f"b{repeat}", prefix + [12])
        verifier.sessions.release(f"b{repeat}")
        if repeat:
            first_times.append(first)
            hit_times.append(hit)
            cached.append(tokens)
    first, hit = statistics.median(first_times), statistics.median(hit_times)
    print("| prompt tokens | first request ms | repeated prefix ms | ratio | cached tokens |")
    print("|---|---|---|---|---|")
    print(f"| {args.prefix_tokens + 1} | {1e3 * first:.1f} | {1e3 * hit:.1f} | "
          f"{hit / first:.2f}x | {min(cached)} |")


if __name__ == "__main__":
    main()
