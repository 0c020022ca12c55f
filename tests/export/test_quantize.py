"""INT8 plans: where the Q/DQ pairs went (read back from the written graph), what calibration
reads, and that a plan which cannot be trusted is refused before anything is written."""

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper

import deploykit.data
from deploykit.encodings import list_encodings
from deploykit.errors import ConfigError, ExportError
from deploykit.export import export
from deploykit.export.lint import TABLE_PREFIXES
from deploykit.export.manifest import Manifest, graph_quantization
from deploykit.export.quantize import CalibrationOptions
from deploykit.nn import create_model
from deploykit.nn.checkpoint import load_model
from deploykit.zoo.dataset import ShapeRelations
from deploykit.zoo.registry import DEFAULT_ZOO_MODEL, model_dir

RES = (64, 64)
QUICK = CalibrationOptions(samples=8, held_out=16, min_agreement=None)
QDQ = ("QuantizeLinear", "DequantizeLinear")


def _model(encoding):
    torch.manual_seed(0)
    return create_model("vit_tiny_patch16", encoding=encoding, depth=2, img_size=64, num_classes=10)


@pytest.fixture(scope="module", params=list_encodings())
def int8_graph(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"int8-{request.param}")
    export(_model(request.param), [RES], out, precisions=["fp32", "int8"], calibration=QUICK)
    return request.param, onnx.load(str(out / "model_64_int8.onnx")), Manifest.read(out)


def _dequantized_inputs(proto):
    """Node -> the inputs it reads through a DequantizeLinear."""
    dq = {n.output[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    return {n.name: [i for i in n.input if i in dq] for n in proto.graph.node}


def _scopes(node):
    return next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), "")


def test_qdq_only_on_matmul_inputs_and_never_near_the_encoding(int8_graph):
    encoding, proto, _ = int8_graph
    dequantized = _dequantized_inputs(proto)
    producers = {o: n for n in proto.graph.node for o in n.output}
    head = producers[proto.graph.output[0].name]
    # A quantized tensor's other readers see the dequantized value: only Shape may (the image's).
    quantized = [n for n in proto.graph.node if dequantized[n.name] and n.op_type not in (*QDQ, "Shape")]
    assert quantized, "no node reads an int8 tensor"
    for node in quantized:
        assert node.op_type in ("MatMul", "Gemm", "Conv"), (node.op_type, node.name)
        assert node.domain in ("", "ai.onnx")
        assert not any(i.startswith(TABLE_PREFIXES) for i in node.input), node.name
    assert not dequantized[head.name], "the logits are computed from int8 inputs"
    for node in proto.graph.node:  # rotations and table adds read tables; LayerNorm, Softmax, custom ops
        if (
            any(i.startswith(TABLE_PREFIXES) for i in node.input)
            or node.op_type in ("LayerNormalization", "Softmax")
            or node.domain not in ("", "ai.onnx")
        ):
            assert not dequantized[node.name], (node.op_type, node.name)
    # Q/DQ pairs sit on activations and weights only: no table is ever quantized, all stay fp32.
    tables = {i.name: i for i in proto.graph.initializer if i.name.startswith(TABLE_PREFIXES)}
    assert tables and all(t.data_type == TensorProto.FLOAT for t in tables.values())
    assert not [n.name for n in proto.graph.node if n.op_type in QDQ and set(n.input) & set(tables)]
    # The block GEMMs run int8 with per-output-channel weight scales; the attention products stay float.
    qkv = [n for n in quantized if "attn.qkv" in _scopes(n)]
    assert len(qkv) == 2
    weights = {i.name: i for i in proto.graph.initializer}
    for node in qkv:
        dq = producers[node.input[1]]
        assert dq.op_type == "DequantizeLinear" and weights[dq.input[0]].data_type == TensorProto.INT8
        assert numpy_helper.to_array(weights[dq.input[1]]).size == 3 * 192
    activations = [
        n
        for n in proto.graph.node
        if n.op_type == "MatMul"
        and not set(n.input) & set(weights)
        and not any(producers.get(i) and producers[i].op_type == "DequantizeLinear" and producers[i].input[0] in weights for i in n.input)
    ]
    assert all(not dequantized[n.name] for n in activations)


