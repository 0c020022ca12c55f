"""Which SaPE² nodes TensorRT's ONNX parser turns into plugin layers, shown with TensorRT-RTX's
real parser on CPU (the parser code TensorRT 10/11 and TensorRT-RTX share, onnx-tensorrt).

The parser uses a registered plugin for a node only when the node carries ``plugin_namespace``;
otherwise a model-local function of the same name wins and is inlined. The exported graph keeps
the function (ONNX Runtime runs it) and no such attribute, so a build with the plugin loaded
inlined every SaPE² node while its fingerprint demanded the plugin (defect 2). ``deploykit build``
now hands the parser the graph marked for the plugins it was given (``deploykit.graph.plugin_nodes``),
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
import tensorrt_rtx as rtx

from deploykit.backends._polygraphy import backend
from deploykit.backends.plugins import Plugins, registered_creators
from deploykit.backends.tensorrt import BuildOptions, EngineFromOnnx, with_plugin_nodes
from deploykit.errors import ExportError
from deploykit.graph.plugin_nodes import mark_plugin_nodes

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


def _loaded_probe(root, source: str):
    """``(plugins, creator)``: a plugin directory at ``root`` whose module ``source`` registers the
    probe when loaded, and the probe, deregistered afterwards."""
    backend("tensorrt_rtx")  # Polygraphy on TensorRT-RTX, as every build here
    root.mkdir()
    (root / "sape2_probe.py").write_text(source)
    plugins = Plugins.resolve([root])
    plugins.load("tensorrt_rtx")
    module = sys.modules[f"deploykit_plugins.{root.name}.sape2_probe"]
    try:
        yield plugins, module.CREATOR
    finally:
        rtx.get_plugin_registry().deregister_creator(module.CREATOR)  # later builds in this process must not see it


@pytest.fixture
def probe(tmp_path):
    """``(plugins, creator)``: a plugin directory registering the probe when loaded, and the probe."""
    yield from _loaded_probe(tmp_path / f"probe_{tmp_path.name}", _PROBE)  # module names are cached per process


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


# -------------------------------------------------------------------- the split SaPE² plugin form
#
# The SaPE² plugin is deploykit::SaPE2Distance: an AOT plugin launches one kernel and has no
# workspace, so each SaPE2Bias node is split into its signature stage (plain ONNX ops) and a marked
# SaPE2Distance node reading Zx [B, h, N, W] and Zy [B, h, N, H] (deploykit.graph.plugin_nodes).

DISTANCE = ("deploykit", "SaPE2Distance")


def _one_node_graph(grid, prefix, head_dim, npos_max, mode):
    from onnx import TensorProto, helper

    from deploykit.export.custom_ops import attach_functions

    tokens = prefix + grid[0] * grid[1]
    node = helper.make_node(
        "SaPE2Bias", ["q", "k", "tx", "ty"], ["bias"], domain="deploykit", name="blk", grid_h=grid[0], grid_w=grid[1],
        num_prefix_tokens=prefix, scale=0.4, mode=mode,
    )  # fmt: skip
    shapes = {"q": [2, 3, tokens, head_dim], "k": [2, 3, tokens, head_dim], "tx": [head_dim, npos_max], "ty": [head_dim, npos_max]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("bias", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("deploykit", 1)])
    attach_functions(model)  # the op's function and its signature stage, as the exporter writes them
    return model


def _signature_stage(model: onnx.ModelProto) -> onnx.ModelProto:
    """The split graph cut before its plugin nodes, less all that follows them: the inputs (Zx, Zy)
    of those whose signature stage is left are the outputs."""
    from onnx import TensorProto, helper

    plugin = [n for n in model.graph.node if (n.domain, n.op_type) == DISTANCE]
    after, kept = {o for n in plugin for o in n.output}, []
    for node in model.graph.node:  # in graph (topological) order: drop everything downstream
        if node in plugin or after & set(node.input):
            after |= set(node.output)
        else:
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    del model.graph.output[:]
    made = {o for n in kept for o in n.output}  # a later block's signatures follow an earlier plugin
    model.graph.output.extend(helper.make_tensor_value_info(z, TensorProto.FLOAT, None) for n in plugin for z in n.input if z in made)
    return model


@pytest.mark.parametrize("grid, prefix, head_dim, npos_max, mode", [((3, 5), 1, 8, 4, 0), ((4, 4), 0, 16, 9, 1), ((5, 3), 2, 8, 3, 2)])
def test_the_split_keeps_the_signatures_as_plain_onnx_equal_to_the_float64_reference(grid, prefix, head_dim, npos_max, mode):
    """Every mode, non-square grids, prefix tokens, tables clamped (M - 1 below a side)."""
    import onnxruntime as ort
    import torch

    from deploykit.encodings.sape2 import MODES, sape2_axis_signatures

    model = _one_node_graph(grid, prefix, head_dim, npos_max, mode)
    assert mark_plugin_nodes(model, {DISTANCE}) == ["blk/distance"]
    stage, node = [n for n in model.graph.node if n.domain == "deploykit"]  # the signature stage, then the plugin's node
    assert stage.op_type == "SaPE2AxisSignatures" and [(f.domain, f.name) for f in model.functions] == [
        ("deploykit", "SaPE2AxisSignatures")
    ]
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (node.op_type, attributes["plugin_namespace"], attributes["plugin_version"]) == ("SaPE2Distance", b"deploykit", b"1")
    assert (attributes["grid_h"], attributes["grid_w"], attributes["num_prefix_tokens"]) == (*grid, prefix)
    assert model.graph.node[-1].op_type == "CastLike" and list(model.graph.node[-1].output) == ["bias"]  # q's dtype, same name
    g = torch.Generator().manual_seed(mode)
    feeds = {n: torch.randn(*[d.dim_value for d in i.type.tensor_type.shape.dim], generator=g) for i in model.graph.input for n in [i.name]}
    zx, zy = ort.InferenceSession(_signature_stage(model).SerializeToString()).run(None, {n: t.numpy() for n, t in feeds.items()})
    q, k, tx, ty = (feeds[n].double() for n in ("q", "k", "tx", "ty"))
    ref_x, ref_y = sape2_axis_signatures(q[:, :, prefix:], k[:, :, prefix:], tx, ty, grid, 0.4, MODES[mode])
    assert zx.shape == tuple(ref_x.shape) == (2, 3, grid[0] * grid[1], grid[1]) and zy.shape == tuple(ref_y.shape)
    for got, ref in ((zx, ref_x), (zy, ref_y)):
        assert abs(torch.from_numpy(got).double() - ref).max() <= 1e-5 * ref.abs().max()


def test_rtx_builds_the_signature_stage_and_hands_each_distance_node_to_the_plugin(sape2_export, probe_distance):
    """The plugin form on TensorRT-RTX's real parser and builder (CPU): the signature stage builds;
    the parser hands each SaPE2Distance node to the registered creator with its attributes. RTX
    cannot host the plugin itself (no quickly deployable plugins; a Python-made plugin aborts its
    bindings), so the probe creates none and the build of the whole plugin form stops there."""
    plugins, creator = probe_distance
    exported = (sape2_export / "model_32.onnx").read_bytes()
    provided = plugins.load("tensorrt_rtx")
    graph, marked = with_plugin_nodes(exported, provided)
    model = onnx.load_from_string(graph)
    assert _sape2_nodes(model) == []  # nothing left to inline but the signature stage the split calls
    assert [(f.domain, f.name) for f in model.functions] == [("deploykit", "SaPE2AxisSignatures")]
    assert marked == [n.name for n in model.graph.node if (n.domain, n.op_type) == DISTANCE] and len(marked) == 2

    stage = _signature_stage(onnx.load_from_string(graph))
    assert len(stage.graph.output) == 2  # the first block's Zx, Zy
    assert EngineFromOnnx(stage.SerializeToString(), RTX)()  # plain ONNX ops only: built on CPU

    with pytest.raises(ExportError) as err:
        EngineFromOnnx(exported, RTX, plugins=plugins)()
    assert "Could not create the plugin" in str(err.value) and "\n" not in str(err.value)
    (name, fields), *_ = creator.requests
    first = {a.name: onnx.helper.get_attribute_value(a) for a in _sape2_nodes(onnx.load_from_string(exported))[0].attribute}
    assert name == marked[0] and fields == {k: [first[k]] for k in ("grid_h", "grid_w", "num_prefix_tokens")}


@pytest.fixture
def probe_distance(tmp_path):
    """As ``probe``, registered as deploykit::SaPE2Distance with its three attributes."""
    source = _PROBE.replace('"SaPE2Bias"', '"SaPE2Distance"').replace(
        '("grid_h", "grid_w", "num_prefix_tokens", "mode")', '("grid_h", "grid_w", "num_prefix_tokens")'
    )
    source = source.replace('[*ints, rtx.PluginField("scale", np.array([]), rtx.PluginFieldType.FLOAT32)]', "ints").replace(
        "deploykit::SaPE2Bias", "deploykit::SaPE2Distance"
    )
    yield from _loaded_probe(tmp_path / f"probe_distance_{tmp_path.name}", source)
