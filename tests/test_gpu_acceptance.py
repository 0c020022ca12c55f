"""``benchmarks/gpu_acceptance.py`` on a tiny model: its CPU parts run here and pass, and every
part that needs a GPU (or a package not installed) is skipped with the reason, in one JSON report
that starts with the device line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploykit.export.precision import PRECISIONS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_acceptance.py"
ENCODINGS = ("ape", "sape2")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("acceptance") / "report.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--model",
        "vit_tiny_patch16",
        "--depth",
        "1",
        "--img-size",
        "32",
        "--one-resolution",
        "--encodings",
        ",".join(ENCODINGS),
        "--budget",
        "0.05",
        # An untrained tiny model: INT8 agreement means nothing there, and the fallback's search
        # would take most of the run; calibrate on few inputs and check the plan's tolerance only.
        "--calibration-samples",
        "16",
        "--held-out",
        "32",
        "--min-agreement",
        "none",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)  # a guard against a hung run, not a timing
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(out.read_text())


@pytest.mark.slow
def test_cpu_parts_run_and_pass(report):
    code, data = report
    checks = {c["name"]: c for c in data["checks"]}
    assert code == 0 and data["summary"]["failed"] == 0, [c for c in data["checks"] if c["status"] == "failed"]
    assert data["device"] and data["environment"]["versions"]["torch"] == torch.__version__
    for encoding in ENCODINGS:
        assert checks[f"export {encoding}"]["status"] == "passed"
        assert checks[f"inspect graph {encoding}"]["status"] == "passed"
        for precision in PRECISIONS:  # every plan the export wrote is validated, or skipped with a reason
            check = checks[f"validate ort {encoding} {precision}"]
            assert check["status"] == "passed" or (check["status"] == "skipped" and check["reason"])
        assert checks[f"validate ort {encoding} fp32"]["status"] == "passed"
        if checks[f"build rtx {encoding}"]["status"] != "skipped":
            assert checks[f"build rtx {encoding}"]["status"] == "passed" and checks[f"build rtx {encoding}"]["details"]["engines"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skips on a machine without a GPU")
@pytest.mark.slow  # shares the one-minute acceptance run with the test above
def test_gpu_parts_are_skipped_with_the_reason(report):
    _, data = report
    assert "no GPU" in data["device"]
    gpu_only = [
        c
        for c in data["checks"]
        if c["name"].startswith(
            (
                "validate rtx",
                "validate trt",
                "profile ",
                "inspect engine",
                "serve ",
                "sape2 ",
                "static-batch",
                "resolution-range",
                "cuda graphs",
            )
        )
        or "plugin library" in c["name"]
    ]
    assert len(gpu_only) >= 2 * len(ENCODINGS) * 4
    assert all(c["status"] == "skipped" and ("GPU" in c["reason"] or "not installed" in c["reason"]) for c in gpu_only)
    names = {c["name"] for c in gpu_only}
    for encoding in ENCODINGS:
        assert {
            f"profile rtx {encoding} cuda graphs on",
            f"profile rtx {encoding} cuda graphs off",
            f"serve rtx {encoding} under concurrent load",
            f"static-batch engine trt {encoding}",
            f"resolution-range engine rtx {encoding}",
            f"cuda graphs match plain runs rtx {encoding}, shapes alternating",
            f"{encoding} with the plugin library None on trt",
        } <= names
    others = {c["name"]: c for c in data["checks"]}
    for encoding in ENCODINGS:  # skipped for what this machine lacks, said
        assert others[f"tritonserver loads the packaged {encoding} repository"]["status"] == "skipped"
        placement = others[f"ort-cuda node placement {encoding}"]
        assert placement["status"] == "skipped" and placement["reason"] == "onnxruntime has no CUDA provider"
