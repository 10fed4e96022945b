"""The `specserve` command: generate in-process, benchmark, build the demo pair."""

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import torch

from specserve.cli_args import (
    FlagError,
    check_args,
    confidence_value,
    k_value,
    positive_int,
    sampling,
    unwritable,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    add_generate_arguments(add_command(
        commands, "generate", help="run the speculative round loop in-process"))

    from bench.suite import build_parser as bench_parser

    bench_parser(add_command(
        commands, "bench", allow_abbrev=False, help="every mode side by side: tokens/s, "
        "acceptance, overhead, bytes (results.json/.md, plots)"))

    from specserve.check_gpu import add_arguments as check_gpu_parser

    check_gpu_parser(add_command(commands, "check-gpu", help="the engine's acceptance run on a "
                                 "device: exactness, batching, forward times, memory"))

    add_build_demo_arguments(add_command(commands, "build-demo-models",
                                         help="train the offline demo pair"))
    return parser


def add_command(commands, name: str, **options) -> argparse.ArgumentParser:
    """The subcommand's parser, which its args carry as `command_parser`: a check after
    parsing refuses through its .error(), as argparse refuses a value of its flags (the
    subcommand's usage, `specserve <name>: error: ...`, exit 2)."""
    command = commands.add_parser(name, **options)
    command.set_defaults(command_parser=command)
    return command


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    from drafter.registry import DRAFTERS
    from engine.models import DEMO_DRAFT, DEMO_TARGET

    parser.add_argument("--target", default=DEMO_TARGET, help="target model (path or hub id)")
    parser.add_argument("--draft", default=DEMO_DRAFT, help="draft model (path or hub id)")
    parser.add_argument("--drafter", choices=sorted(DRAFTERS), default="model",
                        help="; ".join(f"{name}: {kind.help}" for name, kind in DRAFTERS.items()))
    parser.add_argument("--prompt", default="def ", help="prompt text")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = no top-k truncation")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="Hugging Face semantics, on the prompt's and output's tokens")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stop-token-id", type=int, action="append", default=[],
                        help="stop token id besides the checkpoint's end tokens (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="do not stop at the checkpoint's end tokens")
    add_speculation_arguments(parser)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_speculation_arguments(parser: argparse.ArgumentParser) -> None:
    """K, the draft's shape and length, pipelining and the draft distributions' form."""
    from drafter.registry import DrafterSpec

    parser.add_argument("--num-speculative-tokens", "-k", type=k_value, default=4,
                        help="K, tokens drafted per round; 0 = target alone, no drafter call; "
                             "auto = chosen per round from the acceptance so far, in 1..8")
    parser.add_argument("--tree-width", type=k_value, default=1,
                        help="> 1: each round drafts a tree, up to that many children at each "
                             "node of a main chain K deep (sequential rounds); 1 = a chain; "
                             "auto = chain or tree per round by their yields (with -k auto)")
    parser.add_argument("--tree-nodes", type=int, default=None,
                        help="a tree's nodes in all, placed where the draft is least sure "
                             "(default: the width at every node)")
    parser.add_argument("--n", type=int, default=1, help="independent samples")
    parser.add_argument("--plain-steps", type=int, default=4,
                        help="a round without a draft asks the target for this many tokens, "
                             "one forward each (the router's plain_steps)")
    parser.add_argument("--pipelined", action="store_true",
                        help="draft the next block while the target verifies this one (the "
                             "pools overlap only when served; in-process this costs the bonus "
                             "token of fully accepted rounds)")
    parser.add_argument("--draft-top-k", type=int, default=DrafterSpec.draft_top_k,
                        help="truncate each draft distribution to its top entries (0 = off)")
    parser.add_argument("--draft-q-mass", type=float, default=DrafterSpec.draft_q_mass,
                        help="keep the fewest top entries of each draft distribution that hold "
                             "this mass (1 = all)")
    parser.add_argument("--draft-q-dtype", choices=["float32", "float16"],
                        default=DrafterSpec.draft_q_dtype,
                        help="the precision of the draft distributions (as a drafter pool ships)")
    parser.add_argument("--draft-confidence", type=confidence_value,
                        default=DrafterSpec.draft_confidence,
                        help="end a block once its drafted tokens' probabilities multiplied "
                             "fall below this (0 = every block K tokens; auto = learnt from "
                             "acceptance and costs, with -k auto)")


def add_build_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.models import DEMO_TARGET

    parser.add_argument("--out", type=Path, default=None,
                        help=f"where the pair is saved (default: the bundled demo pair, "
                             f"{Path(DEMO_TARGET).parent}; --quick needs its own)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    parser.add_argument("--quick", action="store_true",
                        help="a few steps only (a smoke test; needs --out, so the bundled pair "
                             "is not overwritten)")


def build_engines(args, target):
    """(drafter or None for K = 0, verifier), checked at start-up against the target's
    Checkpoint."""
    from drafter.registry import DRAFTERS, DrafterSpec, build_drafter
    from engine.models import load_causal_lm
    from verifier.engine import ModelVerifier

    spec = DrafterSpec(kind=args.drafter, model=args.draft, target=args.target, dtype=args.dtype,
                       draft_top_k=args.draft_top_k, draft_q_mass=args.draft_q_mass,
                       draft_q_dtype=args.draft_q_dtype,
                       draft_confidence=0.0 if args.draft_confidence == "auto"
                       else args.draft_confidence)
    needed = args.num_speculative_tokens or not DRAFTERS[args.drafter].needs_model
    drafter = build_drafter(spec, target) if needed else None
    return drafter, ModelVerifier(load_causal_lm(args.target, args.dtype))


def check_against_target(args, target, prompt_tokens: int) -> None:
    """ValueError naming the flag for what the router refuses against the target's config
    (deployments.prompts: its context, its vocabulary), before any weights load."""
    limit = target.served_positions
    if limit is not None and prompt_tokens + args.max_tokens > limit:
        raise ValueError(f"the prompt ({prompt_tokens} tokens) plus --max-tokens "
                         f"({args.max_tokens}) exceed the target's context of {limit}")
    vocab = target.vocab_size
    if any(not 0 <= token < vocab for token in args.stop_token_id):
        raise ValueError(f"--stop-token-id must be in [0, {vocab}), got {args.stop_token_id}")
    if args.top_k > vocab:
        raise ValueError(f"--top-k must be at most the vocabulary size ({vocab}); 0 disables "
                         "it")


def generate(args) -> dict:
    """The same request the router serves, in-process: choices with text, token ids, finish
    and stop reasons; usage; the speculative stats."""
    from engine.checkpoint import Checkpoint, end_token_ids, reported_stop_ids, stop_token_ids
    from engine.models import load_tokenizer
    from speculative.driver import Generation, text_decoder

    tokenizer = load_tokenizer(args.target)
    # with the tokenizer's special tokens (a Llama checkpoint's BOS), as a completions prompt
    prompt_ids = tuple(tokenizer(args.prompt)["input_ids"])
    if not prompt_ids:
        raise ValueError("the prompt tokenizes to nothing: give at least one character")
    target = Checkpoint.load(args.target)
    check_against_target(args, target, len(prompt_ids))
    drafter, verifier = build_engines(args, target)
    end_ids = end_token_ids(args.target, tokenizer)
    stop_ids = stop_token_ids(end_ids, args.stop_token_id, args.ignore_eos)
    # the stop ids a stop_reason names, as the router's (an end token's is none)
    reported = reported_stop_ids(end_ids, args.stop_token_id, args.ignore_eos)
    plan = request_front_end(args).plan(uuid.uuid4().hex, prompt_ids, sampling(args), args.n,
                                        stop_ids, drafter_kind=args.drafter,
                                        context_limit=verifier.max_positions)
    decode, done = text_decoder(tokenizer), []
    started = time.perf_counter()
    for choice in plan.choices:
        generation = Generation(choice.request, decode, reported)
        asyncio.run(generation.run(drafter, verifier, choice.policy, plan.pipelined))
        done.append(generation)
    seconds = time.perf_counter() - started
    choices = [{"index": index, "text": g.text, "token_ids": g.token_ids,
                "finish_reason": g.finish_reason, "stop_reason": g.stop_reason}
               for index, g in enumerate(done)]
    usage = plan.usage(done)
    stats = plan.merged_stats(done).as_dict() | {
        "seconds": seconds, "tokens_per_s": usage["completion_tokens"] / seconds}
    return {"choices": choices, "usage": usage, "stats": stats}


def request_front_end(args):
    """The request front end the router uses, under the CLI's defaults: its K (4, or auto in
    1..8; a seeded sampled request pins auto to 4, as the router does) and --pipelined."""
    from speculative.frontend import RequestFrontEnd
    from speculative.options import SpeculationDefaults, TreeShape

    return RequestFrontEnd(SpeculationDefaults(
        num_speculative_tokens=args.num_speculative_tokens,
        pipelined_drafting="on" if args.pipelined else "off",
        tree=TreeShape(auto=True) if args.tree_width == "auto"
        else TreeShape(args.tree_width, nodes=args.tree_nodes),
        draft_confidence="auto" if args.draft_confidence == "auto" else None,
        plain_steps=args.plain_steps))


def build_demo(parser: argparse.ArgumentParser, args) -> int:
    from engine.models import DEMO_TARGET
    from specserve.demo import DemoRecipe, build_demo_models

    if args.quick and args.out is None:
        parser.error("--quick trains a smoke-test pair: give --out (the default is the "
                     "bundled demo pair, which it would overwrite)")
    recipe = DemoRecipe(target_steps=4, draft_steps=4, distill_steps=4) if args.quick \
        else DemoRecipe()
    out = args.out or Path(DEMO_TARGET).parent
    problem = unwritable(out)  # before the training, not after its hour
    if problem:
        parser.error(f"--out {out}: cannot write there ({problem})")
    print(json.dumps(build_demo_models(out, recipe), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command_parser
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if args.command == "build-demo-models":
        return build_demo(command, args)
    if args.command == "generate":
        return generate_command(command, args)
    try:  # their flags' checks before their run
        if args.command == "bench":
            from bench.suite import main as bench

            return bench(args, sys.argv[1:] if argv is None else argv)
        from specserve.check_gpu import main as check_gpu

        return check_gpu(args)
    except FlagError as error:
        command.error(str(error))


def generate_command(command: argparse.ArgumentParser, args) -> int:
    check_args(command, args)
    try:
        result = generate(args)
    except (OSError, ValueError) as error:  # the flags against the target, its files
        command.error(str(error))
    if args.json:
        print(json.dumps(result))
    else:
        for choice in result["choices"]:
            if len(result["choices"]) > 1:  # multi-line completions, told apart
                print(f"--- choice {choice['index']} ---")
            print(args.prompt + choice["text"])
        print(summary(result), file=sys.stderr)
    return 0


def summary(result: dict) -> str:
    """The run in a line: its rounds, acceptance rate (none without drafts), output tokens a
    round (a round without a draft may make several: plain_steps) and speed. Output tokens
    are the completion's, as tokens/s counts them: a stop string's round made more, which
    the output drops."""
    stats, tokens = result["stats"], result["usage"]["completion_tokens"]
    rate = stats["acceptance_rate"]
    per_round = tokens / stats["rounds"] if stats["rounds"] else 0.0
    return (f"[{stats['rounds']} rounds, acceptance "
            f"{'-' if rate is None else f'{rate:.2f}'}, {per_round:.2f} tokens/round, "
            f"{stats['tokens_per_s']:.1f} tokens/s]")


if __name__ == "__main__":
    sys.exit(main())
