"""One graph for a resolution range (RoPE, GridPE, GeoPE): dynamic height/width, tables cropped
in the graph, validated at min/opt/max, built by TensorRT-RTX with a matching profile."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from deploykit.errors import ExportError, ResolutionError
from deploykit.export import export, onnx_from_model
from deploykit.export.manifest import Manifest
from deploykit.nn import create_model
from deploykit.runners.onnxrt import OnnxrtRunner
from deploykit.validation.run import validate

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
LOW, OPT, HIGH = (64, 64), (96, 96), (128, 128)


def _model(encoding="rope-mixed"):
    torch.manual_seed(0)
    return create_model("vit_tiny_patch16", encoding=encoding, depth=2, num_classes=10).eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("range")
    model = _model()
    manifest = export(model, [OPT], out, resolution_range=(LOW, OPT, HIGH))
    return model, out, manifest


@pytest.mark.slow
def test_manifest_and_graph_take_any_resolution_in_range(exported):
    model, out, manifest = exported
    (static,) = [g for g in manifest.graphs if g.resolution_range is None]
    (ranged,) = [g for g in manifest.graphs if g.resolution_range is not None]
    assert ranged.file == "model_64-128.onnx" and ranged.resolution == OPT and ranged.resolution_range == (LOW, HIGH)
    assert Manifest.read(out).graphs == manifest.graphs  # round-trips through JSON
    proto = onnx.load(str(out / ranged.file))
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims[:2]] == [0, 3] and all(d.dim_param for d in (dims[0], dims[2], dims[3]))
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["deploykit.resolution_range"]) == [list(LOW), list(HIGH)]
    rng = np.random.default_rng(0)
    with OnnxrtRunner(out / ranged.file) as runner, OnnxrtRunner(out / static.file) as fixed:
        for shape in (LOW, OPT, HIGH, (64, 128), (112, 80)):
            x = rng.standard_normal((2, 3, *shape)).astype(np.float32)
            got = runner.infer({"images": x})["logits"]
            with torch.no_grad():
                want = model(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
            if shape == OPT:  # the same numbers as the graph baked for that one resolution
                np.testing.assert_allclose(got, fixed.infer({"images": x})["logits"], atol=2e-6, rtol=0)


def test_validate_checks_the_range_at_min_opt_max(exported):
    _, out, _ = exported
    report = validate(out, num_random=2, num_real=2)
    assert bool(report)
    checked = [(r.graph, tuple(r.resolution)) for r in report.records]
    assert checked == [("model_96.onnx", OPT), ("model_64-128.onnx", LOW), ("model_64-128.onnx", OPT), ("model_64-128.onnx", HIGH)]
    assert report.records[1].label == "ort@64 in model_64-128.onnx"


class _RangeEngine(OnnxrtRunner):
    """Stands in for engines built over each graph: the range graph's over 64-128 px × batch
    1/2/4, the fixed graph's at 96 px; any other shape is refused, as an engine would."""

    name = "engine"
    seen: list = []

    @property
    def profiled_shapes(self):
        if "-" in Path(self.model).name:
            return ((1, 3, 64, 64), (2, 3, 96, 96), (4, 3, 128, 128))
        return ((1, 3, 96, 96), (2, 3, 96, 96), (4, 3, 96, 96))

    def _infer(self, feed):
        shape = next(iter(feed.values())).shape
        assert shape in self.profiled_shapes, shape
        self.seen.append(shape)
        return super()._infer(feed)


def test_engine_over_the_range_is_validated_at_each_profile_shape(exported, stand_in_backend):
    _, out, _ = exported
    stand_in_backend("engine", lambda path, options: _RangeEngine(path))
    _RangeEngine.seen = []
    report = validate(out, backends=("engine",), num_random=2, num_real=3)
    assert bool(report)
    assert [(r.graph, tuple(r.resolution), r.batch) for r in report.records] == [
        ("model_96.onnx", OPT, 1),
        ("model_96.onnx", OPT, 2),
        ("model_96.onnx", OPT, 4),
        ("model_64-128.onnx", LOW, 1),
        ("model_64-128.onnx", OPT, 2),
        ("model_64-128.onnx", HIGH, 4),
    ]
    assert {(1, 3, 64, 64), (4, 3, 128, 128)} <= set(_RangeEngine.seen)
    assert report.records[-1].label == "engine@128/b4 in model_64-128.onnx"


@pytest.mark.parametrize(
    "encoding, span, message",
    [
        ("ape", (LOW, OPT, HIGH), "builds its tables for the whole grid"),
        ("rope-axial", (OPT, LOW, HIGH), "min <= opt <= max"),
    ],
)
def test_ranges_one_graph_cannot_serve_are_refused(encoding, span, message, tmp_path):
    with pytest.raises(ExportError, match=message):
        export(_model(encoding), [], tmp_path / "x", resolution_range=span)
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_range_off_the_patch_grid_is_refused():
    with pytest.raises(ResolutionError, match="multiple of the patch size"):
        onnx_from_model(_model(), OPT, resolution_range=(LOW, (130, 130)))


def test_rtx_builds_the_range_with_its_profile(exported):
    from deploykit.backends.build import build
    from deploykit.backends.engine_cache import read_fingerprint

    _, out, _ = exported
    (result,) = build(out, "rtx", resolutions=None, precisions=["fp32"], optimization_level=0, dynamic=True, batch=2, max_batch=4)[1:]
    assert result.graph == "model_64-128.onnx" and result.engine.is_file()
    assert read_fingerprint(result.fingerprint).fingerprint.shapes == {"images": [[1, 3, 64, 64], [2, 3, 96, 96], [4, 3, 128, 128]]}


@pytest.mark.slow
def test_rtx_builds_resolution_buckets_between_the_exported_resolutions(exported, tmp_path):
    import shutil

    from deploykit.backends.build import build
    from deploykit.backends.engine_cache import read_fingerprint

    out = shutil.copytree(exported[1], tmp_path / "exp")
    built = build(out, "rtx", precisions=["fp32"], optimization_level=0, max_batch=4, profiles_from_resolutions=True, rebuild=True)
    (result,) = [b for b in built if b.graph == "model_64-128.onnx"]
    # 96 px is exported inside the range 64-128: one profile below it, one above, each tuned at 96 px
    assert read_fingerprint(result.fingerprint).profiles == [
        ((1, 3, 64, 64), (1, 3, 96, 96), (4, 3, 96, 96)),
        ((1, 3, 96, 96), (1, 3, 96, 96), (4, 3, 128, 128)),
    ]


def test_cli_refuses_a_range_without_its_tuned_shape(tmp_path, capsys):
    """(tests/test_cli_output.py exports a range from the command line.)"""
    from deploykit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["export", "-e", "geope", "--resolution-range", "32:64", "-o", str(tmp_path / "h")])
    assert exit_info.value.code == 2 and "MIN:OPT:MAX" in capsys.readouterr().err
