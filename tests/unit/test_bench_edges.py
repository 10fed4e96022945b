"""Edges of `specserve bench`'s derived figures on hand-made tallies (bench.records,
bench.costs, bench.report): which record names a q and which comparison, per-round figures
over rounds without drafts, the formula's verify cost, the report's order and labels."""

import pytest
import torch

from bench import costs, report
from bench.costs import round_cost
from bench.pairs import PAIRS
from bench.records import FIELDS, Tallies, Tally, add_speedups, describe_q, record
from bench.report import same_tokens, vs_off
from speculative.stats import SpecStats

FACTS = {"c": 0.25}


def test_only_a_sampled_record_of_a_mode_that_drafts_names_its_q():
    tally = Tally(1, 10, 0.1)
    assert record("demo", "serve_sync", 4, 1.0, 1, tally, FACTS, "dense")["draft_q"] == "dense"
    for mode, k, temperature in [("serve_off", 0, 1.0), ("target_only", 0, 1.0),
                                 ("serve_sync", 4, 0.0)]:
        assert record("demo", mode, k, temperature, 1, tally, FACTS, "dense")["draft_q"] is None


def test_a_sampled_comparison_is_named_as_the_inprocess_one():
    tally = Tally(1, 10, 0.1)
    tally.compare([1, 3], [1, 2])
    rec = record("demo", "serve_sync", 2, 1.0, 1, tally, FACTS)
    assert rec["sampled_matches_inprocess"] is False
    assert rec["greedy_matches_target"] is None and rec["greedy_departures_at_ties"] is None


def test_per_round_figures_count_every_round_and_k_positions():
    """Of 10 rounds, 4 drafted (the rest plain): bytes are per round, acceptance by position
    per draft, over the cell's K positions only."""
    stats = SpecStats(rounds=10, num_drafts=4, num_draft_tokens=8, num_accepted_tokens=4,
                      num_emitted_tokens=18, accepted_per_position=[3, 1, 0],
                      wire_bytes=1000)
    tally = Tally()
    tally.add(tokens=18, seconds=1.0, stats=stats)
    rec = record("demo", "serve_sync", 2, 0.0, 1, tally, FACTS)
    assert rec["wire_bytes_per_round"] == 100.0
    assert rec["acceptance_by_position"] == [0.75, 0.25]
    adaptive = record("demo", "serve_adaptive", "auto", 0.0, 1, tally, FACTS)
    assert adaptive["acceptance_by_position"] == [0.75, 0.25, 0.0]  # every position seen


def test_a_round_costs_its_measured_verify_of_k_plus_one_tokens_and_k_drafts():
    facts = {"c": 0.25, "verify_cost": {"1": 1.0, "3": 1.5, "5": 2.0}}
    assert round_cost(facts, 2) == pytest.approx(1.5 + 2 * 0.25)
    assert round_cost(facts, 4) == pytest.approx(2.0 + 4 * 0.25)
    assert round_cost({"c": 0.25}, 3) == pytest.approx(1.0 + 3 * 0.25)  # not measured: free


def test_cells_are_reported_by_temperature_mode_k_with_auto_last_and_dense_q_last():
    tallies = Tallies("mass0.99-float16")
    for mode, k, temperature, q in [("serve_adaptive", "auto", 0.0, None),
                                    ("serve_sync", 4, 1.0, "dense"), ("serve_sync", 4, 1.0, None),
                                    ("serve_sync", 8, 0.0, None), ("serve_sync", 2, 0.0, None),
                                    ("target_only", 0, 0.0, None)]:
        tallies.cell(mode, k, temperature, q=q).add(10, 0.1)
    order = [(r["temperature"], r["mode"], r["k"], r["draft_q"])
             for r in tallies.records("demo", FACTS)]
    assert order == [(0.0, "target_only", 0, None), (0.0, "serve_sync", 2, None),
                     (0.0, "serve_sync", 8, None), (0.0, "serve_adaptive", "auto", None),
                     (1.0, "serve_sync", 4, "mass0.99-float16"), (1.0, "serve_sync", 4, "dense")]


