"""One local Ray instance and one Serve deployment shared by every integration test that
needs a cluster; stopped after the last test that uses it by the fixture that started it.

The deployment holds cluster/config.yaml's three apps for the whole run. The apps only one
module uses are added beside them for that module's tests and removed after (module fixtures
below; the three keep their replicas): a router with a 64-token context (/short, for
fuzzing), a router with 2 running slots and an API key (/limited), and a drafter / verifier
/ router trio serving the quirky pair (/quirky). An idle replica costs about 1 % of a core
(Ray's own threads), so the five are not left idle for the whole run. The tests of pool loss
and rescaling redeploy too: removing a pool or adding a replica is what they test. Under
pytest-xdist the tests that use the cluster run on one worker (one xdist group:
tests/conftest.py), beside the in-process tests on the other.
"""

import contextlib
import copy
import json
import os
from pathlib import Path

import pytest
import requests

from deployments.local import (  # noqa: F401 (re-exported for the tests)
    app_config,
    deploy,
    free_port,
    load_config,
    on_free_ports,
    start_serve,
)

ROOT = Path(__file__).resolve().parents[2]


class Cluster:
    def __init__(self, config: dict, metrics_port: int) -> None:
        self.config = config
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.base_url = f"http://127.0.0.1:{config['http_options']['port']}"
        self.grpc_address = f"127.0.0.1:{config['grpc_options']['port']}"

    def post(self, path: str, body: dict, timeout: float = 120) -> requests.Response:
        return requests.post(self.base_url + path, json=body, timeout=timeout)

    def post_many(self, path: str, bodies: list[dict], at_once: int = 3) -> list:
        """Each body's response, `at_once` requests in flight (their choices share the
        pools' batches). 3 x n 16 stays below a pool replica's 64 direct calls in flight
        (twice its max_batch_size 32): at 4 x 16, releases on top of 64 streams made the
        verifier answer RESOURCE_EXHAUSTED, which the router turns into a 429."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(at_once) as pool:
            return list(pool.map(lambda body: self.post(path, body), bodies))

    def redeploy(self, config: dict) -> None:
        deploy(config)
        self.config = config

    @contextlib.contextmanager
    def deployed(self, config: dict):
        """config for the length of the block, then the session's deployment again (in a
        finally: a failed test leaves the next one the cluster it expects)."""
        base = self.config
        try:
            self.redeploy(config)
            yield self
        finally:
            self.redeploy(base)


# a request to the shared deployment, as test_http.py and test_http_exactness.py make them
def complete(cluster, prompt, **fields):
    response = cluster.post("/v1/completions", {"prompt": prompt, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def stream_text(cluster, body) -> tuple[str, list[dict]]:
    with requests.post(cluster.base_url + "/v1/completions", json={**body, "stream": True},
                       stream=True, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.iter_lines(decode_unicode=True)
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, chunks


def session_config() -> dict:
    """cluster/config.yaml on free ports, its router's drafter deadline the tests' own."""
    config = on_free_ports(load_config())
    app_config(config, "router")["args"]["draft_timeout_s"] = TEST_DRAFT_TIMEOUT_S
    # the controller's and proxy's logs at WARNING: their INFO lines about every replica
    # stopped would reach the test output when the cluster stops after its last test
    config["logging_config"] = {"log_level": "WARNING"}
    return config


def with_router(config: dict, name: str, args: dict) -> dict:
    """config plus a second router app under /<name>, its args the router's and these."""
    config = copy.deepcopy(config)
    app = copy.deepcopy(app_config(config, "router"))
    app.update(name=name, route_prefix=f"/{name}")
    app["args"] = {**app["args"], **args}
    app["deployments"][0]["ray_actor_options"] = {"num_cpus": 0.1}
    config["applications"].append(app)
    return config


@pytest.fixture(scope="module")
def short_router(cluster):
    """The URL of a router with a 64-token context, for the module's tests."""
    with cluster.deployed(with_router(cluster.config, "short", {"max_context_tokens": 64})):
        yield cluster.base_url + "/short"