def test_the_plan_is_recorded_in_graph_and_manifest(int8_graph):
    _, proto, manifest = int8_graph
    details = graph_quantization(proto)
    entry = next(g for g in manifest.graphs if g.precision == "int8")
    assert entry.quantization == details
    assert details["plan"] == "int8" and details["calibration"] == "minmax" and details["samples"] == 8
    assert "bundled sample images" in details["calibration_data"]
    assert details["float_nodes"]["logits"] and details["float_nodes"]["attention"]
    assert details["quantized_nodes"] == 1 + 4 * 2  # patch embedding + qkv, proj, fc1, fc2 per block
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["deploykit.precision"] == "int8" and "deploykit.encoding" in meta


def test_ega_gate_stays_float(tmp_path):
    torch.manual_seed(0)
    model = create_model("seq_tiny_ega")
    export(model, [(32,)], tmp_path, precisions=["int8"], calibration=QUICK)
    proto = onnx.load(str(tmp_path / "model_32_int8.onnx"))
    dequantized = _dequantized_inputs(proto)
    gates = [n for n in proto.graph.node if n.op_type in ("MatMul", "Gemm") and "attn.gate" in _scopes(n)]
    assert len(gates) == 2 and not any(dequantized[n.name] for n in gates)
    assert any(dequantized[n.name] for n in proto.graph.node if "attn.qkv" in _scopes(n))
    assert len(graph_quantization(proto)["float_nodes"]["float-module"]) == 2


def test_calibration_and_the_plan_check_never_read_the_test_split(tmp_path, monkeypatch):
    splits = []
    images = ShapeRelations.images
    monkeypatch.setattr(ShapeRelations, "images", lambda self, split, *a, **k: splits.append(split) or images(self, split, *a, **k))
    model = load_model(model_dir(DEFAULT_ZOO_MODEL))
    manifest = export(model, [(48, 48)], tmp_path, precisions=["int8"], calibration=CalibrationOptions(samples=16, held_out=32))
    assert set(splits) == {"train", "val"}  # control: the spy sees the dataset being read
    assert "train split" in manifest.graph((48, 48), "int8").quantization["calibration_data"]


def test_nan_calibration_is_refused_with_nodes_named_and_nothing_written(tmp_path, monkeypatch):
    real = deploykit.data.calibration_inputs

    def poisoned(model, shape, count, held_out=False):
        inputs, source = real(model, shape, count, held_out)
        if not held_out:
            inputs[0, 0, 0, 0] = np.nan
        return inputs, source

    monkeypatch.setattr(deploykit.data, "calibration_inputs", poisoned)
    out = tmp_path / "x"
    with pytest.raises(ExportError, match=r"NaN/Inf ranges at node_\S+") as err:
        export(_model("ape"), [RES], out, precisions=["fp32", "int8"], calibration=QUICK)
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_a_plan_that_fails_its_check_is_refused(tmp_path, monkeypatch):
    """A calibration whose ranges are far too small clips every activation: refused, block named."""
    from deploykit.export import quantize

    real = quantize._StaticQuantizer.quantize

    def shrunk_ranges(self, nodes):
        proto = real(self, nodes)
        for init in proto.graph.initializer:
            if init.name.endswith("_scale") and init.data_type == TensorProto.FLOAT and len(init.dims) == 0:
                init.CopyFrom(numpy_helper.from_array(np.asarray(numpy_helper.to_array(init) / 100, np.float32), init.name))
        return proto

    monkeypatch.setattr(quantize._StaticQuantizer, "quantize", shrunk_ranges)
    with pytest.raises(ExportError, match=r"int8 plan at 64 fails its tolerance .* first divergent block model\.blocks\.0"):
        export(_model("ape"), [RES], tmp_path / "x", precisions=["int8"], calibration=QUICK)
    assert not (tmp_path / "x").exists()


