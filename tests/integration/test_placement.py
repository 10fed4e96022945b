"""cluster/gpu.yaml as operators deploy it, on a local multi-node Ray whose nodes declare GPUs
and accelerator types (`accelerator_type:A100`, `accelerator_type:H100`): the pools land on their
class by the file's own ray_actor_options, and the whole deployed file serves a completion.
Only the models (the demo pair), the device (CPU), CPU counts and the HTTP host are overridden
(placement_check.overridden says which and why).

It needs a Ray cluster of its own, so it runs in a child process (placement_check.py) that
starts and stops that cluster; the shared single-node instance of the other tests is untouched.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT
from tests.integration.placement_check import DEADLINE_S


def run_check() -> dict:
    # its own process group: if it outlives its own deadline, it and what it started die together
    process = subprocess.Popen([sys.executable, "tests/integration/placement_check.py"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=DEADLINE_S + 60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr[-3000:]
    line = next(line for line in stdout.splitlines() if line.startswith("PLACEMENT "))
    return json.loads(line.removeprefix("PLACEMENT "))


@pytest.mark.slow
def test_gpu_yaml_places_pools_by_accelerator_type_and_serves():
    report = run_check()
    nodes = report["nodes"]
    assert report["replicas"] == {"drafter": 1, "verifier": 1}  # autoscaling's min_replicas
    # one replica per pool, on its class's node, holding a Ray GPU that does not exist:
    # CUDA_VISIBLE_DEVICES names it, the model stays on the CPU its args ask for
    for pool, accelerator in (("drafter", "A100"), ("verifier", "H100")):
        [where] = report["where"][pool]
        assert where["node"] == nodes[accelerator]
        assert where["cuda_visible_devices"] == ",".join(where["gpu_ids"]) != ""
        assert where["device"] == "cpu"
    completion = report["completion"]
    assert completion["status"] == 200, completion["body"]
    assert completion["body"]["choices"] and completion["body"]["choices"][0]["text"]
