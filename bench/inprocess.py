"""First in-process figures: the demo pair with and without speculation, side by side.

    python -m bench.inprocess [--max-tokens 128] [--threads 2] [--ks 2 4 8]

Every mode decodes the same prompts, interleaved prompt by prompt so that machine drift hits
all modes alike. Prints one table: tokens/s, the speedup over target alone (our loop with
K = 0) at the same temperature, the measured acceptance rate alpha, tokens per round and the
formula's tokens per round (1 - alpha^(K+1)) / (1 - alpha).
"""

import argparse
import asyncio
import time
import uuid

import torch
from tqdm import tqdm

from drafter.model import ModelDrafter
from specserve.cli import decode_text
from speculative.loop import Request, SpecStats
from speculative.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm, load_tokenizer
from speculative.sampling import SamplingParams
from verifier.engine import ModelVerifier

PROMPTS = [
    "import os\n",
    "def main():\n",
    "class Config:\n",
    "    def __init__(self",
    "for i in range(",
    'if __name__ == "__main__":\n',
    "from collections import",
    "        return self.",
]


def expected_tokens_per_round(alpha: float | None, k: int) -> float | None:
    if alpha is None:
        return None
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def hf_generate_seconds(model, prompt_ids, max_tokens: int) -> float:
    ids = torch.tensor([prompt_ids])
    started = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                   max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer(DEMO_TARGET)
    target = load_causal_lm(DEMO_TARGET, args.dtype)
    drafter = ModelDrafter(load_causal_lm(DEMO_DRAFT, args.dtype))
    verifier = ModelVerifier(target)
    modes = [(t, k) for t in (0.0, 1.0) for k in [0, *args.ks]]
    stats = {mode: SpecStats() for mode in modes}
    tokens = dict.fromkeys(modes, 0)
    seconds = dict.fromkeys(modes, 0.0)
    hf_tokens, hf_seconds = 0, 0.0

    for index, prompt in enumerate(tqdm(PROMPTS, desc="prompts")):
        prompt_ids = tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        hf_seconds += hf_generate_seconds(target, prompt_ids, args.max_tokens)
        hf_tokens += args.max_tokens
        for temperature, k in modes:
            params = SamplingParams(temperature=temperature, seed=index,
                                    max_tokens=args.max_tokens)
            request = Request(uuid.uuid4().hex, prompt_ids, params)  # no EOS: fixed lengths
            started = time.perf_counter()
            _, ids, state = asyncio.run(decode_text(request, drafter, verifier, k, tokenizer))
            seconds[(temperature, k)] += time.perf_counter() - started
            tokens[(temperature, k)] += len(ids)
            stats[(temperature, k)].add(state.stats)

    print(f"\ndemo pair, {args.dtype}, {args.threads} threads, {len(PROMPTS)} prompts x "
          f"{args.max_tokens} tokens")
    print(f"HF generate, target alone, greedy: {hf_tokens / hf_seconds:.1f} tokens/s\n")
    print("| temperature | K | tokens/s | speedup | alpha | tokens/round | formula |")
    print("|---|---|---|---|---|---|---|")
    for temperature, k in modes:
        rate = tokens[(temperature, k)] / seconds[(temperature, k)]
        base = tokens[(temperature, 0)] / seconds[(temperature, 0)]
        s = stats[(temperature, k)]
        formula = expected_tokens_per_round(s.acceptance_rate, k)
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"| {temperature:g} | {k} | {rate:.1f} | {rate / base:.2f}x | "
              f"{fmt(s.acceptance_rate)} | {fmt(s.mean_acceptance_length)} | {fmt(formula)} |")


if __name__ == "__main__":
    main()
