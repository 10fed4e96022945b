"""Losing a pool: without its drafter the deployment still answers, exactly (the target
alone); without its verifier it answers 503 fast, and a stream in flight ends with an error
event and [DONE]."""

import copy
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from bench.soak import sse_events

FAST_S = 20  # below the router's call_timeout_s (30 s): an answer by then was not a deadline
PROMPTS = ["def add(a, b):\n", "import os\n", "class Tree:\n", "for i in range(", "# sort a list"]


def without(config: dict, app: str) -> dict:
    config = copy.deepcopy(config)
    config["applications"] = [a for a in config["applications"] if a["name"] != app]
    return config


def complete(cluster, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True,
            "num_speculative_tokens": 3, **extra}
    response = cluster.post("/v1/completions", body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def token_ids(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


@pytest.mark.slow
def test_without_the_drafter_requests_complete_as_the_target_alone(cluster):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        started = time.monotonic()
        before = list(pool.map(lambda p: complete(cluster, p), PROMPTS))
        undisturbed = time.monotonic() - started
        assert all(a["speculative"]["num_drafts"] > 0 for a in before)
        with cluster.deployed(without(cluster.config, "drafter")):
            started = time.monotonic()
            during = list(pool.map(lambda p: complete(cluster, p), PROMPTS))
            without_drafter = time.monotonic() - started
            streamed = complete(cluster, PROMPTS[0], pipelined=True)
    identical = sum(token_ids(a) == token_ids(b) for a, b in zip(before, during))
    print(f"\nfault: drafter app deleted; requests {len(PROMPTS)}, completed {len(during)}, "
          f"identical {identical}, batch {undisturbed:.2f} s -> {without_drafter:.2f} s")
    for a, b in zip(before, during):
        assert token_ids(a) == token_ids(b)  # greedy: the target's own tokens
        assert b["speculative"]["draft_fallback_rounds"] > 0
    assert token_ids(streamed) == token_ids(before[0])
    after = complete(cluster, PROMPTS[1])  # the drafter is back: speculation too
    assert after["speculative"]["num_drafts"] > 0 and token_ids(after) == token_ids(before[1])


@pytest.mark.slow
def test_without_the_verifier_errors_are_fast_and_streams_end_cleanly(cluster):
    """Fast: both answers come within FAST_S, short of the router's 30 s call deadline (a
    client timeout, not a measured threshold: they take well under a second)."""
    # speculation off: the stream runs about twice as long (for the same CPU, as the removal
    # cuts it), so it surely outlasts the verifier's removal
    body = {"prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True, "num_speculative_tokens": 0}
    # the read timeout bounds each wait for a line of the stream
    with requests.post(cluster.base_url + "/v1/completions", json=body, stream=True,
                       timeout=FAST_S) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))  # the stream is running
        with cluster.deployed(without(cluster.config, "verifier")):
            started = time.monotonic()
            events = list(sse_events(stream))
            stream_ended = time.monotonic() - started
            started = time.monotonic()
            plain = cluster.post("/v1/completions", {"prompt": "x", "max_tokens": 4},
                                 timeout=FAST_S)
            plain_seconds = time.monotonic() - started
    print(f"\nfault: verifier app deleted; in-flight stream ended in {stream_ended:.2f} s "
          f"with an error event and [DONE]; a new request got {plain.status_code} in "
          f"{plain_seconds:.2f} s")
    assert events[-1] == "[DONE]"
    assert "error" in events[-2], events[-2]
    assert plain.status_code == 503 and "error" in plain.json()
    assert complete(cluster, PROMPTS[2])["choices"][0]["token_ids"]  # back in service
