"""INT8 plans: where the Q/DQ pairs went (read back from the written graph), what calibration
reads, and that a plan which cannot be trusted is refused before anything is written."""

import ast
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper

import deploykit.inputs.builtin
from deploykit.catalog import TABLE_PREFIXES
from deploykit.encodings import list_encodings
from deploykit.errors import ConfigError, ExportError
from deploykit.export import export
from deploykit.export.int8_static import CalibrationOptions
from deploykit.export.manifest import Manifest
from deploykit.export.metadata import GraphMetadata, QuantizationRecord
from deploykit.export.sensitivity import QualityTarget
from deploykit.inputs.datasets import ShapeRelations
from deploykit.nn import create_model
from deploykit.nn.checkpoint import load_model
from deploykit.zoo.registry import DEFAULT_ZOO_MODEL, model_dir
from tests.encoding_params import encoding_params

RES = (64, 64)
QUICK = CalibrationOptions(samples=8, held_out=16, min_agreement=None)
QDQ = ("QuantizeLinear", "DequantizeLinear")


def _model(encoding):
    torch.manual_seed(0)
    return create_model("vit_tiny_patch16", encoding=encoding, depth=2, img_size=64, num_classes=10)


@pytest.fixture(scope="module", params=encoding_params())
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


def _module(node):
    """The deepest ``model.*`` scope without ``model.`` (read here from the raw metadata)."""
    scopes = [s for s in ast.literal_eval(_scopes(node) or "[]") if s.startswith("model.")]
    return scopes[-1][len("model.") :] if scopes else ""


@pytest.mark.slow
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
    details = GraphMetadata.of(proto).quantization.to_dict()
    entry = next(g for g in manifest.graphs if g.precision == "int8")
    assert entry.quantization == details
    assert details["plan"] == "int8" and details["calibration"] == "minmax" and details["samples"] == 8
    assert "bundled sample images" in details["calibration_data"]
    assert details["float_nodes"]["logits"] and details["float_nodes"]["attention"]
    assert details["quantized_nodes"] == 1 + 4 * 2  # patch embedding + qkv, proj, fc1, fc2 per block
    # Every node named by its PyTorch module, its ONNX name beside it, and why it is float.
    modules = {n.name: m for n in proto.graph.node for m in [_module(n)]}
    kept = details["kept_float"]
    assert {(e["module"], e["why"]) for e in kept} == {("head", "logits"), ("blocks.0.attn", "attention"), ("blocks.1.attn", "attention")}
    assert all(e["reason"] == "policy" and modules[e["onnx"]] == e["module"] for e in kept)
    assert details["float_nodes"]["logits"] == [f"head ({next(e['onnx'] for e in kept if e['why'] == 'logits')})"]
    assert [e["module"] for e in details["sensitivity"]["most_sensitive"]][0].startswith(("blocks.", "patch_embed"))
    entry = next(g for g in manifest.graphs if g.precision == "int8")
    assert entry.quantization["inputs"]["calibration"]["count"] == 8 and len(entry.quantization["inputs"]["held_out"]["sha256"]) == 64
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
    assert len(GraphMetadata.of(proto).quantization.float_nodes["float-module"]) == 2


@pytest.mark.slow
def test_calibration_and_the_plan_check_never_read_the_test_split(tmp_path, monkeypatch):
    splits = []
    images = ShapeRelations.images
    monkeypatch.setattr(ShapeRelations, "images", lambda self, split, *a, **k: splits.append(split) or images(self, split, *a, **k))
    model = load_model(model_dir(DEFAULT_ZOO_MODEL))
    manifest = export(model, [(48, 48)], tmp_path, precisions=["int8"], calibration=CalibrationOptions(samples=16, held_out=32))
    assert set(splits) == {"train", "val"}  # control: the spy sees the dataset being read
    assert "train split" in manifest.graph((48, 48), "int8").quantization["calibration_data"]


