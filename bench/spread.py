"""Where requests of one hot prompt prefix land: `serve run` of the embedded config with two
verifier replicas, 16 streams whose prompts share their first 60 tokens (an app's fixed
system prompt), once placed by the prefix alone and once under the bounded load
(deployments.placement); prints each replica's sessions while the streams run.

    python -m bench.spread            # ~3 minutes on 2 cores
"""

import argparse
import tempfile
import threading
import time
from pathlib import Path

import requests
import yaml

from bench.newcomer import start, stop_group
from deployments.local import load_config, on_free_ports

SHARED = "# a system prompt every request of this app begins with, the same each time\n" * 3


def config_with(load_factor: float | None, replicas: int) -> dict:
    config = on_free_ports(load_config())
    for app in config["applications"]:
        if app["name"] == "verifier":
            deployment = app["deployments"][0]
            deployment["num_replicas"] = replicas
            deployment["ray_actor_options"] = {"num_cpus": 1 / replicas}
        if app["name"] == "router":
            app["args"]["prefix_affinity_load_factor"] = load_factor
    return config


def sessions_per_replica(polls: int = 16) -> list[int]:
    """Each verifier replica's sessions, from handle calls Serve spreads over them."""
    import ray
    from ray import serve

    ray.init(address="auto", logging_level="ERROR", ignore_reinit_error=True)
    handle = serve.get_deployment_handle("VerifierPool", "verifier")
    seen = {}
    for _ in range(polls):
        ids = handle.session_ids.remote().result()
        seen[frozenset(ids)] = len(ids)
    ray.shutdown()
    return sorted(seen.values(), reverse=True)


def run(load_factor: float | None, streams: int, replicas: int) -> dict:
    config = config_with(load_factor, replicas)
    port = config["http_options"]["port"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        process, _ = start(path, port)
        try:
            statuses = []

            def one(i: int) -> None:
                statuses.append(requests.post(
                    f"http://127.0.0.1:{port}/v1/completions", timeout=600,
                    json={"prompt": SHARED + f"def f{i}(", "max_tokens": 200,
                          "temperature": 0, "ignore_eos": True}).status_code)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
            for thread in threads:
                thread.start()
            time.sleep(1.0)  # every first call placed
            spread = sessions_per_replica()
            for thread in threads:
                thread.join()
        finally:
            stop_group(process)
    return {"load_factor": load_factor, "sessions_per_replica": spread,
            "ok": statuses.count(200)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    for load_factor in [None, 1.25]:
        result = run(load_factor, args.streams, args.replicas)
        print(f"load factor {str(load_factor):>4}: sessions per verifier replica "
              f"{result['sessions_per_replica']}, {result['ok']}/{args.streams} answered",
              flush=True)


if __name__ == "__main__":
    main()
