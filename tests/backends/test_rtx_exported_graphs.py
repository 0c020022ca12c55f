"""``deploykit build --backend rtx`` on real exports: TensorRT-RTX's parser and builder run on
CPU, so CI checks that every registered encoding's graph builds, in the fp32, fp16 and int8 (Q/DQ)
plans, that ONNX Runtime-only plans are refused, and that the engine cache reuses, refuses and
rebuilds as documented."""

import dataclasses
import json
import shutil

import pytest
import torch

from deploykit.backends.build import build
from deploykit.backends.devices import Device
from deploykit.backends.engine_cache import EngineFromPath, engine_paths
from deploykit.encodings import list_encodings
from deploykit.errors import DeployKitError, StaleEngineError
from deploykit.export import export
from deploykit.export.int8_static import CalibrationOptions
from deploykit.nn import create_model

# torch.onnx's dynamo exporter trips a deprecation inside torch.utils._pytree; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
RES = (96, 64)
FAST = dict(optimization_level=0)  # CI checks that graphs build, not how fast the engine runs


@pytest.fixture(scope="module")
def exported_and_built(tmp_path_factory):
    """encoding -> (export dir, build results), each built once per module."""
    done = {}

    def get(encoding):
        if encoding not in done:
            torch.manual_seed(0)
            model = create_model("vit_tiny_patch16", encoding=encoding, depth=1, img_size=64, num_classes=10)
            out = tmp_path_factory.mktemp(f"rtx-{encoding}")
            export(
                model,
                [RES],
                out,
                precisions=["fp32", "fp16", "int8", "int8-dynamic"],
                calibration=CalibrationOptions(samples=8, held_out=16, min_agreement=None),
            )
            done[encoding] = out, build(out, "rtx", **FAST)
        return done[encoding]

    return get


@pytest.fixture
def ape_copy(exported_and_built, tmp_path):
    """A private copy of the ape export with its engines, free to doctor."""
    return shutil.copytree(exported_and_built("ape")[0], tmp_path / "x")


@pytest.mark.slow
@pytest.mark.parametrize("encoding", list_encodings())
def test_every_plan_builds(exported_and_built, encoding):
    out, results = exported_and_built(encoding)
    # Every plan TensorRT builds, by default; int8-dynamic is ONNX Runtime's own and is left out.
    assert [r.graph for r in results] == ["model_96x64.onnx", "model_96x64_fp16.onnx", "model_96x64_int8.onnx"]
    for r, precision in zip(results, ("fp32", "fp16", "int8")):
        assert not r.cached and r.engine.stat().st_size > 1000
        record = json.loads(r.fingerprint.read_text())["fingerprint"]
        assert record["module"] == "tensorrt_rtx" and record["gpu"] is None
        assert record["shapes"] == {"images": [[1, 3, 96, 64]] * 3}  # static by default
        assert record["precision"] == precision
        assert json.loads(record["encoding"])["name"] == encoding
    # The engine loads back through its fingerprint check.
    assert EngineFromPath(out / "model_96x64_fp16.onnx", "tensorrt_rtx")() == results[1].engine.read_bytes()


def test_ort_only_plans_are_refused_in_one_line(ape_copy):
    with pytest.raises(DeployKitError, match=r"^cannot build int8-dynamic engines: .*MatMulInteger.*--precision int8") as err:
        build(ape_copy, "rtx", precisions=["int8-dynamic"], **FAST)
    assert "\n" not in str(err.value)


def test_cache_reuses_refuses_and_rebuilds(ape_copy):
    out = ape_copy
    engine, fp_path = engine_paths(out / "model_96x64.onnx", "tensorrt_rtx")
    before = engine.read_bytes(), engine.stat().st_mtime_ns
    assert all(r.cached for r in build(out, "rtx", **FAST))
    assert (engine.read_bytes(), engine.stat().st_mtime_ns) == before  # reused, not rewritten

    with pytest.raises(StaleEngineError, match=r"build.max_batch \(built 1, now 4\).*--rebuild") as err:
        build(out, "rtx", dynamic=True, max_batch=4, **FAST)
    assert "\n" not in str(err.value)
    assert (engine.read_bytes(), engine.stat().st_mtime_ns) == before  # refused: nothing touched

    (dyn,) = build(out, "rtx", dynamic=True, max_batch=4, rebuild=True, precisions=["fp32"], **FAST)
    assert not dyn.cached
    assert json.loads(fp_path.read_text())["fingerprint"]["shapes"]["images"] == [[1, 3, 96, 64], [1, 3, 96, 64], [4, 3, 96, 64]]


