"""The speculation methods beside the default chain, as rows of `specserve bench`: draft trees
against chains at equal node budgets (bench.trees), the model-free drafters on repetitive
work (bench.model_free) and draft length by confidence (bench.confidence), in this process
on the demo pair, after the served modes (the same prompts and token counts as the run;
--quick keeps a few shapes, greedy only)."""

from argparse import Namespace

from bench import confidence, model_free, trees
from bench.pairs import PAIRS, PROMPTS

QUICK_SHAPES = ("target alone", "chain K=4", "chain K=8", "tree w2 d4 n8", "tree w2 d6 n8",
                "K=auto tree=auto")


def run(num_prompts: int, max_tokens: int, quick: bool) -> dict:
    shapes = [m for m in trees.methods() if not quick or m[0] in QUICK_SHAPES]
    prompts = PROMPTS[:num_prompts]
    temperatures = (0.0,) if quick else (0.0, 1.0)
    return {"trees": {f"{t:g}": trees.rows_of(PAIRS["demo"], shapes, prompts, max_tokens, t)
                      for t in temperatures},
            "model_free": model_free.run(Namespace(max_tokens=max_tokens, k=4)),
            "confidence": confidence.run("demo", max_tokens, quick, num_prompts)}


def markdown_lines(methods: dict) -> list[str]:
    lines = ["## Methods (demo pair, in process)", "",
             "Draft trees against chains at equal node budgets (`python -m bench.trees` for "
             "every shape, `--pair scaled`):", "",
             "| T | method | nodes verified/round | tokens/round | tokens/s | speedup | "
             "same tokens |", "|---|---|---|---|---|---|---|"]
    for temperature, rows in methods["trees"].items():
        for r in rows:
            same = "–" if r["same_tokens"] is None else "yes" if r["same_tokens"] else "NO"
            lines.append(f"| {temperature} | {r['method']} | {r['nodes_per_round']:.2f} | "
                         f"{r['tokens_per_round']:.2f} | {r['tokens_per_s']:.0f} | "
                         f"{r['speedup']:.2f}x | {same} |")
    lines += ["", "Model-free drafting on repetitive work (`python -m bench.model_free`), "
              "greedy, K = 4:", "", "| pass | workload | method | tokens/round | tokens/s | "
              "speedup | same tokens |", "|---|---|---|---|---|---|---|"]
    for r in methods["model_free"]:
        lines.append(f"| {r['pass']} | {r['workload']} | {r['method']} | "
                     f"{model_free.shown(r['tokens_per_round'], '.2f')} | "
                     f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    lines += ["", "Draft length by confidence (`python -m bench.confidence`), greedy, the "
              "second of two passes:", ""]
    return lines + confidence.markdown_lines(methods.get("confidence", [])) + [""]