def test_nan_calibration_is_refused_with_nodes_named_and_nothing_written(tmp_path, monkeypatch):
    real = deploykit.inputs.builtin.calibration_inputs

    def poisoned(model, shape, count, held_out=False):
        inputs, source = real(model, shape, count, held_out)
        if not held_out:
            inputs[0, 0, 0, 0] = np.nan
        return inputs, source

    monkeypatch.setattr(deploykit.inputs.builtin, "calibration_inputs", poisoned)
    out = tmp_path / "x"
    with pytest.raises(ExportError, match=r"NaN/Inf ranges at patch_embed\.proj \(node_\S+\)") as err:
        export(_model("ape"), [RES], out, precisions=["fp32", "int8"], calibration=QUICK)
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_a_histogram_calibration_that_cannot_fit_in_memory_is_refused_before_it_runs(tmp_path, monkeypatch):
    """ONNX Runtime's histogram calibrators keep every calibrated tensor of every input: where
    that is more than the machine has, the export says so in one line and writes nothing (the
    same machine, made small here, still calibrates min-max: it keeps only per-batch ranges)."""
    import deploykit.runners.cpu
    from deploykit.export import int8_static, onnx_from_model

    model = _model("ape")
    fp32 = onnx_from_model(model, RES)
    per_input = int8_static._calibrated_bytes_per_input(fp32)
    # attention's scores alone: 3 heads x 17 x 17 tokens at 64 px, two of them per block, 2 blocks
    assert per_input >= 4 * 2 * 2 * 3 * 17 * 17
    monkeypatch.setattr(deploykit.runners.cpu, "available_memory", lambda: per_input * QUICK.samples - 1)
    out = tmp_path / "x"
    percentile = CalibrationOptions(samples=QUICK.samples, held_out=QUICK.held_out, min_agreement=None, method="percentile")
    with pytest.raises(
        ConfigError,
        match=r"--calibration-method percentile keeps every calibrated tensor of all 8 inputs .* use --calibration-method minmax",
    ) as err:
        export(model, [RES], out, precisions=["fp32", "int8"], calibration=percentile)
    assert "\n" not in str(err.value) and not out.exists()
    export(model, [RES], out, precisions=["fp32", "int8"], calibration=QUICK)  # control: min-max
    assert (out / "model_64_int8.onnx").is_file()


def test_a_plan_that_fails_its_check_is_refused(tmp_path, monkeypatch):
    """A calibration whose ranges are far too small clips every activation: refused, block named."""
    from deploykit.export import int8_static

    real = int8_static._StaticQuantizer.quantize

    def shrunk_ranges(self, nodes):
        proto = real(self, nodes)
        for init in proto.graph.initializer:
            if init.name.endswith("_scale") and init.data_type == TensorProto.FLOAT and len(init.dims) == 0:
                init.CopyFrom(numpy_helper.from_array(np.asarray(numpy_helper.to_array(init) / 100, np.float32), init.name))
        return proto

    monkeypatch.setattr(int8_static._StaticQuantizer, "quantize", shrunk_ranges)
    with pytest.raises(
        ExportError,
        match=r"int8 plan at 64 fails its tolerance .* first divergent block blocks\.0 \(quantized there: blocks\.0\.attn\.qkv \(node_",
    ):
        export(_model("ape"), [RES], tmp_path / "x", precisions=["int8"], calibration=QUICK)
    assert not (tmp_path / "x").exists()


def test_bad_calibration_options():
    with pytest.raises(ConfigError, match="minmax, percentile, entropy"):
        CalibrationOptions(method="kl")
    with pytest.raises(ConfigError, match="at least one"):
        CalibrationOptions(samples=0)


@pytest.mark.slow
def test_dynamic_and_fused_attention_plans_validate(tmp_path):
    from deploykit.validation.run import validate

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


