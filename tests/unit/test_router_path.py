"""bench.router_path: the router's request path (Choices, the pool clients, their streams)
against fake replicas runs every request to its full length, whole and streamed."""

import asyncio

import pytest

from bench.router_path import served
from deployments import auth


@pytest.mark.parametrize("k, stream", [(0, False), (4, True), ("auto", False)])
def test_the_router_path_measure_runs_every_request_to_its_end(k, stream, monkeypatch):
    monkeypatch.setattr(auth, "_secret", "test-secret")  # no Ray to share one through
    cpu, tokens, rounds = asyncio.run(served(streams=2, k=k, requests=4, max_tokens=12,
                                             stream=stream, cycle_s=1e-4))
    assert cpu > 0 and tokens == 4 * 12 and 0 < rounds <= tokens
