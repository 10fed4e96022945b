"""Schema-based fuzzing of the HTTP API (schemathesis, from the router's OpenAPI document):
whatever the bodies, no 5xx. The fuzzed router (conftest's /short) has a 64-token
context, so that every valid request generates at most 63 tokens (bounded time)."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings


@pytest.mark.slow
def test_no_input_makes_the_router_fail(short_router):
    short = short_router
    schema = schemathesis.openapi.from_url(short + "/openapi.json")
    calls = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def no_server_error(case):
            response = case.call(base_url=short, timeout=60)
            calls[response.status_code] = calls.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.body, response.status_code, response.text)

        no_server_error()
    print(f"\nfuzz: {sum(calls.values())} requests, by status: {dict(sorted(calls.items()))}")
    assert calls.get(200) and calls.get(400)  # both valid and invalid bodies were tried