@pytest.mark.slow
def test_int8_mha_is_the_int8_plan_with_its_float_attention_fused(tmp_path, monkeypatch):
    """Same calibration and fallback as ``int8``; the attention core becomes MultiHeadAttention.
    Asked for both (in either order), the export reads its inputs, runs the fp32 reference and
    searches the plan once, and writes int8-mha from the int8 graph."""
    from deploykit.export import int8_static
    from deploykit.export.precision import apply_precision_to_base
    from deploykit.runners.onnxrt import run_graph
    from deploykit.validation.run import validate

    calls = {"inputs": 0, "calibration": 0}

    def counted(key, function):
        def call(*args, **kwargs):
            calls[key] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(
        deploykit.inputs.builtin.DefaultCalibration, "inputs", counted("inputs", deploykit.inputs.builtin.DefaultCalibration.inputs)
    )
    monkeypatch.setattr(int8_static, "quantize_static_int8", counted("calibration", int8_static.quantize_static_int8))
    model = load_model(model_dir(DEFAULT_ZOO_MODEL))
    options = CalibrationOptions(samples=32, held_out=64)
    export(model, [(48, 48)], tmp_path, precisions=["int8-mha", "int8"], calibration=options)
    assert calls == {"inputs": 1, "calibration": 1}
    int8, fused = (onnx.load(str(tmp_path / f"model_48_{p}.onnx")) for p in ("int8", "int8-mha"))
    assert fused.SerializeToString() == apply_precision_to_base(int8, "int8-mha").SerializeToString()
    with pytest.raises(ConfigError, match="not written from a int8-mha graph"):
        apply_precision_to_base(fused, "int8-mha")
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("MultiHeadAttention") == model.cfg.depth and "Softmax" not in ops
    assert ops.count("QuantizeLinear") == [n.op_type for n in int8.graph.node].count("QuantizeLinear") > 0
    assert GraphMetadata.of(fused).quantization.kept_float == GraphMetadata.of(int8).quantization.kept_float
    assert GraphMetadata.of(fused).precision == "int8-mha"
    inputs = deploykit.inputs.builtin.dataset_inputs(model.cfg.dataset, (48, 48), model.cfg.mean, model.cfg.std, 16)
    # Equal but for summation order (which can move a value across an int8 rounding step downstream).
    a, b = run_graph(fused, inputs), run_graph(int8, inputs)
    assert (
        np.mean(a.argmax(-1) == b.argmax(-1)) >= 15 / 16
        and np.min(np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)) > 0.999
    )
    assert validate(tmp_path, precision="int8-mha", num_random=1, num_real=8)


@pytest.mark.slow
def test_validate_passes_int8_on_a_trained_model_and_fails_a_planted_bad_scale(tmp_path, zoo_int8_export):
    """On a copy of the suite's int8 export of the default zoo model (conftest.py), at 48 px."""
    import shutil

    from deploykit.export.manifest import MANIFEST_FILE, sha256_file
    from deploykit.validation.run import validate

    out = shutil.copytree(zoo_int8_export, tmp_path / "x")
    (good,) = validate(out, resolutions=[(48, 48)], precision="int8").records
    assert good.passed and good.num_real == 8 and good.mean_cosine >= 0.99 and good.tolerance["real_only"]
    # Plant: block 1's fc1 weights dequantized with a 30x scale (as a broken calibration or a
    # hand edit would leave them); the manifest is updated so only the values are wrong.
    path = out / "model_48_int8.onnx"
    proto = onnx.load(str(path))
    producers = {o: n for n in proto.graph.node for o in n.output}
    fc1 = next(n for n in proto.graph.node if n.op_type == "MatMul" and "blocks.1.mlp.fc1" in _scopes(n))
    scale = next(i for i in proto.graph.initializer if i.name == producers[fc1.input[1]].input[1])
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 30, scale.name))
    onnx.save(proto, str(path))
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    next(g for g in manifest["graphs"] if g["file"] == path.name)["sha256"] = sha256_file(path)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    (bad,) = validate(out, resolutions=[(48, 48)], precision="int8").records
    assert not bad.passed and any("mean cosine" in f or "top-1" in f for f in bad.failures), bad.failures
    assert bad.first_divergent_block == "blocks.1"


def test_every_encoding_has_a_measured_attention_choice():
    """Each encoding's choice is what its measurement says (benchmarks/results/int8-attention.json,
    from ``benchmarks/int8_plans.py attention``): quantize the attention products only where that
    kept top-1 agreement with fp32 at every measured resolution. A new encoding needs its own
    measurement before its INT8 plan may decide for it."""
    from deploykit.export.int8_selection import ATTENTION_INT8

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "int8-attention.json"
    agreement = {(r["encoding"], r["resolution"], r["attention_int8"]): r["agreement"] for r in json.loads(results.read_text())["records"]}
    assert set(ATTENTION_INT8) == set(list_encodings())
    for encoding, choice in ATTENTION_INT8.items():
        resolutions = sorted({res for e, res, _ in agreement if e == encoding})
        assert len(resolutions) >= 2, f"{encoding}: no measurement at 1x and 2x"
        measured = all(agreement[encoding, res, True] >= agreement[encoding, res, False] for res in resolutions)
        assert choice == measured, (
            encoding,
            {res: (agreement[encoding, res, False], agreement[encoding, res, True]) for res in resolutions},
        )


