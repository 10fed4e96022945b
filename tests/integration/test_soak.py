"""A short soak (the CI version of `specserve bench --soak`, which runs for minutes): streams
with cancellations and disconnects for 15 s; no errors, memory flat, no session left
behind."""

import pytest

from bench.soak import report, soak


@pytest.mark.slow
def test_a_short_soak_has_no_errors_flat_memory_and_no_leftover_sessions(cluster):
    result = soak(cluster.base_url, seconds=15, streams=8, seed=3)
    print("\n" + report(result))
    assert result["errors"] == 0, result["error_kinds"]
    assert result["completed"] > 10 and result["cancelled"] > 0
    for kind, mb in result["rss"].items():
        assert mb["end_mb"] < 1.5 * mb["after_warmup_mb"] + 50, (kind, mb)
    # cancelled and finished requests released their caches (the LRU and TTL were not needed)
    assert result["sessions_left"] == {"drafter": 0, "verifier": 0}
