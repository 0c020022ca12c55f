"""One image, one preprocessing: the tensor INT8 calibration quantized from, the tensor validate
compared, and the tensors every serving front end feeds the model (the in-process pipeline, the
Triton ``classify`` model of ``deploykit serve`` and the ``preprocess_<res>`` model of ``package
triton``, each run as the Triton Python backend runs it) are the same bits, for a model whose
preprocessing is not deploykit's default."""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import sys
import types

import numpy as np
import PIL.Image as PIL
import pytest
import torch

import deploykit
from deploykit.export import export, int8_static
from deploykit.export.int8_static import CalibrationOptions
from deploykit.inputs import imaging
from deploykit.inputs.user import UserCalibration, read_inputs
from deploykit.nn import create_model
from deploykit.validation import run as validate_module
from deploykit.validation.run import validate
from tests.serve.serve_reference import torch_preprocess

SETTINGS = dict(crop_pct=0.95, crop_mode="squash", interpolation="bilinear", mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
RES = (32, 32)
SECOND = (48, 48)  # a second resolution: validate reads the user's inputs once per resolution


@pytest.fixture(scope="module")
def image_png(tmp_path_factory):
    pixels = np.random.default_rng(0).integers(0, 256, (45, 70, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.fromarray(pixels).save(buf, format="PNG")
    return pixels, buf.getvalue()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, image_png):
    """An int8 export calibrated on a folder holding the image twice; the calibration inputs seen."""
    folder = tmp_path_factory.mktemp("imgs")
    for name in ("a.png", "b.png"):
        (folder / name).write_bytes(image_png[1])
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=10, **SETTINGS).eval()
    seen = []
    real = int8_static.quantize_static_int8

    def spy(proto, calibration, *args, **kwargs):
        seen.append(calibration.inputs.copy())
        return real(proto, calibration, *args, **kwargs)

    out = tmp_path_factory.mktemp("export") / "out"
    options = CalibrationOptions(samples=1, held_out=1, min_agreement=None, data=UserCalibration(read_inputs(folder)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(int8_static, "quantize_static_int8", spy)
        manifest = export(model, [RES, SECOND], out, precisions=["fp32", "int8"], calibration=options)
    return out, folder, {x.shape[-2:]: x for x in seen}, manifest


@pytest.mark.slow
def test_calibration_validation_and_serving_see_the_same_tensor(exported, image_png, monkeypatch):
    out, folder, calibrated_at, manifest = exported
    calibrated = calibrated_at[RES]
    pixels, png = image_png
    # The oracle: timm's transform in torch, with the settings the export recorded.
    recorded = manifest.preprocessing
    assert recorded == imaging.Preprocessing(**SETTINGS).to_dict()
    expected = torch_preprocess(pixels, RES, **{k: v for k, v in recorded.items()})
    assert calibrated.shape == (1, 3, *RES)
    np.testing.assert_allclose(calibrated[0], expected, rtol=0, atol=1e-6)

    real_inputs = []
    original = validate_module.validation_inputs
    monkeypatch.setattr(
        validate_module, "validation_inputs", lambda *a, real=None, **k: real_inputs.append(real) or original(*a, real=real, **k)
    )
    report = validate(out, precision="int8", num_random=1, num_real=2, inputs=read_inputs(folder))
    assert report and report.records[0].inputs["count"] == 2
    assert sorted(tuple(r.resolution) for r in report.records) == [RES, SECOND]
    validated = real_inputs[0]
    assert validated.shape[-2:] == RES and real_inputs[1].shape == (2, 3, *SECOND)

    pipeline = deploykit.load(out)
    served = pipeline.preprocess(imaging.decode(png), RES)
    classify = _triton_classify_model(pipeline, monkeypatch)._prepare(png)
    packaged = _triton_preprocess_model(pipeline, monkeypatch)._preprocess(png)
    for tensor in (validated[0], validated[1], served, packaged):
        np.testing.assert_array_equal(tensor, calibrated[0])
    # Triton's classify model routes the 45x70 image to the nearest exported size (48x48 here).
    assert classify[0] == SECOND
    np.testing.assert_array_equal(classify[1], calibrated_at[SECOND][0])
    np.testing.assert_array_equal(real_inputs[1][0], calibrated_at[SECOND][0])


def _load_python_model(path, name, monkeypatch):
    """A Triton Python-backend model file, imported as Triton's stub does: ``deploykit_imaging``
    beside it, ``triton_python_backend_utils`` provided by the stub."""
    monkeypatch.setitem(sys.modules, "deploykit_imaging", imaging)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel()


def _triton_classify_model(pipeline, monkeypatch):
    from deploykit.serve.triton_server import CLASSIFY_MODEL_SOURCE, ServerOptions, classify_config

    text = classify_config(pipeline, ServerOptions())
    settings = json.loads(text.split("string_value: ", 1)[1].rsplit(" }", 2)[0])
    model = _load_python_model(CLASSIFY_MODEL_SOURCE, "classify_model", monkeypatch)
    model.initialize({"model_config": json.dumps({"parameters": {"settings": {"string_value": settings}}})})
    return model


def _triton_preprocess_model(pipeline, monkeypatch):
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from deploykit.serve.triton_repo import PREPROCESS_MODEL_SOURCE, RepositoryOptions, preprocess_config

    text = preprocess_config("preprocess_32", RES, pipeline.config, RepositoryOptions())
    config = json_format.MessageToDict(text_format.Parse(text, model_config_pb2.ModelConfig()), preserving_proto_field_name=True)
    model = _load_python_model(PREPROCESS_MODEL_SOURCE, "preprocess_model", monkeypatch)
    model.initialize({"model_config": json.dumps(config)})
    return model
