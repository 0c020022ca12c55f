"""Engine builds through the TensorRT-RTX builder, which runs without a GPU."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import deploykit.backends.tensorrt as trt_backend
from deploykit._lazy import is_available
from deploykit.backends import _polygraphy
from deploykit.backends._polygraphy import import_trt
from deploykit.backends.plugins import Plugins, PluginSource
from deploykit.backends.tensorrt import BuildOptions, EngineFromOnnx, save_engine
from deploykit.errors import ExportError, MissingDependencyError

# torch.onnx's dynamo exporter trips a deprecation inside torch.utils._pytree; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

RTX = BuildOptions(module="tensorrt_rtx", max_batch=4)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.norm(self.fc(x)), dim=-1)


def _export(path, dynamic_shapes) -> str:
    torch.manual_seed(0)
    torch.onnx.export(
        _Tiny().eval(),
        (torch.randn(2, 4, 8),),
        str(path),
        dynamo=True,
        opset_version=18,
        dynamic_shapes=dynamic_shapes,
    )
    return str(path)


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory) -> str:
    return _export(tmp_path_factory.mktemp("onnx") / "tiny.onnx", ({0: torch.export.Dim("batch")},))


def test_build_from_path(onnx_path):
    engine = EngineFromOnnx(onnx_path, RTX)()
    assert isinstance(engine, bytes) and len(engine) > 0


def test_build_from_bytes_and_callable(onnx_path):
    with open(onnx_path, "rb") as f:
        data = f.read()
    assert len(EngineFromOnnx(data, RTX)()) > 0
    assert len(EngineFromOnnx(lambda: data, RTX)()) > 0


def test_build_options_applied(onnx_path, tmp_path):
    # Workspace and optimization level go through the real config setters; the timing cache is
    # a no-op in TensorRT-RTX, so it must be ignored rather than written.
    cache = tmp_path / "timing.cache"
    opts = BuildOptions(module="tensorrt_rtx", workspace_mib=256, optimization_level=0, timing_cache=str(cache))
    assert len(EngineFromOnnx(onnx_path, opts)()) > 0
    assert not cache.exists()


@pytest.mark.filterwarnings("ignore:.*Timing cache operations are no-ops:DeprecationWarning")
def test_tensorrt_code_path_with_timing_cache(onnx_path, tmp_path, monkeypatch):
    # Real TensorRT is not installable here; its API is a superset of what the build uses, so
    # drive the module="tensorrt" path (timing cache load + save) through TensorRT-RTX instead.
    rtx, polygraphy_on_rtx = import_trt("tensorrt_rtx"), trt_backend.backend("tensorrt_rtx")
    monkeypatch.setattr(trt_backend, "import_trt", lambda module: rtx)
    monkeypatch.setattr(trt_backend, "backend", lambda module: polygraphy_on_rtx)
    cache = tmp_path / "caches" / "timing.cache"
    opts = BuildOptions(module="tensorrt", timing_cache=str(cache))
    assert len(EngineFromOnnx(onnx_path, opts)()) > 0
    assert cache.is_file()
    assert len(EngineFromOnnx(onnx_path, opts)()) > 0  # second build loads the saved cache


@pytest.mark.parametrize("seed", range(5))
def test_corrupt_onnx_is_one_line_export_error(onnx_path, tmp_path, seed):
    # Random junk often decodes as an empty protobuf; a truncated model never parses.
    junk = random.Random(seed).randbytes(256)
    with open(onnx_path, "rb") as f:
        truncated = f.read()[:200]
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(junk)
    for source in (str(bad), junk, truncated):
        with pytest.raises(ExportError) as err:
            EngineFromOnnx(source, RTX)()
        message = str(err.value)
        assert message.startswith("TensorRT could not parse the ONNX model")
        assert "\n" not in message


def test_missing_onnx_file(tmp_path):
    with pytest.raises(ExportError, match="does not exist"):
        EngineFromOnnx(tmp_path / "nope.onnx", RTX)()


def test_missing_plugin_library(onnx_path, tmp_path):
    gone = Plugins((PluginSource("library", tmp_path / "libnope.so"),))  # resolved, then deleted
    with pytest.raises(ExportError, match="plugin library .* does not exist"):
        EngineFromOnnx(onnx_path, RTX, plugins=gone)()


def test_dynamic_non_batch_dim_rejected(tmp_path):
    path = _export(tmp_path / "seq.onnx", ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},))
    with pytest.raises(ExportError, match="dynamic non-batch dim") as err:
        EngineFromOnnx(path, RTX)()
    assert "static shape is expected" in str(err.value)


def test_unknown_module_rejected():
    with pytest.raises(ValueError, match="tensorrt, tensorrt_rtx"):
        import_trt("tensorrt_llm")
    with pytest.raises(ValueError, match="unknown TensorRT module"):
        BuildOptions(module="onnxruntime")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_batch": 4, "opt_batch": 2},
        {"min_batch": 0},
        {"optimization_level": 6},
        {"workspace_mib": 0},
    ],
)
def test_bad_options_rejected(kwargs):
    with pytest.raises(ValueError):
        BuildOptions(module="tensorrt_rtx", **kwargs)


def test_import_trt():
    assert import_trt("tensorrt_rtx").__name__ == "tensorrt_rtx"
    if is_available("tensorrt"):
        assert import_trt("tensorrt").__name__ == "tensorrt"
    else:
        with pytest.raises(MissingDependencyError, match="deploykit\\[trt\\]"):
            import_trt("tensorrt")


def test_save_engine_roundtrip(onnx_path, tmp_path):
    engine = EngineFromOnnx(onnx_path, RTX)()
    dest = save_engine(engine, tmp_path / "out" / "tiny.engine")
    assert dest.read_bytes() == engine


def test_save_engine_failure_keeps_existing_file(tmp_path):
    dest = tmp_path / "tiny.engine"
    dest.write_bytes(b"old engine")
    with pytest.raises(TypeError):
        save_engine(object(), dest)  # type: ignore[arg-type]  # write fails mid-way
    assert dest.read_bytes() == b"old engine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.engine"]


def test_the_build_runs_on_polygraphy_bound_to_tensorrt_rtx(onnx_path, monkeypatch):
    """Polygraphy's loaders do the build, on the flavour asked for, set through Polygraphy's own
    config (no environment variable read or written); the other flavour is refused in one line."""
    import os

    from deploykit.backends._polygraphy import backend
    from deploykit.errors import DeployKitError

    assert len(EngineFromOnnx(onnx_path, RTX)()) > 0
    import polygraphy.config  # only now: importing polygraphy.backend.trt first would bind it to TensorRT
    from polygraphy.backend.trt import loader

    assert polygraphy.config.USE_TENSORRT_RTX is True and loader.trt.__name__ == "tensorrt_rtx"
    assert "POLYGRAPHY_USE_TENSORRT_RTX" not in os.environ
    monkeypatch.setattr(_polygraphy, "import_trt", lambda module: import_trt("tensorrt_rtx"))  # as if TensorRT were installed
    with pytest.raises(DeployKitError, match=r"Polygraphy already runs on TensorRT-RTX in this process.*separate command") as err:
        backend("tensorrt")
    assert "\n" not in str(err.value)
