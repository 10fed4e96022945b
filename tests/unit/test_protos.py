"""The committed generated modules are exactly what the documented command writes."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ["specserve_pb2.py", "specserve_pb2.pyi", "specserve_pb2_grpc.py"]


def test_generated_modules_are_current(tmp_path):
    (tmp_path / "protos").mkdir()
    shutil.copy(ROOT / "protos" / "specserve.proto", tmp_path / "protos")
    # the command documented at the top of specserve.proto
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
         "--grpc_python_out=.", "protos/specserve.proto"],
        cwd=tmp_path, check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "protos" / name).read_bytes()
        committed = (ROOT / "protos" / name).read_bytes()
        assert fresh == committed, f"protos/{name} is stale: regenerate it (see specserve.proto)"
