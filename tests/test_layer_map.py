"""A planted wrong layer is named as the first divergent one, with its ONNX node, the module it
comes from and the layer TensorRT-RTX's real parser made of it."""

from __future__ import annotations

import io
import json
import shutil
from collections import Counter
from dataclasses import asdict

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from deploykit.export.manifest import MANIFEST_FILE, sha256_file
from deploykit.export.precision import PLANS
from deploykit.runners.onnxrt import with_outputs
from deploykit.validation.bundle import BUNDLE_FILE
from deploykit.validation.layer_map import DivergentLayer, first_divergent_node, layer_nodes, network_layers, node_origins
from deploykit.validation.run import validate

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
    layers = network_layers(rtx, planted)
    assert layers
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


# ------------------------------------------------------------------ validate: the layer at the seam


@pytest.fixture(scope="module")
def planted_validation(zoo_ape_export, tmp_path_factory):
    """``validate --bundle`` at 48 px on a copy of the export whose graph has ``PLANTED_MODULE``'s
    matmul weights scaled (the manifest re-recorded, as an export that wrote a wrong graph would);
    the report's one record, the bundle and the planted graph and node."""
    out = tmp_path_factory.mktemp("planted") / "exp"
    shutil.copytree(zoo_ape_export, out)
    path = out / "model_48.onnx"
    planted, node = _planted(onnx.load(str(path)))
    onnx.save(planted, str(path))
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    for graph in manifest["graphs"]:
        if graph["file"] == path.name:
            graph["sha256"] = sha256_file(path)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    bundle = out.parent / "bundle"
    report = validate(out, resolutions=[(48, 48)], num_random=2, num_real=2, bundle=bundle)
    (record,) = report.records
    return record, bundle, planted, node


def test_validate_names_the_first_divergent_layer_with_its_node_module_and_error(planted_validation):
    record, _, planted, node = planted_validation
    assert not record.passed and record.first_divergent_block == "blocks.2"
    layer = record.first_divergent_layer
    assert layer is not None and layer.module == PLANTED_MODULE
    origins = {o.node: o for o in node_origins(planted)}
    # the module's nodes: the planted matmul, up to the node computing the output compared
    assert node in layer.nodes and all(origins[n].module == PLANTED_MODULE for n in layer.nodes)
    found = layer.nodes[-1]
    assert layer.tensor in origins[found].outputs and (found == node or _depends_on(planted, found, node))
    assert layer.max_abs > PLANS["fp32"].tolerance.max_abs
    assert layer.layer is None  # ONNX Runtime runs nodes, not engine layers
    # what came before the planted module in the block was measured and kept the tolerance
    before = record.node_errors[: [e.node for e in record.node_errors].index(found)]
    assert before and not any(e.diverged for e in before)
    assert {e.module for e in before} >= {"blocks.2.norm1", "blocks.2.attn.proj", "blocks.2.norm2"}
    assert json.loads(json.dumps(asdict(record)))["first_divergent_layer"]["module"] == PLANTED_MODULE


def test_the_bundle_holds_the_divergence_and_model_explorer_node_data(planted_validation):
    record, bundle, planted, _ = planted_validation
    written = json.loads((bundle / BUNDLE_FILE).read_text())["divergences"]
    summary_file, overlay_file = written
    summary = json.loads((bundle / summary_file).read_text())
    assert summary["check"] == record.label and summary["first_divergent_block"] == "blocks.2"
    assert summary["first_divergent_layer"]["nodes"] == record.first_divergent_layer.nodes
    errors = [e["max_abs"] for e in summary["node_errors"]]
    assert errors == sorted(errors, reverse=True) and len(errors) == len(record.node_errors)
    # Model Explorer's node data: graph id → results keyed by node id, each {"value": ...}
    ((graph_id, data),) = json.loads((bundle / overlay_file).read_text()).items()
    assert graph_id == planted.graph.name
    names = {n.name for n in planted.graph.node}
    assert set(data["results"]) <= names and len(data["results"]) == len(record.node_errors)
    measured = {e.node: e for e in record.node_errors}
    for name, result in data["results"].items():
        assert result["value"] == measured[name].max_abs
    # the first divergent node is flagged: the one colour no other node has
    colours = Counter(r["bgColor"] for r in data["results"].values())
    assert [n for n, r in data["results"].items() if colours[r["bgColor"]] == 1] == record.first_divergent_layer.nodes[-1:]
    assert f"--node_data_paths={overlay_file}" in (bundle / "README.md").read_text()


def test_the_divergent_node_maps_to_a_layer_of_tensorrt_rtx_parsed_network(planted_validation):
    import tensorrt_rtx as rtx

    record, _, planted, _ = planted_validation
    order = [n.name for n in planted.graph.node]
    layers = network_layers(rtx, planted)
    assert layers
    layer = DivergentLayer.of(record.node_errors, layers, order)
    assert layer is not None and layer.layer in layers and layer.module == PLANTED_MODULE
    assert record.first_divergent_layer.nodes[-1] in layer.nodes == layer_nodes(layer.layer, order)
    assert layer.describe().startswith(f"engine layer {layer.layer!r} (ONNX node")


def _depends_on(proto: onnx.ModelProto, node: str, upstream: str) -> bool:
    """Whether ``node`` reads, directly or through other nodes, an output of ``upstream``."""
    producers = {o: n for n in proto.graph.node for o in n.output}
    nodes = {n.name: n for n in proto.graph.node}
    seen, todo = set(), [nodes[node]]
    while todo:
        current = todo.pop()
        for tensor in current.input:
            parent = producers.get(tensor)
            if parent is None or parent.name in seen:
                continue
            if parent.name == upstream:
                return True
            seen.add(parent.name)
            todo.append(parent)
    return False


def test_the_validate_output_names_the_first_divergent_layer(planted_validation):
    from rich.console import Console

    from deploykit.cli import render
    from deploykit.validation.run import ValidationReport

    record, *_ = planted_validation
    out = Console(file=io.StringIO(), color_system=None)
    render.validation(out, ValidationReport([record]))
    lines = out.file.getvalue().splitlines()
    assert "first divergence: blocks.2" in lines[0]
    assert lines[1].strip().startswith("first divergent layer: ONNX nodes ")
    assert f" of {PLANTED_MODULE}: max abs " in lines[1] and all(n in lines[1] for n in record.first_divergent_layer.nodes)