def _doctor(fp_path, **fields):
    record = json.loads(fp_path.read_text())
    record["fingerprint"].update(fields)
    fp_path.write_text(json.dumps(record))


def test_doctored_fingerprint_is_refused(ape_copy):
    out = ape_copy
    onnx_path = out / "model_96x64_fp16.onnx"
    engine, fp_path = engine_paths(onnx_path, "tensorrt_rtx")
    _doctor(fp_path, trt_version="0.0.1", precision="fp32")
    with pytest.raises(StaleEngineError) as err:
        EngineFromPath(onnx_path, "tensorrt_rtx")()
    message = str(err.value)
    assert "precision (built fp32, now fp16)" in message and "trt_version (built 0.0.1" in message
    assert "onnx_sha256" not in message and "\n" not in message
    with pytest.raises(StaleEngineError, match="trt_version"):
        build(out, "rtx", **FAST)  # build refuses too: never silently overwritten
    assert engine.is_file()


def test_rtx_engines_are_portable_and_tensorrt_engines_are_not(ape_copy):
    """TensorRT-RTX builds for every supported GPU, on a CPU too: its fingerprint records nothing
    of the build machine's device, so an engine built here loads on a GPU machine (whether it runs
    there is TensorRT-RTX's own verdict from the header). A TensorRT engine is for its GPU, driver
    and CUDA: any difference is refused, naming the fields."""
    from deploykit.backends.engine_cache import current_fingerprint
    from deploykit.backends.tensorrt import BuildOptions
    from deploykit.export.metadata import GraphMetadata

    src = ape_copy
    gpu = Device("13.0", "580.65", "NVIDIA RTX 4090", "8.9")
    engine = EngineFromPath(src / "model_96x64.onnx", "tensorrt_rtx", device=gpu)()
    assert engine == (src / "model_96x64.rtx.engine").read_bytes()
    onnx_path = src / "model_96x64.onnx"
    shapes = {"images": [[1, 3, 96, 64]] * 3}
    built = current_fingerprint(onnx_path, GraphMetadata.of_file(onnx_path), shapes, BuildOptions(module="tensorrt_rtx"), device=Device())
    now = current_fingerprint(onnx_path, GraphMetadata.of_file(onnx_path), shapes, BuildOptions(module="tensorrt_rtx"), device=gpu)
    assert built == now and built.gpu is None and built.cuda_driver is None
    tensorrt = dict(trt_version="11.4.0", module="tensorrt")
    on_l4 = dataclasses.replace(built, **tensorrt, cuda_driver="12.8", driver="570.1", gpu="NVIDIA L4", compute_capability="8.9")
    on_h100 = dataclasses.replace(on_l4, gpu="NVIDIA H100", compute_capability="9.0", driver="580.65")
    assert (
        on_l4.explain(on_h100)
        == "driver (built 570.1, now 580.65); gpu (built NVIDIA L4, now NVIDIA H100); compute_capability (built 8.9, now 9.0)"
    )


def test_changed_engine_or_missing_fingerprint_is_refused(ape_copy):
    out = ape_copy
    onnx_path = out / "model_96x64.onnx"
    engine, fp_path = engine_paths(onnx_path, "tensorrt_rtx")
    with open(engine, "ab") as f:
        f.write(b"\0")
    with pytest.raises(StaleEngineError, match="changed since it was built"):
        EngineFromPath(onnx_path, "tensorrt_rtx")()
    fp_path.unlink()
    with pytest.raises(StaleEngineError, match="fingerprint .* is missing"):
        EngineFromPath(onnx_path, "tensorrt_rtx")()
    engine.unlink()
    with pytest.raises(DeployKitError, match="no rtx engine for model_96x64.onnx; run: deploykit build"):
        EngineFromPath(onnx_path, "tensorrt_rtx")()
