"""validate() says which execution provider ran, and locates a divergence in the backend that
failed: the recorded block outputs are marked as outputs of that backend's graph (ONNX Runtime)
or of a debug engine built like the failing one, and the first block out of tolerance there is
named, in the fp32 and the reduced-precision plans."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import numpy_helper

from deploykit.backends import registry
from deploykit.errors import ExportError
from deploykit.export import export
from deploykit.export.bundle import load_reference
from deploykit.export.int8_check import check_plan
from deploykit.export.manifest import MANIFEST_FILE, Manifest, sha256_file
from deploykit.export.precision import PLANS
from deploykit.nn import create_model
from deploykit.runners.onnxrt import OnnxrtRunner
from deploykit.validation.layer_map import marked_graph
from deploykit.validation.run import first_divergent_block, validate

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
RES = (64, 64)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("bisect") / "exp"
    export(
        create_model("vit_tiny_patch16", encoding="rope-axial", depth=3, img_size=64, num_classes=10),
        [RES],
        out,
        precisions=["fp32", "fp16"],
    )
    return out


def _miscompile(model: bytes, block: int, factor: float = 3.0) -> bytes:
    """``model`` with the weight of ``blocks.<block>.mlp.fc2`` scaled: a planted divergence."""
    proto = onnx.load_from_string(model)
    node = next(
        n
        for n in proto.graph.node
        if n.op_type in ("MatMul", "Gemm") and any(f"blocks.{block}.mlp.fc2" in p.value for p in n.metadata_props)
    )
    init = next(i for i in proto.graph.initializer if i.name in node.input)
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * factor, init.name))
    return proto.SerializeToString()


@pytest.mark.slow
def test_records_say_which_execution_provider_ran(export_dir):
    report = validate(export_dir, num_random=1, num_real=1)
    with OnnxrtRunner(export_dir / "model_64.onnx") as runner:
        ran = runner.provider
    assert ran in onnxruntime.get_available_providers()
    assert [r.provider for r in report.records] == [ran]
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        assert ran == "CPUExecutionProvider"


def test_fp16_divergence_is_named_in_onnxruntime(export_dir, tmp_path):
    out = shutil.copytree(export_dir, tmp_path / "exp")
    path = out / "model_64_fp16.onnx"
    path.write_bytes(_miscompile(path.read_bytes(), block=1))
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    for graph in manifest["graphs"]:
        graph["sha256"] = sha256_file(out / graph["file"])
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    (record,) = validate(out, precision="fp16", num_random=2, num_real=2).records
    assert not record.passed and record.first_divergent_block == "blocks.1"
    # the layer: fc2, not the qkv projection whose q/k rows the export reordered (compared in the graph's order)
    assert record.first_divergent_layer.module == "blocks.1.mlp.fc2"
    assert not any(e.diverged for e in record.node_errors if e.module == "blocks.1.attn.qkv")
    clean = validate(out, precision="fp32", num_random=2, num_real=2).records[0]  # fp32 intact
    assert clean.first_divergent_block is None and clean.first_divergent_layer is None and clean.node_errors is None


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_an_engine_s_divergence_is_located_in_that_engine(export_dir, stand_in_backend, precision):
    """A stand-in engine backend that miscompiles block 2 (ONNX Runtime underneath): the graph on
    disk is right, so bisecting it in ONNX Runtime would find nothing ("head"); bisecting the
    debug "engine" built from the marked graph finds block 2."""
    compile_ = lambda model: OnnxrtRunner(_miscompile(model, block=2))
    stand_in_backend("engine", lambda path, options: compile_(Path(path).read_bytes()), lambda path, marked, options: compile_(marked))
    report = validate(export_dir, backends=["ort", "engine"], precision=precision, num_random=2, num_real=2)
    (ort_record, engine_record) = report.records
    assert ort_record.passed and ort_record.first_divergent_block is None
    assert not engine_record.passed and engine_record.first_divergent_block == "blocks.2"
    assert engine_record.first_divergent_layer.module == "blocks.2.mlp.fc2"  # in the engine too


class _StandInStop(Exception):
    pass


def test_debug_engine_is_built_from_the_marked_graph_with_the_engine_s_settings(export_dir, tmp_path, monkeypatch):
    """TensorRT-RTX on CPU: the marked graph's block outputs survive TensorRT's parser under their
    ONNX names, and the debug engine is built with the settings recorded for the failing engine."""
    from deploykit.backends import tensorrt, trt_runner
    from deploykit.backends._polygraphy import backend
    from deploykit.backends.build import build
    from deploykit.backends.devices import Device

    out = shutil.copytree(export_dir, tmp_path / "exp")
    (built,) = build(out, "rtx", dynamic=True, batch=2, max_batch=4, optimization_level=0, precisions=["fp16"])
    onnx_path = out / "model_64_fp16.onnx"
    marked, names = marked_graph(onnx_path)
    assert len(names) == 3  # one recorded output per block
    _, network, _ = backend("tensorrt_rtx").NetworkFromOnnxBytes(marked, strongly_typed=True)()
    assert {network.get_output(i).name for i in range(network.num_outputs)} == {"logits", *names}

    options, engines = [], []
    real_call = tensorrt.EngineFromOnnx.__call__
    monkeypatch.setattr(tensorrt.EngineFromOnnx, "__call__", lambda self: options.append(self.options) or real_call(self))

    def check_rtx_engine(runtime, data, what):  # the first step on the engine's bytes, which then needs a GPU
        engines.append(data)
        raise _StandInStop

    monkeypatch.setattr(trt_runner, "check_rtx_engine", check_rtx_engine)
    monkeypatch.setattr(trt_runner, "probe_device", lambda index=0: Device("12.8", "570.1", "NVIDIA RTX 4090", "8.9"))
    with pytest.raises(_StandInStop):
        registry.create_bisect_runner("rtx", onnx_path, marked).activate()
    (debug_options,) = options
    assert (debug_options.min_batch, debug_options.opt_batch, debug_options.max_batch) == (1, 2, 4)
    assert debug_options.optimization_level == 0 and debug_options.module == "tensorrt_rtx"
    (debug_engine,) = engines
    assert debug_engine and debug_engine != built.engine.read_bytes()


def test_a_debug_engine_is_refused_when_the_engine_is_stale(export_dir, tmp_path, monkeypatch):
    from deploykit.backends import trt_runner
    from deploykit.backends.build import build
    from deploykit.backends.devices import Device
    from deploykit.errors import StaleEngineError

    monkeypatch.setattr(trt_runner, "probe_device", lambda index=0: Device("12.8", "570.1", "NVIDIA RTX 4090", "8.9"))
    out = shutil.copytree(export_dir, tmp_path / "exp")
    build(out, "rtx", optimization_level=0, precisions=["fp32"])
    fp_path = out / "model_64.rtx.json"
    record = json.loads(fp_path.read_text())
    record["fingerprint"]["precision"] = "fp16"
    fp_path.write_text(json.dumps(record))
    marked, _ = marked_graph(out / "model_64.onnx")
    with pytest.raises(StaleEngineError, match="precision"):
        registry.create_bisect_runner("rtx", out / "model_64.onnx", marked).activate()


def test_the_plan_check_and_validate_name_the_same_divergent_block(export_dir, tmp_path):
    """One block search (``checks.first_divergent``) behind both checks: a divergence planted
    in block 1 is named by the plan check (planned graph against the fp32 graph, in ONNX Runtime)
    and by validate (the graph against PyTorch) alike, under the same tolerance."""
    fp32 = onnx.load(str(export_dir / "model_64.onnx"))
    planted = tmp_path / "model_64.onnx"
    planted.write_bytes(_miscompile(fp32.SerializeToString(), block=1))
    inputs = np.random.default_rng(0).standard_normal((4, 3, *RES)).astype(np.float32)
    plan = PLANS["fp32"]
    assert first_divergent_block(planted, load_reference(export_dir), inputs, plan.tolerance) == "blocks.1"
    with pytest.raises(ExportError, match=r"first divergent block blocks\.1 \(quantized there: none\)"):
        check_plan(fp32, onnx.load(str(planted)), inputs, plan, "planted")
    check_plan(fp32, fp32, inputs, plan, "intact")  # control: the same graph passes


def test_torch_runner_with_baked_tables_matches_the_exported_graph_and_refuses_other_shapes(export_dir):
    """Profile's torch baseline (tables baked once, as the graph holds them) computes what the
    per-call reference and the exported fp32 graph compute, and only at the baked shape."""
    from deploykit.backends import TorchRunner
    from deploykit.errors import DeployKitError

    model = load_reference(export_dir)
    images = np.random.default_rng(0).standard_normal((2, 3, *RES)).astype(np.float32)
    with TorchRunner(model, torch.float32, shape=RES) as baked, TorchRunner(model, torch.float32) as per_call:
        logits = baked.infer({"images": images})["logits"]
        np.testing.assert_array_equal(logits, per_call.infer({"images": images})["logits"])
        with pytest.raises(DeployKitError, match="baked for input shape"):
            baked.infer({"images": np.zeros((1, 3, 32, 32), np.float32)})
    (fp32,) = Manifest.read(export_dir).graphs_at("fp32")
    with OnnxrtRunner(export_dir / fp32.file) as ort_runner:
        np.testing.assert_allclose(logits, ort_runner.infer({"images": images})["logits"], rtol=1e-4, atol=1e-4)
