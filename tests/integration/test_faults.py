"""A pool replica killed while 20 streams run: every request completes with the tokens of an
undisturbed run (greedy, and seeded sampled at a fixed K). The router's pinned direct address
dies with the replica, and its calls fall back to Serve's routing, which places them on the
replacement (the cache rebuilt from the committed prefix: exact)."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from bench.soak import DONE, sse_events

PROMPTS = ["import os\n", "def main():\n", "class Tree:\n", "for i in range(", "# parse\n",
           "from collections import", "try:\n", "if x:\n", "while True:\n", "return "]
REQUESTS = [{"prompt": p, "max_tokens": 64, "temperature": 0} for p in PROMPTS] + \
    [{"prompt": p, "max_tokens": 64, "temperature": 1.0, "seed": 100 + i,
      "num_speculative_tokens": 4} for i, p in enumerate(PROMPTS)]


def stream(cluster, body) -> list[int]:
    """The token ids of a streamed completion (the final chunk carries them)."""
    body = {**body, "stream": True, "return_token_ids": True, "ignore_eos": True}
    ids, done = None, False
    with requests.post(cluster.base_url + "/v1/completions", json=body, stream=True,
                       timeout=120) as response:
        assert response.status_code == 200, response.text
        for chunk in sse_events(response):
            if chunk == DONE:
                done = True
                continue
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                ids = choice.get("token_ids", ids)
    assert done and ids is not None
    return ids


def run_all(cluster, during=None) -> tuple[list, float]:
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        started = time.monotonic()
        futures = [pool.submit(stream, cluster, body) for body in REQUESTS]
        if during is not None:
            time.sleep(1.0)  # the streams are running
            during()
        outputs = [f.result() for f in futures]
    return outputs, time.monotonic() - started


def kill_replica(app: str, deployment: str) -> None:
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(prefix)]
    assert names, f"no replica of {app}"
    ray.kill(ray.get_actor(names[0], namespace="serve"))


def wait_running(app: str, timeout_s: float = 120) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications[app]
        if status.status == "RUNNING" and all(
                d.status == "HEALTHY" for d in status.deployments.values()):
            return
        time.sleep(0.5)
    raise TimeoutError(f"{app} not running again after {timeout_s} s")


@pytest.mark.slow
@pytest.mark.parametrize("app, deployment", [("drafter", "DrafterPool"),
                                             ("verifier", "VerifierPool")])
def test_a_replica_killed_mid_stream_loses_no_request(cluster, app, deployment):
    expected, undisturbed = run_all(cluster)
    try:
        outputs, disturbed = run_all(cluster, lambda: kill_replica(app, deployment))
    finally:
        wait_running(app)
    identical = sum(a == b for a, b in zip(outputs, expected))
    print(f"\nfault: {app} replica killed; requests {len(REQUESTS)}, completed {len(outputs)}, "
          f"identical {identical}, batch {undisturbed:.2f} s -> {disturbed:.2f} s "
          f"(+{disturbed - undisturbed:.2f} s)")
    assert outputs == expected
