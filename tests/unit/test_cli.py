"""`specserve generate`: JSON shape, exactness through the CLI, seeds, clear errors."""

import json

import pytest

from specserve.cli import main


def run_generate(pair, *flags) -> int:
    """`specserve generate` on the pair's target and draft; its exit status."""
    return main(["generate", "--target", str(pair / "target"), "--draft", str(pair / "draft"),
                 *flags])


def refusal(capsys, argv) -> str:
    """`specserve argv` refused as argparse refuses a flag (exit 2); its stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def generate_argv(pair, *flags) -> list[str]:
    return ["generate", "--target", str(pair / "target"), "--draft", str(pair / "draft"), *flags]


def generate(capsys, pair, *flags):
    code = run_generate(pair, "--json", "--max-tokens", "16", "--prompt", "def add(", *flags)
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_json_output_has_choices_and_stats(capsys, tiny_pair_dir):
    result = generate(capsys, tiny_pair_dir, "-k", "3")
    choice = result["choices"][0]
    assert isinstance(choice["text"], str) and len(choice["token_ids"]) <= 16
    for key in ("rounds", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                "mean_acceptance_length"):
        assert key in result["stats"]
    stats = result["stats"]
    assert stats["mean_acceptance_length"] == pytest.approx(
        (stats["num_accepted_tokens"] + stats["rounds"]) / stats["rounds"])


def test_the_summary_line_counts_every_token_of_a_round(capsys, tiny_pair_dir):
    """A round without a draft makes plain_steps tokens: 16 in 5 rounds (the first token
    alone, then up to 4 a round) is 3.20 a round, though speculation's mean acceptance
    length is 1 (it has no drafts: no acceptance rate)."""
    code = run_generate(tiny_pair_dir, "--max-tokens", "16", "--prompt", "def add(", "-k", "0",
                        "--plain-steps", "4")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 0 and line.startswith("[5 rounds, acceptance -, 3.20 tokens/round, "), line


def test_several_choices_print_apart(capsys, tiny_pair_dir):
    code = run_generate(tiny_pair_dir, "--max-tokens", "4", "--prompt", "def add(",
                        "--temperature", "1", "--seed", "1", "--n", "2")
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("--- choice 0 ---\ndef add(") and \
        "\n--- choice 1 ---\ndef add(" in out


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_through_the_cli_equals_target_alone(capsys, tiny_pair_dir, drafter):
    alone = generate(capsys, tiny_pair_dir, "-k", "0")
    assert alone["stats"]["num_draft_tokens"] == 0
    steps = generate(capsys, tiny_pair_dir, "-k", "0", "--plain-steps", "3")
    assert steps["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    assert steps["stats"]["plain_step_tokens"] > 0
    for k in ("2", "5"):
        spec = generate(capsys, tiny_pair_dir, "-k", k, "--drafter", drafter)
        assert spec["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]


def test_same_seed_same_samples(capsys, tiny_pair_dir):
    flags = ("--temperature", "1", "--top-k", "50", "--n", "3", "-k", "3")
    first = generate(capsys, tiny_pair_dir, *flags, "--seed", "7")
    second = generate(capsys, tiny_pair_dir, *flags, "--seed", "7")
    ids = [c["token_ids"] for c in first["choices"]]
    assert ids == [c["token_ids"] for c in second["choices"]]
    assert len({tuple(i) for i in ids}) > 1  # the n samples are independent, not copies
    other = generate(capsys, tiny_pair_dir, *flags, "--seed", "8")
    assert ids != [c["token_ids"] for c in other["choices"]]


def test_a_negative_seed_and_a_top_k_of_minus_one_read_as_the_routers(capsys, tiny_pair_dir):
    """The router takes any int64 seed but -1 (none, vLLM's) as its bits and vLLM's top_k -1
    as none; the CLI refused both (the seeds: test_cli_edges, as -1 is unseeded)."""
    flags = ("--temperature", "1", "--n", "2", "-k", "3")
    ids = lambda result: [c["token_ids"] for c in result["choices"]]  # noqa: E731
    assert ids(generate(capsys, tiny_pair_dir, *flags, "--seed", "-2")) == \
        ids(generate(capsys, tiny_pair_dir, *flags, "--seed", "-2"))
    assert ids(generate(capsys, tiny_pair_dir, *flags, "--seed", "3", "--top-k", "-1")) == \
        ids(generate(capsys, tiny_pair_dir, *flags, "--seed", "3", "--top-k", "0"))


def test_a_seeded_sampled_auto_request_repeats(capsys, tiny_pair_dir):
    # an adaptive K would follow this run's timings: the front end pins it to 4, as the
    # router does
    flags = ("--temperature", "1", "--seed", "5", "-k", "auto", "--max-tokens", "32",
             "--ignore-eos")
    first = generate(capsys, tiny_pair_dir, *flags)
    second = generate(capsys, tiny_pair_dir, *flags)
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    assert len(first["choices"][0]["token_ids"]) == 32
    assert max(map(int, first["stats"]["rounds_by_num_speculative_tokens"])) == 4


def test_the_summary_line_counts_the_output_tokens_of_a_stopped_round(capsys, tiny_pair_dir):
    """A stop string ends the output inside a round: tokens/round counts the tokens output
    (as tokens/s does), not those the round made past the stop."""
    flags = ("-k", "4", "--drafter", "ngram")  # the tiny pair's text repeats: it drafts
    full = generate(capsys, tiny_pair_dir, *flags)["choices"][0]["text"]
    flags += ("--stop", full[3:5])
    stopped = generate(capsys, tiny_pair_dir, *flags)
    rounds, tokens = stopped["stats"]["rounds"], stopped["usage"]["completion_tokens"]
    assert stopped["stats"]["num_emitted_tokens"] > tokens  # the round went past the stop
    code = run_generate(tiny_pair_dir, "--max-tokens", "16", "--prompt", "def add(", *flags)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 0 and f", {tokens / rounds:.2f} tokens/round, " in line, line


def test_stop_strings_cut_the_text(capsys, tiny_pair_dir):
    full = generate(capsys, tiny_pair_dir, "-k", "2")["choices"][0]["text"]
    stop = full[3:5]
    cut = generate(capsys, tiny_pair_dir, "-k", "2", "--stop", stop)["choices"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"


BAD_GENERATE_FLAGS = [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "--top-p"),  # the flag, not the request's field (top_p)
    (["--top-k", "-2"], "--top-k"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["-k", "-1"], "num-speculative-tokens"),
    (["-k", "65"], "num-speculative-tokens"),  # over the drafters' bound
    (["--n", "0"], "--n"),
    (["--n", "129"], "--n must be in [1, 128]"),  # the router's bound (an hour, unbounded)
    (["--plain-steps", "0"], "--plain-steps"),
    (["--drafter", "tree"], "invalid choice"),
    (["--temperature", "hot"], "invalid float"),
    (["--threads", "0"], "--threads"),
    (["-k", "4", "--draft-confidence", "auto"], "--draft-confidence auto"),
    (["-k", "auto", "--pipelined", "--draft-confidence", "auto"], "--draft-confidence auto"),
    (["--tree-nodes", "5"], "--tree-width > 1"),
    (["-k", "4", "--tree-width", "3", "--tree-nodes", "3"], "must exceed the tree's main"),
    (["-k", "auto", "--tree-width", "3", "--tree-nodes", "4"], "(4 tokens under -k auto)"),
    (["-k", "64", "--tree-width", "2"], "no room beside a main chain of 64"),
    # a byte that is not UTF-8 in argv (a lone surrogate): the tokenizer's TypeError
    (["--prompt", "ab\udcff"], "--prompt 'ab\\udcff' holds bytes that are not UTF-8"),
    (["--stop", "\udcff"], "--stop '\\udcff' holds bytes"),  # matched nothing
]
BAD_OTHER_FLAGS = [
    (["bench", "--threads", "0"], "--threads"),
    (["bench", "--soak-streams", "0"], "--soak-streams"),
    (["bench", "--soak-seconds", "-5"], "--soak-seconds"),
    (["bench", "--draft-timeout-s", "nan"], "--draft-timeout-s"),
    (["bench", "--soak-sec", "5"], "unrecognized arguments"),  # no abbreviations past its check
    (["build-demo-models", "--quick"], "give --out"),  # not over the bundled pair
    (["build-demo-models", "--threads", "-1"], "--threads"),
]


@pytest.mark.parametrize("argv, message", [(["generate", *flags], message)
                                           for flags, message in BAD_GENERATE_FLAGS]
                         + BAD_OTHER_FLAGS)
def test_bad_flags_exit_non_zero_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_max_tokens_past_the_context_is_refused_before_generating(capsys, tiny_pair_dir):
    argv = generate_argv(tiny_pair_dir, "--prompt", "ab", "--max-tokens", "100000")
    assert "--max-tokens (100000) exceed" in refusal(capsys, argv)


@pytest.mark.parametrize("flags, message", [
    (["--stop-token-id", "-1"], "--stop-token-id must be in [0, "),
    (["--stop-token-id", "999999"], "--stop-token-id must be in [0, "),
    (["--top-k", "999999"], "--top-k must be at most the vocabulary size"),
])
def test_what_the_router_refuses_against_the_target_is_refused_before_loading(
        capsys, monkeypatch, tiny_pair_dir, flags, message):
    """The router answers 400 (deployments.prompts); the CLI ran, ignoring them."""
    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the flags were checked")

    monkeypatch.setattr("engine.models.load_causal_lm", no_weights)
    monkeypatch.setattr("drafter.registry.load_causal_lm", no_weights)
    assert message in refusal(capsys, generate_argv(tiny_pair_dir, "--temperature", "1", *flags))


def test_a_missing_model_is_a_clear_error(capsys, tmp_path):
    missing = str(tmp_path / "nothing")
    argv = ["generate", "--target", missing, "--max-tokens", "2"]
    assert f"no model at {missing!r}" in refusal(capsys, argv)


@pytest.mark.parametrize("argv, message", [
    (["check-gpu", "--device", "gpu"], "--device 'gpu'"),
    (["check-gpu", "--device", "cuda:99"], "--device 'cuda:99'"),  # none, or too few, visible
    (["check-gpu", "--device", "cpu"], "add --small"),  # not the 1B and 8B shapes on a CPU
    (["check-gpu", "--device", "cpu", "--small", "--out", "/nonexistent/x.json"],
     "its folder does not exist"),
    (["bench", "--soak", "--quick", "--pair", "demo"], "--quick, --pair do not apply to --soak"),
    (["bench", "--soak-seconds", "5"], "--soak-seconds does not apply without --soak"),
])
def test_commands_refuse_what_they_cannot_use_before_they_run(capsys, argv, message):
    assert message in refusal(capsys, argv)


@pytest.mark.parametrize("argv", [
    ["generate", "--seed", str(2**63)],  # specserve.cli_args.check_args
    ["generate", "--target", "/nonexistent", "--max-tokens", "2"],  # found by the run
    ["build-demo-models", "--quick"],
    ["check-gpu", "--device", "meta", "--small"],
    ["bench", "--soak-seconds", "5"],
])
def test_a_refusal_after_parsing_reads_as_the_subcommands_own(capsys, argv):
    """As argparse refuses a subcommand's bad value: that subcommand's usage and
    `specserve <command>: error:` (the top-level usage and `specserve: error:` before, or
    no usage at all)."""
    err = refusal(capsys, argv)
    assert err.startswith(f"usage: specserve {argv[0]} [-h]"), err
    assert f"\nspecserve {argv[0]}: error: " in err, err


@pytest.mark.parametrize("flags, message", [
    (["--device", "cpu:0"], "add --small"),  # ran the 1B and 8B shapes on the CPU
    (["--device", "meta", "--small"], "--device 'meta'"),
    (["--device", "cpu", "--small", "--out", "."], "is a folder"),  # failed after the run
])
def test_check_gpu_refuses_before_it_runs(capsys, monkeypatch, flags, message):
    def no_run(*args):
        raise AssertionError("the checks ran")

    monkeypatch.setattr("specserve.check_gpu.run", no_run)
    assert message in refusal(capsys, ["check-gpu", *flags])


def test_check_gpu_refuses_an_out_that_names_a_folder_before_it_runs(capsys, monkeypatch,
                                                                     tmp_path):
    """`--out some/dir/`: Path drops the separator, and the report was written as a file
    named some/dir after the whole run."""
    monkeypatch.setattr("specserve.check_gpu.run", lambda device, small: {"ok": True})
    folder = tmp_path / "reports"
    err = refusal(capsys, ["check-gpu", "--device", "cpu", "--small", "--out", f"{folder}/"])
    assert f"--out: {folder}/ names a folder: name a file" in err
    assert not folder.exists()


@pytest.mark.parametrize("mode", [["--quick", "--pair", "demo"], ["--soak"]])
def test_bench_refuses_an_out_it_cannot_write_before_its_run(capsys, monkeypatch, tmp_path,
                                                             mode):
    def no_run(*args):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr("bench.suite.run", no_run)
    monkeypatch.setattr("bench.soak.main", no_run)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "cannot write there" in refusal(capsys, ["bench", *mode, "--out",
                                                     str(blocker / "results")])


def test_build_demo_models_refuses_an_out_it_cannot_write_before_training(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["build-demo-models", "--quick", "--out", str(blocker / "pair")])
    assert exit_info.value.code == 2 and "cannot write there" in capsys.readouterr().err
