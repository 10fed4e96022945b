"""Edges of `specserve bench`'s derived figures on hand-made tallies (bench.records,
bench.costs, bench.report): which record names a q and which comparison, per-round figures
over rounds without drafts, the formula's verify cost, the report's order and labels."""

import pytest

from bench.costs import round_cost
from bench.records import Tallies, Tally, describe_q, record
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
