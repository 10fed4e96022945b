"""Where requests of one hot prompt prefix land: `serve run` of the embedded config with two
verifier replicas, 16 streams whose prompts share their first 60 tokens (an app's fixed
system prompt), once placed by the prefix alone and once under the bounded load
(deployments.placement); prints each replica's sessions while the streams run.

    python -m bench.spread            # ~3 minutes on 2 cores
"""

import argparse
import json
import subprocess
import sys
import threading
import time

import requests

from bench.newcomer import fresh_serve_run
from deployments.local import load_config

SHARED = "# a system prompt every request of this app begins with, the same each time\n" * 3


def config_with(load_factor: float | None, replicas: int) -> dict:
    config = load_config()
    for app in config["applications"]:
        if app["name"] == "verifier":
            deployment = app["deployments"][0]
            deployment["num_replicas"] = replicas
            deployment["ray_actor_options"] = {"num_cpus": 1 / replicas}
        if app["name"] == "router":
            app["args"]["prefix_affinity_load_factor"] = load_factor
    return config


def poller(streams: int) -> subprocess.Popen:
    """A process of its own that watches each verifier replica's sessions (a driver's Serve
    client outlives its Ray connection: a second run's calls went to the first run's dead
    controller)."""
    return subprocess.Popen([sys.executable, "-m", "bench.spread", "--poll", str(streams)],
                            stdout=subprocess.PIPE, text=True)


def poll_sessions(streams: int, seconds: float = 120.0) -> None:
    """Print the sessions per replica when the most requests were held (all of them, or
    the most seen within `seconds`), from handle calls Serve spreads over the replicas."""
    import ray
    from ray import serve

    ray.init(address="auto", logging_level="ERROR")
    handle = serve.get_deployment_handle("VerifierPool", "verifier")
    best, ends = [], time.monotonic() + seconds
    while sum(best) < streams and time.monotonic() < ends:
        seen = {}
        for _ in range(8):
            ids = handle.session_ids.remote().result()
            seen[frozenset(ids)] = len(ids)
        if sum(seen.values()) > sum(best):
            best = sorted(seen.values(), reverse=True)
        time.sleep(0.2)
    print(json.dumps(best), flush=True)


def all_at_once(work, count: int) -> float:
    """Seconds for work(0), ..., work(count - 1), each on its own thread, all at once."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def run(load_factor: float | None, streams: int, replicas: int) -> dict:
    with fresh_serve_run(config_with(load_factor, replicas)) as (port, _):
        statuses, watching = [], poller(streams)
        time.sleep(8.0)  # its Ray connection made

        def one(i: int) -> None:
            statuses.append(requests.post(
                f"http://127.0.0.1:{port}/v1/completions", timeout=600,
                json={"prompt": SHARED + f"def f{i}(", "max_tokens": 200, "temperature": 0,
                      "ignore_eos": True}).status_code)

        seconds = all_at_once(one, streams)
        spread = json.loads(watching.communicate(timeout=180)[0].strip().splitlines()[-1])
    return {"load_factor": load_factor, "sessions_per_replica": spread,
            "ok": statuses.count(200), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--poll", type=int, help=argparse.SUPPRESS)  # sessions_per_replica's
    args = parser.parse_args()
    if args.poll:
        return poll_sessions(args.poll)
    for load_factor in [None, 1.25]:
        result = run(load_factor, args.streams, args.replicas)
        print(f"load factor {str(load_factor):>4}: sessions per verifier replica "
              f"{result['sessions_per_replica']}, {result['ok']}/{args.streams} answered in "
              f"{result['seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
