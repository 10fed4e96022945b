"""The router's GET /metrics (deployments.prometheus): its node's Ray export, as Ray's metrics
agent writes it, translated to vLLM's names; and the route, its export read by a stand-in
(no Ray)."""

import asyncio
from types import SimpleNamespace

import pytest

from deployments import prometheus
from deployments.prometheus import (
    CONTENT_TYPE,
    MetricsUnavailable,
    NodeExport,
    NodeMetrics,
    translated,
)

SERVE = ('Component="core_worker",SessionName="session_1",Version="2.60.0",WorkerId="ab12",'
         'application="{app}",deployment="{deployment}",replica="{app}#x1"')
ROUTER, OTHER = SERVE.format(app="router", deployment="Router"), \
    SERVE.format(app="short", deployment="Router")
VERIFIER = SERVE.format(app="verifier", deployment="Verifier")

# Ray's export as its agent writes it (prometheus_client's text format): counters with
# `_total` and, under RAY_EXPORT_COUNTER_AS_GAUGE, their deprecated gauge twin; a histogram's
# buckets, count and sum; a tagged counter; another router's series; Ray's and Serve's own.
RAY_EXPORT = f"""\
# HELP target_info Target metadata
# TYPE target_info gauge
target_info{{service_name="ray-dashboard-agent"}} 1.0
# HELP ray_tasks Current number of tasks currently in a particular state.
# TYPE ray_tasks gauge
ray_tasks{{Component="core_worker",State="RUNNING"}} 3.0
# HELP ray_serve_num_router_requests_total The number of requests processed by the router.
# TYPE ray_serve_num_router_requests_total counter
ray_serve_num_router_requests_total{{{ROUTER},route="/"}} 7.0
# HELP ray_generation_tokens_total Tokens output by the choices.
# TYPE ray_generation_tokens_total counter
ray_generation_tokens_total{{{ROUTER}}} 42.0
ray_generation_tokens_total{{{OTHER}}} 5.0
# HELP ray_generation_tokens (DEPRECATED, use ray_generation_tokens_total metric instead) \
Tokens output by the choices.
# TYPE ray_generation_tokens gauge
ray_generation_tokens{{{ROUTER}}} 42.0
# HELP ray_num_requests_running Choices running in this router replica (n counts).
# TYPE ray_num_requests_running gauge
ray_num_requests_running{{{ROUTER}}} 2.0
# HELP ray_request_success_total Choices that finished, by finish reason (stop, length).
# TYPE ray_request_success_total counter
ray_request_success_total{{{ROUTER},finished_reason="stop"}} 3.0
# HELP ray_e2e_request_latency_seconds Seconds from a choice's start to its end.
# TYPE ray_e2e_request_latency_seconds histogram
ray_e2e_request_latency_seconds_bucket{{{ROUTER},le="0.1"}} 1.0
ray_e2e_request_latency_seconds_bucket{{{ROUTER},le="1.0"}} 3.0
ray_e2e_request_latency_seconds_bucket{{{ROUTER},le="+Inf"}} 3.0
ray_e2e_request_latency_seconds_count{{{ROUTER}}} 3.0
ray_e2e_request_latency_seconds_sum{{{ROUTER}}} 1.25
# HELP ray_specserve_pool_batch_occupancy The running batch's size over max_batch_size.
# TYPE ray_specserve_pool_batch_occupancy gauge
ray_specserve_pool_batch_occupancy{{{VERIFIER},pool="verifier"}} 0.5
"""

