"""Engines whose plugin layers carry their kernel load with no plugin (issue 42, item 6).

NVIDIA documents that an engine built with an ahead-of-time (AOT) quickly deployable plugin
"does not require any Python modules or definitions to be present at runtime" and runs on the
standard TensorRT runtime, in any tool that deserializes engines, such as trtexec
(NVIDIA/TensorRT ``samples/python/quickly_deployable_plugins``). What ``tensorrt.plugin`` makes
for an ``@aot_impl`` is an ``IPluginV3QuickAOTBuild`` with no runtime capability of its own; for
an ``@impl`` (JIT), an ``IPluginV3QuickRuntime`` that TensorRT calls back into Python at
inference. The plugin objects below are built as ``tensorrt.plugin``'s ``_TemplateAOTPlugin`` and
``_TemplateJITPlugin`` are, on TensorRT 11's real classes (``tensorrt_lean``); the network and its
layers are autospecs of TensorRT-RTX's (full TensorRT, whose builder these come from, does not
install here).
"""

from __future__ import annotations

import json
import shutil

import pytest

lean = pytest.importorskip("tensorrt_lean", reason="tensorrt-lean-cu13 is in the test extra (TensorRT 11's runtime classes)")
rtx = pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx is in the test extra")

from deploykit.backends.engine_cache import EngineFromPath, engine_paths, read_fingerprint
from deploykit.backends.plugins import Plugins
from deploykit.backends.tensorrt import embedded_plugin_layers
from deploykit.errors import StaleEngineError
from tests.trt_api import strict_autospec

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


class _QuickPlugin(lean.IPluginV3, lean.IPluginV3QuickCore, lean.IPluginV3QuickBuild):
    def __init__(self):
        lean.IPluginV3.__init__(self)
        lean.IPluginV3QuickCore.__init__(self)
        lean.IPluginV3QuickBuild.__init__(self)


class _AotPlugin(_QuickPlugin, lean.IPluginV3QuickAOTBuild):
    def __init__(self):
        _QuickPlugin.__init__(self)
        lean.IPluginV3QuickAOTBuild.__init__(self)


class _JitPlugin(_QuickPlugin, lean.IPluginV3QuickRuntime):
    def __init__(self):
        _QuickPlugin.__init__(self)
        lean.IPluginV3QuickRuntime.__init__(self)


def _network(*layers):
    network = strict_autospec(rtx.INetworkDefinition, num_layers=len(layers))
    network.get_layer.side_effect = list(layers).__getitem__
    return network


def _plugin_layer(plugin):
    return strict_autospec(rtx.IPluginV3Layer, type=rtx.LayerType.PLUGIN_V3, plugin=plugin)


def test_only_ahead_of_time_plugin_layers_count_as_carrying_their_kernel():
    plain = strict_autospec(rtx.ILayer, type=rtx.LayerType.MATRIX_MULTIPLY)
    network = _network(plain, _plugin_layer(_AotPlugin()), _plugin_layer(_JitPlugin()), _plugin_layer(_AotPlugin()))
    assert embedded_plugin_layers(lean, network) == 2
    assert embedded_plugin_layers(lean, _network(_plugin_layer(_JitPlugin()), plain)) == 0
    assert embedded_plugin_layers(rtx, network) == 0  # TensorRT-RTX has no quickly deployable plugins


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny export with a TensorRT-RTX engine (no plugins: its record is doctored below)."""
    import torch

    from deploykit.build import build
    from deploykit.export import export
    from deploykit.nn import create_model

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("aot") / "exp"
    export(create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=10), [(32, 32)], out)
    build(out, "rtx", optimization_level=0)
    return out


def _as_built_with_sape2(out, embedded: int):
    """The record ``deploykit build --plugins sape2`` writes for 2 SaPE² layers, ``embedded`` of
    them carrying their kernel."""
    fp_path = engine_paths(out / "model_32.onnx", "tensorrt_rtx")[1]
    sape2 = Plugins.resolve(["sape2"])
    record = json.loads(fp_path.read_text())
    record["fingerprint"]["plugin_sha256"] = sape2.sha256()
    record.update(plugins=sape2.describe(), installed_plugins=list(sape2.installed), plugin_layers=2, embedded_plugin_layers=embedded)
    fp_path.write_text(json.dumps(record))


def test_an_engine_whose_plugin_layers_carry_their_kernel_loads_no_plugin(built, tmp_path, monkeypatch):
    """Before: every runner imported the plugin (``tensorrt.plugin`` and Triton) before loading it."""
    out = shutil.copytree(built, tmp_path / "exp")
    loaded = []
    monkeypatch.setattr(Plugins, "load", lambda self, module: loaded.append(self.describe()) or frozenset())
    _as_built_with_sape2(out, embedded=2)
    assert read_fingerprint(engine_paths(out / "model_32.onnx", "tensorrt_rtx")[1]).self_contained
    engine = EngineFromPath(out / "model_32.onnx", "tensorrt_rtx")()
    assert engine == (out / "model_32.rtx.engine").read_bytes() and loaded == []
    with pytest.raises(StaleEngineError, match="built with other plugins than the ones given"):
        EngineFromPath(out / "model_32.onnx", "tensorrt_rtx", plugins=Plugins.resolve([tmp_path]))()  # plugins given are still checked

    _as_built_with_sape2(out, embedded=0)  # a plugin TensorRT calls at inference: loaded first, as before
    assert EngineFromPath(out / "model_32.onnx", "tensorrt_rtx")() == engine and loaded == [["deploykit.plugins.sape2 (installed)"]]


def test_a_record_written_before_kernels_were_recorded_loads_its_plugins(built, tmp_path):
    out = shutil.copytree(built, tmp_path / "exp")
    _as_built_with_sape2(out, embedded=2)
    fp_path = engine_paths(out / "model_32.onnx", "tensorrt_rtx")[1]
    record = json.loads(fp_path.read_text())
    del record["embedded_plugin_layers"]
    fp_path.write_text(json.dumps(record))
    stored = read_fingerprint(fp_path)
    assert stored.plugin_layers == 2 and stored.embedded_plugin_layers == 0 and not stored.self_contained
