"""One local Ray instance and one Serve deployment of cluster/config.yaml, shared by every
integration test; stopped at the end of the session by the fixture that started it."""

import contextlib
import copy
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

    def redeploy(self, config: dict) -> None:
        deploy(config)
        self.config = config

    @contextlib.contextmanager
    def serving_pair(self, name: str, pair_dir, drafter_args: dict | None = None):
        """The default apps plus a trio serving pair_dir under /<name> (see with_pair), for
        the length of the block; declarative, so redeploying the base removes the trio."""
        base = self.config
        self.redeploy(with_pair(base, name, pair_dir, drafter_args))
        try:
            yield pair_dir
        finally:
            self.redeploy(base)


@pytest.fixture(scope="session")
def cluster():
    import ray
    from ray import serve

    config = on_free_ports(load_config())
    metrics_port = free_port()
    # 4 logical CPUs on this 2-core machine: room for a second drafter replica in tests
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning",
             _metrics_export_port=metrics_port)
    try:
        start_serve(config)
        deploy(config)
        yield Cluster(copy.deepcopy(config), metrics_port)
    finally:
        serve.shutdown()
        ray.shutdown()


def with_pair(config: dict, name: str, pair_dir, drafter_args: dict | None = None) -> dict:
    """config plus a second drafter / verifier / router trio serving the pair in pair_dir, its
    router under /<name> (served model name `name`); the first trio is untouched."""
    config = copy.deepcopy(config)
    target, draft = str(pair_dir / "target"), str(pair_dir / "draft")
    extra = {"drafter": {"model": draft, "target": target, **(drafter_args or {})},
             "verifier": {"model": target},
             "router": {"model": target, "served_model_name": name,
                        "drafter_app": f"{name}-drafter", "verifier_app": f"{name}-verifier"}}
    for base in list(config["applications"]):
        app = copy.deepcopy(base)
        app["name"] = f"{name}-{base['name']}"
        app["route_prefix"] = f"/{name}" + (base["route_prefix"] if base["name"] != "router"
                                            else "")
        app["args"] = {**app["args"], **extra[base["name"]]}
        for deployment in app["deployments"]:
            deployment["ray_actor_options"] = {"num_cpus": 0.1}
        config["applications"].append(app)
    return config
