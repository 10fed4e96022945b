"""The suite's derived figures, on hand-made tallies (the end-to-end run is in integration)."""

import pytest

from bench.suite import FIELDS, Tally, add_speedups, expected_tokens_per_round, record
from speculative.stats import SpecStats


def test_expected_tokens_per_round_is_the_geometric_formula():
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(None, 4) is None


def test_a_speculative_record_has_the_formula_and_the_measured_ratio():
    stats = SpecStats(rounds=10, num_drafts=10, num_draft_tokens=20, num_accepted_tokens=10,
                      num_emitted_tokens=20,
                      accepted_per_position=[7, 3], draft_compute_seconds=0.01,
                      verify_compute_seconds=0.05, draft_seconds=0.02, verify_seconds=0.06,
                      round_seconds=0.081, wire_bytes=2500)
    tally = Tally()
    tally.add(tokens=20, seconds=0.1, stats=stats, overhead_p50=2.0)
    tally.compare([1, 2], [1, 2])
    rec = record("demo", "serve_sync", 2, 0.0, 1, tally, {"c": 0.25})
    anchor = record("demo", "target_only", 0, 0.0, 1, Tally(1, 10, 0.1), {"c": 0.25})
    add_speedups([rec, anchor])
    assert set(rec) == set(FIELDS)
    assert rec["acceptance_rate"] == 0.5 and rec["mean_acceptance_length"] == 2.0
    assert rec["acceptance_by_position"] == [0.7, 0.3]
    assert rec["predicted_tokens_per_round"] == 1.75
    assert rec["predicted_speedup"] == pytest.approx(1.75 / 1.5, abs=1e-3)
    assert rec["speedup"] == 2.0 and anchor["speedup"] == 1.0
    assert rec["speedup_vs_predicted"] == pytest.approx(2.0 / 1.167, abs=1e-3)
    assert (rec["ms_draft"], rec["ms_verify"], rec["ms_transport"], rec["ms_router"]) == \
        pytest.approx((1.0, 5.0, 2.0, 0.1))
    assert rec["wire_bytes_per_round"] == 250 and rec["overhead_ms_p50"] == 2.0
    assert rec["greedy_matches_target"] is True and rec["sampled_matches_inprocess"] is None
    assert anchor["acceptance_rate"] is None and anchor["predicted_speedup"] is None
