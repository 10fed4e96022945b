"""One local Ray instance and one Serve deployment of cluster/config.yaml, shared by every
integration test; stopped at the end of the session by the fixture that started it."""

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
