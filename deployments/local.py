"""Run a cluster/ config on the local Ray instance from Python (tests, benchmarks), as
`serve run` / `serve deploy` would."""

import copy
import os
import socket
import time
from pathlib import Path

import yaml

CLUSTER_DIR = Path(__file__).resolve().parents[1] / "cluster"


# Ports for servers we start are taken from below Linux's ephemeral range (32768 and up) and
# above Ray's worker ports (10002-19999): the kernel never hands these out for a bind to port
# 0 or an outgoing connection, so one that is free now stays free until our server binds it
# (a port from bind(0), closed and returned, may be handed to anyone in between). Each
# process starts at its own offset and never returns a port twice.
PORT_RANGE = range(20000, 32000)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port no server on this machine listens on that this process has not handed out."""
    span = len(PORT_RANGE)
    start = (os.getpid() * 97) % span
    for i in range(span):
        port = PORT_RANGE.start + (start + i) % span
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def load_config(name: str = "config.yaml") -> dict:
    return yaml.safe_load((CLUSTER_DIR / name).read_text())


def app_config(config: dict, name: str) -> dict:
    return next(app for app in config["applications"] if app["name"] == name)


def on_free_ports(config: dict) -> dict:
    """A copy of config whose HTTP and gRPC proxies listen on free ports."""
    config = copy.deepcopy(config)
    http_port, grpc_port = free_port(), free_port()
    config["http_options"]["port"] = http_port
    config["grpc_options"]["port"] = grpc_port
    app_config(config, "router")["args"]["grpc_address"] = f"127.0.0.1:{grpc_port}"
    return config


def start_serve(config: dict) -> None:
    from ray import serve

    serve.start(http_options=config["http_options"], grpc_options=config["grpc_options"],
                proxy_location=config["proxy_location"],
                logging_config=config.get("logging_config"))


def deploy(config: dict, timeout_s: float = 600) -> None:
    """What `serve deploy` does: declare the whole config, then wait until it runs (a guard
    against a hang, not a speed check: the tests' twelve apps on two busy cores took 104-113 s,
    and once over 120 s)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate(config))
    deadline = time.monotonic() + timeout_s
    names = {app["name"] for app in config["applications"]}
    while time.monotonic() < deadline:
        apps = app_states(client)
        if all(n in apps and apps[n]["status"] == "RUNNING" for n in names):
            return
        failed = [f"{n}: {apps[n]['message']}" for n in names
                  if n in apps and apps[n]["status"] == "DEPLOY_FAILED"]
        if failed:
            raise RuntimeError("deploy failed: " + "; ".join(failed))
        time.sleep(0.5)
    raise TimeoutError(f"apps not running after {timeout_s}s: {app_states(client)}")


def app_states(client) -> dict:
    """{app: {"status": ..., "message": ...}} from the controller's details as they come:
    serve.status() builds them into pydantic models, which cloudpickles every deployment's
    request router class once per call (20 ms of CPU against 1.6 here, in a process that has
    imported torch and transformers: most of what polling cost)."""
    return {name: {"status": app["status"], "message": app.get("message", "")}
            for name, app in client.get_serve_details().get("applications", {}).items()}
