"""`specserve bench`'s plan and cells (bench/suite.py) on stand-ins for the models and Serve:
what --quick and the full run cover, which requests each mode sends, and what its record
counts (the end-to-end run is in integration)."""

import argparse
import types
from dataclasses import replace

import pytest

from bench import suite, sweep
from bench.pairs import PAIRS, PROMPTS
from bench.sweep import Streamed
from speculative.stats import SpecStats
from tests.tiny import CodePointTokenizer


def spec(rounds: int = 2) -> dict:
    """An HTTP answer's `speculative` object (what stats_from_http reads)."""
    return {"rounds": rounds, "ms_per_round": {"total": 1.0}, "num_drafts": rounds,
            "num_draft_tokens": 2 * rounds, "num_accepted_tokens": rounds,
            "num_emitted_tokens": 2 * rounds, "accepted_per_position": [rounds, 0],
            "wire_bytes_per_round": None, "overhead_ms_p50": 0.5}


class Models:
    """InProcess's stand-in: loop answers `answers[k]` (default: the reference) in 2 s."""

    target, draft = object(), object()

    def __init__(self, reference: list[int], answers: dict | None = None) -> None:
        self.reference, self.answers, self.calls = reference, answers or {}, []

    def loop(self, ids, n, temperature, seed, k, dense_q=False):
        self.calls.append((tuple(ids), n, temperature, seed, k, dense_q))
        out = self.answers.get(k, self.reference)[:n]
        return out, 2.0, SpecStats(rounds=1, num_drafts=1, num_draft_tokens=k,
                                   num_accepted_tokens=k, num_emitted_tokens=k + 1,
                                   accepted_per_position=[1] * k)


class Served:
    """Served's stand-in: complete answers `answers[(k, pipelined)]` (default the reference)
    in 4 s; concurrent answers c copies of the reference in 3 s."""

    url = "http://stand-in"

    def __init__(self, reference: list[int], answers: dict | None = None) -> None:
        self.reference, self.answers, self.calls, self.concurrent_calls = \
            reference, answers or {}, [], []

    def complete(self, ids, n, temperature, seed, k, pipelined=None):
        self.calls.append((tuple(ids), n, temperature, seed, k, pipelined))
        return self.answers.get((k, pipelined), self.reference)[:n], 4.0, spec()

    def concurrent(self, ids, n, temperature, seed, k, c):
        self.concurrent_calls.append((tuple(ids), n, temperature, seed, k, c))
        return [(self.reference[:n], 0.0, spec()) for _ in range(c)], 3.0


@pytest.fixture
def hf_calls(monkeypatch):
    """hf_generate answers the first max_tokens of 1..100 in 1 s; its calls are recorded."""
    calls = []

    def hf_generate(model, ids, n, temperature, seed, draft=None, k=0):
        calls.append((tuple(ids), n, temperature, seed, draft is not None, k))
        return list(range(1, 101))[:n], 1.0

    monkeypatch.setattr(suite, "hf_generate", hf_generate)
    monkeypatch.setattr(suite, "departs_at_tie", lambda *args: False)
    return calls


def quick(**changes) -> suite.Plan:
    """--quick's plan for the demo pair, with `changes`."""
    return replace(suite.Plan.make(True, "demo"), **changes)


def test_quick_and_full_plans_cover_every_pair_k_temperature_and_the_sweep():
    """--quick keeps every pair, both temperatures, K 1 and 4 and the whole concurrency
    sweep at fewer tokens; the full run K 1, 2, 4, 6 with 4 requests at once."""
    fast, full = suite.Plan.make(True, "all"), suite.Plan.make(False, "all")
    assert fast.pairs == full.pairs == tuple(PAIRS) == ("demo", "scaled", "balanced")
    assert (fast.ks, fast.temperatures, fast.num_prompts, fast.max_tokens) == \
        ((1, 4), (0.0, 1.0), 2, 32)
    assert (fast.serve_concurrency, fast.sweep_tokens) == (1, 12)
    assert (full.ks, full.temperatures, full.num_prompts, full.max_tokens) == \
        ((1, 2, 4, 6), (0.0, 1.0), 3, 48)
    assert (full.serve_concurrency, full.sweep_tokens) == (4, 40)
    for plan in (fast, full):
        assert plan.sweep_levels == sweep.LEVELS == (1, 4, 16, 32)
        assert plan.sweep_pairs == ("demo", "scaled")
        assert plan.sweep_requests_per_client == 1 and plan.draft_timeout_s is None
    assert fast.max_tokens < 48 <= full.max_tokens  # run(): methods' quick is max_tokens < 48
    one = suite.Plan.make(True, "scaled", (2, 8))
    assert one.pairs == ("scaled",) and one.sweep_levels == (2, 8)