MODEL = 'model_name="demo"'
EXPECTED = f"""\
# HELP vllm:generation_tokens_total Tokens output by the choices.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{{ROUTER},{MODEL}}} 42.0
# HELP vllm:num_requests_running Choices running in this router replica (n counts).
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{ROUTER},{MODEL}}} 2.0
# HELP vllm:request_success_total Choices that finished, by finish reason (stop, length).
# TYPE vllm:request_success_total counter
vllm:request_success_total{{{ROUTER},finished_reason="stop",{MODEL}}} 3.0
# HELP vllm:e2e_request_latency_seconds Seconds from a choice's start to its end.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{{ROUTER},le="0.1",{MODEL}}} 1.0
vllm:e2e_request_latency_seconds_bucket{{{ROUTER},le="1.0",{MODEL}}} 3.0
vllm:e2e_request_latency_seconds_bucket{{{ROUTER},le="+Inf",{MODEL}}} 3.0
vllm:e2e_request_latency_seconds_count{{{ROUTER},{MODEL}}} 3.0
vllm:e2e_request_latency_seconds_sum{{{ROUTER},{MODEL}}} 1.25
# HELP specserve_pool_batch_occupancy The running batch's size over max_batch_size.
# TYPE specserve_pool_batch_occupancy gauge
specserve_pool_batch_occupancy{{{VERIFIER},pool="verifier"}} 0.5
"""
APPLICATIONS = frozenset({"router", "drafter", "verifier"})


def test_rays_export_is_read_as_vllms_metrics_of_this_router_only():
    assert translated(RAY_EXPORT, "demo", APPLICATIONS) == EXPECTED


def test_a_pools_kv_cache_usage_is_vllms_and_its_sessions_keep_their_name():
    """Each pool replica's KV cache usage reads as vLLM's gauge, tagged with the served model
    (and its pool); its sessions are specserve's own."""
    text = (f"# TYPE ray_kv_cache_usage_perc gauge\n"
            f"ray_kv_cache_usage_perc{{{VERIFIER},pool=\"verifier\"}} 0.25\n"
            f"# TYPE ray_specserve_pool_sessions gauge\n"
            f"ray_specserve_pool_sessions{{{VERIFIER},pool=\"verifier\"}} 3.0\n")
    assert translated(text, "demo", APPLICATIONS) == (
        f"# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{VERIFIER},pool=\"verifier\",{MODEL}}} 0.25\n"
        f"# TYPE specserve_pool_sessions gauge\n"
        f"specserve_pool_sessions{{{VERIFIER},pool=\"verifier\"}} 3.0\n")


def test_a_served_name_is_escaped_as_a_label_value():
    text = f"# TYPE ray_num_requests_waiting gauge\nray_num_requests_waiting{{{ROUTER}}} 1\n"
    out = translated(text, 'a"b\\c', APPLICATIONS)
    assert out.endswith(f'{{{ROUTER},model_name="a\\"b\\\\c"}} 1\n')


def test_a_label_value_holding_braces_and_quotes_stays_whole():
    labels = 'application="router",finished_reason="st}o\\"p,"'
    text = f"ray_request_success_total{{{labels}}} 1.0 1700000000000\n"
    assert translated(text, "m", APPLICATIONS) == \
        f'vllm:request_success_total{{{labels},model_name="m"}} 1.0 1700000000000\n'


def test_every_vllm_named_metric_recorded_is_translated(monkeypatch):
    """VLLM_FAMILIES is RouterMetrics' and PoolMetrics' metrics without specserve's prefix: a
    metric added there and not here would be missing from /metrics."""
    from tests.unit.test_metrics import exported_metrics

    names = {name for name in exported_metrics(monkeypatch)
             if not name.startswith("specserve_")}
    assert names == prometheus.VLLM_FAMILIES


def node_metrics(texts: list, shared_s: float = 1.0) -> tuple[NodeMetrics, list]:
    """NodeMetrics whose export is read from texts in turn (an exception is raised); and
    the URLs it read, and each lookup ("locate")."""
    calls = []

    def locate():
        calls.append("locate")
        return NodeExport("http://node:8080/metrics", "router")

    async def fetch(url):
        calls.append(url)
        await asyncio.sleep(0.01)
        text = texts.pop(0)
        if isinstance(text, Exception):
            raise text
        return text

    return NodeMetrics("demo", ("drafter", "verifier"), locate, fetch, shared_s), calls


def test_scrapes_within_a_second_share_one_read_and_a_later_one_reads_again():
    metrics, calls = node_metrics([RAY_EXPORT, ""], shared_s=0.2)

    async def main():
        together = await asyncio.gather(*(metrics.text() for _ in range(3)))
        again = await metrics.text()  # within shared_s of the read: the same
        await asyncio.sleep(0.25)
        return together, again, await metrics.text()

    together, again, later = asyncio.run(main())
    assert together == [EXPECTED] * 3 and again == EXPECTED and later == ""
    assert calls == ["locate", "http://node:8080/metrics", "http://node:8080/metrics"]


