"""``deploykit import-plan``: a Q/DQ graph made by NVIDIA Model Optimizer enters an export directory
as the ``imported`` plan once it matches the checkpoint; a graph of other weights, architecture or
resolution is refused in one line with nothing written."""

from __future__ import annotations

import hashlib
import json
import shutil

import onnx
import pytest
import torch

from deploykit.export import export
from deploykit.export.metadata import GraphMetadata
from deploykit.export.qdq_compare import modelopt_quantize
from deploykit.inputs.builtin import DefaultCalibration
from deploykit.nn import create_model
from deploykit.nn.checkpoint import load_model
from deploykit.zoo.registry import DEFAULT_ZOO_MODEL, model_dir


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """The default zoo model exported at 48 (fp32), and ModelOpt int8 graphs: of it at 48 and 64,
    of another zoo model (same trunk, other weights) and of a two-block ViT (other architecture)."""
    root = tmp_path_factory.mktemp("import-plan")
    zoo = load_model(model_dir(DEFAULT_ZOO_MODEL))
    calibration, _, _ = DefaultCalibration().inputs(zoo, (48, 48), 64, 8)
    torch.manual_seed(0)
    sources = {
        "same": (zoo, 48),
        "resolution": (zoo, 64),
        "weights": (load_model(model_dir("shapes-rope-axial")), 48),
        "architecture": (create_model("vit_tiny_patch16", encoding="ape", depth=2, img_size=48, num_classes=4), 48),
    }
    made = {}
    for name, (model, size) in sources.items():
        out = root / name
        export(model, [(size, size)], out)
        data = calibration if size == 48 else DefaultCalibration().inputs(zoo, (size, size), 16, 8)[0]
        modelopt_quantize(out / f"model_{size}.onnx", "int8", data, root / f"{name}-int8.onnx")
        made[name] = root / f"{name}-int8.onnx"
    return root / "same", made


def _state(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_a_modelopt_graph_enters_as_the_imported_plan_and_validates(graphs, tmp_path, deploykit_cli):
    source, made = graphs
    directory = tmp_path / "exp"
    shutil.copytree(source, directory)
    code, err = deploykit_cli("import-plan", directory, made["same"])
    assert code == 0, err
    proto = onnx.load(str(directory / "model_48_imported.onnx"))
    meta = GraphMetadata.of(proto)
    assert meta.precision == "imported" and meta.encoding == "ape" and tuple(meta.resolution) == (48, 48)
    record = meta.quantization
    assert record.qdq_type == "int8" and record.remainder == "fp16" and record.source.startswith("onnx.quantize")
    assert record.quantized_nodes == sum(1 for n in onnx.load(str(made["same"])).graph.node if n.op_type == "MatMul") + 1  # + patch Conv
    manifest = json.loads((directory / "manifest.json").read_text())
    entry = next(g for g in manifest["graphs"] if g["precision"] == "imported")
    assert entry["file"] == "model_48_imported.onnx" and entry["opset"] == 19 and entry["quantization"]["qdq_type"] == "int8"
    code, err = deploykit_cli("validate", directory, "--precision", "imported")
    assert code == 0, err
    # TensorRT-RTX's builder (on this CPU) builds it like any plan; the fingerprint names the plan.
    code, err = deploykit_cli("build", directory, "--backend", "rtx", "--precision", "imported", "--compute-capability", "8.9")
    assert code == 0, err
    assert json.loads((directory / "model_48_imported.rtx.json").read_text())["fingerprint"]["precision"] == "imported"
    # Importing again replaces the entry rather than adding a second one.
    code, err = deploykit_cli("import-plan", directory, made["same"])
    assert code == 0, err
    assert sum(g["precision"] == "imported" for g in json.loads((directory / "manifest.json").read_text())["graphs"]) == 1


@pytest.mark.parametrize(
    "mismatch, says",
    [
        ("resolution", "takes 64x64 images; .* has fp32 graphs at 48x48 only"),
        ("weights", "holds other weights: patch_embed.proj \\(node_conv2d\\) differs from the checkpoint's by"),
        ("architecture", "is another architecture: 10 weighted matrix products against the checkpoint.s 18"),
    ],
)
def test_a_graph_of_another_model_is_refused_in_one_line_with_nothing_written(graphs, tmp_path, deploykit_cli, mismatch, says):
    import re

    source, made = graphs
    directory = tmp_path / "exp"
    shutil.copytree(source, directory)
    before = _state(directory)
    code, err = deploykit_cli("import-plan", directory, made[mismatch])
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(lines) == 1 and re.search(says, lines[0]), err
    assert _state(directory) == before


def test_a_graph_without_qdq_and_export_of_the_imported_plan_are_refused(graphs, tmp_path, deploykit_cli):
    source, _ = graphs
    directory = tmp_path / "exp"
    shutil.copytree(source, directory)
    before = _state(directory)
    code, err = deploykit_cli("import-plan", directory, directory / "model_48.onnx")
    assert code == 1 and "has no QuantizeLinear/DequantizeLinear nodes" in err
    code, err = deploykit_cli("export", "-c", model_dir(DEFAULT_ZOO_MODEL), "-r", 48, "--precision", "imported", "-o", tmp_path / "o")
    assert code == 1 and "deploykit import-plan" in err and not (tmp_path / "o").exists()
    assert _state(directory) == before


@pytest.mark.parametrize(
    "fixture, graph, qtype, remainder",
    [("zoo_gpu_export", "model_48_fp8.onnx", "float8e4m3fn", "fp16"), ("zoo_int8_export", "model_48_int8.onnx", "int8", "fp32")],
)
def test_graphs_storing_quantized_weights_enter_too(request, tmp_path, deploykit_cli, fixture, graph, qtype, remainder):
    """Weights stored quantized (FP8 or INT8 initializers read by a per-channel DequantizeLinear, as
    deploykit's and ONNX Runtime's quantizers write them) are dequantized to match the checkpoint."""
    source = request.getfixturevalue(fixture)
    directory = tmp_path / "exp"
    shutil.copytree(source, directory)
    outside = tmp_path / "elsewhere.onnx"
    shutil.copyfile(source / graph, outside)
    code, err = deploykit_cli("import-plan", directory, outside)
    assert code == 0, err
    record = GraphMetadata.of(onnx.load(str(directory / "model_48_imported.onnx"))).quantization
    assert (record.qdq_type, record.remainder) == (qtype, remainder)
