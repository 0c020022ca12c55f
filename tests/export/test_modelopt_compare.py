"""deploykit's GPU plans against NVIDIA Model Optimizer's ONNX PTQ of the same fp32 zoo graph,
calibrated on the same images: every difference in where Q/DQ pairs sit, their types and scale
shapes, and the remainder's types is listed, and each must have a reason."""

from __future__ import annotations

import onnx
import pytest

from deploykit.export import export
from deploykit.export.int8_static import Calibration
from deploykit.export.metadata import GraphMetadata
from deploykit.export.precision import apply_precision
from deploykit.export.qdq_compare import REASONS, compare, modelopt_quantize, placement
from deploykit.inputs.builtin import DefaultCalibration
from deploykit.nn.checkpoint import load_model
from deploykit.zoo.registry import model_dir

MODES = {"fp8": "fp8", "int8-fp16": "int8"}


@pytest.fixture(scope="module", params=["shapes-ape", "shapes-rope-axial"])
def zoo_fp32(request, tmp_path_factory):
    """A trained zoo model's fp32 graph at 48 px and 32 of its train-split images."""
    model = load_model(model_dir(request.param))
    out = tmp_path_factory.mktemp(request.param) / "exp"
    export(model, [(48, 48)], out)
    calibration, _, _ = DefaultCalibration().inputs(model, (48, 48), 32, 16)
    return out / "model_48.onnx", calibration


@pytest.fixture(scope="module", params=list(MODES))
def both(request, zoo_fp32, tmp_path_factory):
    """``(plan, deploykit's graph, ModelOpt's graph)``: every selected node quantized (no fallback)."""
    path, calibration = zoo_fp32
    ours = apply_precision(onnx.load(str(path)), request.param, Calibration(calibration, "train split"))
    theirs = modelopt_quantize(path, MODES[request.param], calibration, tmp_path_factory.mktemp("modelopt") / "q.onnx")
    return request.param, ours, theirs


def test_every_difference_from_modelopt_has_a_reason(both):
    plan, ours, theirs = both
    differences = compare(ours, theirs)
    unexplained = [d.line() for d in differences if d.reason is None]
    assert not unexplained, "\n".join(unexplained)
    # The lists are not empty: deploykit keeps LayerNorm and Softmax fp32 where ModelOpt casts to fp16.
    assert {d.reason for d in differences} >= {REASONS["remainder:LayerNormalization"], REASONS["remainder:Softmax"]}


def test_modelopt_quantizes_every_product_deploykit_does_with_the_same_scale_shapes(both):
    plan, ours, theirs = both
    a, b = placement(ours), placement(theirs)
    quantized = [name for name, p in a.items() if p.quantized_inputs]
    attention = [name for name in quantized if a[name].op_type == "MatMul" and all(shape == () for shape in a[name].scale_shapes)]
    assert len(attention) == 2 * 4, attention  # q·kᵀ and attention·v of each of the 4 blocks
    for name in quantized:
        if a[name].op_type == "Conv" and not b[name].quantized_inputs:
            assert plan == "fp8"  # ModelOpt's fp8 mode leaves the patch embedding float (REASONS["quantized:Conv"])
            continue
        assert b[name].quantized_inputs == a[name].quantized_inputs, name
        assert b[name].scale_shapes == a[name].scale_shapes, name  # per-tensor activations, per-channel weights
        assert set(b[name].qdq_types) == set(a[name].qdq_types) == {"float8e4m3fn" if plan == "fp8" else "int8"}
        assert a[name].runs_in == b[name].runs_in == "float16", name


def test_a_difference_with_no_reason_is_reported_unexplained(both):
    """A product's activation Q/DQ bypassed without the plan recording why: ``compare`` cannot explain it."""
    plan, ours, theirs = both
    target = next(name for name, p in placement(ours).items() if p.quantized_inputs and placement(theirs)[name].quantized_inputs)
    edited = onnx.ModelProto()
    edited.CopyFrom(ours)
    producers = {o: n for n in edited.graph.node for o in n.output}
    node = next(n for n in edited.graph.node if n.name == target)
    for k, name in enumerate(node.input[:2]):
        dq = producers.get(name)
        if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in producers:
            node.input[k] = producers[dq.input[0]].input[0]
    assert GraphMetadata.of(edited).quantization is not None
    unexplained = [d for d in compare(edited, theirs) if d.reason is None]
    assert unexplained and {d.node for d in unexplained} == {target}


def test_modelopt_cannot_read_sape2s_function_and_says_so(sape2_export, tmp_path):
    """SaPE²'s bias is a model-local function (``deploykit::SaPE2Bias``): ModelOpt 0.47's calibration
    session does not register it, so the comparison covers the table and rotary encodings; deploykit's
    own plans quantize SaPE² graphs (tests/export/test_gpu_plans.py)."""
    import numpy as np

    calibration = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    with pytest.raises(RuntimeError, match="deploykit:SaPE2Bias.* is not a registered function/op"):
        modelopt_quantize(sape2_export / "model_32.onnx", "fp8", calibration, tmp_path / "q.onnx")
    assert not (tmp_path / "q.onnx").exists()