def router_with(metrics: NodeMetrics) -> SimpleNamespace:
    # an API key set: /metrics stays open, as vLLM's (its key guards /v1 and a few others)
    return SimpleNamespace(node_metrics=metrics, api_key="secret")


def test_the_route_answers_prometheus_text_without_the_api_key():
    from deployments.router import Router, app

    metrics, _ = node_metrics([RAY_EXPORT])
    response = asyncio.run(Router.prometheus_metrics(router_with(metrics)))
    assert response.status_code == 200 and response.body.decode() == EXPECTED
    assert response.headers["content-type"] == CONTENT_TYPE
    # routed, and outside the OpenAPI document as vLLM's mount is (so no fuzzing either)
    assert app.url_path_for("prometheus_metrics") == "/metrics"
    assert "/metrics" not in app.openapi()["paths"]


def test_no_metrics_agent_is_a_503_that_says_so_and_the_next_scrape_looks_again():
    from deployments.router import Router

    refused = MetricsUnavailable("Ray's metrics export at http://node:8080/metrics cannot be "
                                 "reached (ClientConnectorError: refused)")
    metrics, calls = node_metrics([refused, RAY_EXPORT], shared_s=0.0)
    response = asyncio.run(Router.prometheus_metrics(router_with(metrics)))
    assert response.status_code == 503
    assert "metrics are unavailable" in response.body.decode()
    assert "cannot be reached" in response.body.decode()
    assert asyncio.run(metrics.text()) == EXPECTED
    assert calls.count("locate") == 2


def test_an_export_that_cannot_be_reached_is_metrics_unavailable():
    async def main():  # a port nothing listens on
        from deployments.local import free_port

        await prometheus.fetched(f"http://127.0.0.1:{free_port()}/metrics", timeout_s=2)

    with pytest.raises(MetricsUnavailable, match="cannot be reached"):
        asyncio.run(main())


def test_a_gcs_lookup_that_does_not_answer_is_a_503_and_is_not_started_again(monkeypatch):
    """locate blocked (Ray's GCS not answering): each scrape is a 503 within FETCH_TIMEOUT_S,
    and waits for the same lookup (no thread more per scrape); once it answers, read."""
    import threading

    monkeypatch.setattr(prometheus, "FETCH_TIMEOUT_S", 0.05)
    answer, lookups = threading.Event(), []

    def locate():
        lookups.append("locate")
        answer.wait(10)
        return NodeExport("http://node:8080/metrics", "router")

    async def fetch(url):
        return RAY_EXPORT

    async def main():
        metrics = NodeMetrics("demo", ("drafter", "verifier"), locate, fetch, shared_s=0.0)
        refused = [await asyncio.wait_for(metrics.response(), 2) for _ in range(2)]
        answer.set()
        await asyncio.sleep(0.05)
        return refused, await asyncio.wait_for(metrics.text(), 2)

    try:
        refused, text = asyncio.run(main())
    finally:
        answer.set()
    assert [response.status_code for response in refused] == [503, 503]
    assert "did not say within 0.05 s" in refused[0].body.decode()
    assert text == EXPECTED and lookups == ["locate"]


def test_an_unexpected_error_is_a_503_naming_it_logged_once(caplog):
    """Outside a replica (serve.get_replica_context's error) or a bug: a 503 naming the
    error, not a 500; logged at its first scrape only."""
    def locate():
        raise RuntimeError("not called from within a replica")

    async def main():
        metrics = NodeMetrics("demo", ("drafter",), locate, shared_s=0.0)
        return [await metrics.response() for _ in range(3)]

    answers = asyncio.run(main())
    assert [answer.status_code for answer in answers] == [503] * 3
    assert "RuntimeError: not called from within a replica" in answers[0].body.decode()
    assert [record.message for record in caplog.records] == ["/metrics failed"]
