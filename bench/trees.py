"""Draft trees against chains at equal verify budget, in process.

    python -m bench.trees [--pair scaled] [--max-tokens 48] [--temperature 0]

One pair in this process (one thread), the bench prompts, drafting then verifying (no
pre-drafts: a tree's rounds are sequential). Rows: the target alone, chains of K = 1..8 and
trees "w W d D n N" (a main chain D deep, up to W children at its nodes, N nodes in all, the
siblings where the draft is least sure), each with the nodes the verifier scores per round
(its verify budget), tokens per round (mean acceptance length), tokens/s and the speedup over
the target alone in the same run. A tree of N nodes costs a verify of a chain of K = N but
drafts only D steps; it accepts more than that chain where the draft's second choice holds
the target's token more often than the chain's last positions are reached. Greedy rows are
checked token-identical to the target alone.
"""

import argparse
from dataclasses import replace
from itertools import product
from statistics import stdev

import torch

from bench.costs import flattest_dtype
from bench.pairs import PAIRS, PROMPTS, Pair
from bench.runners import run_loop
from drafter.model import ModelDrafter
from speculative.frontend import RequestFrontEnd
from speculative.options import SpeculationDefaults
from engine.models import load_causal_lm, load_tokenizer
from verifier.engine import ModelVerifier

CHAINS = (1, 2, 3, 4, 6, 8)
# (width, depth, nodes): siblings at every node, then a budget of a chain's nodes with the
# siblings where the draft is least sure
TREES = ((2, 2, 4), (2, 4, 8), (3, 3, 9), (2, 3, 4), (2, 6, 8), (3, 6, 8), (2, 7, 8),
         (3, 5, 8))


def methods() -> list[tuple[str, int | str, int | str, int | None]]:
    """(name, K, width, nodes): the target alone, the chains, the trees, and the adaptive K
    with chains and with the shape chosen per round (AdaptiveK.round_shape)."""
    return [("target alone", 0, 1, None)] + [(f"chain K={k}", k, 1, None) for k in CHAINS] + \
        [(f"tree w{w} d{d} n{n}", d, w, n) for w, d, n in TREES] + \
        [("K=auto", "auto", 1, None), ("K=auto tree=auto", "auto", "auto", None)]


def resolved(pair: Pair) -> Pair:
    """The pair with an "auto" dtype chosen as the bench suite chooses it (the target's
    flattest cost curve up to 9 tokens on this machine; the draft follows)."""
    if pair.target_dtype != "auto":
        return pair
    dtype, _ = flattest_dtype(pair.target, 9, repeats=3)
    return replace(pair, target_dtype=dtype,
                   draft_dtype=dtype if pair.draft_dtype == "auto" else pair.draft_dtype)


def run(args) -> list[dict]:
    pair = args.resolved = resolved(PAIRS[args.pair])
    shapes = [m for m in methods() if not args.only or m[0] in args.only or not m[1]]
    return rows_of(pair, shapes, PROMPTS, args.max_tokens, args.temperature, args.seeds)


def rows_of(pair: Pair, shapes: list[tuple], prompt_texts: list[str], max_tokens: int,
            temperature: float, seeds: int = 1) -> list[dict]:
    """One row per (name, K, width, nodes) of `shapes`, the target alone first; each prompt
    runs with `seeds` seeds (sampled rows: more rounds, a smaller standard error)."""
    drafter, verifier, prompts = warm_pair(pair, prompt_texts)
    rows, alone = [], None
    for name, k, width, nodes in shapes:
        if k == "auto" and temperature > 0:
            continue  # a seeded sampled request pins an adaptive K (the router's rule)
        tokens, seconds, rounds, emitted, verified, per_request = [], 0.0, 0, 0, 0, []
        # one front end a row: an adaptive K's requests share what they learn
        front_end = RequestFrontEnd(SpeculationDefaults(num_speculative_tokens=k,
                                                        pipelined_drafting="off"))
        for seed, (i, prompt) in product(range(seeds), enumerate(prompts)):
            out, took, stats = run_loop(drafter if k else None, verifier, prompt,
                                        max_tokens, temperature, 1000 * seed + i, k, width,
                                        nodes, front_end)
            tokens.append(out)
            seconds += took
            rounds += stats.rounds
            # a round without a draft asks for several tokens (plain_steps): its later ones
            # are no speculation's (SpecStats.mean_acceptance_length)
            emitted += stats.num_emitted_tokens - stats.plain_step_tokens
            verified += stats.num_draft_tokens
            per_request.append(stats.mean_acceptance_length)
        count = sum(len(t) for t in tokens)
        alone = alone or (tokens, count / seconds)
        rows.append({"method": name, "nodes_per_round": verified / rounds,
                     "tokens_per_round": emitted / rounds,
                     "tokens_per_round_se": stdev(per_request) / len(per_request) ** 0.5
                     if len(per_request) > 1 else 0.0,
                     "tokens_per_s": count / seconds,
                     "speedup": count / seconds / alone[1],
                     "same_tokens": tokens == alone[0] if temperature == 0 else None})
    return rows


def warm_pair(pair: Pair, prompt_texts: list[str]) -> tuple:
    """(drafter, verifier, prompt token ids) of the pair in this process, warmed up by one
    short request."""
    tokenizer = load_tokenizer(pair.target)
    verifier = ModelVerifier(load_causal_lm(pair.target, dtype=pair.target_dtype))
    drafter = ModelDrafter(load_causal_lm(pair.draft, dtype=pair.draft_dtype),
                           vocab_size=verifier.model.config.vocab_size)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompt_texts]
    run_loop(drafter, verifier, prompts[0], 8, 0.0, 0, 4)
    return drafter, verifier, prompts


def print_table(rows: list[dict], args) -> None:
    pair = args.resolved
    print(f"{pair.name} pair ({pair.note}; target {pair.target_dtype}), T = {args.temperature}, "
          f"{args.max_tokens} tokens x {len(PROMPTS)} prompts x {args.seeds} seeds, one thread, "
          f"torch {torch.__version__}")
    print("| method | nodes verified/round | tokens/round (± s.e. over requests) | tokens/s | "
          "speedup | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        same = "–" if r["same_tokens"] is None else "yes" if r["same_tokens"] else "NO"
        print(f"| {r['method']} | {r['nodes_per_round']:.2f} | {r['tokens_per_round']:.2f} ± "
              f"{r['tokens_per_round_se']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="scaled")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seeds", type=int, default=1,
                        help="runs of each prompt, each with its own seed (sampled rows)")
    parser.add_argument("--only", type=lambda text: text.split(","), default=None,
                        help="comma-separated rows to run (the target alone always runs), "
                             'e.g. "chain K=8,tree w3 d6 n8"')
    args = parser.parse_args()
    torch.set_num_threads(1)
    print_table(run(args), args)


if __name__ == "__main__":
    main()