@pytest.mark.slow
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
    weights |= {n.output[0] for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in weights}  # int8 weights
    products = [n for n in proto.graph.node if n.op_type == "MatMul" and not set(n.input) & weights and len(dequantized[n.name]) == 2]
    assert len(products) == 2 * 2  # q·kᵀ and attention·v in both blocks, both inputs int8
    details = manifest.graph(RES, "int8").quantization
    assert details["attention_int8"] and "attention" not in details["float_nodes"]


# ------------------------------------------------------------------ the fallback, planted


def _planted_model():
    """A seeded ViT whose block 1 fc2 reads one hidden channel ~100x larger than the rest, a
    channel fc2 ignores: per-tensor int8 scales set by it round fc2's real input to zero."""
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=2, img_size=32, patch_size=8, embed_dim=64, num_heads=2, num_classes=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5)  # logits far apart: agreement measures quantization, not ties
        model.blocks[1].mlp.fc1.bias[7] = 300.0
        model.blocks[1].mlp.fc2.weight[:, 7] = 0.0
    return model.eval()


def test_the_fallback_finds_the_planted_matmul_names_it_and_meets_the_target(tmp_path, caplog, monkeypatch):
    from deploykit.export import int8_check, int8_static, onnx_export
    from deploykit.export.int8_check import describe_plan
    from deploykit.inputs.user import InputData, UserCalibration
    from deploykit.runners import base
    from deploykit.runners.onnxrt import run_graph

    checked = []
    check_plan = int8_check.check_plan
    monkeypatch.setattr(int8_check, "check_plan", lambda *a, **kw: checked.append((a[2], kw["actual"])) or check_plan(*a, **kw))
    # The held-out checks run as many inputs per call as keep one input's attention scores within a
    # budget, made here to fit 7 of this model's inputs.
    model = _planted_model()
    scores = 4 * model.cfg.num_heads * model.num_tokens((32, 32)) ** 2
    monkeypatch.setattr(onnx_export, "_SCORES_PER_CALL_BYTES", 7 * scores + scores // 2)
    calls, run_batched = [], base.run_batched
    monkeypatch.setattr(
        base, "run_batched", lambda runner, x, batch, *a: calls.append((len(x), batch)) or run_batched(runner, x, batch, *a)
    )
    # ...and so does ONNX Runtime's calibrator (at most 8: it keeps every intermediate tensor).
    handed, get_next = [], int8_static._Reader.get_next
    monkeypatch.setattr(
        int8_static._Reader, "get_next", lambda reader: (lambda b: handed.append(b and len(b["images"])) or b)(get_next(reader))
    )
    inputs = np.random.default_rng(0).standard_normal((300, 3, 32, 32)).astype(np.float32)
    data = UserCalibration(InputData(Path("noise.npy"), arrays={"": inputs}))
    options = CalibrationOptions(samples=64, held_out=236, min_agreement=0.9, data=data)
    manifest = export(model, [(32, 32)], tmp_path, precisions=["int8"], calibration=options)
    assert handed[:-1] == [7] * 9 + [1] and handed[-1] is None  # 64 calibration inputs, 7 at a time
    assert (236, 7) in calls and not any(rows == 236 and batch != 7 for rows, batch in calls)  # the fp32 reference
    assert sum(rows for rows, batch in calls if batch == rows <= 7) >= 2 * 236  # the fallback's trials
    details = manifest.graph((32, 32), "int8").quantization
    record = details["agreement"]
    assert record["quantized_all"]["top1_agreement"] < 0.9  # control: the outlier breaks the all-int8 plan
    assert record["met"] and record["final"]["top1_agreement"] >= 0.9 and record["final"]["complete"]
    (moved,) = [e for e in details["kept_float"] if e["reason"] == "sensitivity"]
    assert moved["module"] == "blocks.1.mlp.fc2" and moved["onnx"].startswith("node_")
    assert details["sensitivity"]["most_sensitive"][0]["module"] == "blocks.1.mlp.fc2"
    budget = int(9 * QualityTarget.max_float_share)  # of the 9 quantizable nodes (patch embedding, 4 per block)
    assert record["checks"] <= 2 + math.ceil(math.log2(budget))
    proto = onnx.load(str(tmp_path / "model_32_int8.onnx"))
    # The final check took the outputs of the fallback's last run of the plan: the written graph's, to the bit.
    ((held_out, reused),) = checked
    assert reused is not None and len(held_out) == 236 and np.array_equal(reused, run_graph(proto, held_out))
    (fc2,) = [n for n in proto.graph.node if n.name == moved["onnx"]]
    assert not _dequantized_inputs(proto)[fc2.name]  # float in the written graph
    assert any(_dequantized_inputs(proto)[n.name] for n in proto.graph.node if _module(n) == "blocks.1.mlp.fc1")
    text = "\n".join(describe_plan(QuantizationRecord.from_dict(details)))
    assert f"kept float: blocks.1.mlp.fc2 ({moved['onnx']}): sensitivity" in text
    assert not any("untrained" in r.message for r in caplog.records)  # its weights were changed: not at their init


def test_bisection_checks_a_logarithmic_number_of_times():
    from deploykit.export.sensitivity import bisect_fallback

    ranked = [f"n{i}" for i in range(100)]
    for needed in (0, 1, 7, 24, 25):
        calls = []

        def check(nodes, stop_early, calls=calls, needed=needed):
            calls.append(len(nodes))
            return {"top1_agreement": 0.0, "mean_cosine": 0.0}, len(nodes) >= needed

        count, trials = bisect_fallback(ranked, 25, check)
        assert count == needed and [t.float_count for t in trials] == calls
        assert len(calls) <= 2 + math.ceil(math.log2(25))
    count, _ = bisect_fallback(ranked, 25, lambda nodes, stop_early: ({}, False))
    assert count == 25  # never met: the most float allowed


def test_moving_every_node_back_to_float_gives_the_fp32_graph(tmp_path):
    from deploykit.export import int8_selection, int8_static, onnx_from_model
    from deploykit.export.sensitivity import dequantize_nodes
    from deploykit.runners.onnxrt import run_graph

    fp32 = onnx_from_model(_model("rope-axial"), RES)
    inputs = np.random.default_rng(0).standard_normal((8, 3, *RES)).astype(np.float32)
    planned, _ = int8_static.quantize_static_int8(fp32, int8_static.Calibration(inputs, "noise"))
    quantized = int8_selection.select_nodes(fp32, False).quantize
    restored = dequantize_nodes(planned, fp32, quantized)
    assert not {n.op_type for n in restored.graph.node} & set(QDQ)
    np.testing.assert_allclose(run_graph(restored, inputs), run_graph(fp32, inputs), rtol=0, atol=1e-5)
    assert np.abs(run_graph(planned, inputs) - run_graph(fp32, inputs)).max() > 1e-4  # control


@pytest.mark.parametrize("which", ["planted", "sape2"])
def test_each_nodes_sensitivity_is_the_output_error_with_it_alone_int8(which, monkeypatch):
    """The one pass (nodes a few at a time, each group's graph started where its first node
    reads, fed the fp32 tensors crossing there) against the definition, one graph per node:
    the plan with every other node back in float, run whole."""
    from deploykit.export import int8_selection, int8_static, onnx_from_model, sensitivity
    from deploykit.export.sensitivity import dequantize_nodes, node_sensitivity
    from deploykit.runners.onnxrt import run_graph

    monkeypatch.setattr(sensitivity, "_GROUPS_PER_CAPTURE", 2)  # cut tensors captured in several runs
    model, res = (_planted_model(), (32, 32)) if which == "planted" else (_model("sape2"), RES)
    fp32 = onnx_from_model(model, res)
    inputs = np.random.default_rng(0).standard_normal((6, 3, *res)).astype(np.float32)
    planned, _ = int8_static.quantize_static_int8(fp32, int8_static.Calibration(inputs, "noise"))
    quantized = int8_selection.select_nodes(fp32, False).quantize
    measured = node_sensitivity(fp32, planned, quantized, inputs)  # 6 inputs: 2 nodes per group, 2 groups per capture
    reference = run_graph(fp32, inputs)
    for node in quantized:
        alone = run_graph(dequantize_nodes(planned, fp32, [n for n in quantized if n != node]), inputs)
        expected = np.sum((alone - reference) ** 2) / np.sum(reference**2)
        assert measured[node] == pytest.approx(expected, rel=1e-3, abs=1e-12), node
    assert len(quantized) > 4 and min(measured.values()) > 0
    if which == "planted":
        modules = {n.name: _module(n) for n in fp32.graph.node}
        assert modules[max(measured, key=measured.get)] == "blocks.1.mlp.fc2"


@pytest.mark.slow
def test_keep_float_pins_layers_by_module_path(tmp_path):
    options = CalibrationOptions(samples=8, held_out=16, min_agreement=None, keep_float=("blocks.0.mlp.*", "blocks.1.attn.qkv"))
    manifest = export(_model("ape"), [RES], tmp_path, precisions=["int8"], calibration=options)
    pinned = {e["module"]: e["why"] for e in manifest.graph(RES, "int8").quantization["kept_float"] if e["reason"] == "pinned"}
    assert pinned == {
        "blocks.0.mlp.fc1": "--keep-float blocks.0.mlp.*",
        "blocks.0.mlp.fc2": "--keep-float blocks.0.mlp.*",
        "blocks.1.attn.qkv": "--keep-float blocks.1.attn.qkv",
    }
    proto = onnx.load(str(tmp_path / "model_64_int8.onnx"))
    dequantized = _dequantized_inputs(proto)
    assert not any(dequantized[n.name] for n in proto.graph.node if _module(n) in pinned)
    assert any(dequantized[n.name] for n in proto.graph.node if _module(n) == "blocks.1.mlp.fc1")
    with pytest.raises(ConfigError, match=r"--keep-float 'blocks\.9\.\*' matches no quantizable layer; they are: patch_embed\.proj, "):
        export(
            _model("ape"), [RES], tmp_path / "x", precisions=["int8"], calibration=CalibrationOptions(samples=8, keep_float=("blocks.9.*",))
        )


@pytest.mark.slow
def test_a_features_model_is_judged_by_per_token_cosine(tmp_path):
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=0, global_pool="")
    unreachable = CalibrationOptions(samples=8, held_out=8, min_cosine=1.0)
    manifest = export(model, [(32, 32)], tmp_path, precisions=["int8"], calibration=unreachable)
    record = manifest.graph((32, 32), "int8").quantization["agreement"]
    assert record["target"]["min_cosine"] == 1.0 and record["target"]["min_agreement"] is None
    final = record["final"]
    assert "top1_agreement" not in final and 0.99 < final["mean_cosine"] < 1 and 0 < final["mean_relative_error"] < 0.2
    assert final["rows"] == 8 * (1 + 4) and not record["met"]  # a row per token of every input; 1.0 is out of reach
    reachable = CalibrationOptions(samples=8, held_out=8, min_cosine=0.9, max_relative_error=0.5)
    record = (
        export(model, [(32, 32)], tmp_path / "b", precisions=["int8"], calibration=reachable)
        .graph((32, 32), "int8")
        .quantization["agreement"]
    )
    assert record["met"] and record["checks"] == 1


@pytest.mark.slow
def test_untrained_weights_are_recognised(zoo_int8_export):
    from deploykit.export import onnx_from_model
    from deploykit.export.int8_selection import looks_untrained

    assert looks_untrained(onnx_from_model(_model("ape"), RES))
    # the trained zoo model's fp32 graph, as the suite's int8 export of it wrote it (conftest.py)
    trained = Manifest.read(zoo_int8_export).graph((48, 48), "fp32")
    assert not looks_untrained(onnx.load(str(zoo_int8_export / trained.file)))
    assert not looks_untrained(onnx_from_model(_planted_model(), (32, 32)))
