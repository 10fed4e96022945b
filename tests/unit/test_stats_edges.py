"""A request's speculative counters (speculative.stats.SpecStats) at their edges: what a
client reads in `metrics.speculative_decoding` and in the usage's counters, over rounds of
different K and pre-drafted tokens tested at the bonus position."""

from dataclasses import fields

from speculative.rejection import RoundOutcome
from speculative.stats import SpecStats


def test_num_spec_tokens_is_the_longest_block_not_the_last():
    """A round of K = 4 and then one of K = 2: no round tested more than num_spec_tokens, so
    it is 4 and the histogram keeps its five buckets (the last round's 2 would undercount
    the first, and num_draft_tokens would exceed steps x num_spec_tokens)."""
    stats = SpecStats()
    stats.record(4, RoundOutcome((1, 2, 3, 4, 5), 4))
    stats.record(2, RoundOutcome((1, 9), 1))
    metrics = stats.vllm_metrics()["speculative_decoding"]
    assert metrics["num_spec_tokens"] == 4
    assert metrics["acceptance_histogram"] == [0, 1, 0, 0, 1]
    assert metrics["num_draft_tokens"] <= metrics["num_spec_steps"] * 4


def test_rounds_by_k_counts_the_verified_block_not_the_predrafted_token():
    """rounds_by_num_speculative_tokens is keyed by the K the round verified: a pre-drafted
    y1 tested at its bonus position is counted in num_draft_tokens and
    bonus_position_drafts, not as a round of K + 1."""
    stats = SpecStats()
    stats.record(2, RoundOutcome((1, 2, 3), 2, predraft_tested=1, predraft_accepted=1))
    stats.record(2, RoundOutcome((1, 9), 1, predraft_tested=1, predraft_accepted=0))
    summary = stats.as_dict()
    assert summary["rounds_by_num_speculative_tokens"] == {"2": 2}
    assert summary["num_draft_tokens"] == 6 and summary["bonus_position_drafts"] == 2
    assert summary["mean_num_speculative_tokens"] == 3.0


def test_merging_choices_sums_every_counter():
    """A request's choices merged (frontend.merged_stats): every counter and time adds up,
    the fallback rounds and batch sizes included; the longest block is the longest of either
    and the cached prompt tokens are the usage's to combine (a shared prompt, not a sum)."""
    not_summed = {"longest_tested", "cached_tokens"}
    names = [f.name for f in fields(SpecStats)
             if isinstance(f.default, (int, float)) and f.name not in not_summed]
    total, other = SpecStats(), SpecStats()
    for value, name in enumerate(names, start=1):
        setattr(other, name, value)
    total.add(other)
    total.add(other)
    assert {name: getattr(total, name) for name in names} == {
        name: 2 * value for value, name in enumerate(names, start=1)}


def test_the_router_time_is_the_round_less_its_waits():
    """ms_per_round splits a round: each pool's own compute, the rest of its waits
    (transport) and what the round took beyond the waits (the router's own work)."""
    stats = SpecStats(rounds=2, draft_seconds=0.010, verify_seconds=0.030, round_seconds=0.050,
                      draft_compute_seconds=0.004, verify_compute_seconds=0.020)
    phases = {name: round(ms, 6) for name, ms in stats.ms_per_round().items()}
    assert phases == {"draft": 2.0, "verify": 10.0, "transport": 8.0, "router": 5.0,
                      "total": 25.0}
