"""The router's and the pools' metrics: what RouterMetrics records (with Ray's metric classes
stood in for, and real ones, Ray not running), and what an operator's dashboards and a client
read is what the docs name: every metric exported and every field of a response's statistics
(`speculative`, vLLM's `metrics.speculative_decoding`) named in the docs, and every metric the
docs name exported (a dashboard built from the docs would read a series nobody writes)."""

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments import metrics as metrics_module
from deployments.admission import Admission
from deployments.pools import PoolReplica
from deployments.router import Router
from speculative.sampling import SamplingParams
from speculative.stats import SpecStats

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a metric name as the docs write it: in backticks, without Ray's `ray_` prefix
DOCUMENTED_METRIC = re.compile(r"`((?:spec_decode|specserve)_\w+)")


def docs_text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def exported_metrics(monkeypatch) -> set[str]:
    """The names RouterMetrics and PoolMetrics give Ray's metric classes (stood in for)."""
    created = stood_in_metrics(monkeypatch)
    metrics_module.RouterMetrics()
    metrics_module.PoolMetrics("verifier")
    return {name for name, kind, *_ in created if kind == "new"}


def test_the_docs_name_every_exported_metric_and_no_other(monkeypatch):
    exported, text = exported_metrics(monkeypatch), docs_text()
    assert set(DOCUMENTED_METRIC.findall(text)) <= exported
    # vLLM's request metrics keep vLLM's names, without a prefix the pattern could find
    named = set(re.findall(r"`(\w+)[`{]", text))  # a name, or a name{its tags}
    assert sorted(exported - named) == []


def test_the_docs_name_every_field_of_a_responses_statistics():
    stats, text = SpecStats(), docs_text()
    fields = [*stats.as_dict(), *stats.vllm_metrics()["speculative_decoding"]]
    assert [name for name in fields if f"`{name}`" not in text] == []


def stood_in_metrics(monkeypatch) -> list:
    """What the metrics classes create and record, with Ray's metric classes stood in for:
    (name, kind, value, tags) in order, kind "new" for a metric's creation."""
    from deployments import metrics as metrics_module

    recorded = []

    class Metric:
        def __init__(self, name, **_):
            self.name = name
            recorded.append((name, "new", None, None))

        def inc(self, value, tags=None):
            recorded.append((self.name, "inc", value, tags))

        def observe(self, value, tags=None):
            recorded.append((self.name, "observe", value, tags))

        def set(self, value, tags=None):
            recorded.append((self.name, "set", value, tags))

    for name in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics_module, name, Metric)
    return recorded


@pytest.mark.parametrize("finished", [True, False])
def test_router_metrics_record_a_choices_tokens_and_times_as_vllms(monkeypatch, finished):
    """A finished choice counts its success by finish reason and its end-to-end time; one
    that failed or was cancelled counts its tokens only. Real Ray metric classes (no Ray
    running) take every call too: tag keys and values as they require."""
    from deployments import metrics as metrics_module
    from speculative.state import Request, RequestState

    state = RequestState(Request("r", (1, 2, 3), SamplingParams(temperature=0.0)))
    state.committed.extend([4, 5])
    state.stats.cached_tokens = 2  # of its 3 prompt tokens, from the prefix cache
    state.finish_reason = "length" if finished else None
    metrics_module.RouterMetrics().record_choice(state, 3, 0.02, 0.5)
    recorded = stood_in_metrics(monkeypatch)
    metrics_module.RouterMetrics().record_choice(state, 3, 0.02, 0.5)
    got = {name: (value, tags) for name, kind, value, tags in recorded
           if kind not in ("new", "set") and not name.startswith(("spec_decode", "specserve"))}
    assert got == {"prompt_tokens": (3, None), "generation_tokens": (2, None),
                   "prefix_cache_queries": (3, None), "prefix_cache_hits": (2, None),
                   "time_to_first_token_seconds": (0.02, None)} | (
        {"request_success": (1, {"finished_reason": "length"}),
         "e2e_request_latency_seconds": (0.5, None),
         "request_time_per_output_token_seconds": (0.48, None)} if finished else {})


