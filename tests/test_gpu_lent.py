"""``benchmarks/gpu_lent.py``, the run a session lent a GPU makes first: its CPU half (``--dry-run``)
runs here as it runs there, from a Python where deploykit is not installed (the lent machine's),
and without a GPU the full run refuses in one line instead of reporting nothing as a pass."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploykit.encodings import list_encodings

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_lent.py"
# The lent GPU's Python: deploykit is not installed there, nor TensorRT, Polygraphy or graphsurgeon.
AS_ON_THE_LENT_GPU = """
import runpy, sys
sys.modules.update(dict.fromkeys(["onnx_graphsurgeon", "polygraphy", "tensorrt", "tensorrt_rtx", "openvino"]))
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
script = sys.argv[1]
sys.path.insert(0, script.rsplit("/", 1)[0])
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""
GPU_CHECKS = ("sape2 kernels @", "goal:", "sape2 plugin launches", "profile torch cuda")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu_lent")
    out = work / "report.json"
    cmd = [sys.executable, "-c", AS_ON_THE_LENT_GPU, str(SCRIPT), "--dry-run", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, timeout=1800)  # a guard against a hang, not a timing
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(out.read_text())


@pytest.mark.slow
def test_dry_run_compiles_the_plugin_kernel_and_checks_every_encoding_from_the_checkout(dry_run):
    assert importlib.util.find_spec("deploykit") is not None  # control: here it is installed; the run did not see it
    code, report = dry_run
    assert code == 0 and report["summary"]["failed"] == 0, [c for c in report["checks"] if c["status"] == "failed"]
    assert list(report)[0] == "device" and report["dry_run"] is True
    assert report["deploykit"] == "this checkout, not installed"
    checks = {c["name"]: c for c in report["checks"]}

    compiled = checks["sape2 plugin kernels compile for Hopper with the launch's parameters"]
    rows = compiled["details"]["rows"]
    assert [r["parameters"] for r in rows] == [5] * len(rows)  # q, k, table_x, table_y, bias: what TensorRT passes
    assert all(r["ptx_target"] == "sm_90a" for r in rows)
    # No instance needs the shared-memory opt-in a TensorRT AOT launch may not make (the hat form of
    # the last shape took 72 KiB: a launch without the opt-in was refused on an H200).
    assert all(r["shared_mem"] <= 48 * 1024 for r in rows) and rows[-1]["shape"] == "384, tables for 2048 px"

    for encoding in list_encodings():
        check = checks[f"encoding {encoding} on cpu against float64"]
        assert check["status"] == "passed" and len(check["details"]["rows"]) == 2, check
    skipped = [c for c in report["checks"] if c["name"].startswith(GPU_CHECKS)]
    assert len(skipped) == 7 and all(c["status"] == "skipped" and c["reason"].startswith("needs a CUDA GPU") for c in skipped)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the full run would start")
def test_without_a_gpu_the_full_run_refuses_in_one_line(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: no GPU checks can run: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert not out.exists()
