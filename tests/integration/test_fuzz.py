"""Schema-based fuzzing of the HTTP API (schemathesis, from the router's OpenAPI document):
whatever the bodies, no 5xx. The router runs with a 64-token context for the length of the
test, so that every valid request generates at most 63 tokens (bounded time)."""

import copy

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.integration.conftest import app_config


@pytest.fixture(scope="module")
def short_context(cluster):
    base = cluster.config
    short = copy.deepcopy(base)
    app_config(short, "router")["args"]["max_context_tokens"] = 64
    cluster.redeploy(short)
    yield cluster
    cluster.redeploy(base)


@pytest.mark.slow
def test_no_input_makes_the_router_fail(short_context):
    schema = schemathesis.openapi.from_url(short_context.base_url + "/openapi.json")
    calls = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def no_server_error(case):
            response = case.call(timeout=60)
            calls[response.status_code] = calls.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.body, response.status_code, response.text)

        no_server_error()
    print(f"\nfuzz: {sum(calls.values())} requests, by status: {dict(sorted(calls.items()))}")
    assert calls.get(200) and calls.get(400)  # both valid and invalid bodies were tried
