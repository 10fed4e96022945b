"""Run by test_placement.py in its own process: cluster/gpu.yaml, deployed as operators deploy it,
on a local 2-node Ray whose nodes declare GPUs and accelerator types the way Ray itself does.

- head, the "A100" node: 2 GPUs and the resource `accelerator_type:A100` (the router, which asks
  for no GPU, may land on either node; Serve's controller and proxies cost no CPU)
- "H100" node: 2 GPUs and the resource `accelerator_type:H100`

Ray's own detection gives a GPU node `accelerator_type:<name>` = 1 (one per node, whatever its
GPU count), and `accelerator_type: <name>` in an actor's options asks for 0.001 of it
(ray._common.utils.resources_from_ray_options), so the nodes here declare exactly that.

The pools are placed by gpu.yaml's own ray_actor_options (num_gpus: 1, accelerator_type: A100 /
H100) and autoscaling configs. What is overridden, and why, is in `overridden()` below. Each
replica that asks for a GPU gets CUDA_VISIBLE_DEVICES set by Ray to a device that does not exist;
the pools run on CPU because their args say `device: cpu`: each replica reports its node, its
GPU ids, CUDA_VISIBLE_DEVICES and its model's device (`PoolReplica.where`).

Prints one line `PLACEMENT {json}`; every Ray process started here is stopped before exit, and
an alarm turns a hang into an exception so that the cleanup still runs.
"""

import json
import os
import signal

import requests

from deployments.local import app_config, deploy, load_config, on_free_ports, start_serve
from engine.models import DEMO_DRAFT, DEMO_TARGET

DEADLINE_S = 360  # test_placement.py waits a little longer, then kills this process group
POOLS = {"drafter": ("DrafterPool", DEMO_DRAFT), "verifier": ("VerifierPool", DEMO_TARGET)}


def overridden(config: dict) -> dict:
    """gpu.yaml with only what a 2-core, GPU-less, offline machine cannot take changed:

    - pools' args: `model` -> the demo pair (no hub access here), `device: cpu` and
      `dtype: float32` (no CUDA, and bf16 is slow or unsupported on these CPUs),
      `torch_threads: 1` (2 cores for everything); the drafter's `target` -> the demo target.
    - router's args: `model`, `tokenizer`, `served_model_name`, `max_context_tokens` dropped (they
      name the real checkpoint): the router takes its demo defaults; the rest is gpu.yaml's.
    - every deployment's `ray_actor_options.num_cpus` -> 0.1 (gpu.yaml asks 4 / 8 / 2 CPUs per
      replica; this machine has 2). num_gpus and accelerator_type stay as in gpu.yaml, and so
      do the autoscaling configs (min_replicas 1: one replica per pool at rest).
    - http_options.host 0.0.0.0 -> 127.0.0.1: tests only listen on loopback. Ports are free ones
      (on_free_ports). proxy_location EveryNode stays: one proxy per node, all three on the same
      ports of this machine (Serve's proxies set SO_REUSEPORT).
    """
    config = on_free_ports(config)
    config["http_options"]["host"] = "127.0.0.1"
    for name, (_, model) in POOLS.items():
        args = app_config(config, name)["args"]
        args.update(model=model, device="cpu", dtype="float32", torch_threads=1)
        if name == "drafter":
            args["target"] = DEMO_TARGET
    router_args = app_config(config, "router")["args"]
    for key in ("model", "tokenizer", "served_model_name", "max_context_tokens"):
        router_args.pop(key, None)
    for app in config["applications"]:
        for deployment in app["deployments"]:
            deployment["ray_actor_options"]["num_cpus"] = 0.1
    return config


def gpu_node(accelerator: str) -> dict:
    """A node's arguments: 2 GPUs and `accelerator_type:<accelerator>` as Ray's own detection
    declares them."""
    return {"num_gpus": 2, "resources": {f"accelerator_type:{accelerator}": 1}}


def on_deadline(signum, frame):
    raise TimeoutError(f"placement check still running after {DEADLINE_S}s")


def main() -> None:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    signal.signal(signal.SIGALRM, on_deadline)
    signal.alarm(DEADLINE_S)
    # no dashboard: its processes cost this 2-core machine CPU the check does not need
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, include_dashboard=False, **gpu_node("A100")))
    try:
        nodes = {"A100": cluster.head_node,
                 "H100": cluster.add_node(num_cpus=1, **gpu_node("H100"))}
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="warning")
        config = overridden(load_config("gpu.yaml"))
        start_serve(config)
        deploy(config, timeout_s=240)
        where, replicas = {}, {}
        for name, (deployment, _) in POOLS.items():
            handle = serve.get_deployment_handle(deployment, name)
            # every replica's answer (20 calls reach them all): node, GPUs, model device
            where[name] = list({json.dumps(handle.where.remote().result(), sort_keys=True)
                                for _ in range(20)})
            status = serve.status().applications[name].deployments[deployment]
            replicas[name] = status.replica_states.get("RUNNING", 0)

        port = config["http_options"]["port"]
        response = requests.post(f"http://127.0.0.1:{port}/v1/completions",
                                 json={"prompt": "def ", "max_tokens": 8, "temperature": 0},
                                 timeout=120)
        body = response.json() if response.ok else response.text
        print("PLACEMENT " + json.dumps({
            "nodes": {accelerator: node.node_id for accelerator, node in nodes.items()},
            "where": {name: [json.loads(w) for w in sorted(found)] for name, found in where.items()},
            "replicas": replicas,
            "completion": {"status": response.status_code, "body": body}}), flush=True)
    finally:
        signal.alarm(0)
        try:
            if ray.is_initialized():  # serve.shutdown() would start a Ray of its own otherwise
                serve.shutdown()
        finally:
            try:
                ray.shutdown()
            finally:
                cluster.shutdown()


if __name__ == "__main__":
    main()
