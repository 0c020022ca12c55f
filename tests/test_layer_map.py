"""A planted wrong layer is named as the first divergent one, with its ONNX node, the module it
comes from and the layer TensorRT-RTX's real parser made of it."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from deploykit.export.precision import PLANS
from deploykit.runners.onnxrt import with_outputs
from deploykit.validation.layer_map import first_divergent_node, layer_nodes, node_origins

PLANTED_MODULE = "blocks.2.mlp.fc1"


def _run_all(proto: onnx.ModelProto, images: np.ndarray) -> dict[str, np.ndarray]:
    """Every node output of ``proto`` on ``images`` (ONNX Runtime, all outputs marked)."""
    import onnxruntime

    names = [o for n in proto.graph.node for o in n.output if o]
    marked = with_outputs(proto, names)
    session = onnxruntime.InferenceSession(marked.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"images": images})))


def _planted(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """A copy whose matmul of ``PLANTED_MODULE`` has wrong weights, and that node's name."""
    planted = onnx.ModelProto()
    planted.CopyFrom(proto)
    origins = node_origins(planted)
    initializers = {i.name: i for i in planted.graph.initializer}
    node = next(n for n, o in zip(planted.graph.node, origins) if o.module == PLANTED_MODULE and n.op_type == "MatMul")
    weight = initializers[next(i for i in node.input if i in initializers)]
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.5, weight.name))
    return planted, node.name


def test_a_planted_wrong_layer_is_named_with_its_node_and_module(zoo_ape_export):
    import tensorrt_rtx as rtx

    proto = onnx.load(str(zoo_ape_export / "model_48.onnx"))
    planted, node = _planted(proto)
    images = np.random.default_rng(0).standard_normal((2, 3, 48, 48)).astype(np.float32)
    # the layers TensorRT-RTX's real parser makes of the planted graph, named after their nodes
    logger = rtx.Logger(rtx.Logger.ERROR)
    builder = rtx.Builder(logger)
    network = builder.create_network(1 << int(rtx.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = rtx.OnnxParser(network, logger)
    assert parser.parse(planted.SerializeToString())
    layers = [network.get_layer(i).name for i in range(network.num_layers)]
    found = first_divergent_node(node_origins(planted), _run_all(proto, images), _run_all(planted, images), PLANS["fp32"].tolerance, layers)
    assert found is not None
    assert (found.origin.node, found.origin.op_type, found.origin.module) == (node, "MatMul", PLANTED_MODULE)
    assert found.layer is not None and node in layer_nodes(found.layer, [o.node for o in node_origins(planted)])
    assert found.describe().startswith(f"{node} (MatMul) of {PLANTED_MODULE}, in engine layer ")
    # the unplanted graph against itself: nothing diverges
    same = _run_all(proto, images)
    assert first_divergent_node(node_origins(proto), same, same, PLANS["fp32"].tolerance) is None


def test_fused_layer_names_map_back_to_their_nodes():
    order = ["node_a", "node_b", "node_c", "node_d", "node_e"]
    assert layer_nodes("node_b + node_c", order) == ["node_b", "node_c"]
    assert layer_nodes("{ForeignNode[node_b...node_d]}", order) == ["node_b", "node_c", "node_d"]
    assert layer_nodes("ONNXTRT_ShapeElementWise_68", order) == []


def test_modules_come_from_the_exporter_scopes(zoo_ape_export):
    origins = node_origins(onnx.load(str(zoo_ape_export / "model_48.onnx")))
    modules = {o.module for o in origins}
    assert {"blocks.0.attn", "blocks.3.mlp.fc2", "head"} <= modules
    assert not any(m.startswith("model.") for m in modules)