@pytest.mark.parametrize("options, label", [
    ({}, "dense"), ({"draft_q_mass": 1.0, "draft_q_dtype": "float32"}, "dense"),
    ({"draft_q_mass": 0.99, "draft_q_dtype": "float16"}, "mass0.99-float16"),
    ({"draft_top_k": 32, "draft_q_mass": 1.0}, "top32-float32"),
    ({"draft_q_dtype": "float16"}, "float16"),
])
def test_the_q_label_names_only_what_truncates_or_rounds(options, label):
    assert describe_q(options) == label


def test_the_report_cells_say_of_off_and_the_ties_apart():
    rec = {"speedup": 2.0, "speedup_vs_off": 0.5, "greedy_matches_target": True,
           "greedy_departures_at_ties": 0, "sampled_matches_inprocess": None}
    assert vs_off(rec) == " (0.50x of off)" and vs_off(rec | {"speedup_vs_off": None}) == ""
    assert same_tokens(rec) == "yes"
    assert same_tokens(rec | {"greedy_departures_at_ties": 1}) == "yes (1 at a tie)"
    assert same_tokens(rec | {"greedy_matches_target": False, "greedy_departures_at_ties": 2}) \
        == "NO (2 at ties)"
    assert same_tokens(rec | {"greedy_matches_target": None,
                              "sampled_matches_inprocess": False}) == "NO"


def test_a_record_keeps_its_rate_to_two_places_and_the_medians_of_its_requests():
    """tokens/s to 0.01 and seconds to 0.001; overhead and exposed: the median over requests
    of their medians (one slow request does not move it)."""
    tally = Tally()
    for overhead in (1.0, 2.0, 9.0):
        tally.add(100, 3.14159 / 3, overhead_p50=overhead, exposed_p50=overhead + 1)
    rec = record("demo", "serve_sync", 2, 0.0, 1, tally, FACTS)
    assert (rec["seconds"], rec["tokens_per_s"]) == (3.142, 95.49)
    assert (rec["overhead_ms_p50"], rec["exposed_ms_p50"]) == (2.0, 3.0)


def test_only_a_fixed_k_has_the_formula():
    """serve_adaptive's K changes round by round: no E[N] or predicted speedup of one K."""
    stats = SpecStats(rounds=4, num_drafts=4, num_draft_tokens=8, num_accepted_tokens=4,
                      num_emitted_tokens=12, accepted_per_position=[3, 1])
    tally = Tally()
    tally.add(12, 0.1, stats)
    facts = {"c": 0.25, "verify_cost": {"1": 1.0, "3": 1.5}}
    adaptive = record("demo", "serve_adaptive", "auto", 0.0, 1, tally, facts)
    assert adaptive["acceptance_rate"] == 0.5
    assert adaptive["predicted_tokens_per_round"] is None and adaptive["predicted_speedup"] is None
    fixed = record("demo", "serve_sync", 2, 0.0, 1, tally, facts)
    assert fixed["predicted_speedup"] == round(1.75 / 2.0, 3)
    add_speedups([fixed])  # no target_only in the run: no speedup, nor one to the formula
    assert fixed["speedup"] is None and fixed["speedup_vs_predicted"] is None


def test_each_temperature_has_its_own_anchor():
    """speedup: over target_only at the record's own temperature, not another's."""
    records = [record("demo", mode, k, t, 1, Tally(1, tokens, 1.0), FACTS)
               for mode, k, t, tokens in [("target_only", 0, 0.0, 100), ("target_only", 0, 1.0, 50),
                                          ("serve_sync", 4, 0.0, 200), ("serve_sync", 4, 1.0, 150)]]
    add_speedups(records)
    assert [r["speedup"] for r in records] == [1.0, 1.0, 2.0, 3.0]