def test_client_counts_and_the_flags_given():
    """--concurrency: "none" is no sweep, counts are at least 1; given() finds a flag alone
    or with =value, not a longer flag that starts with it."""
    assert suite.client_counts("none") == ()
    assert suite.client_counts("1,4,16") == (1, 4, 16)
    assert suite.client_counts("1") == (1,)
    for wrong in ("0", "2,0", "-1", "a,b", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            suite.client_counts(wrong)
    argv = ["--quick", "--pair=demo", "--concurrency-x", "1"]
    assert suite.given(argv, suite.SUITE_FLAGS) == ["--quick", "--pair"]
    assert suite.given(["--seed", "3"], suite.SOAK_FLAGS) == ["--seed"]


def test_machine_names_the_plan_and_only_the_swept_pairs(monkeypatch):
    """results.json's machine block: the plan's prompts, tokens, K and temperatures, and the
    sweep over the run's pairs that are swept."""
    monkeypatch.setattr("subprocess.run", lambda *a, **k: types.SimpleNamespace(stdout="abc\n"))
    plan = replace(suite.Plan.make(True, "all"), pairs=("demo", "balanced"))
    facts = suite.machine(plan, 3, ["bench", "--quick"])
    assert facts["command"] == "specserve bench --quick" and facts["commit"] == "abc"
    assert (facts["torch_threads"], facts["prompts"], facts["max_tokens"]) == (3, 2, 32)
    assert facts["ks"] == [1, 4] and facts["temperatures"] == [0.0, 1.0]
    assert facts["sweep"] == {"concurrency": [1, 4, 16, 32], "max_tokens": 12,
                              "requests_per_client": 1, "pairs": ["demo"]}


def test_a_greedy_prompt_runs_every_mode_once_at_each_k(hf_calls):
    """Greedy: target_only's tokens are the reference; hf_assisted and inprocess at each K,
    serve_off, serve_sync and serve_pipelined at each K and serve_adaptive, all seeded, each
    counting its own tokens and seconds and compared with the reference."""
    reference = list(range(1, 33))
    models = Models(reference, {4: reference[:-1] + [0]})
    served = Served(reference, {(1, True): reference[:20]})
    bench = suite.PairBench(quick(), models, served, "dense")
    bench.prompt([5, 6], 0.0, seed=1001)
    cells = bench.tallies.cells
    assert set(cells) == {
        ("target_only", 0, 0.0, 1, "dense"), ("hf_assisted", 1, 0.0, 1, "dense"),
        ("hf_assisted", 4, 0.0, 1, "dense"), ("inprocess", 1, 0.0, 1, "dense"),
        ("inprocess", 4, 0.0, 1, "dense"), ("serve_off", 0, 0.0, 1, "dense"),
        ("serve_sync", 1, 0.0, 1, "dense"), ("serve_sync", 4, 0.0, 1, "dense"),
        ("serve_pipelined", 1, 0.0, 1, "dense"), ("serve_pipelined", 4, 0.0, 1, "dense"),
        ("serve_adaptive", "auto", 0.0, 1, "dense")}
    assert hf_calls == [((5, 6), 32, 0.0, 1001, False, 0), ((5, 6), 32, 0.0, 1001, True, 1),
                        ((5, 6), 32, 0.0, 1001, True, 4)]
    assert models.calls == [((5, 6), 32, 0.0, 1001, 1, False), ((5, 6), 32, 0.0, 1001, 4, False)]
    assert served.calls == [((5, 6), 32, 0.0, 1001, k, p) for k, p in
                            [(0, False), (1, False), (1, True), (4, False), (4, True),
                             ("auto", None)]]
    assert served.concurrent_calls == []  # serve_concurrency 1
    target = cells[("target_only", 0, 0.0, 1, "dense")]
    assert (target.requests, target.tokens, target.seconds, target.mismatches) == \
        (1, 32, 1.0, None)
    short = cells[("serve_pipelined", 1, 0.0, 1, "dense")]
    assert (short.tokens, short.seconds, short.mismatches) == (20, 4.0, 1)
    assert cells[("inprocess", 4, 0.0, 1, "dense")].mismatches == 1
    inprocess = cells[("inprocess", 1, 0.0, 1, "dense")]
    assert (inprocess.tokens, inprocess.seconds, inprocess.mismatches) == (32, 2.0, 0)
    assert inprocess.stats.num_draft_tokens == 1
    assert cells[("serve_adaptive", "auto", 0.0, 1, "dense")].mismatches == 0
    assert cells[("serve_off", 0, 0.0, 1, "dense")].stats.rounds == 2
    assert cells[("hf_assisted", 4, 0.0, 1, "dense")].mismatches == 0


def test_a_sampled_prompt_compares_serve_sync_with_inprocess_and_unseeds_adaptive(hf_calls):
    """Sampled: serve_adaptive is sent without a seed (the others with it); serve_sync is
    compared with inprocess at its K (the same draws), serve_off and pipelined are not; with
    a shipped q that is not dense, inprocess runs again with dense q into its own cell."""
    reference = list(range(1, 33))
    models = Models(reference, {4: reference[:10]})
    served = Served(reference)
    bench = suite.PairBench(quick(), models, served, "mass0.99-float16")
    bench.prompt([5], 1.0, seed=7)
    seeds = {(k, p): seed for _, _, _, seed, k, p in served.calls}
    assert seeds == {(0, False): 7, (1, False): 7, (1, True): 7, (4, False): 7, (4, True): 7,
                     ("auto", None): None}
    assert [(k, dense) for *_, k, dense in models.calls] == \
        [(1, False), (1, True), (4, False), (4, True)]
    cells, q = bench.tallies.cells, "mass0.99-float16"
    assert cells[("serve_sync", 1, 1.0, 1, q)].mismatches == 0
    assert cells[("serve_sync", 4, 1.0, 1, q)].mismatches == 1  # inprocess K = 4 differed
    assert cells[("serve_pipelined", 4, 1.0, 1, q)].mismatches is None
    assert cells[("serve_off", 0, 1.0, 1, q)].mismatches is None
    assert cells[("inprocess", 4, 1.0, 1, q)].mismatches is None
    assert cells[("hf_assisted", 1, 1.0, 1, "dense")].mismatches is None
    dense = cells[("inprocess", 4, 1.0, 1, "dense")]
    assert (dense.requests, dense.tokens, dense.seconds) == (1, 10, 2.0)
    assert ("hf_assisted", 4, 1.0, 1, q) not in cells  # HF assisted generation's q is dense
    shipped_dense = suite.PairBench(quick(), Models(reference), Served(reference), "dense")
    shipped_dense.prompt([5], 1.0, seed=7)
    assert [dense for *_, dense in shipped_dense.models.calls] == [False, False]


def test_concurrent_cells_count_every_request_and_the_cells_wall_time(hf_calls):
    """serve_concurrency > 1: serve_off and serve_sync at K = 4 with that many requests at
    once; the cell has c requests a prompt, their tokens and each batch's seconds once,
    summed over the prompts."""
    reference = list(range(1, 49))
    served = Served(reference)
    bench = suite.PairBench(suite.Plan.make(False, "demo"), Models(reference), served, "dense")
    bench.prompt([9], 0.0, seed=3)
    assert served.concurrent_calls == [((9,), 48, 0.0, 3, 0, 4), ((9,), 48, 0.0, 3, 4, 4)]
    assert len(served.calls) == 1 + 2 * 4 + 1  # off, sync and pipelined at K 1 2 4 6, auto
    bench.prompt([8], 0.0, seed=4)
    for mode, k in (("serve_off", 0), ("serve_sync", 4)):
        cell = bench.tallies.cells[(mode, k, 0.0, 4, "dense")]
        assert (cell.requests, cell.tokens, cell.seconds) == (2 * 4, 2 * 4 * 48, 2 * 3.0)
        assert cell.stats.rounds == 2 * 4 * 2 and len(cell.overhead_p50s) == 2 * 4


def test_bench_pair_runs_each_temperature_and_prompt_with_its_seed(monkeypatch):
    """bench_pair: the plan's first num_prompts prompts, warm-up on the first, every
    (temperature, prompt) with seed 1000 + index, then the sweep only for a swept pair."""
    runs, swept = [], []

    class Bench:
        def __init__(self, plan, models, served, draft_q):
            self.tallies = types.SimpleNamespace(
                records=lambda name, facts: [{"pair": name, "facts": facts}])

        def warm_up(self, ids):
            runs.append(("warm", tuple(ids)))

        def prompt(self, ids, temperature, seed):
            runs.append((tuple(ids), temperature, seed))

    monkeypatch.setattr(suite, "resolve", lambda pair, plan, repeats: (pair, {"r": repeats}))
    monkeypatch.setattr(suite, "load_tokenizer", lambda name: CodePointTokenizer())
    monkeypatch.setattr(suite, "InProcess", lambda pair, q: Models([]))
    monkeypatch.setattr(suite, "pair_facts", lambda *args: {"c": 0.1})
    monkeypatch.setattr(suite, "PairBench", Bench)
    monkeypatch.setattr(suite, "sweep_pair", lambda name, *a: swept.append(name) or ["sw"])
    served = types.SimpleNamespace(draft_q_options=lambda: {"draft_q_mass": 0.99},
                                   use=lambda pair: None)
    ids = [tuple(CodePointTokenizer()(p)["input_ids"]) for p in PROMPTS]
    records, facts = suite.bench_pair(PAIRS["demo"], quick(), served)
    assert runs == [("warm", ids[0]), (ids[0], 0.0, 1000), (ids[1], 0.0, 1001),
                    (ids[0], 1.0, 1000), (ids[1], 1.0, 1001)]
    assert facts == {"c": 0.1, "r": 5, "draft_q": "mass0.99-float32"}
    assert records == [{"pair": "demo", "facts": facts}, "sw"] and swept == ["demo"]
    runs.clear()
    records, _ = suite.bench_pair(PAIRS["balanced"], suite.Plan.make(False, "all"), served)
    assert len(runs) == 1 + 2 * 3 and records[-1] != "sw" and swept == ["demo"]
    suite.bench_pair(PAIRS["demo"], quick(sweep_levels=()), served)
    assert swept == ["demo"]  # --concurrency none


def test_sweep_pair_sends_distinct_prompts_off_then_auto_at_each_level(monkeypatch, hf_calls):
    """The sweep: max(levels) x per_client distinct prompts, each cell the first clients x
    per_client of them, serve_off then serve_adaptive; a record per cell with the cell's
    wall time, every request's tokens and its match with the target's greedy tokens."""
    cells = []

    def run_cell(url, prompts, clients, n, k):
        cells.append((len(prompts), clients, n, k))
        short = k == "auto" and clients == 4
        return [Streamed(list(range(1, n + 1))[: n - short], 0.1, 0.5, spec())
                for _ in prompts], 2.0 * clients

    monkeypatch.setattr(sweep, "run_cell", run_cell)
    plan = quick(sweep_levels=(1, 4), sweep_requests_per_client=2)
    records = suite.sweep_pair("demo", plan, Served([]), Models([]), CodePointTokenizer(),
                               {"c": 0.2})
    assert len(hf_calls) == 8 and len({ids for ids, *_ in hf_calls}) == 8
    assert hf_calls[3][0][:4] == tuple(ord(c) for c in "# 3\n")
    assert {(n, t, seed) for _, n, t, seed, _, _ in hf_calls} == {(12, 0.0, 0)}
    assert cells == [(2, 1, 12, 0), (2, 1, 12, "auto"), (8, 4, 12, 0), (8, 4, 12, "auto")]
    assert [(r["mode"], r["k"], r["concurrency"]) for r in records] == \
        [("serve_off", 0, 1), ("serve_adaptive", "auto", 1), ("serve_off", 0, 4),
         ("serve_adaptive", "auto", 4)]
    last = records[-1]
    assert (last["requests"], last["tokens"], last["seconds"]) == (8, 8 * 11, 8.0)
    assert last["tokens_per_s"] == 11.0 and last["stream"] is True
    assert last["greedy_matches_target"] is False and records[2]["greedy_matches_target"]
    assert last["ttft_ms_p50"] == 100.0
