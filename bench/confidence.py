"""Draft length by confidence, in process: blocks of K tokens against blocks cut where the
draft's confidence falls below a fixed threshold, and below the one learnt from acceptance
and costs (draft_confidence "auto", speculative.confidence).

    python -m bench.confidence [--pair demo] [--max-tokens 64]

One pair in this process (one thread), greedy, the bench prompts, drafting then verifying.
Each row runs the prompts twice on one request front end, so that what its requests learn
(the adaptive K's costs and the cut) carries over as it does on a router; the second pass is
measured. Rows report drafted tokens, accepted tokens, tokens per round, tokens/s and the
speedup over the target alone in the same run, and whether the tokens equal the target's.
"""

import argparse

import torch

from bench.pairs import PAIRS, PROMPTS, Pair
from bench.runners import run_loop
from bench.trees import resolved, warm_pair
from speculative.frontend import RequestFrontEnd
from speculative.options import SpeculationDefaults

# (name, K, draft_confidence): None leaves the drafter's own (0: no cut)
ROWS = (("target alone", 0, None), ("K=4", 4, None), ("K=4, cut 0.2", 4, 0.2),
        ("K=4, cut 0.6", 4, 0.6), ("K=auto", "auto", None), ("K=auto, cut learnt", "auto", "auto"))
QUICK_ROWS = ("target alone", "K=4", "K=auto, cut learnt")


def rows_of(pair: Pair, shapes, prompt_texts: list[str], max_tokens: int) -> list[dict]:
    drafter, verifier, prompts = warm_pair(pair, prompt_texts)
    rows, alone = [], None
    for name, k, cut in shapes:
        front_end = RequestFrontEnd(SpeculationDefaults(
            num_speculative_tokens=k, pipelined_drafting="off", draft_confidence=cut))
        for _ in range(2):  # the first pass learns, the second is measured
            tokens, seconds, rounds, drafted, accepted, plain = [], 0.0, 0, 0, 0, 0
            for i, prompt in enumerate(prompts):
                out, took, stats = run_loop(drafter if k else None, verifier, prompt,
                                            max_tokens, 0.0, i, k, front_end=front_end)
                tokens.append(out)
                seconds += took
                rounds += stats.rounds
                drafted += stats.num_draft_tokens
                accepted += stats.num_accepted_tokens
                plain += stats.plain_step_tokens  # a draftless round's later steps
        count = sum(len(t) for t in tokens)
        alone = alone or (tokens, count / seconds)
        rows.append({"method": name, "drafted": drafted, "accepted": accepted,
                     "tokens_per_round": (count - plain) / rounds,
                     "tokens_per_s": count / seconds,
                     "speedup": count / seconds / alone[1], "same_tokens": tokens == alone[0]})
    return rows


def run(pair_name: str, max_tokens: int, quick: bool = False, num_prompts: int | None = None
        ) -> list[dict]:
    shapes = [row for row in ROWS if not quick or row[0] in QUICK_ROWS]
    return rows_of(resolved(PAIRS[pair_name]), shapes, PROMPTS[:num_prompts], max_tokens)


def markdown_lines(rows: list[dict]) -> list[str]:
    lines = ["| method | drafted | accepted | tokens/round | tokens/s | speedup | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['drafted']} | {r['accepted']} | "
                     f"{r['tokens_per_round']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['speedup']:.2f}x | {'yes' if r['same_tokens'] else 'NO'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="demo")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.pair} pair, greedy, {args.max_tokens} tokens x {len(PROMPTS)} prompts, the "
          f"second of two passes, one thread, torch {torch.__version__}")
    print("\n".join(markdown_lines(run(args.pair, args.max_tokens))))


if __name__ == "__main__":
    main()
