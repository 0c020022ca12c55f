"""What is served is what was exported and checked: every precision plan the export holds can be
loaded and served, and every file that changes an answer (graphs, ``config.json``) is covered by
``manifest.json``; a changed or uncovered one is refused in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import SERVED_PLANS
from serve_reference import ort_logits

import deploykit
from deploykit.errors import DeployKitError, InputError


@pytest.mark.slow
@pytest.mark.parametrize("precision", SERVED_PLANS)
def test_load_serves_every_plan_the_export_holds(plans_export_dir, precision):
    x = np.random.default_rng(3).standard_normal((2, 3, 32, 32), dtype=np.float32)
    with deploykit.load(plans_export_dir, precision=precision, backend="ort") as pipe:
        assert pipe.precision == precision and pipe.resolutions == [(32, 32), (48, 48)]
        got = pipe.logits(x)
    np.testing.assert_array_equal(got, ort_logits(plans_export_dir, x, precision))
    if precision in ("fp16", "int8", "int8-dynamic"):  # really that plan's graph, not fp32's under another name
        assert not np.array_equal(got, ort_logits(plans_export_dir, x, "fp32"))


def test_a_plan_the_export_does_not_hold_is_one_line(export_dir):
    with pytest.raises(DeployKitError, match=r"^no int8 graphs at a fixed resolution exported \(exported: 32, 48\)"):
        deploykit.load(export_dir, precision="int8", backend="ort")
    with pytest.raises(DeployKitError, match="unknown precision 'fp64'; choose one of: fp32, fp16"):
        deploykit.load(export_dir, precision="fp64", backend="ort")


@pytest.fixture
def copied_export(export_dir, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(export_dir, out)
    return out


def _edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_an_edited_config_is_refused_by_load_and_validate(copied_export):
    """The normalisation mean/std live in config.json: an edit changes every served answer."""
    from deploykit.validation.run import validate

    _edit_json(copied_export / "config.json", lambda c: c.update(mean=[0.0, 0.0, 0.0]))
    for run in (lambda: deploykit.load(copied_export, backend="ort"), lambda: validate(copied_export, backends=["ort"])):
        with pytest.raises(
            DeployKitError, match=r"config.json changed since export \(sha256 differs from manifest.json\); re-run deploykit export"
        ):
            run()


def test_a_manifest_that_does_not_cover_the_config_is_refused_naming_the_fix(copied_export):
    _edit_json(copied_export / "manifest.json", lambda m: m.pop("config_sha256"))
    with pytest.raises(
        DeployKitError, match=r"does not record config.json's sha256 \(written by an older deploykit\); re-run deploykit export$"
    ):
        deploykit.load(copied_export, backend="ort")


def test_graph_metadata_and_manifest_must_agree_on_the_encoding(copied_export):
    _edit_json(copied_export / "manifest.json", lambda m: m.update(encoding="rope-axial"))
    with pytest.raises(
        DeployKitError, match="disagrees with .*model_32.onnx: encoding rope-axial in the manifest, ape in the graph; re-run"
    ):
        deploykit.load(copied_export, backend="ort")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_are_refused(export_dir, value):
    x = np.zeros((2, 3, 32, 32), np.float32)
    x[1, 2, 3, 4] = value
    with (
        deploykit.load(export_dir, backend="ort") as pipe,
        pytest.raises(InputError, match="^images hold 1 NaN/Inf values; send finite numbers$"),
    ):
        pipe.logits(x)
