"""Which CPU matmul serves a verify's few rows, measured on this machine at start-up.

The lean forward applies a projection as x @ W up to `small_rows` rows and through oneDNN's
packed copy of the weight beyond (engine.lean.Projection). Where the two cross depends on the
machine: on a 2-core AMD EPYC VM with AVX-512 the packed copy was 2.2x faster at 5 rows
(SMALL_MATMUL_ROWS = 2); on a 2-core Intel Xeon VM with AVX-512 and AMX, in the demo target's
whole forward, x @ W was 10-20 % faster up to 9 rows (1 x 5: 3.8-4.2 against 4.7 ms; the
draft's forwards 15-20 % faster at every batch up to 32 rows; 2026-11-29). So a runner whose
projections have packed copies times its own forward at a few row counts, x @ W against the
packed copy, alternating, and keeps x @ W up to the largest count where it won at that count
and every smaller one. The result is kept per model and thread count for the process, so
every runner of one model in a process computes alike.
"""

import logging
import time

import torch

from engine.batch import Segment
from engine.lean import SMALL_MATMUL_ROWS

ROWS = (3, 5, 9, 17, 33)  # verifies of K = 2, 4, 8, 16; batches of that many one-token calls
CONTEXT = 64  # cached positions the timed forwards attend over
REPEATS = 5

logger = logging.getLogger(__name__)
measured: dict[tuple, int] = {}  # (model, dtype, threads) -> small_rows


def calibrate_small_matmuls(runner) -> int | None:
    """Set the lean forward's small_rows from this machine's timings (module doc); None where
    no projection has a packed copy (nothing to choose), else the rows chosen."""
    lean = runner.lean
    projections = [] if lean is None else lean.projections()
    if not any(p.packed is not None for p in projections):
        return None
    model = runner.model
    key = (model.config.name_or_path or id(model), str(lean.embed.weight.dtype),
           torch.get_num_threads())
    if key not in measured:
        measured[key] = timed_crossing(runner, projections)
        logger.info("engine: x @ W up to %d rows, oneDNN's packed weights beyond (measured)",
                    measured[key])
    for projection in projections:
        projection.small_rows = measured[key]
    return measured[key]


def timed_crossing(runner, projections) -> int:
    """`crossing` of this runner's forwards: at each of ROWS, the median of REPEATS with x @ W
    and with the packed copies, alternating, after a warm-up of each (oneDNN builds a kernel
    per shape at its first call)."""
    cache = runner.new_cache()

    def forward(rows: int, small_rows: int) -> float:
        for projection in projections:
            projection.small_rows = small_rows
        started = time.perf_counter()
        runner.forward([Segment(cache, [1] * rows, CONTEXT, rows)])
        return time.perf_counter() - started

    try:
        runner.forward([Segment(cache, [1] * CONTEXT, 0, 1)])
        medians = {}
        for rows in ROWS:
            forward(rows, rows), forward(rows, rows - 1)
            times = [(forward(rows, rows), forward(rows, rows - 1)) for _ in range(REPEATS)]
            medians[rows] = tuple(sorted(column)[REPEATS // 2] for column in zip(*times))
            if medians[rows][0] >= medians[rows][1]:
                break  # the larger counts cannot matter: x @ W stops here
        return crossing(medians)
    finally:
        cache.free()


def crossing(medians: dict[int, tuple[float, float]]) -> int:
    """The largest row count up to which x @ W was faster (medians: rows -> (x @ W, packed)
    seconds) at it and at every smaller one; SMALL_MATMUL_ROWS where it lost at the first."""
    chosen = SMALL_MATMUL_ROWS
    for rows in sorted(medians):
        plain, packed = medians[rows]
        if plain >= packed:
            break
        chosen = rows
    return chosen
