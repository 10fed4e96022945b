"""Edges of `specserve generate`'s flags, each at its exact bound: one past it exits 2 naming the
flag, the bound itself is taken (checked before any model loads: specserve.cli_args.check_args
and specserve.cli.check_against_target)."""

from types import SimpleNamespace

import pytest

from specserve.cli import build_parser, check_against_target, main, request_front_end, summary
from specserve.cli_args import check_args, sampling
from speculative.options import MAX_PLAIN_STEPS, MAX_TREE_WIDTH, TreeShape


def checked(*flags):
    """The generate args after the CLI's checks (SystemExit(2) where they refuse)."""
    parser = build_parser()
    args = parser.parse_args(["generate", *flags])
    check_args(parser, args)
    return args


@pytest.mark.parametrize("flags, message", [
    (["--plain-steps", str(MAX_PLAIN_STEPS + 1)], "--plain-steps must be in [1, 64]"),
    (["--tree-width", str(MAX_TREE_WIDTH + 1)], "--tree-width must be in [1, 8]"),
    (["--tree-width", "2", "--tree-nodes", "65"], "--tree-nodes must be in [1, 64]"),
    (["-k", "auto", "--tree-width", "auto", "--pipelined"], "--tree-width auto"),
    (["--draft-confidence", "1"], "must be in [0, 1) or auto"),  # a drafter refuses 1
    (["--draft-top-k", "-1"], "--draft-top-k must be >= 0"),
    (["--draft-q-mass", "0"], "--draft-q-mass must be in (0, 1]"),
    (["--draft-q-mass", "1.5"], "--draft-q-mass must be in (0, 1]"),
    (["--seed", str(2**63)], "--seed must be a 64-bit signed integer"),  # the router's 400
    (["--seed", str(-2**63 - 1)], "--seed must be a 64-bit signed integer"),
    # the sampling parameters' own checks, named by the flag, not the request's field
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or in"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-k", "-2"], "--top-k must be an integer >= 0"),
    (["--min-p", "2"], "--min-p must be in [0, 1]"),
    (["--presence-penalty", "nan"], "--presence-penalty must be in [-2, 2]"),
    (["--frequency-penalty", "3"], "--frequency-penalty must be in [-2, 2]"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be in [0.01, 100.0]"),
    (["--stop", ""], "--stop must be a list of non-empty strings"),
])
def test_one_past_each_bound_exits_2_naming_the_flag(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        checked(*flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_each_bound_itself_is_taken():
    assert checked("--plain-steps", str(MAX_PLAIN_STEPS)).plain_steps == MAX_PLAIN_STEPS
    assert checked("--tree-width", str(MAX_TREE_WIDTH)).tree_width == MAX_TREE_WIDTH
    assert checked("-k", "4", "--tree-width", "2", "--tree-nodes", "64").tree_nodes == 64
    assert checked("-k", "4", "--tree-width", "2", "--tree-nodes", "5").tree_nodes == 5
    assert checked("-k", "63", "--tree-width", "2").num_speculative_tokens == 63
    assert checked("-k", "auto", "--tree-width", "auto").tree_width == "auto"
    assert checked("--draft-confidence", "0.999").draft_confidence == 0.999
    assert checked("--draft-q-mass", "1", "--draft-top-k", "0").draft_q_mass == 1.0


def test_a_positive_float_flag_refuses_infinity_and_nan(capsys):
    """bench's --draft-timeout-s: a finite number above 0 (an infinite deadline never fires)."""
    for value in ("inf", "nan", "0"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "--draft-timeout-s", value])
        assert "--draft-timeout-s" in capsys.readouterr().err


def target(context: int | None = 32, vocab: int = 100):
    return SimpleNamespace(served_positions=context, vocab_size=vocab)


def generate_args(**fields):
    return SimpleNamespace(**({"max_tokens": 8, "stop_token_id": [], "top_k": 0} | fields))


def test_the_prompt_and_max_tokens_may_fill_the_context_exactly():
    check_against_target(generate_args(max_tokens=22), target(context=32), 10)
    with pytest.raises(ValueError, match=r"--max-tokens \(23\) exceed the target's context"):
        check_against_target(generate_args(max_tokens=23), target(context=32), 10)
    check_against_target(generate_args(max_tokens=10**6), target(context=None), 10)  # none


def test_stop_token_ids_and_top_k_are_bounded_by_the_vocabulary_itself():
    check_against_target(generate_args(stop_token_id=[0, 99], top_k=100), target(vocab=100), 1)
    with pytest.raises(ValueError, match=r"--stop-token-id must be in \[0, 100\)"):
        check_against_target(generate_args(stop_token_id=[100]), target(vocab=100), 1)
    with pytest.raises(ValueError, match="--top-k must be at most the vocabulary size"):
        check_against_target(generate_args(top_k=101), target(vocab=100), 1)


def test_the_summary_line_without_drafts_or_rounds():
    result = {"usage": {"completion_tokens": 0},
              "stats": {"rounds": 0, "acceptance_rate": None, "tokens_per_s": 0.0}}
    assert summary(result) == "[0 rounds, acceptance -, 0.00 tokens/round, 0.0 tokens/s]"
    result = {"usage": {"completion_tokens": 9},
              "stats": {"rounds": 3, "acceptance_rate": 0.5, "tokens_per_s": 12.34}}
    assert summary(result) == "[3 rounds, acceptance 0.50, 3.00 tokens/round, 12.3 tokens/s]"


def test_an_error_of_the_run_is_exit_2_with_the_message(capsys, monkeypatch):
    def refused(args):
        raise ValueError("the prompt tokenizes to nothing")

    monkeypatch.setattr("specserve.cli.generate", refused)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("usage: specserve generate [-h]")
    assert err.endswith("\nspecserve generate: error: the prompt tokenizes to nothing\n")


def test_one_choice_prints_the_prompt_and_its_text_without_a_header(capsys, monkeypatch):
    result = {"choices": [{"index": 0, "text": "pass"}], "usage": {"completion_tokens": 2},
              "stats": {"rounds": 1, "acceptance_rate": 1.0, "tokens_per_s": 4.0}}
    monkeypatch.setattr("specserve.cli.generate", lambda args: result)
    assert main(["generate", "--prompt", "def f(): "]) == 0
    out = capsys.readouterr()
    assert out.out == "def f(): pass\n"
    assert out.err == "[1 rounds, acceptance 1.00, 2.00 tokens/round, 4.0 tokens/s]\n"


def test_the_front_end_carries_the_speculation_flags():
    defaults = request_front_end(checked("--pipelined", "-k", "3", "--plain-steps", "7")).defaults
    assert (defaults.pipelined_drafting, defaults.num_speculative_tokens,
            defaults.plain_steps) == ("on", 3, 7)
    defaults = request_front_end(checked("--tree-width", "2", "--tree-nodes", "5")).defaults
    assert defaults.pipelined_drafting == "off" and defaults.tree == TreeShape(2, nodes=5)


def test_a_seed_of_minus_one_is_none_as_the_routers():
    """The router reads `seed: -1` as no seed (vLLM's) and any other int64 as its bits; the
    CLI took -1 for the seed 2**64 - 1, repeating what the router draws anew."""
    sampled = ("--temperature", "1")
    assert sampling(checked(*sampled, "--seed", "-1")).seed is None
    assert sampling(checked(*sampled, "--seed", "-2")).seed == 2**64 - 2
    assert sampling(checked(*sampled, "--seed", str(2**63 - 1))).seed == 2**63 - 1
