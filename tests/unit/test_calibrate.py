"""engine.calibrate: which CPU matmul serves a forward's few rows, from this machine's timings."""

from engine import calibrate
from engine.calibrate import calibrate_small_matmuls, crossing
from engine.lean import SMALL_MATMUL_ROWS
from engine.runner import serving_runner
from tests.tiny import tiny_llama


def test_x_at_w_is_kept_up_to_where_it_first_loses():
    assert crossing({3: (1.0, 2.0), 5: (1.0, 2.0), 9: (2.0, 1.0), 17: (1.0, 2.0)}) == 5
    assert crossing({3: (2.0, 1.0), 5: (1.0, 2.0)}) == SMALL_MATMUL_ROWS  # lost at once
    assert crossing({3: (1.0, 1.0)}) == SMALL_MATMUL_ROWS  # a tie is no win
    assert crossing({rows: (1.0, 2.0) for rows in calibrate.ROWS}) == calibrate.ROWS[-1]


def test_a_runner_with_packed_weights_measures_once_per_model_and_applies_it_everywhere(
        monkeypatch):
    monkeypatch.setattr(calibrate, "measured", {})
    timed = []
    monkeypatch.setattr(calibrate, "timed_crossing",
                        lambda runner, projections: timed.append(runner) or 9)
    model = tiny_llama(1, hidden=256)  # weights large enough to pack (engine.lean)
    first = serving_runner(model, "paged", "paged", kv_cache_tokens=1024)
    second = serving_runner(model, "paged", "paged", kv_cache_tokens=1024)
    assert len(timed) == 1  # the second runner of the model takes the first's
    assert {p.small_rows for r in (first, second) for p in r.lean.projections()} == {9}


def test_its_timings_run_the_forward_and_leave_nothing_behind():
    runner = serving_runner(tiny_llama(2, hidden=256), "paged", "paged", kv_cache_tokens=1024)
    free = runner.pool.free_units
    assert calibrate.timed_crossing(runner, runner.lean.projections()) in \
        (SMALL_MATMUL_ROWS, *calibrate.ROWS)
    assert runner.pool.free_units == free


def test_a_runner_without_packed_weights_has_nothing_to_choose():
    runner = serving_runner(tiny_llama(3), "paged", "paged", kv_cache_tokens=1024)
    assert calibrate_small_matmuls(runner) is None
    assert {p.small_rows for p in runner.lean.projections()} == {SMALL_MATMUL_ROWS}
