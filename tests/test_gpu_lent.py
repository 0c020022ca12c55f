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
GPU_CHECKS = ("sape2 kernels @", "goal:", "sape2 plugin launches")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu_lent")
    out, kernels = work / "report.json", work / "kernels.json"
    cmd = [sys.executable, "-c", AS_ON_THE_LENT_GPU, str(SCRIPT), "--dry-run", "--out", str(out), "--kernels-out", str(kernels)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, timeout=1800)  # a guard against a hang, not a timing
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not kernels.exists()  # the kernel table is rewritten by GPU runs only
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
    assert [r["parameters"] for r in rows] == [3] * len(rows)  # zx, zy, bias: what TensorRT passes
    assert all(r["ptx_target"] == "sm_90a" for r in rows)
    # No instance needs the shared-memory opt-in a TensorRT AOT launch may not make (the hat form of
    # the last shape took 72 KiB: a launch without the opt-in was refused on an H200).
    assert all(r["shared_mem"] <= 48 * 1024 for r in rows) and rows[-1]["shape"] == "384, tables for 2048 px"

    for encoding in list_encodings():
        check = checks[f"encoding {encoding} on cpu against float64"]
        assert check["status"] == "passed" and len(check["details"]["rows"]) == 2, check
    skipped = [c for c in report["checks"] if c["name"].startswith(GPU_CHECKS)]
    assert len(skipped) == 5 and all(c["status"] == "skipped" and c["reason"].startswith("needs a CUDA GPU") for c in skipped)


@pytest.mark.slow
def test_dry_run_runs_the_new_gpu_checks_on_the_cpu(dry_run):
    """Issue 51's checks run in the dry run at small sizes: the machine's rates, the bias against
    its floor (L2 warm and flushed), the plugin's kernel, the op's modes, a non-square grid, head
    sizes, clamped tables and batch 64 against float64 (Triton's interpreter), the model ratio
    and profile on the CPU."""
    _, report = dry_run
    checks = {c["name"]: c for c in report["checks"]}
    rates = checks["machine rates (cpu)"]["details"]
    assert rates["bandwidth_gb_s"] > 0 and rates["fp32_tflops"] > 0 and rates["tf32_tflops"] > 0

    floor = checks["sape2 bias floor @ dry 64 (interpreted)"]
    assert floor["status"] == "passed" and floor["details"]["rel_err_vs_float64"] <= 1e-5
    d = floor["details"]
    bound = max(d["bytes"] / (rates["bandwidth_gb_s"] * 1e9), d["flops"] / (rates["fp32_tflops"] * 1e12)) * 1e3
    assert d["floor_ms"] == pytest.approx(bound) and d["bias_ms_p50"] > 0 and d["bias_ms_p50_l2_flushed"] > 0
    assert d["ratio_to_floor_l2_flushed"] == pytest.approx(d["bias_ms_p50_l2_flushed"] / d["floor_ms"])
    assert checks["sape2 plugin kernel @ dry 64 (interpreted)"]["status"] == "passed"

    op = checks["sape2 op against float64: modes, non-square, head dims, clamping, batch 64 (interpreted)"]
    cases = {row["case"]: row for row in op["details"]["rows"]}
    assert op["status"] == "passed" and len(cases) == 8
    assert {"head dim 32", "head dim 80", "head dim 128", "batch 64"} <= set(cases) and cases["batch 64"]["batch"] == 64
    assert all(row["rel_err_vs_float64"] <= 1e-5 and row["diag_zero"] for row in cases.values())

    ratio = checks["sape2/ape model ratio (cpu)"]["details"]
    assert ratio["sape2_over_ape"] == pytest.approx(ratio["ms_p50"]["sape2"] / ratio["ms_p50"]["ape"]) and not ratio["cuda_graph_replay"]
    assert checks["goal: sape2/ape model ratio <= 1.3"]["status"] == "skipped"  # no GPU goal is judged on the CPU

    profile = checks["profile torch cpu vit_tiny_patch16"]
    assert profile["status"] == "passed" and {r["encoding"] for r in profile["details"]["records"]} == {"ape", "sape2"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the full run would start")
def test_without_a_gpu_the_full_run_refuses_in_one_line(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: no GPU checks can run: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert not out.exists()


def test_a_dry_run_refuses_to_write_over_the_committed_gpu_report(tmp_path):
    """``--dry-run`` as benchmarks/README.md listed it wrote its CPU results over the H200 report."""
    committed = SCRIPT.parents[0] / "results" / "gpu-lent.json"
    assert json.loads(committed.read_text())["dry_run"] is False  # control: the evidence at stake
    out = tmp_path / "gpu-lent.json"
    out.write_bytes(committed.read_bytes())
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 2 and out.read_bytes() == committed.read_bytes()
    assert proc.stderr.startswith(f"error: {out} holds a report of a run that was not dry") and proc.stderr.count("\n") == 1, proc.stderr
    assert "error:" not in proc.stdout


def test_a_dry_run_without_out_writes_outside_the_results(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_lent_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert module.DRY_RUN_RESULTS.parent != module.RESULTS.parent
    report = tmp_path / "dry.json"
    report.write_text(json.dumps({"device": "x", "dry_run": True}))
    assert module.refuse_to_replace(report) is None  # a dry run's own report may be replaced
    report.write_text("not json")
    assert "is not a gpu_lent report" in module.refuse_to_replace(report)
