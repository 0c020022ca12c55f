"""``import deploykit`` is the front door: the whole workflow, imported on first use, with typed results."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import deploykit
from deploykit.errors import DeployKitError, ValidationError

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["build", "create_model", "export", "list_encodings", "list_models", "load", "profile", "validate"]


def test_import_deploykit_loads_neither_torch_nor_onnxruntime():
    code = "import json, sys, deploykit\nprint(json.dumps([sorted(dir(deploykit)), sorted(m for m in ('torch', 'onnxruntime') if m in sys.modules)]))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    names, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    assert heavy == [] and set(STEPS) <= set(names)


def test_each_step_stays_the_function_after_its_module_is_imported():
    import deploykit.backends.build
    import deploykit.export.bundle
    import deploykit.profile.run
    import deploykit.validation.run

    assert [getattr(deploykit, step).__module__ for step in STEPS] == ["deploykit.api"] * len(STEPS)


def test_the_root_module_type_is_a_plain_module():
    """No class swap keeps the steps apart from their modules: only ``export/`` and ``profile/``
    share a step's name, and the root binds the steps over them once."""
    assert type(deploykit) is types.ModuleType
    assert {step for step in STEPS if importlib.util.find_spec(f"deploykit.{step}") is not None} == {"export", "profile"}


def test_no_code_reaches_a_step_module_through_the_package_attribute():
    """``from deploykit import export`` and ``import deploykit.export as m`` give the function, not the package."""
    shadowed = r"(build|export|profile|validate)"
    pattern = re.compile(rf"^\s*(from deploykit import .*\b{shadowed}\b|import deploykit\.{shadowed}\b.* as )", re.M)
    files = [p for folder in ("deploykit", "tests", "benchmarks", "plugins", "examples") for p in (ROOT / folder).rglob("*.py")]
    root = ROOT / "deploykit" / "__init__.py"  # loads the two packages before binding the steps over them
    offenders = [str(p.relative_to(ROOT)) for p in files if p != root and pattern.search(p.read_text(encoding="utf-8"))]
    assert offenders == []


def test_the_names_need_no_torch_to_list():
    assert "rope-mixed" in deploykit.list_encodings() and "vit_tiny_patch16" in deploykit.list_models()


def test_the_workflow_from_python(tmp_path):
    """create_model → export → validate → profile (writes the choice) → load, each result typed."""
    model = deploykit.create_model("vit_tiny_patch16", depth=1, img_size=32, num_classes=10).eval()
    exported = deploykit.export(model, tmp_path / "out")
    assert exported and [g["file"] for g in exported.to_json()["graphs"]] == ["model_32.onnx"]
    exported.raise_for_failure()

    report = deploykit.validate(exported.directory, num_random=2, num_real=2)
    assert report and {r["backend"] for r in report.to_json()} == {"ort"}
    report.raise_for_failure()

    profiled = deploykit.profile(exported.directory, batches=[1], iterations=2, warmup=1, rounds=1, end_to_end=False, compare_ape=False)
    assert profiled and profiled.choice == exported.directory / "profile_choice.json" and profiled.choice.is_file()
    assert {r["backend"] for r in profiled.to_json()["records"]} == {"torch", "ort"}

    prediction = deploykit.load(exported.directory, top_k=3)(np.zeros((32, 32, 3), np.uint8))
    assert len(prediction.classes) == 3 and prediction.resolution == (32, 32)


def test_a_failed_profile_check_raises(tmp_path):
    from deploykit.api import ProfileResult
    from deploykit.profile.report import ProfileRecord, ProfileReport, Verdict
    from deploykit.profile.timing import LatencyStats

    kernel = LatencyStats(
        p50_ms=1.0, p90_ms=1.1, p95_ms=1.15, p99_ms=1.2, mean_ms=1.0, std_ms=0.1, min_ms=0.9, max_ms=1.3, n=5, throughput_per_s=1000.0
    )
    record = ProfileRecord("ort", "int8", "ape", "32", 1, kernel, verdict=Verdict(False, ("top-1 agreement 0.5 < 0.99",)))
    failed = ProfileResult(ProfileReport([record], {}, {}))
    assert not failed
    with pytest.raises(ValidationError, match="ort int8 @ 32"):
        failed.raise_for_failure()
    with pytest.raises(DeployKitError, match="nothing was profiled: no engine"):
        ProfileResult(ProfileReport([], {}, {}, notes=["no engine"])).raise_for_failure()


def test_bad_input_is_a_deploykit_error(tmp_path):
    with pytest.raises(DeployKitError, match="unknown"):
        deploykit.create_model("vit_nope")
    with pytest.raises(DeployKitError):
        deploykit.validate(tmp_path)  # not an export directory
