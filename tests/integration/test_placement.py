"""Placement on hardware classes, on a local multi-node Ray (custom resources as GPU classes).

It needs a Ray cluster of its own, so it runs in a child process (placement_check.py) that
starts and stops that cluster; the shared single-node instance of the other tests is untouched.
"""

import json
import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT


@pytest.mark.slow
def test_drafter_lands_on_small_gpu_nodes_and_verifier_on_large_ones():
    result = subprocess.run([sys.executable, "tests/integration/placement_check.py"], cwd=ROOT,
                            capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("PLACEMENT "))
    report = json.loads(line.removeprefix("PLACEMENT "))
    assert report["where"]["drafter"] == [report["small"]]
    assert report["where"]["verifier"] == [report["large"]]
