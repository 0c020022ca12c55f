"""The GPU plans (``fp8``, ``int8-fp16``): Q/DQ on every matrix product and both attention
products, FP8 E4M3 or INT8, over an fp16 remainder; read back from the written graphs and run
by ONNX Runtime on CPU."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, numpy_helper

from deploykit.catalog import TABLE_PREFIXES
from deploykit.export import export, gpu_plans
from deploykit.export.int8_static import CalibrationOptions
from deploykit.export.manifest import Manifest
from deploykit.export.metadata import GraphMetadata
from deploykit.nn import create_model
from deploykit.zoo.registry import DEFAULT_ZOO_MODEL, model_dir
from tests.encoding_params import encoding_params

QDQ = ("QuantizeLinear", "DequantizeLinear")
PRODUCTS = ("MatMul", "Gemm", "Conv")
QUICK = CalibrationOptions(samples=8, held_out=16, min_agreement=None)


@pytest.fixture(scope="module", params=encoding_params())
def gpu_graphs(request, tmp_path_factory):
    """A seeded two-block ViT of the encoding at 64 px, its fp8 and int8-fp16 plans (no fallback)."""
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding=request.param, depth=2, img_size=64, num_classes=10)
    out = tmp_path_factory.mktemp(f"gpu-{request.param.replace('+', '_')}")
    export(model, [(64, 64)], out, precisions=["fp8", "int8-fp16"], calibration=QUICK)
    return request.param, out


def _types(proto: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    values = (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)
    return {v.name: v.type.tensor_type.elem_type for v in values} | {t.name: t.data_type for t in proto.graph.initializer}


@pytest.mark.parametrize("plan, qtype", [("fp8", TensorProto.FLOAT8E4M3FN), ("int8-fp16", TensorProto.INT8)])
def test_products_and_attention_quantized_over_fp16_and_the_encoding_kept_fp32(gpu_graphs, plan, qtype):
    encoding, out = gpu_graphs
    proto = onnx.load(str(out / f"model_64_{plan}.onnx"))
    assert {o.domain: o.version for o in proto.opset_import}[""] == 19
    types, producers = _types(proto), {o: n for n in proto.graph.node for o in n.output}
    weights = {t.name: t for t in proto.graph.initializer}

    def through_dq(name):
        node = producers.get(name)
        return node is not None and node.op_type == "DequantizeLinear"

    # Every pair quantizes to the plan's type, zero point 0.
    zero_points = [weights[n.input[2]] for n in proto.graph.node if n.op_type in QDQ]
    assert zero_points and {z.data_type for z in zero_points} == {qtype}
    assert all(not np.any(numpy_helper.to_array(z).astype(np.float32)) for z in zero_points)
    quantized = [n for n in proto.graph.node if n.op_type in PRODUCTS and any(through_dq(i) for i in n.input)]
    # Each quantized product reads its DQs directly (no Cast between) and runs in fp16.
    for node in quantized:
        assert all(through_dq(i) for i in node.input[:2]), node.name
        assert types[node.output[0]] == TensorProto.FLOAT16, node.name
    # Both attention products of each block: two activations, both quantized.
    batched = [n for n in quantized if n.op_type == "MatMul" and not any(producers[i].input[0] in weights for i in n.input[:2])]
    record = GraphMetadata.of(proto).quantization
    attention_floats = [e for e in record.kept_float if e.module.endswith(".attn") and e.reason == "policy"]
    assert batched and len(batched) + len(attention_floats) == 2 * 2, encoding
    assert record.plan == plan and record.attention_int8 and record.remainder == "fp16"
    assert record.qdq_type == ("float8e4m3fn" if plan == "fp8" else "int8")
    # Weights per output channel (1-D scale), activations per tensor (scalar scale), scales in fp16.
    for node in proto.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in weights:
            assert weights[node.input[0]].data_type == qtype and numpy_helper.to_array(weights[node.input[1]]).ndim == 1
        elif node.op_type in QDQ:
            assert numpy_helper.to_array(weights[node.input[1]]).ndim == 0
    # The encoding stays fp32: tables, their readers, LayerNorm, Softmax, custom ops, the logits.
    for node in proto.graph.node:
        reads_table = any(i.startswith(TABLE_PREFIXES) for i in node.input)
        if reads_table or node.op_type in ("LayerNormalization", "Softmax") or node.domain not in ("", "ai.onnx"):
            assert not any(through_dq(i) for i in node.input), (node.op_type, node.name)
            assert all(types.get(o) in (TensorProto.FLOAT, None) for o in node.output), (node.op_type, node.name)
    assert all(t.data_type == TensorProto.FLOAT for name, t in weights.items() if name.startswith(TABLE_PREFIXES))
    assert types[proto.graph.output[0].name] == TensorProto.FLOAT
    # ONNX Runtime's CPU provider runs the graph.
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: np.zeros((1, 3, 64, 64), np.float32)})[0]
    assert np.isfinite(logits).all()
    entry = next(g for g in Manifest.read(out).graphs if g.precision == plan)
    assert entry.quantization == record.to_dict()


def test_fp8_scales_are_amax_over_448_from_the_int8_plans_ranges(zoo_int8_export):
    """``int8_to_fp8`` on the zoo model's int8 graph: activation scales are the int8 ones × 127/448
    (the same calibrated maximum), weights re-quantized from fp32 per output channel, each channel's
    maximum at 448, every value within E4M3's rounding of the fp32 weight."""
    fp32 = onnx.load(str(zoo_int8_export / "model_48.onnx"))
    int8 = onnx.load(str(zoo_int8_export / "model_48_int8.onnx"))
    fp8 = gpu_plans.int8_to_fp8(int8, fp32)
    old = {t.name: numpy_helper.to_array(t) for t in int8.graph.initializer}
    new = {t.name: numpy_helper.to_array(t) for t in fp8.graph.initializer}
    fp32_weights = {t.name: numpy_helper.to_array(t) for t in fp32.graph.initializer}
    pairs = list(zip((n for n in int8.graph.node if n.op_type in QDQ), (n for n in fp8.graph.node if n.op_type in QDQ), strict=True))
    activations = weights_checked = 0
    for before, after in pairs:
        assert new[after.input[2]].dtype == ml_dtypes.float8_e4m3fn
        if before.input[0] not in old:
            np.testing.assert_allclose(new[after.input[1]], old[before.input[1]] * 127 / 448, rtol=1e-6)
            activations += 1
            continue
        reader = next(n for n in fp32.graph.node if n.name in {r.name for r in int8.graph.node if before.output[0] in r.input})
        weight = next(fp32_weights[i] for i in reader.input if i in fp32_weights and fp32_weights[i].ndim >= 2)
        axis = next((a.i for a in after.attribute if a.name == "axis"), 1)
        other = tuple(d for d in range(weight.ndim) if d != axis)
        scale = new[after.input[1]]
        np.testing.assert_allclose(scale, np.abs(weight).max(axis=other) / 448, rtol=1e-6)
        shape = [1] * weight.ndim
        shape[axis] = -1
        restored = new[after.input[0]].astype(np.float32) * scale.reshape(shape)
        assert np.all(np.abs(restored - weight) <= np.abs(weight) * 2.0**-4 + scale.reshape(shape) * 2.0**-9)
        weights_checked += 1
    assert activations and weights_checked