def test_the_flattest_dtype_is_the_one_whose_widest_forward_costs_least_per_token(monkeypatch):
    """float32 with t(5)/t(1) = 4 against bfloat16's 1.5 (though bfloat16 is slower)."""
    curves = {"float32": {"1": 1.0, "5": 4.0}, "bfloat16": {"1": 4.0, "5": 6.0}}
    monkeypatch.setattr(costs, "load_causal_lm", lambda path, dtype: dtype)
    monkeypatch.setattr(costs, "cost_curve", lambda model, ns, repeats: curves[model])
    assert costs.flattest_dtype.__wrapped__("x", 5, 1) == ("bfloat16", curves)


def test_pair_facts_measure_the_verify_of_k_plus_one_and_c_as_draft_over_target(monkeypatch):
    asked = []

    def curve(model, ns, repeats):
        asked.append(list(ns))
        return {str(n): 2.0 * n for n in ns}

    monkeypatch.setattr(costs, "cost_curve", curve)
    monkeypatch.setattr(costs, "forward_ms", lambda model, context, new, repeats: 0.5)
    model = torch.nn.Linear(2, 2)
    facts = costs.pair_facts(PAIRS["demo"], model, model, [2, 4], 1)
    assert asked == [[1, 3, 5]]
    assert facts["verify_cost"] == {"1": 1.0, "3": 3.0, "5": 5.0} and facts["c"] == 0.25


def results_of(curve: dict, records: list[dict]) -> dict:
    """A results.json of one pair, its facts with the target's cost curve `curve`."""
    machine = dict.fromkeys(("command", "commit", "date", "cpu", "cores", "torch",
                             "torch_threads", "transformers", "ray", "prompts", "max_tokens"), "x")
    machine["sweep"] = {"concurrency": [4], "requests_per_client": 1, "max_tokens": 8}
    facts = {"note": "a pair", "target": {"parameters": 6e6, "dtype": "float32"},
             "draft": {"parameters": 1e6, "dtype": "float32"}, "target_forward_ms": curve,
             "verify_cost": {n: ms / curve["1"] for n, ms in curve.items()},
             "draft_forward_ms": 0.5, "c": 0.25, "draft_q": "dense"}
    return {"machine": machine, "pairs": {"demo": facts}, "results": records}


def test_the_warning_reads_the_widest_forward_and_spares_one_at_1_5():
    """The widest n by number ("17", not "9" as text); over 1.5x one token warns."""
    warns = "Verification is far from free"
    lines = report.pair_lines(results_of({"1": 1.0, "9": 1.2, "17": 1.6}, [])["pairs"]["demo"])
    assert warns in lines[-1] and "17 tokens cost 1.6x" in lines[-1]
    assert not any(warns in line for line in report.pair_lines(
        results_of({"1": 1.0, "9": 1.2, "17": 1.5}, [])["pairs"]["demo"]))


def test_the_pair_table_holds_the_suite_cells_and_the_sweep_its_own():
    """A streamed cell is the sweep's (its own section); a batched cell says its ratio to
    off beside its speedup."""
    batched = {**dict.fromkeys(FIELDS), "pair": "demo", "mode": "serve_sync", "k": 4,
               "temperature": 0.0, "concurrency": 4, "requests": 4, "tokens_per_s": 123.0,
               "speedup": 2.0, "speedup_vs_off": 1.5, "stream": None}
    streamed = {**batched, "mode": "serve_adaptive", "k": "auto", "tokens_per_s": 456.0,
                "stream": True, "speedup": None, "speedup_vs_off": 1.25}
    text = report.markdown(results_of({"1": 1.0, "5": 1.1}, [batched, streamed]))
    table, sweep_part = text.split("## Concurrency sweep")
    assert "| 123.0 | 2.00x (1.50x of off) |" in table and "456.0" not in table
    assert "| demo | serve_adaptive | 4 | 4 | 456.0 | 1.25x |" in sweep_part
    assert "123.0" not in sweep_part