@pytest.fixture(scope="module")
def limited(cluster):
    """The path of a router with 2 running slots, 2 places in its queue, an API key and a
    Responses store (its Ray actor), for the module's tests."""
    limits = {"max_running_requests": 2, "max_waiting_requests": 2, "api_key": LIMITED_KEY,
              "responses_store": {}}
    with cluster.deployed(with_router(cluster.config, "limited", limits)):
        yield "/limited"


@pytest.fixture(scope="module")
def quirky(cluster, quirky_pair_dir):
    """quirky_pair_dir, served at /quirky for the module's tests."""
    with cluster.deployed(with_pair(cluster.config, "quirky", quirky_pair_dir)):
        yield quirky_pair_dir


LIMITED_KEY = "sesame"
# Every router's drafter deadline in the shared deployment, instead of the config's 1 s: on
# 2 cores shared with the other worker's tests, every draft of a short request once took
# over 1 s in CI, so it ran without drafts, exact, and the test that checks it speculated
# failed on the machine's load. A wall-clock deadline must not decide a test. A drafter that
# is gone still fails its calls at once (Serve's proxy answers NOT_FOUND: test_pool_loss);
# the deadline and what a missed draft does are tested without a cluster (test_pool_stream,
# test_draft_fallback).
TEST_DRAFT_TIMEOUT_S = 30.0


def stop_ray() -> None:
    """Serve and the Ray instance this process started, if they still run."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def cluster():
    import ray

    config = session_config()
    metrics_port = free_port()
    # 4 logical CPUs on this 2-core machine: room for a second drafter replica in tests
    with quieter_serve():
        ray.init(num_cpus=4, include_dashboard=False, logging_level="warning",
                 _metrics_export_port=metrics_port)
    try:
        start_serve(config)
        deploy(config)
        yield Cluster(copy.deepcopy(config), metrics_port)
    finally:
        stop_ray()


# Serve's controller loop every 0.5 s instead of 0.1, and each replica's metrics exported
# every second instead of every 100 ms: an idle deployment of twelve apps took 0.21 of the 2
# cores instead of 0.27 (measured). Nothing here tests those intervals; the metrics
# tests poll until their series appear.
QUIETER_SERVE = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
                 "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


@contextlib.contextmanager
def quieter_serve():
    """QUIETER_SERVE in the environment of the Ray instance started in the block (its
    processes inherit it), not of the instances other tests start later in this worker."""
    saved = {name: os.environ.get(name) for name in QUIETER_SERVE}
    os.environ.update(QUIETER_SERVE)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The cluster stops after the last test that uses it, not at the end of the session: its
    idle processes (controller, proxy, replicas, Ray's own) would otherwise poll beside the
    tests this worker runs next (0.12 of a core with the three apps, measured)."""
    yield
    if "cluster" in item.fixturenames:
        RAN_ON_CLUSTER.add(item.nodeid)
        if all(other.nodeid in RAN_ON_CLUSTER for other in item.session.items
               if "cluster" in other.fixturenames):
            stop_ray()


RAN_ON_CLUSTER: set[str] = set()


def with_pair(config: dict, name: str, pair_dir, drafter_args: dict | None = None) -> dict:
    """config plus a second drafter / verifier / router trio serving the pair in pair_dir, its
    router under /<name> (served model name `name`); the first trio is untouched."""
    config = copy.deepcopy(config)
    target, draft = str(pair_dir / "target"), str(pair_dir / "draft")
    extra = {"drafter": {"model": draft, "target": target, **(drafter_args or {})},
             "verifier": {"model": target},
             "router": {"model": target, "served_model_name": name,
                        "drafter_app": f"{name}-drafter", "verifier_app": f"{name}-verifier"}}
    for base in [a for a in config["applications"] if a["name"] in extra]:
        app = copy.deepcopy(base)
        app["name"] = f"{name}-{base['name']}"
        app["route_prefix"] = f"/{name}" + (base["route_prefix"] if base["name"] != "router"
                                            else "")
        app["args"] = {**app["args"], **extra[base["name"]]}
        for deployment in app["deployments"]:
            deployment["ray_actor_options"] = {"num_cpus": 0.1}
        config["applications"].append(app)
    return config