def test_zoo_model_fp8_and_int8_fp16_meet_the_agreement_target_and_validate(zoo_gpu_export, deploykit_cli):
    """Each plan meets the fallback's 99.5% top-1 target on held-out val images, the graph as
    written (fp16 remainder) agrees with fp32 on >= 99% of them, and ``validate`` passes it
    against PyTorch."""
    from deploykit.export.int8_check import describe_plan
    from deploykit.inputs.builtin import DefaultCalibration
    from deploykit.nn.checkpoint import load_model

    out = zoo_gpu_export
    held_out, _ = DefaultCalibration().held_out(load_model(model_dir(DEFAULT_ZOO_MODEL)), (48, 48), 32, 200)

    def answers(path):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {session.get_inputs()[0].name: held_out})[0].argmax(1)

    reference = answers(out / "model_48.onnx")
    for plan in ("fp8", "int8-fp16"):
        record = GraphMetadata.of(onnx.load(str(out / f"model_48_{plan}.onnx"))).quantization
        assert record.agreement["final"]["top1_agreement"] >= 0.995, record.agreement
        assert np.mean(answers(out / f"model_48_{plan}.onnx") == reference) >= 0.99
        kind = "fp8" if plan == "fp8" else "int8"  # the plan's messages name its type
        assert all(e.why.endswith(f"when {kind} alone") for e in record.kept_float if e.reason == "sensitivity")
        assert describe_plan(record)[0].startswith(f"{record.quantized_nodes} matmuls {kind}, ")
        code, err = deploykit_cli("validate", out, "--precision", plan)
        assert code == 0, err


def test_tensorrt_rtx_builds_both_plans_for_compute_capability_8_9_and_fingerprints_the_plan(zoo_gpu_export, tmp_path, deploykit_cli):
    """TensorRT-RTX's real builder (on this CPU) builds fp8 and int8-fp16 engines for an Ada GPU
    (8.9, the first with FP8), and refuses fp8 for Ampere (8.6), writing no engine."""
    import json
    import shutil

    out = tmp_path / "exp"
    shutil.copytree(zoo_gpu_export, out)
    for plan in ("fp8", "int8-fp16"):
        code, err = deploykit_cli("build", out, "--backend", "rtx", "--precision", plan, "--compute-capability", "8.9")
        assert code == 0, err
        fingerprint = json.loads((out / f"model_48_{plan}.rtx.json").read_text())["fingerprint"]
        assert fingerprint["precision"] == plan and fingerprint["module"] == "tensorrt_rtx"
        assert fingerprint["build"]["compute_capabilities"] == ["8.9"]
        assert (out / f"model_48_{plan}.rtx.engine").stat().st_size > 0
    ampere = tmp_path / "ampere"
    shutil.copytree(zoo_gpu_export, ampere)
    code, err = deploykit_cli("build", ampere, "--backend", "rtx", "--precision", "fp8", "--compute-capability", "8.6")
    assert code == 1 and "fp8_e4m3" in err and "sm86" in err, err
    assert not list(ampere.glob("*.engine"))
