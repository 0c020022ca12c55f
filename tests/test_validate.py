"""validate(): every baseline passes at several resolutions; a planted error is caught and located."""

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from deploykit.checks import Reference, judge
from deploykit.encodings import list_encodings
from deploykit.errors import ConfigError, DeployKitError, ValidationError
from deploykit.export.manifest import MANIFEST_FILE, sha256_file
from deploykit.export.precision import PLANS
from deploykit.runners.onnxrt import OnnxrtRunner
from deploykit.validation.run import validate
from tests.encoding_params import EXPORT_RESOLUTIONS

RESOLUTIONS = [list(r) for r in EXPORT_RESOLUTIONS]  # 1x, 2x and a 32x32 patch grid


@pytest.fixture(scope="module", params=list_encodings())
def export_dir(request, encoding_export):
    return encoding_export(request.param)


@pytest.mark.slow
def test_passes_at_every_resolution(export_dir):
    report = validate(export_dir, num_random=2, num_real=4)
    assert bool(report)
    assert [r.resolution for r in report.records] == RESOLUTIONS
    for r in report.records:
        assert r.max_abs <= 1e-4 and r.cosine >= 0.99999 and r.nan_count == 0
        assert r.top1_agreement == 1.0 and r.num_inputs == 6
    json.dumps(report.to_json())  # serialisable


def _plant_error_in_block(src, dst, block):
    """Copy an export and scale one weight of ``blocks.<block>.mlp.fc2`` in its 64 px graph."""
    shutil.copytree(src, dst)
    path = dst / "model_64.onnx"
    proto = onnx.load(str(path))
    # MatMul weights are stored transposed under exporter-chosen names; find fc2's by its node scope.
    node = next(
        n
        for n in proto.graph.node
        if n.op_type in ("MatMul", "Gemm") and any(f"blocks.{block}.mlp.fc2" in p.value for p in n.metadata_props)
    )
    init = next(i for i in proto.graph.initializer if i.name in node.input)
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 1.5, init.name))
    onnx.save(proto, str(path))
    manifest = json.loads((dst / MANIFEST_FILE).read_text())
    for g in manifest["graphs"]:
        if g["file"] == "model_64.onnx":
            g["sha256"] = sha256_file(path)
    (dst / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.slow
def test_planted_error_fails_and_names_the_block(export_dir, tmp_path):
    _plant_error_in_block(export_dir, tmp_path / "bad", block=1)
    report = validate(tmp_path / "bad", resolutions=[(64, 64)], num_random=2, num_real=2)
    assert not report
    (record,) = report.records
    assert record.first_divergent_block == "blocks.1"
    assert any("max abs" in f for f in record.failures)
    with pytest.raises(ValidationError, match="ort@64"):
        report.raise_for_failure()


# The checks below are the same for every encoding: they share the small export of conftest.py
# rather than paying for an export per encoding.
def test_graph_changed_since_export_is_refused(good_export, tmp_path):
    shutil.copytree(good_export, tmp_path / "x")
    with open(tmp_path / "x" / "model_32.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(DeployKitError, match="changed since export"):
        validate(tmp_path / "x", resolutions=[(32, 32)])


def test_bad_arguments(good_export, tmp_path):
    with pytest.raises(ConfigError, match="ort"):
        validate(good_export, backends=["nope"])
    with pytest.raises(ConfigError, match="fp32"):
        validate(good_export, precision="fp4")
    with pytest.raises(DeployKitError, match="no graph exported at 320"):
        validate(good_export, resolutions=[(320, 320)])
    with pytest.raises(DeployKitError, match="not a deploykit export directory"):
        validate(tmp_path)


def test_fp32_criteria_metrics():
    ref = np.array([[1.0, 2.0, 3.0, 0.0, -1.0, 0.5], [0.0, 0.0, 1.0, 2.0, 3.0, 4.0]])
    fp32 = lambda actual: judge(Reference.of_outputs(ref, 2), actual, PLANS["fp32"].criteria).result
    same = fp32(ref.copy())
    assert same.passed and same.metrics["max_abs"] == 0 and same.metrics["top1_agreement"] == 1.0
    swapped = ref.copy()
    swapped[0, [1, 2]] = swapped[0, [2, 1]]  # changes the arg-max of row 0 only
    m = fp32(swapped)
    assert not m.passed and m.metrics["top1_agreement"] == 0.5 and m.metrics["max_abs"] == 1.0
    nan = ref.copy()
    nan[1, 0] = np.nan
    m = fp32(nan)
    assert m.metrics["nan_count"] == 1 and not m.passed


def test_reference_weights_changed_since_export_are_refused(good_export, tmp_path):
    shutil.copytree(good_export, tmp_path / "w")
    from deploykit.nn import load_model, save_model

    model = load_model(tmp_path / "w")
    with torch.no_grad():
        model.head.bias.add_(1.0)
    save_model(model, tmp_path / "w")
    with pytest.raises(DeployKitError, match="model.safetensors changed since export"):
        validate(tmp_path / "w")


class _ProfiledEngine(OnnxrtRunner):
    """Stands in for a dynamic-batch engine (ONNX Runtime underneath): it has a min/opt/max
    profile and, like an engine, refuses any other shape; records every batch it was fed."""

    name = "engine"
    seen: list[int] = []

    @property
    def profiled_shapes(self):
        return tuple((b, 3, 64, 64) for b in (1, 3, 8))

    def _infer(self, feed):
        shape = next(iter(feed.values())).shape
        assert shape in self.profiled_shapes, f"fed {shape}"
        self.seen.append(shape[0])
        return super()._infer(feed)


@pytest.mark.slow
def test_engine_is_validated_at_every_profiled_batch(encoding_export, stand_in_backend):
    stand_in_backend("engine", lambda path, options: _ProfiledEngine(path))
    _ProfiledEngine.seen = []
    report = validate(encoding_export("ape"), resolutions=[(64, 64)], backends=("ort", "engine"), num_random=2, num_real=3)
    assert bool(report)
    assert [(r.backend, r.batch, r.profiled) for r in report.records] == [
        ("ort", 4, False),
        ("engine", 1, True),
        ("engine", 3, True),
        ("engine", 8, True),
    ]
    assert sorted(set(_ProfiledEngine.seen)) == [1, 3, 8] and all(r.num_inputs == 5 for r in report.records)
    assert [r.label for r in report.records][1:] == ["engine@64/b1", "engine@64/b3", "engine@64/b8"]
