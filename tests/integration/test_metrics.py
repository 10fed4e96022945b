"""The router's counters reach Serve's Prometheus export under the names vLLM users know."""

import re
import time

import requests

NAMES = ["spec_decode_num_drafts", "spec_decode_num_draft_tokens",
         "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
         "spec_decode_round_seconds_count",
         # a request's life, as vLLM's
         "prompt_tokens", "generation_tokens", "request_success",
         "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
         "request_time_per_output_token_seconds_count",
         "num_requests_running"]


def totals(text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"ray_(\w+?)(?:_total)?\{.*\} ([0-9.e+]+)$", line)
        if match:
            found[match[1]] = found.get(match[1], 0.0) + float(match[2])
    return found


def test_spec_decode_counters_are_exported(cluster):
    response = cluster.post("/v1/completions", {"prompt": "def main():\n", "max_tokens": 24,
                                                "temperature": 0, "num_speculative_tokens": 3})
    drafted = response.json()["speculative"]["num_draft_tokens"]
    deadline, found = time.monotonic() + 60, {}
    while time.monotonic() < deadline:  # metrics are pushed every few seconds
        found = totals(requests.get(cluster.metrics_url, timeout=10).text)
        if all(name in found for name in NAMES):
            break
        time.sleep(1)
    assert all(name in found for name in NAMES), sorted(found)
    assert found["spec_decode_num_draft_tokens"] >= drafted > 0
    assert found["spec_decode_num_accepted_tokens"] <= found["spec_decode_num_draft_tokens"]
    assert found["generation_tokens"] >= response.json()["usage"]["completion_tokens"] > 0


def test_pool_batch_metrics_are_exported(cluster):
    cluster.post("/v1/completions", {"prompt": "import os\n", "max_tokens": 8,
                                     "temperature": 0, "num_speculative_tokens": 2})
    deadline, pools = time.monotonic() + 60, set()
    while time.monotonic() < deadline and pools != {"drafter", "verifier"}:
        text = requests.get(cluster.metrics_url, timeout=10).text
        pools = set(re.findall(r'ray_specserve_pool_batch_size_count\{[^}]*pool="(\w+)"', text))
        time.sleep(1)
    assert pools == {"drafter", "verifier"}
    assert "ray_specserve_pool_batch_occupancy" in text


def test_the_routers_metrics_path_serves_vllms_names(cluster):
    """GET /metrics on the router's port: the router's metrics under vLLM's `vllm:` names,
    each tagged with the served model's name, and nothing of Ray's own."""
    from prometheus_client.parser import text_string_to_metric_families

    name = requests.get(cluster.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    response = cluster.post("/v1/completions", {"prompt": "def main():\n", "max_tokens": 16,
                                                "temperature": 0, "num_speculative_tokens": 3})
    tokens = response.json()["usage"]["completion_tokens"]
    generated = re.compile(r'^vllm:generation_tokens_total\{[^}]*model_name="'
                           + re.escape(name) + r'"[^}]*\} ([0-9.e+]+)$', re.MULTILINE)
    deadline, text, answer = time.monotonic() + 60, "", None
    while time.monotonic() < deadline:  # replicas push their metrics every few seconds
        answer = requests.get(cluster.base_url + "/metrics", timeout=10)
        text = answer.text
        counted = sum(float(value) for value in generated.findall(text))
        if counted >= tokens > 0 and "vllm:e2e_request_latency_seconds_bucket{" in text \
                and "specserve_pool_batch_size_count" in text:
            break
        time.sleep(1)
    assert answer.status_code == 200, text
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert sum(float(value) for value in generated.findall(text)) >= tokens > 0, text[:2000]
    assert "vllm:e2e_request_latency_seconds_bucket{" in text
    assert "vllm:prefix_cache_queries_total{" in text  # vLLM's prefix cache counters
    assert not any(line.startswith("ray_") for line in text.splitlines())
    families = list(text_string_to_metric_families(text))
    assert all("model_name" in sample.labels for family in families
               for sample in family.samples if sample.name.startswith("vllm:"))
    assert "specserve_pool_batch_size_count" in text
    # the pools' KV gauges, set from their start: each pool's under vLLM's name
    usage = {sample.labels["pool"]: sample.value for family in families
             for sample in family.samples if sample.name == "vllm:kv_cache_usage_perc"}
    assert usage.keys() == {"drafter", "verifier"} and all(0 <= u < 1 for u in usage.values())
    assert "specserve_pool_sessions{" in text
    assert "specserve_pool_direct_calls{" in text  # the autoscaling policy's load, from 0
