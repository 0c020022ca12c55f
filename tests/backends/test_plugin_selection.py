"""Which SaPE² nodes TensorRT's ONNX parser turns into plugin layers, shown with TensorRT-RTX's
real parser on CPU (the parser code TensorRT 10/11 and TensorRT-RTX share, onnx-tensorrt).

The parser uses a registered plugin for a node only when the node carries ``plugin_namespace``;
otherwise a model-local function of the same name wins and is inlined. The exported graph keeps
the function (ONNX Runtime runs it) and no such attribute, so a build with the plugin loaded
inlined every SaPE² node while its fingerprint demanded the plugin (defect 2). ``deploykit build``
now hands the parser the graph marked for the plugins it was given (``deploykit.export.plugin_nodes``),
and only those: a plugin another build or import registered earlier in the process is not used
(issue 42, item 7).

TensorRT-RTX cannot host the quickly deployable SaPE² plugin (no ``IPluginV3QuickAOTBuild``), and
its Python bindings abort on a Python-made plugin object, so the plugin here is a real
``IPluginCreatorV3One`` subclass registered under SaPE²'s name that records what the parser hands
it and creates nothing: the parser's choice is what is observed. It comes as a plugin directory
whose ``register()`` registers it, as a ``--plugins DIR`` source would.
"""

from __future__ import annotations

import sys
import textwrap

import onnx
import pytest

rtx = pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx is in the test extra")

from deploykit.backends._polygraphy import backend
from deploykit.backends.plugins import Plugins, registered_creators
from deploykit.backends.tensorrt import BuildOptions, EngineFromOnnx, with_plugin_nodes
from deploykit.errors import ExportError
from deploykit.export.plugin_nodes import mark_plugin_nodes

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
RTX = BuildOptions(module="tensorrt_rtx", optimization_level=0)

_PROBE = textwrap.dedent(
    """
    import numpy as np
    import tensorrt_rtx as rtx


    # Registered as deploykit::SaPE2Bias v1 with the node's attributes as fields (as the quickly
    # deployable plugin declares them); records each request and creates no plugin.
    class ProbeCreator(rtx.IPluginCreatorV3One):
        def __init__(self):
            rtx.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_namespace, self.plugin_version = "SaPE2Bias", "deploykit", "1"
            ints = [rtx.PluginField(n, np.array([]), rtx.PluginFieldType.INT32) for n in ("grid_h", "grid_w", "num_prefix_tokens", "mode")]
            self.field_names = rtx.PluginFieldCollection([*ints, rtx.PluginField("scale", np.array([]), rtx.PluginFieldType.FLOAT32)])
            self.requests = []

        def create_plugin(self, name, fields, phase):
            self.requests.append((name, {f.name: np.asarray(f.data).tolist() for f in fields}))
            return None


    CREATOR = ProbeCreator()


    def register():
        assert rtx.get_plugin_registry().register_creator(CREATOR, "deploykit")
        return "deploykit::SaPE2Bias"
    """
)


@pytest.fixture
def probe(tmp_path):
    """``(plugins, creator)``: a plugin directory registering the probe when loaded, and the probe."""
    backend("tensorrt_rtx")  # Polygraphy on TensorRT-RTX, as every build here
    root = tmp_path / f"probe_{tmp_path.name}"  # module names are cached per process
    root.mkdir()
    (root / "sape2_probe.py").write_text(_PROBE)
    plugins = Plugins.resolve([root])
    plugins.load("tensorrt_rtx")
    module = sys.modules[f"deploykit_plugins.{root.name}.sape2_probe"]
    try:
        yield plugins, module.CREATOR
    finally:
        rtx.get_plugin_registry().deregister_creator(module.CREATOR)  # later builds in this process must not see it


def _sape2_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "SaPE2Bias"]


def _plugin_layers(graph: bytes) -> int:
    _, network, _ = backend("tensorrt_rtx").NetworkFromOnnxBytes(graph, strongly_typed=True)()
    kinds = (rtx.LayerType.PLUGIN, rtx.LayerType.PLUGIN_V2, rtx.LayerType.PLUGIN_V3)
    return sum(network.get_layer(i).type in kinds for i in range(network.num_layers))


def test_the_exported_graph_is_inlined_even_with_the_plugin_registered(sape2_export, probe):
    """What 64d379d handed the parser: the node without plugin_namespace, its function present."""
    _, creator = probe
    exported = (sape2_export / "model_32.onnx").read_bytes()
    assert _plugin_layers(exported) == 0 and creator.requests == []


def test_with_the_plugin_given_every_sape2_node_is_marked_and_handed_to_it(sape2_export, probe):
    plugins, creator = probe
    exported = (sape2_export / "model_32.onnx").read_bytes()
    provided = plugins.load("tensorrt_rtx")
    assert ("deploykit", "SaPE2Bias") in provided and ("deploykit", "SaPE2Bias") in registered_creators("tensorrt_rtx")
    graph, marked = with_plugin_nodes(exported, provided)
    model = onnx.load_from_string(graph)
    nodes = _sape2_nodes(model)
    assert marked == [n.name for n in nodes] and len(nodes) == 2  # one per block
    for node in nodes:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["plugin_namespace"] == b"deploykit" and attributes["plugin_version"] == b"1"
    assert list(model.functions) == []  # nothing left for the parser to inline instead
    original = onnx.load_from_string(exported)
    assert [n.name for n in model.graph.node] == [n.name for n in original.graph.node]  # no other node touched

    # The build hands that graph to the parser, which asks the plugin for the first node, with
    # the node's attributes as fields; the probe creates nothing, so the build stops there.
    with pytest.raises(ExportError) as err:
        EngineFromOnnx(exported, RTX, plugins=plugins)()
    assert "Could not create the plugin" in str(err.value) and "\n" not in str(err.value)
    (name, fields), *_ = creator.requests
    first = {a.name: onnx.helper.get_attribute_value(a) for a in _sape2_nodes(original)[0].attribute}
    assert name == nodes[0].name
    assert fields == {k: [first[k]] for k in ("grid_h", "grid_w", "num_prefix_tokens", "mode")} | {"scale": [pytest.approx(first["scale"])]}


def test_a_plugin_registered_earlier_in_the_process_is_not_used_by_a_build_not_given_it(sape2_export, probe):
    """Item 7: the build marked nodes for every creator in TensorRT's registry, so a build after
    another one (or any import) that registered a plugin used it, though not asked to."""
    _, creator = probe
    exported = (sape2_export / "model_32.onnx").read_bytes()
    loader = EngineFromOnnx(exported, RTX)
    assert loader() and loader.plugin_nodes == [] and creator.requests == []  # built, the op inlined
    assert Plugins().load("tensorrt_rtx") == frozenset()


def test_a_marked_node_whose_plugin_is_not_loaded_fails_the_build_in_one_line(sape2_export):
    model = onnx.load(str(sape2_export / "model_32.onnx"))
    mark_plugin_nodes(model, {("deploykit", "SaPE2Bias")})
    with pytest.raises(ExportError, match=r"^TensorRT could not parse the ONNX model: .*SaPE2Bias.*Plugin not found") as err:
        EngineFromOnnx(model.SerializeToString(), RTX)()
    assert "\n" not in str(err.value)


def test_custom_ops_without_a_registered_plugin_are_left_to_the_function(sape2_export):
    exported = (sape2_export / "model_32.onnx").read_bytes()
    assert with_plugin_nodes(exported, {("other", "Op")}) == (exported, [])
    assert with_plugin_nodes(exported, set()) == (exported, [])
