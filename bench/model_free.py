"""Model-free drafting on repetitive work: n-gram against suffix decoding, in process.

    python -m bench.model_free [--max-tokens 64] [--k 4]

The demo target in this process (one thread), greedy, on held-out prompts that repeat
themselves the way edits, rewrites and chats do (a function and the start of its copy, a JSON
record and the start of the next, a chat whose turns come back). Each workload runs twice
through one drafter: the second pass is a later request that repeats an earlier one (an agent
loop, a retried request), where suffix decoding's index of recent outputs can propose and
prompt lookup cannot. Rows: the target alone, n-gram, suffix and suffix trees (width 3: the
other frequent continuations beside the main one) at K = --k, with tokens per round (mean
acceptance length), acceptance rate, tokens/s and the speedup over the target alone in the
same run; every speculative row's tokens are checked equal to the target alone.
"""

import argparse

import torch

from bench.runners import run_loop
from drafter.ngram import NgramDrafter
from drafter.suffix import SuffixDrafter
from engine.models import DEMO_TARGET, load_causal_lm, load_tokenizer
from speculative.stats import SpecStats
from verifier.engine import ModelVerifier

FUNCTION = "def area(width, height):\n    return width * height\n\n\n"
RECORD = '{"name": "alpha", "size": 3, "tags": ["a", "b"]}\n'
WORKLOADS = {  # held-out prompts, not in the demo pair's training text
    "code edit": FUNCTION + "# the same, renamed\n" + FUNCTION.replace("area", "surface")[:24],
    "JSON rewrite": RECORD + RECORD.replace("alpha", "beta").replace("3", "4")[:30],
    "chat repeat": "user: list the files\nassistant: import os\nprint(os.listdir())\n"
                   "user: again\nassistant: import os\n",
}


def run(args) -> list[dict]:
    tokenizer = load_tokenizer(DEMO_TARGET)
    verifier = ModelVerifier(load_causal_lm(DEMO_TARGET))
    vocab = verifier.model.config.vocab_size
    methods = {"target alone": (None, 0, 1), "ngram": (NgramDrafter(vocab), args.k, 1),
               "suffix": (SuffixDrafter(vocab), args.k, 1),
               "suffix tree": (SuffixDrafter(vocab), args.k, 3)}
    rows, alone = [], {}
    for attempt in ("first", "repeat"):
        for workload, text in WORKLOADS.items():
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            for method, (drafter, k, width) in methods.items():
                tokens, seconds, stats = run_loop(drafter, verifier, prompt, args.max_tokens,
                                                  0.0, 0, k, width)  # greedy, all max_tokens
                alone.setdefault((attempt, workload), (tokens, seconds))
                rows.append(row(attempt, workload, method, tokens, seconds, stats,
                                alone[(attempt, workload)]))
    return rows


def row(attempt: str, workload: str, method: str, tokens, seconds: float, stats: SpecStats,
        alone) -> dict:
    return {"pass": attempt, "workload": workload, "method": method,
            "tokens_per_round": stats.mean_acceptance_length,
            "acceptance_rate": stats.acceptance_rate,
            "tokens_per_s": len(tokens) / seconds, "speedup": alone[1] / seconds,
            "same_tokens": tokens == alone[0]}


def shown(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def print_table(rows: list[dict], args) -> None:
    print(f"demo target, greedy, {args.max_tokens} tokens a request, K = {args.k}, "
          f"one thread, torch {torch.__version__}")
    print("| pass | workload | method | tokens/round | acceptance | tokens/s | speedup | "
          "same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pass']} | {r['workload']} | {r['method']} | "
              f"{shown(r['tokens_per_round'], '.2f')} | {shown(r['acceptance_rate'], '.2f')} | "
              f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
              f"{'yes' if r['same_tokens'] else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print_table(run(args), args)


if __name__ == "__main__":
    main()
