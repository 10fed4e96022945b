"""Predicted Outputs (OpenAI's `prediction`) as a draft source, in process.

    python -m bench.predicted [--max-tokens 128] [--edits 0.1] [--edit-kind replace]

The demo pair in this process (one thread), greedy, on held-out prompts. Each prompt's
answer is the target's alone (K = 0) first; then the same request again with a prediction:
that answer with a share (--edits) of its tokens edited by seeded random ones, as an edited
file differs from the one it replaces (--edit-kind: each replaced, or edits of 1-3 ids
replaced, inserted or deleted). Rows: K = 0, the draft model at an adaptive K (the
router's default drafter), prompt lookup (ngram) without the prediction and with it (what the
router runs for a request with a prediction and no drafter named), each with tokens per round
(mean acceptance length), tokens/s and the ratio to K = 0 in the same run; every row's
tokens are checked equal to the target alone.
"""

import argparse
import random

import torch

from bench.runners import run_loop
from drafter.model import ModelDrafter
from drafter.ngram import NgramDrafter
from engine.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm, load_tokenizer
from verifier.engine import ModelVerifier

PROMPTS = [  # held-out prompts, not in the demo pair's training text
    "def area(width, height):\n",
    "class Inventory:\n    def __init__(self, items):\n",
    "import json\n\n\ndef load_settings(path):\n",
]


def edited(answer: list[int], share: float, vocab: int, seed: int,
           kind: str = "replace") -> tuple[int, ...]:
    """The answer with about `share` of its tokens edited, seeded: each replaced by a random
    id ("replace"), or ("mixed") at about share / 2 of them an edit of 1 to 3 ids, a
    replacement, an insertion of random ids before them or their deletion, alike."""
    rng = random.Random(seed)
    if kind == "replace":
        return tuple(rng.randrange(vocab) if rng.random() < share else t for t in answer)
    out, i = [], 0
    while i < len(answer):
        if rng.random() >= share / 2:
            out.append(answer[i])
            i += 1
            continue
        span, how = rng.randint(1, 3), rng.choice(("replace", "insert", "delete"))
        if how != "delete":
            out += [rng.randrange(vocab) for _ in range(span)]
        if how != "insert":
            i += span
    return tuple(out)


def run(args) -> list[dict]:
    tokenizer = load_tokenizer(DEMO_TARGET)
    verifier = ModelVerifier(load_causal_lm(DEMO_TARGET))
    draft, vocab = load_causal_lm(DEMO_DRAFT), verifier.model.config.vocab_size
    methods = {"K = 0": lambda: (None, 0), "draft model, auto K": lambda: (ModelDrafter(draft),
                                                                           "auto"),
               "ngram, auto K": lambda: (NgramDrafter(vocab), "auto"),
               "ngram + prediction, auto K": lambda: (NgramDrafter(vocab), "auto")}
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROMPTS]
    run_loop(None, verifier, prompts[0], 8, 0.0, 0, 0)  # warm-up, untimed
    totals = {method: [0, 0.0, 0, True] for method in methods}  # tokens, s, rounds, same
    for index, prompt in enumerate(prompts):
        alone, _, _ = run_loop(None, verifier, prompt, args.max_tokens, 0.0, 0, 0)
        prediction = edited(alone, args.edits, vocab, seed=index, kind=args.edit_kind)
        for method, build in methods.items():
            drafter, k = build()
            predicted = prediction if "prediction" in method else ()
            tokens, seconds, stats = run_loop(drafter, verifier, prompt, args.max_tokens, 0.0,
                                              0, k, prediction_ids=predicted)
            total = totals[method]
            total[0] += len(tokens)
            total[1] += seconds
            total[2] += stats.rounds
            total[3] &= tokens == alone
    base = totals["K = 0"][0] / totals["K = 0"][1]
    return [{"method": method, "tokens_per_s": tokens / seconds,
             "tokens_per_round": tokens / rounds, "ratio": tokens / seconds / base,
             "same_tokens": same} for method, (tokens, seconds, rounds, same) in totals.items()]


def print_table(rows: list[dict], args) -> None:
    print(f"demo pair, greedy, {len(PROMPTS)} prompts x {args.max_tokens} tokens, predictions "
          f"with {args.edits:.0%} of their tokens edited ({args.edit_kind}), one thread, torch "
          f"{torch.__version__}")
    print("| method | tokens/s | tokens/round | vs K = 0 | same tokens |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['tokens_per_s']:.0f} | {r['tokens_per_round']:.2f} | "
              f"{r['ratio']:.2f}x | {'yes' if r['same_tokens'] else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--edits", type=float, default=0.1,
                        help="the share of the prediction's tokens edited")
    parser.add_argument("--edit-kind", choices=["replace", "mixed"], default="replace",
                        help="replace: single ids replaced; mixed: edits of 1-3 ids, "
                             "replaced, inserted or deleted")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print_table(run(args), args)


if __name__ == "__main__":
    main()