def test_bad_calibration_options():
    with pytest.raises(ConfigError, match="minmax, percentile, entropy"):
        CalibrationOptions(method="kl")
    with pytest.raises(ConfigError, match="at least one"):
        CalibrationOptions(samples=0)


def test_dynamic_and_fused_attention_plans_validate(tmp_path):
    from deploykit.validate import validate

    model = load_model(model_dir(DEFAULT_ZOO_MODEL))
    export(model, [(48, 48)], tmp_path, precisions=["fp32", "int8-dynamic", "fp32-mha"])
    proto = onnx.load(str(tmp_path / "model_48_int8-dynamic.onnx"))
    assert {n.op_type for n in proto.graph.node} >= {"DynamicQuantizeLinear", "MatMulInteger"}
    fused = onnx.load(str(tmp_path / "model_48_fp32-mha.onnx"))
    assert sum(n.op_type == "MultiHeadAttention" for n in fused.graph.node) == model.cfg.depth
    for precision in ("int8-dynamic", "fp32-mha"):
        report = validate(tmp_path, precision=precision, num_random=2, num_real=8)
        assert report, report.to_json()
    assert json.loads(json.dumps(report.to_json()))[0]["precision"] == "fp32-mha"


def test_validate_passes_int8_on_a_trained_model_and_fails_a_planted_bad_scale(tmp_path):
    from deploykit.export.manifest import MANIFEST_FILE, sha256_file
    from deploykit.validate import validate

    out = tmp_path / "x"
    export(
        load_model(model_dir(DEFAULT_ZOO_MODEL)),
        [(48, 48)],
        out,
        precisions=["int8"],
        calibration=CalibrationOptions(samples=32, held_out=64),
    )
    (good,) = validate(out, precision="int8").records
    assert good.passed and good.num_real == 8 and good.mean_cosine >= 0.99 and good.tolerance["real_only"]
    # Plant: block 1's fc1 weights dequantized with a 30x scale (as a broken calibration or a
    # hand edit would leave them); the manifest is updated so only the values are wrong.
    path = out / "model_48_int8.onnx"
    proto = onnx.load(str(path))
    producers = {o: n for n in proto.graph.node for o in n.output}
    fc1 = next(n for n in proto.graph.node if n.op_type == "Gemm" and "blocks.1.mlp.fc1" in _scopes(n))
    scale = next(i for i in proto.graph.initializer if i.name == producers[fc1.input[1]].input[1])
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 30, scale.name))
    onnx.save(proto, str(path))
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    next(g for g in manifest["graphs"] if g["file"] == path.name)["sha256"] = sha256_file(path)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    (bad,) = validate(out, precision="int8").records
    assert not bad.passed and any("mean cosine" in f or "top-1" in f for f in bad.failures), bad.failures
    assert bad.first_divergent_block == "blocks.1"


def test_every_encoding_has_a_measured_attention_choice():
    """A new encoding needs its own measurement (benchmarks/int8_plans.py attention) before its
    INT8 plan may decide for it."""
    from deploykit.export.quantize import ATTENTION_INT8

    assert set(ATTENTION_INT8) == set(list_encodings())


def test_attention_products_quantized_on_request(tmp_path):
    manifest = export(
        _model("rope-mixed"),
        [RES],
        tmp_path,
        precisions=["int8"],
        calibration=CalibrationOptions(samples=8, held_out=16, min_agreement=None, attention=True),
    )
    proto = onnx.load(str(tmp_path / "model_64_int8.onnx"))
    weights = {i.name for i in proto.graph.initializer}
    dequantized = _dequantized_inputs(proto)
    products = [n for n in proto.graph.node if n.op_type == "MatMul" and not set(n.input) & weights and len(dequantized[n.name]) == 2]
    assert len(products) == 2 * 2  # q·kᵀ and attention·v in both blocks, both inputs int8
    details = manifest.graph(RES, "int8").quantization
    assert details["attention_int8"] and "attention" not in details["float_nodes"]
