"""The `specserve generate` flags' types and the checks run on them before any model loads
(a bad value exits 2 naming its flag), and the write check of the commands that write their
results at the end."""

import argparse
import os
import re
from pathlib import Path


class FlagError(ValueError):
    """A command's flags refused by a check after parsing (the file system, the device, flags
    together): the command's parser reports it as it reports a bad value (specserve.cli)."""


def sampling(args):
    """The request's sampling parameters (its seed; each choice's is derived from it), read
    as the router reads a request's: a top-k of -1 is none (vLLM's), a seed of -1 none
    (vLLM's), another negative seed its int64 bits, a positive temperature below 1e-2
    raised to it (deployments.openai_api)."""
    from speculative.sampling import SamplingParams, served_temperature

    top_k = 0 if args.top_k == -1 else args.top_k
    seed = None if args.seed in (None, -1) else args.seed % 2**64
    return SamplingParams(temperature=served_temperature(args.temperature), top_k=top_k,
                          top_p=args.top_p, min_p=args.min_p, seed=seed,
                          max_tokens=args.max_tokens,
                          stop=tuple(args.stop),
                          presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty)


def confidence_value(text: str) -> float | str:
    if text == "auto":
        return text
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) or auto, got {text}")
    return value


def positive(kind: type):
    """An argparse type: a finite number of `kind` (int or float) above 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not 0 < value < float("inf"):
            what = "an integer >= 1" if kind is int else "a number > 0"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int, positive_float = positive(int), positive(float)


def file_path(text: str) -> Path:
    """An argparse type: a file's path. One ending in a separator names a folder, which Path
    drops: the file was written under the folder's name (or failed after the run)."""
    if text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"{text} names a folder: name a file")
    return Path(text)


def k_value(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {text!r}") from None


def check_args(parser: argparse.ArgumentParser, args) -> None:
    from speculative.options import (
        MAX_PLAIN_STEPS,
        MAX_SPECULATIVE_TOKENS,
        MAX_TREE_WIDTH,
        SpeculationDefaults,
    )

    k = args.num_speculative_tokens
    if k != "auto" and not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        parser.error(f"--num-speculative-tokens must be in [0, {MAX_SPECULATIVE_TOKENS}]")
    from deployments.request_bounds import MAX_CHOICES

    if not 1 <= args.n <= MAX_CHOICES:  # the router's bound on n
        parser.error(f"--n must be in [1, {MAX_CHOICES}]")
    if args.max_tokens < 1:  # 0 decodes nothing: the router's echo alone serves it
        parser.error("--max-tokens must be >= 1")
    if args.seed is not None and not -2**63 <= args.seed < 2**63:  # the router's: int64
        parser.error("--seed must be a 64-bit signed integer (-1: none)")
    if not 1 <= args.plain_steps <= MAX_PLAIN_STEPS:
        parser.error(f"--plain-steps must be in [1, {MAX_PLAIN_STEPS}]")
    if args.tree_width == "auto" and (args.num_speculative_tokens != "auto" or args.pipelined
                                      or args.tree_nodes is not None):
        parser.error("--tree-width auto chooses each round's shape for -k auto without "
                     "--pipelined, and takes no --tree-nodes")
    if args.tree_width != "auto" and not 1 <= args.tree_width <= MAX_TREE_WIDTH:
        parser.error(f"--tree-width must be in [1, {MAX_TREE_WIDTH}]")
    if args.tree_nodes is not None and not 1 <= args.tree_nodes <= 64:
        parser.error("--tree-nodes must be in [1, 64]")
    if args.tree_nodes is not None and args.tree_width == 1:
        parser.error("--tree-nodes shapes a tree: give --tree-width > 1")
    chain = k if k != "auto" else SpeculationDefaults().seeded_num_speculative_tokens
    if args.tree_width not in (1, "auto") and args.tree_nodes is None and \
            chain >= MAX_SPECULATIVE_TOKENS:
        parser.error(f"a tree's {MAX_SPECULATIVE_TOKENS} nodes leave no room beside a main "
                     f"chain of {chain}: give -k below {MAX_SPECULATIVE_TOKENS}")
    if args.tree_nodes is not None and args.tree_nodes <= chain:
        parser.error(f"--tree-nodes ({args.tree_nodes}) must exceed the tree's main chain "
                     f"({chain} tokens{' under -k auto' if k == 'auto' else ''}): a chain "
                     "alone is -k without a tree")
    if args.draft_confidence == "auto" and (k != "auto" or args.pipelined):
        parser.error("--draft-confidence auto is learnt for -k auto without --pipelined; "
                     "give a number in [0, 1) instead")
    if args.draft_top_k < 0:
        parser.error("--draft-top-k must be >= 0")
    if not 0 < args.draft_q_mass <= 1:
        parser.error("--draft-q-mass must be in (0, 1]")
    try:
        sampling(args)
    except ValueError as error:
        parser.error(flags_named(str(error)))
    check_texts(parser, args)


def flags_named(message: str) -> str:
    """SamplingParams' errors ('; '-joined) with the fields the flags set named as the flags:
    'top_p must be ...' reads '--top-p must be ...'."""
    fields = "temperature|top_k|top_p|min_p|presence_penalty|frequency_penalty|" \
        "repetition_penalty|stop|seed|max_tokens"
    return re.sub(rf"(^|; )({fields}) must",
                  lambda found: f"{found[1]}--{found[2].replace('_', '-')} must", message)


def check_texts(parser: argparse.ArgumentParser, args) -> None:
    """argv's bytes that are not UTF-8 reach Python as lone surrogates: the tokenizer raised
    a TypeError on such a prompt, and such a stop string never matched (the router refuses
    both with the same check)."""
    from deployments.chat_messages import encodable

    for flag, text in [("--prompt", args.prompt), *(("--stop", stop) for stop in args.stop)]:
        try:
            encodable(text, flag)
        except ValueError:
            parser.error(f"{flag} {text!r} holds bytes that are not UTF-8")


def unwritable(out: Path) -> str | None:
    """Why nothing could be written in the folder out (made if missing), or None: a command
    that writes its results at the end asks before its run."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".specserve-write-check"
        probe.touch()
        probe.unlink()
    except OSError as error:
        return error.strerror or str(error)
    return None
