"""``benchmarks/gpu_acceptance.py`` on a tiny model: its CPU parts run here and pass, and every
part that needs a GPU (or a package not installed) is skipped with the reason, in one JSON report
that starts with the device line. Its decisions on a GPU host (which flavour runs on which GPU,
what the exit code says) are checked in-process with the GPU the CUDA driver reports mocked."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploykit.backends.devices import Device
from deploykit.export.precision import PLANS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_acceptance.py"
ENCODINGS = ("ape", "sape2")
H100 = Device("13.0", "580.65.06", "NVIDIA H100 80GB HBM3", "9.0")
L4 = Device("13.0", "580.65.06", "NVIDIA L4", "8.9")


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
    return proc.returncode, json.loads(out.read_text()), proc.stdout


# The plans the acceptance run exports: not an imported one, nor those built for 8.9+ only.
WRITTEN = [name for name, plan in PLANS.items() if not plan.imported and name not in ("fp8", "int8-fp16")]


@pytest.mark.slow
def test_cpu_parts_run_and_pass(report):
    code, data, stdout = report
    checks = {c["name"]: c for c in data["checks"]}
    assert code == 0 and data["summary"]["failed"] == 0, [c for c in data["checks"] if c["status"] == "failed"]
    assert data["device"] and data["environment"]["versions"]["torch"] == torch.__version__
    # No GPU here: no engine check ran, which the summary and the last line say (and exit 0: nothing to accept).
    assert data["summary"]["engine_checks_ran"] == 0 and data["gpu"]["compute_capability"] is None
    assert stdout.strip().splitlines()[-1].endswith("skipped; 0 engine check(s) ran (no GPU here)")
    for encoding in ENCODINGS:
        assert checks[f"export {encoding}"]["status"] == "passed"
        assert checks[f"inspect graph {encoding}"]["status"] == "passed"
        for precision in WRITTEN:  # every plan the export wrote is validated, or skipped with a reason
            check = checks[f"validate ort {encoding} {precision}"]
            assert check["status"] == "passed" or (check["status"] == "skipped" and check["reason"])
        assert checks[f"validate ort {encoding} fp32"]["status"] == "passed"
        if checks[f"build rtx {encoding}"]["status"] != "skipped":
            assert checks[f"build rtx {encoding}"]["status"] == "passed" and checks[f"build rtx {encoding}"]["details"]["engines"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skips on a machine without a GPU")
@pytest.mark.slow  # shares the one-minute acceptance run with the test above
def test_gpu_parts_are_skipped_with_the_reason(report):
    _, data, _ = report
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
                "weight-stripped engines",
            )
        )
        or "plugin library" in c["name"]
    ]
    assert len(gpu_only) >= 2 * len(ENCODINGS) * 4
    ranges = [c for c in gpu_only if c["name"].startswith("resolution-range")]
    # Neither encoding's tables nest: no range graph can be made, which is the reason given (it passed, empty).
    assert len(ranges) == 2 * len(ENCODINGS) and all(c["status"] == "skipped" and "do not nest" in c["reason"] for c in ranges)
    others = [c for c in gpu_only if c not in ranges]
    assert all(c["status"] == "skipped" and ("GPU" in c["reason"] or "not installed" in c["reason"]) for c in others)
    assert all(c["group"] == "engine" for c in gpu_only if not c["name"].startswith("sape2 Triton"))
    names = {c["name"] for c in gpu_only}
    for encoding in ENCODINGS:
        assert {
            f"profile rtx {encoding} cuda graphs on",
            f"profile rtx {encoding} cuda graphs off",
            f"serve rtx {encoding} under concurrent load",
            f"static-batch engine trt {encoding}",
            f"resolution-range engine rtx {encoding}",
            f"cuda graphs match plain runs rtx {encoding}, shapes alternating",
            f"weight-stripped engines rtx {encoding}",
            f"{encoding} with the plugin library None on trt",
        } <= names
    others = {c["name"]: c for c in data["checks"]}
    for encoding in ENCODINGS:  # skipped for what this machine lacks, said
        assert others[f"tritonserver loads the packaged {encoding} repository"]["status"] == "skipped"
        placement = others[f"ort-cuda node placement {encoding}"]
        assert placement["status"] == "skipped" and placement["reason"] == "onnxruntime has no CUDA provider"


@pytest.fixture(scope="module")
def script():
    """The acceptance script as a module (its sibling imports, ``checks``, resolve from benchmarks/)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        yield importlib.import_module("gpu_acceptance")
    finally:
        sys.path.remove(str(SCRIPT.parent))


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    from deploykit.export import export
    from deploykit.nn import create_model

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny") / "exp"
    export(create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=10).eval(), [(32, 32)], out)
    return out


def test_on_an_h100_every_rtx_check_is_skipped_for_its_compute_capability(script, tiny_export, capsys):
    """TensorRT-RTX does not run on compute capability 9.0: its checks failed there (issue 42)."""
    checks = script.Checks()
    script.engine_checks("rtx", {"ape": tiny_export}, 0.05, checks, H100)
    assert checks.items and all(c["status"] == "skipped" for c in checks.items), checks.items
    reasons = {c["name"]: c["reason"] for c in checks.items}
    assert reasons.pop("resolution-range engine rtx ape").startswith("ape tables do not nest")
    assert all("NVIDIA H100 80GB HBM3 (compute capability 9.0) is not supported by rtx" in r for r in reasons.values()), reasons
    assert "build rtx ape" in reasons  # not even built: an engine for another GPU is of no use here
    assert checks.ran("engine") == 0


def test_the_gpu_is_the_cuda_driver_s_answer_not_torch_s(script):
    """With a CPU build of torch on a GPU host every GPU check was skipped (issue 42)."""
    assert not torch.cuda.is_available()  # this machine's torch: a CPU build
    assert script.no_gpu(L4) is None and script.unsupported("rtx", L4) is None and script.unsupported("trt", H100) is None
    assert script.no_gpu(Device()) == "no CUDA GPU here (the CUDA driver reports none)"
    assert script.unsupported("rtx", Device()) is None  # no GPU: TensorRT-RTX still builds


def _checks(script, *items):
    checks = script.Checks()
    for name, status in items:
        checks.add({"name": name, "group": "engine", "status": status, **({"reason": "r"} if status != "passed" else {})})
    checks.add({"name": "export ape", "status": "passed"})  # a CPU check: not an engine check
    return checks


def test_a_gpu_host_where_no_engine_check_ran_exits_2_and_says_so(script):
    skipped = _checks(script, ("static-batch engine trt ape", "skipped"), ("validate rtx ape fp32", "skipped"))
    counts, line, code = script.summary(skipped, H100)
    assert code == 2 and counts["engine_checks_ran"] == 0 and counts["passed"] == 1
    assert "0 engine check(s) ran on NVIDIA H100 80GB HBM3 (compute capability 9.0)" in line and line.endswith("(exit 2)")
    assert script.summary(skipped, Device())[2] == 0  # no GPU: nothing could run, nothing to accept
    ran = _checks(script, ("static-batch engine trt ape", "passed"), ("validate rtx ape fp32", "skipped"))
    counts, line, code = script.summary(ran, H100)
    assert code == 0 and counts["engine_checks_ran"] == 1 and "; 1 engine check(s) ran on NVIDIA H100" in line
    failed = _checks(script, ("static-batch engine trt ape", "failed"))
    assert script.summary(failed, H100)[2] == 1
    assert "2 a GPU is here but no engine check ran" in " ".join(script.__doc__.split())  # documented with the run
