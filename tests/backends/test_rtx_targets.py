"""Which GPUs a TensorRT-RTX engine is built for, and the runner's refusal of one not built for
the GPU present (issue 42, item 2), with TensorRT-RTX's real builder on CPU.

TensorRT-RTX builds for 8.0, 8.6, 8.9, 12.0 and later unless told otherwise, never for Turing
(7.5): that target must be set on the builder config. Whether it was set shows in what the
builder does on CPU: Turing has no FP32 GEMM in TensorRT-RTX, so an fp32 matrix product builds
for the default targets and is refused for 7.5, while its fp16 twin builds for 7.5.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from onnx import helper, numpy_helper

from deploykit.backends.build import build
from deploykit.backends.devices import Device, rtx_targets
from deploykit.backends.engine_cache import EngineFromPath, engine_paths
from deploykit.backends.tensorrt import BuildOptions, EngineFromOnnx
from deploykit.errors import ConfigError, ExportError, StaleEngineError

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

TURING = Device("12.8", "570.1", "NVIDIA GeForce RTX 2080 Ti", "7.5")
ADA = Device("12.8", "570.1", "NVIDIA GeForce RTX 4090", "8.9")
FAST = dict(optimization_level=0, precisions=["fp16"])  # TensorRT-RTX has no fp32 GEMM on Turing


def _matmul(dtype: np.dtype) -> bytes:
    """``relu(x @ w)``, [2, 8] x [8, 8], in ``dtype``."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    x, y = helper.make_tensor_value_info("x", elem, [2, 8]), helper.make_tensor_value_info("y", elem, [2, 8])
    w = numpy_helper.from_array(np.eye(8, dtype=dtype), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    graph = helper.make_graph(nodes, "matmul", [x], [y], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_turing_is_built_for_only_when_set_on_the_builder_config():
    fp32, fp16 = _matmul(np.float32), _matmul(np.float16)
    assert EngineFromOnnx(fp32, BuildOptions(module="tensorrt_rtx"))()  # TensorRT-RTX's default targets: no Turing
    turing = BuildOptions(module="tensorrt_rtx", compute_capabilities=("7.5",))
    with pytest.raises(ExportError, match=r"Turing \(SM75\).*FP32 GEMM is not supported") as err:
        EngineFromOnnx(fp32, turing)()  # compiled for Turing now
    assert "\n" not in str(err.value)
    assert EngineFromOnnx(fp16, turing)()
    with pytest.raises(ValueError, match="compute capability 9.0"):
        BuildOptions(module="tensorrt_rtx", compute_capabilities=("9.0",))  # H100: not a TensorRT-RTX GPU
    with pytest.raises(ValueError, match="TensorRT-RTX's"):
        BuildOptions(module="tensorrt", compute_capabilities=("7.5",))


def test_turing_gets_a_device_specific_engine_and_other_machines_a_portable_one():
    assert rtx_targets(TURING) == ("7.5",)  # NVIDIA: device-specific engines for Turing
    for device in (Device(), ADA):
        targets = rtx_targets(device)
        assert "7.5" not in targets and {"8.6", "8.9", "12.0"} <= set(targets)
    assert rtx_targets(Device(), ("7.5", "8.6", "7.5")) == ("7.5", "8.6")
    with pytest.raises(ConfigError, match=r"^TensorRT-RTX cannot build for compute capability 8\.0"):
        rtx_targets(Device(), ("8.0",))


@pytest.fixture(scope="module")
def fp16_export(tmp_path_factory):
    import torch

    from deploykit.export import export
    from deploykit.nn import create_model

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("rtx-targets") / "exp"
    export(create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=10), [(32, 32)], out, precisions=["fp16"])
    return out


def test_build_records_its_targets_and_the_runner_refuses_other_gpus(fp16_export, tmp_path):
    from deploykit.backends.trt_runner import engine_runner

    out = shutil.copytree(fp16_export, tmp_path / "exp")
    onnx_path = out / "model_32_fp16.onnx"
    (built,) = build(out, "rtx", device=Device(), compute_capabilities=["8.6"], **FAST)
    assert json.loads(built.fingerprint.read_text())["fingerprint"]["build"]["compute_capabilities"] == ["8.6"]
    ampere = Device("12.8", "570.1", "NVIDIA GeForce RTX 3090", "8.6")
    assert EngineFromPath(onnx_path, "tensorrt_rtx", device=ampere)() == built.engine.read_bytes()
    runner = engine_runner(onnx_path, "tensorrt_rtx", device=ADA)
    with pytest.raises(StaleEngineError) as err:
        runner.activate()  # before anything is deserialized
    message = str(err.value)
    assert message.startswith(
        "model_32_fp16.rtx.engine was built for compute capabilities 8.6, not for the NVIDIA GeForce RTX 4090 here (8.9)"
    )
    assert "--rebuild" in message and "\n" not in message


def test_on_turing_an_engine_built_elsewhere_is_refused_and_rebuilt_for_turing(fp16_export, tmp_path):
    """Before: an engine built on a CPU (no Turing target) was refused on Turing by TensorRT-RTX
    only, and ``--rebuild`` on the Turing machine built the same engine again."""
    out = shutil.copytree(fp16_export, tmp_path / "exp")
    onnx_path = out / "model_32_fp16.onnx"
    build(out, "rtx", device=Device(), **FAST)
    with pytest.raises(StaleEngineError, match=r"not for the NVIDIA GeForce RTX 2080 Ti here \(7\.5\); .*--rebuild"):
        EngineFromPath(onnx_path, "tensorrt_rtx", device=TURING)()
    with pytest.raises(StaleEngineError, match=r"build\.compute_capabilities \(built .*8\.6.*, now \[\"7\.5\"\]\)"):
        build(out, "rtx", device=TURING, **FAST)  # the Turing machine wants another engine: refused, not reused
    # --rebuild compiles for Turing now. TensorRT-RTX has no FP32 GEMM there, and the fp16 plan
    # keeps its logits head in fp32, so it refuses that one node, in one line.
    with pytest.raises(ExportError, match=r"for Turing \(SM75\): FP32 GEMM is not supported") as err:
        build(out, "rtx", device=TURING, rebuild=True, **FAST)
    assert "\n" not in str(err.value)


def test_an_engine_recording_no_targets_is_judged_by_tensorrt_rtx_default(fp16_export, tmp_path):
    """A fingerprint written before targets were recorded: TensorRT-RTX built it for its default
    targets, which leave Turing out."""
    out = shutil.copytree(fp16_export, tmp_path / "exp")
    onnx_path = out / "model_32_fp16.onnx"
    build(out, "rtx", device=Device(), **FAST)
    fp_path = engine_paths(onnx_path, "tensorrt_rtx")[1]
    record = json.loads(fp_path.read_text())
    del record["fingerprint"]["build"]["compute_capabilities"]
    fp_path.write_text(json.dumps(record))
    assert EngineFromPath(onnx_path, "tensorrt_rtx", device=ADA)()
    with pytest.raises(StaleEngineError, match=r"built for compute capabilities 8\.0, .*not for the NVIDIA GeForce RTX 2080 Ti"):
        EngineFromPath(onnx_path, "tensorrt_rtx", device=TURING)()


def test_compute_capabilities_are_refused_for_tensorrt(fp16_export):
    with pytest.raises(ConfigError, match=r"^--compute-capability is TensorRT-RTX's"):
        build(fp16_export, "trt", compute_capabilities=["7.5"])
