"""The `specserve` command: generate in-process, benchmark, build the demo pair."""

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from pathlib import Path

import torch


def build_parser() -> argparse.ArgumentParser:
    from speculative.models import DEMO_DRAFT, DEMO_TARGET

    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="run the speculative round loop in-process")
    gen.add_argument("--target", default=DEMO_TARGET, help="target model (path or hub id)")
    gen.add_argument("--draft", default=DEMO_DRAFT, help="draft model (path or hub id)")
    gen.add_argument("--drafter", choices=["model", "ngram"], default="model")
    gen.add_argument("--prompt", default="def ", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = no top-k truncation")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--num-speculative-tokens", "-k", type=int, default=4,
                     help="K, tokens drafted per round; 0 = target alone, no drafter call")
    gen.add_argument("--n", type=int, default=1, help="independent samples")
    gen.add_argument("--draft-top-k", type=int, default=0,
                     help="truncate each draft distribution to its top entries (0 = off)")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument("--threads", type=int, default=None, help="torch threads")
    gen.add_argument("--json", action="store_true", help="print one JSON object")

    from bench.suite import build_parser as bench_parser

    bench_parser(commands.add_parser("bench", help="every mode side by side: tokens/s, "
                                     "acceptance, overhead, bytes (results.json/.md, plots)"))

    build = commands.add_parser("build-demo-models", help="train the offline demo pair")
    build.add_argument("--out", type=Path, default=Path(DEMO_TARGET).parent)
    build.add_argument("--threads", type=int, default=None, help="torch threads")
    build.add_argument("--quick", action="store_true", help="a few steps only (smoke test)")
    return parser


def build_engines(args, vocab_size: int):
    from drafter.model import ModelDrafter
    from drafter.ngram import NgramDrafter
    from speculative.models import load_causal_lm
    from verifier.engine import ModelVerifier

    verifier = ModelVerifier(load_causal_lm(args.target, args.dtype))
    if args.drafter == "ngram":
        return NgramDrafter(vocab_size), verifier
    draft = load_causal_lm(args.draft, args.dtype) if args.num_speculative_tokens else None
    drafter = ModelDrafter(draft, draft_top_k=args.draft_top_k) if draft is not None else None
    return drafter, verifier


async def decode_text(request, drafter, verifier, k: int, tokenizer):
    """Run one request; returns (text, token_ids, state)."""
    from speculative.loop import RequestState, decode
    from speculative.policy import FixedK
    from speculative.stopping import truncate_at_stop

    state = RequestState(request)
    stop = request.sampling.stop
    decode_ids = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    async with contextlib.aclosing(decode(state, drafter, verifier, FixedK(k))) as rounds:
        async for _ in rounds:
            hit = truncate_at_stop(state.output_token_ids, decode_ids, stop) if stop else None
            if hit is not None:
                state.finish_reason = "stop"
                return hit[0], hit[1], state
    ids = state.output_token_ids
    return decode_ids(ids), ids, state


def generate(args) -> dict:
    from speculative.loop import Request, SpecStats
    from speculative.models import load_tokenizer
    from speculative.sampling import SamplingParams, derive_seeds

    seeds = derive_seeds(args.seed, args.n)
    params = [SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             seed=s, max_tokens=args.max_tokens, stop=tuple(args.stop))
              for s in seeds]
    tokenizer = load_tokenizer(args.target)
    prompt_ids = tuple(tokenizer(args.prompt, add_special_tokens=False)["input_ids"])
    if not prompt_ids:
        raise ValueError("the prompt tokenizes to nothing: give at least one character")
    drafter, verifier = build_engines(args, len(tokenizer))
    stop_ids = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    total = SpecStats()
    choices = []
    started = time.perf_counter()
    for index, sampling in enumerate(params):
        request = Request(uuid.uuid4().hex, prompt_ids, sampling, stop_ids)
        text, ids, state = asyncio.run(
            decode_text(request, drafter, verifier, args.num_speculative_tokens, tokenizer)
        )
        choices.append({"index": index, "text": text, "token_ids": ids,
                        "finish_reason": state.finish_reason})
        total.add(state.stats)
    seconds = time.perf_counter() - started
    num_tokens = sum(len(c["token_ids"]) for c in choices)
    stats = total.as_dict() | {"seconds": seconds, "tokens_per_s": num_tokens / seconds}
    return {"choices": choices, "stats": stats}


def check_args(parser: argparse.ArgumentParser, args) -> None:
    from speculative.sampling import SamplingParams

    if args.num_speculative_tokens < 0:
        parser.error("--num-speculative-tokens must be >= 0")
    if args.n < 1:
        parser.error("--n must be >= 1")
    if args.draft_top_k < 0:
        parser.error("--draft-top-k must be >= 0")
    try:
        SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command == "bench":
        from bench.suite import main as bench

        return bench(args, sys.argv[1:] if argv is None else argv)
    if args.command == "build-demo-models":
        from specserve.demo import DemoRecipe, build_demo_models

        recipe = DemoRecipe(target_steps=4, draft_steps=4, distill_steps=4) if args.quick else DemoRecipe()
        print(json.dumps(build_demo_models(args.out, recipe), indent=2))
        return 0
    check_args(parser, args)
    try:
        result = generate(args)
    except (OSError, ValueError) as error:
        print(f"specserve: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        for choice in result["choices"]:
            print(args.prompt + choice["text"])
        stats = result["stats"]
        print(f"[{stats['rounds']} rounds, acceptance {stats['acceptance_rate']}, "
              f"{stats['mean_acceptance_length']:.2f} tokens/round, "
              f"{stats['tokens_per_s']:.1f} tokens/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
