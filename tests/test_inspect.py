"""``deploykit inspect PATH``: a graph's encoding, tables, precision plan, opset, custom ops and
TensorRT-RTX's parse; an engine's fingerprint, profile and (with a GPU) layers; one line for a
path that is neither."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from deploykit.backends.inspection import inspect_path
from deploykit.errors import DeployKitError
from deploykit.export import export
from deploykit.nn import create_model
from tests.test_cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
DEPTH = 2


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("inspect") / "exp"
    export(
        create_model("vit_tiny_patch16", encoding="sape2", depth=DEPTH, img_size=32, num_classes=10),
        [(32, 32)],
        out,
        precisions=["fp32", "fp16"],
    )
    return out


def test_graph(export_dir, tmp_path):
    info = inspect_path(export_dir / "model_32_fp16.onnx")
    assert info["kind"] == "graph" and info["encoding"]["name"] == "sape2" and info["precision_plan"] == "fp16"
    assert info["opset"]["ai.onnx"] >= 17 and info["custom_ops"] == {"deploykit::SaPE2Bias": DEPTH}
    assert info["functions"] == ["deploykit::SaPE2AxisSignatures", "deploykit::SaPE2Bias"]  # the plugin form's first stage too
    assert len(info["tables"]) == 2 * DEPTH and all(t["dtype"] == "float32" for t in info["tables"])  # tables stay fp32
    assert info["initializer_dtypes"].get("float16", 0) > 0 and info["casts"] > 0  # the plan's fp16 weights and casts
    assert info["inputs"] == [{"name": "images", "shape": ["batch", 3, 32, 32], "dtype": "float32"}]
    rtx = info["tensorrt_rtx"]
    if rtx["parsed"] is None:
        pytest.skip(rtx["note"])
    assert rtx["parsed"] is True and rtx["layers"] == sum(rtx["layer_types"].values()) > 0
    # The parser's repeated node-name warning, summarised. TensorRT gives it once per process, so
    # ask a fresh one (any SaPE² graph parsed earlier in this process would have taken it).
    fresh = subprocess.run(
        [sys.executable, "-m", "deploykit", "inspect", str(export_dir / "model_32_fp16.onnx"), "--json", str(tmp_path / "info.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert fresh.returncode == 0, fresh.stderr
    assert "already exists" in json.loads((tmp_path / "info.json").read_text())["tensorrt_rtx"]["warnings"]
    assert inspect_path(export_dir / "model_32.onnx")["precision_plan"] == "fp32"


def test_graph_as_openvino_reads_it(export_dir):
    info = inspect_path(export_dir / "model_32.onnx")["openvino"]
    # SaPE²'s custom node is read through its inlined body; a bf16 hint keeps (at least) each
    # block's bias body, both LayerNorms and the Softmax in f32.
    assert info["read"] is True and info["ops"] == sum(info["op_types"].values())
    assert info["op_types"]["MVN"] == 2 * DEPTH + 1 and info["kept_f32_under_bf16_hint"] > info["op_types"]["MVN"]


def test_engine(export_dir, tmp_path):
    from deploykit.backends.build import build

    out = shutil.copytree(export_dir, tmp_path / "exp")
    (built,) = build(out, "rtx", dynamic=True, max_batch=4, optimization_level=0, precisions=["fp32"])
    info = inspect_path(built.engine)
    recorded = json.loads(built.fingerprint.read_text())["fingerprint"]
    assert info["kind"] == "engine" and info["fingerprint"] == recorded and info["matches_fingerprint"] is True
    assert info["profile_shapes"] == {"images": [[1, 3, 32, 32], [1, 3, 32, 32], [4, 3, 32, 32]]}
    assert info["profiles"] == [info["profile_shapes"]["images"]] and info["lean_runtime"] == ""  # one profile, not version-compatible
    if not torch.cuda.is_available():
        assert info["layers"]["note"].startswith("layers unavailable: cannot deserialize the engine here")
    else:
        assert info["layers"]["count"] > 0 and all(layer["outputs"] for layer in info["layers"]["layers"])
    with open(built.engine, "ab") as f:
        f.write(b"\0")
    assert inspect_path(built.engine)["matches_fingerprint"] is False


def test_cli_and_bad_paths(export_dir, tmp_path, capsys):
    code, stdout, stderr = run_cli(capsys, "inspect", export_dir / "model_32.onnx", "--json", tmp_path / "i.json")
    assert code == 0, stderr
    assert "precision_plan: fp32" in stdout and json.loads((tmp_path / "i.json").read_text())["kind"] == "graph"
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x08\x96\x01not a model")
    for path, message in [
        (export_dir, "is a directory"),
        (tmp_path / "nope.onnx", "does not exist"),
        (export_dir / "manifest.json", "has suffix '.json'"),
        (junk, "is not a readable ONNX graph"),
    ]:
        code, _, stderr = run_cli(capsys, "inspect", path)
        assert code == 1 and stderr.startswith("error: ") and message in stderr and len(stderr.strip().splitlines()) == 1
    with pytest.raises(DeployKitError, match="inspect takes an ONNX graph"):
        inspect_path(export_dir)


def test_engine_layers_read_the_inspector_json_of_tensorrt_11(tmp_path, monkeypatch):
    """Item 7 of issue 42: TensorRT 11 (and TensorRT-RTX) split the inspector's per-tensor
    ``Format/Datatype`` into ``Datatype`` and ``Format`` (NVIDIA's Polygraphy reads both; the 11.4
    runtime library holds ``Datatype`` and no ``Format/Datatype``), so every output read "?". The
    engine and its inspector are autospecs of TensorRT-RTX's classes."""
    import tensorrt_rtx as rtx

    from deploykit.backends._polygraphy import backend
    from deploykit.backends.inspection import _engine_layers
    from tests.trt_api import strict_autospec

    layers = [  # TensorRT 11's schema, then TensorRT 10's
        {
            "Name": "head",
            "LayerType": "Gemm",
            "Outputs": [{"Name": "logits", "Datatype": "Half", "Format": "Row major linear FP16 format (kLINEAR)"}],
        },
        {
            "Name": "norm",
            "LayerType": "Normalization",
            "Outputs": [{"Name": "x", "Format/Datatype": "Row major linear FP32 format (kLINEAR)"}],
        },
    ]
    inspector = strict_autospec(rtx.EngineInspector)
    inspector.get_layer_information.side_effect = lambda index, fmt: json.dumps(layers[index])
    engine = strict_autospec(rtx.ICudaEngine, num_layers=len(layers))
    engine.create_engine_inspector.return_value = inspector
    monkeypatch.setattr(backend("tensorrt_rtx"), "EngineFromBytes", lambda data: lambda: engine)
    path = tmp_path / "model_32.rtx.engine"
    path.write_bytes(b"engine")
    head, norm = _engine_layers(path, "tensorrt_rtx")["layers"]
    assert head["name"] == "head" and "Half" in head["outputs"][0] and "FP16" in head["outputs"][0]
    assert norm["outputs"] == ["Row major linear FP32 format (kLINEAR)"]