def test_the_running_and_waiting_gauges_read_0_before_any_request(monkeypatch):
    """vLLM's gauges are exported from the start; a Ray gauge never set is not: a fresh
    router's /metrics had no num_requests_waiting until a request first waited."""
    recorded = stood_in_metrics(monkeypatch)
    metrics_module.RouterMetrics()
    gauges = {name: value for name, kind, value, _ in recorded if kind == "set"}
    assert gauges == {"num_requests_running": 0, "num_requests_waiting": 0}


def test_a_pools_gauges_read_0_before_any_call(monkeypatch):
    """A pool replica's occupancy, KV cache usage, sessions and direct calls are exported
    from the start, as vLLM's kv_cache_usage_perc is."""
    recorded = stood_in_metrics(monkeypatch)
    metrics_module.PoolMetrics("drafter")
    assert [(name, value, tags) for name, kind, value, tags in recorded if kind == "set"] == [
        (name, 0, {"pool": "drafter"}) for name in (
            "specserve_pool_batch_occupancy", "kv_cache_usage_perc", "specserve_pool_sessions",
            "specserve_pool_direct_calls")]


def test_the_gauges_are_set_again_at_each_health_check(monkeypatch):
    """Ray's agent drops a gauge 20 s after its last set: a steady router's running choices
    (and an idle pool's occupancy) vanished from /metrics while the requests still ran.
    Serve's periodic health checks set them again to their current values: a pool's KV
    cache usage and sessions as its engine's thread last read them, its direct calls in flight
    now."""
    recorded = stood_in_metrics(monkeypatch)
    router = SimpleNamespace(metrics=metrics_module.RouterMetrics(), admission=Admission(8))
    router.admission.admit(3)
    pool = SimpleNamespace(metrics=metrics_module.PoolMetrics("verifier"), waiting=0,
                           direct_in_flight=5, health=SimpleNamespace(check=lambda waiting: None))
    pool.metrics.record_batch(4, 32)
    engine = SimpleNamespace(sessions=[None] * 2, runner=SimpleNamespace(
        pool=SimpleNamespace(usage=0.75)))
    pool.metrics.read_engine(engine)
    del recorded[:]
    asyncio.run(Router.check_health(router))
    asyncio.run(PoolReplica.check_health(pool))
    assert [(name, value) for name, kind, value, _ in recorded if kind == "set"] == [
        ("num_requests_running", 3), ("num_requests_waiting", 0),
        ("specserve_pool_batch_occupancy", 0.125), ("kv_cache_usage_perc", 0.75),
        ("specserve_pool_sessions", 2), ("specserve_pool_direct_calls", 5)]


def test_router_metrics_record_a_requests_counts_by_position_and_its_mean_round_by_phase(
        monkeypatch):
    """RouterMetrics.record, with Ray's metric classes stood in for: acceptance by drafted
    position (0-based, as vLLM's), rounds by K, and each phase's time per round."""
    from deployments import metrics as metrics_module
    from speculative.state import Request, RequestState

    recorded = stood_in_metrics(monkeypatch)
    state = RequestState(Request("r", (1,), SamplingParams(temperature=0.0, min_tokens=2)))
    stats = state.stats
    stats.rounds, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens = 2, 2, 6, 4
    stats.accepted_per_position, stats.rounds_by_k = [2, 2, 0], {3: 2}
    stats.draft_seconds, stats.verify_seconds, stats.round_seconds = 0.004, 0.010, 0.016
    stats.draft_compute_seconds, stats.verify_compute_seconds = 0.002, 0.008
    metrics_module.RouterMetrics().record(state)
    by_name = {}
    for name, kind, value, tags in recorded:
        if kind != "new":
            by_name.setdefault(name, []).append((value, tags))
    assert by_name["spec_decode_num_accepted_tokens_per_pos"] == [
        (2, {"position": "0"}), (2, {"position": "1"})]
    assert by_name["spec_decode_rounds_by_num_speculative_tokens"] == [
        (2, {"num_speculative_tokens": "3"})]
    phases = {tags["phase"]: value for value, tags in by_name["spec_decode_round_seconds"]}
    assert phases == pytest.approx({"draft": 0.001, "verify": 0.004, "transport": 0.002,
                                    "router": 0.001})
    assert by_name["specserve_feature_choices"] == [(1, {"feature": "min_tokens"})]
    assert by_name["specserve_feature_accepted_tokens"] == [(4, {"feature": "min_tokens"})]
