"""Engines whose plugin layers carry their kernel load with no plugin (issue 42, item 6), and the
build finds those layers on a real network (issue 51).

NVIDIA documents that an engine built with an ahead-of-time (AOT) quickly deployable plugin
"does not require any Python modules or definitions to be present at runtime" and runs on the
standard TensorRT runtime, in any tool that deserializes engines, such as trtexec
(NVIDIA/TensorRT ``samples/python/quickly_deployable_plugins``). What ``tensorrt.plugin`` makes
for an ``@aot_impl`` is an ``IPluginV3QuickAOTBuild`` with no runtime capability of its own; for
an ``@impl`` (JIT), an ``IPluginV3QuickRuntime`` that TensorRT calls back into Python at
inference. The plugin objects below are built as ``tensorrt.plugin``'s ``_TemplateAOTPlugin`` and
``_TemplateJITPlugin`` are, on TensorRT 11's real classes (``tensorrt_lean``).

Detection used to test ``isinstance(network.get_layer(i).plugin, IPluginV3QuickAOTBuild)``, but
a real network's ``get_layer`` returns the base ``ILayer`` (no ``plugin``), so no layer was ever
found; its test passed because its mock returned the subclass. The network here is TensorRT-RTX's
real one, parsed from a real SaPE² export. TensorRT-RTX cannot put a V3 plugin layer in it on
this machine: it has no ``add_plugin_v3``, its bindings abort on a Python-made plugin that a
creator hands the parser, and its one built-in V3 creator the parser uses (``ROIAlign_TRT``, for
``RoiAlign``) fails without a CUDA driver. So only the plugin layer is a stand-in, made of
autospecs of RTX's ``ILayer`` (what ``get_layer`` returns) and ``IPluginV3Layer`` (what the
downcast exposes), spliced among the real layers.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import tensorrt_lean as lean
import tensorrt_rtx as rtx

from deploykit.backends._polygraphy import backend
from deploykit.backends.engine_cache import EngineFromPath, engine_paths, read_fingerprint
from deploykit.backends.plugins import Plugins
from deploykit.backends.tensorrt import BuildOptions, EngineFromOnnx, carries_its_kernel, embedded_plugin_layers, plugin_v3_layers
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


@pytest.fixture(scope="module")
def rtx_network(sape2_export):
    """TensorRT-RTX's real network of the SaPE² export (inlined form), with its parser and builder."""
    builder, network, parser = backend("tensorrt_rtx").NetworkFromOnnxBytes(
        (sape2_export / "model_32.onnx").read_bytes(), strongly_typed=True
    )()
    return builder, network, parser


class _PluginLayerAsGetLayerReturnsIt:
    """A V3 plugin layer as ``INetworkDefinition.get_layer`` returns it: the base ``ILayer``'s
    attributes only (no ``plugin``), until its class is set to ``IPluginV3Layer``, as the bindings'
    downcast does; then ``IPluginV3Layer``'s, ``plugin`` included."""

    def __init__(self, trt, plugin):
        self._views = {
            trt.ILayer: strict_autospec(trt.ILayer, type=trt.LayerType.PLUGIN_V3, name="sape2_plugin"),
            trt.IPluginV3Layer: strict_autospec(trt.IPluginV3Layer, type=trt.LayerType.PLUGIN_V3, name="sape2_plugin", plugin=plugin),
        }
        self._class = trt.ILayer

    @property
    def __class__(self):
        return self._class

    @__class__.setter
    def __class__(self, cls):
        if cls not in self._views:
            raise TypeError(f"__class__ assignment: {cls.__name__} is not this layer's type")
        self._class = cls

    def __getattr__(self, name):
        return getattr(self._views[self._class], name)


class _Network:
    """The real network's layers with stand-in plugin layers spliced in at ``at``."""

    def __init__(self, network, at: dict):
        self.network, self.at = network, at
        self.num_layers = network.num_layers + len(at)

    def get_layer(self, i):
        if i in self.at:
            return self.at[i]
        return self.network.get_layer(i - sum(j < i for j in self.at))


def test_a_real_network_returns_base_layers_which_the_plugin_layer_class_can_take(rtx_network):
    _, network, _ = rtx_network
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    assert len(layers) > 20 and {type(layer) for layer in layers} == {rtx.ILayer}  # never the concrete class
    assert not any(hasattr(layer, "plugin") for layer in layers)  # what the old detection looked for
    layer = layers[0]
    layer.__class__ = rtx.IPluginV3Layer  # the downcast TensorRT's samples and Polygraphy make
    assert isinstance(layer, rtx.IPluginV3Layer) and "plugin" in dir(layer)
    assert plugin_v3_layers(rtx, network) == [] and embedded_plugin_layers(rtx, network) == 0  # no plugin layer in the inlined form


# Full TensorRT 11 as this machine has its parts: network and layer classes as TensorRT-RTX's
# bindings define them (the same API), plugin classes as tensorrt_lean's (full TensorRT's own).
TENSORRT_11 = SimpleNamespace(
    LayerType=rtx.LayerType,
    ILayer=rtx.ILayer,
    IPluginV3Layer=rtx.IPluginV3Layer,
    IPluginV3QuickAOTBuild=lean.IPluginV3QuickAOTBuild,
    PluginCapabilityType=lean.PluginCapabilityType,
)


def test_aot_plugin_layers_are_found_among_a_real_networks_layers(rtx_network):
    _, network, _ = rtx_network
    aot, jit = (_PluginLayerAsGetLayerReturnsIt(rtx, p) for p in (_AotPlugin(), _JitPlugin()))
    spliced = _Network(network, {3: aot, 10: jit, 11: _PluginLayerAsGetLayerReturnsIt(rtx, _AotPlugin())})
    assert not hasattr(spliced.get_layer(3), "plugin")  # as get_layer returns it
    found = plugin_v3_layers(TENSORRT_11, spliced)
    assert [layer.plugin for layer in found] == [aot.plugin, jit.plugin, spliced.get_layer(11).plugin]
    assert embedded_plugin_layers(TENSORRT_11, spliced) == 2  # the two AOT layers, not the JIT one
    assert embedded_plugin_layers(TENSORRT_11, _Network(network, {0: _PluginLayerAsGetLayerReturnsIt(rtx, _JitPlugin())})) == 0


def test_only_ahead_of_time_plugins_count_as_carrying_their_kernel():
    assert carries_its_kernel(lean, _AotPlugin()) and not carries_its_kernel(lean, _JitPlugin())
    # A plugin the bindings wrap (C++ made): its build capability's kind decides, read through
    # the real capability classes (TensorRT-RTX has no IPluginV3QuickAOTBuild class of its own).
    plugin = strict_autospec(rtx.IPluginV3)
    plugin.get_capability_interface.return_value = lean.IPluginV3QuickAOTBuild()
    assert carries_its_kernel(rtx, plugin)
    plugin.get_capability_interface.assert_called_once_with(rtx.PluginCapabilityType.BUILD)
    plugin.get_capability_interface.return_value = rtx.IPluginV3OneBuild()
    assert not carries_its_kernel(rtx, plugin)


def test_rtx_builds_the_sape2_export_inlined_and_finds_no_embedded_plugin_layer(sape2_export):
    loader = EngineFromOnnx((sape2_export / "model_32.onnx").read_bytes(), BuildOptions(module="tensorrt_rtx", optimization_level=0))
    assert len(loader()) > 0 and loader.plugin_nodes == [] and loader.embedded_plugin_layers == 0


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny export with a TensorRT-RTX engine (no plugins: its record is doctored below)."""
    import torch

    from deploykit.backends.build import build
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
