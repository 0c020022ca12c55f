"""``DeploySpec``: one per architecture, the only place that tells the architectures apart, and
agreeing with the graphs export writes."""

from __future__ import annotations

import ast
from pathlib import Path

import onnx
import pytest
import torch
from onnx import helper

from deploykit.errors import ExportError
from deploykit.export.manifest import OUTPUT_NAME, Manifest
from deploykit.export.onnx_export import onnx_from_model
from deploykit.nn import create_model, load_model
from deploykit.nn.factory import build_model
from deploykit.nn.spec import BATCH_AXIS, SPECS, SequenceSpec, VitSpec, deploy_spec

PACKAGE = Path(__file__).resolve().parents[2] / "deploykit"
SPEC_MODULE = PACKAGE / "nn" / "spec.py"
# The model and config classes: telling them apart is the spec registry's job.
ARCHITECTURE_CLASSES = {"VisionTransformer", "SequenceTransformer", "ViTConfig", "SequenceConfig", "Model", "ModelConfig"}


def _class_names(node: ast.expr) -> set[str]:
    """Names of the classes an ``isinstance`` second argument lists (``A``, ``m.A``, ``(A, B)``, ``A | B``)."""
    if isinstance(node, ast.Tuple):
        return set().union(*(_class_names(e) for e in node.elts))
    if isinstance(node, ast.BinOp):
        return _class_names(node.left) | _class_names(node.right)
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return {node.id} if isinstance(node, ast.Name) else set()


def _mentions_model(node: ast.expr) -> bool:
    """``model``, ``self.model``, ``model.cfg``, ``cfg``, ...: an object that is a model or its config."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    return bool(names & {"model", "cfg", "_model"})


def architecture_branches(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """``isinstance`` on a model or config class, or ``hasattr`` on a model, in ``path``."""
    found = []
    for node in sorted((n for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.Call)), key=lambda n: n.lineno):
        if not (isinstance(node.func, ast.Name) and len(node.args) == 2):
            continue
        if node.func.id == "isinstance" and _class_names(node.args[1]) & ARCHITECTURE_CLASSES:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        if node.func.id == "hasattr" and _mentions_model(node.args[0]):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_architecture_branches_outside_the_spec_registry():
    """Per-architecture code goes through ``deploy_spec``, as Optimum's ``OnnxConfig``s."""
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if path != SPEC_MODULE for line in architecture_branches(path)]
    assert not found, "ask deploykit.nn.spec.deploy_spec(model) instead of:\n" + "\n".join(found)


def test_the_scan_sees_branches(tmp_path):
    """The scan above is not vacuous: it finds each form of branch it forbids."""
    source = tmp_path / "branches.py"
    source.write_text(
        "isinstance(model.cfg, SequenceConfig)\n"
        "not isinstance(model, nn.VisionTransformer)\n"
        "isinstance(cfg, (ViTConfig, SequenceConfig))\n"
        'hasattr(model, "grid")\n'
        'hasattr(self.model, "pos_enc")\n'
        "isinstance(x, dict)\n"
        'hasattr(os, "sched_getaffinity")\n'
    )
    assert [line.split(": ", 1)[0] for line in architecture_branches(source, tmp_path)] == [f"branches.py:{i}" for i in range(1, 6)]


def test_every_architecture_has_a_spec():
    vit, seq = create_model("vit_tiny_patch16", depth=1), create_model("seq_tiny_ega", depth=1)
    assert type(deploy_spec(vit)) is VitSpec and type(deploy_spec(seq.cfg)) is SequenceSpec
    assert set(SPECS) == {type(vit.cfg), type(seq.cfg)}
    for model in (vit, seq):
        assert type(build_model(model.cfg)) is type(model)
    with pytest.raises(TypeError, match="no DeploySpec for dict"):
        deploy_spec({})


def _declared(value_info: onnx.ValueInfoProto) -> tuple[int, list]:
    tensor = value_info.type.tensor_type
    return tensor.elem_type, [d.dim_param or d.dim_value for d in tensor.shape.dim]


def _check_against_graph(spec, proto: onnx.ModelProto, resolution: tuple[int, ...]) -> None:
    """The graph declares the spec's input (name, dtype, shape with a dynamic batch) and outputs."""
    (graph_input,) = proto.graph.input
    dtype, shape = _declared(graph_input)
    assert graph_input.name == spec.input_name
    assert helper.tensor_dtype_to_np_dtype(dtype) == torch.empty((), dtype=spec.input_dtype).numpy().dtype
    assert shape == [BATCH_AXIS, *spec.input_shape(resolution, 1)[1:]]
    assert tuple(o.name for o in proto.graph.output) == spec.output_names == (OUTPUT_NAME,)
    assert all(_declared(o)[1][0] == BATCH_AXIS for o in proto.graph.output)
    assert spec.example_input(resolution, 2).shape == spec.input_shape(resolution, 2)


def test_vit_spec_agrees_with_its_exported_graph(good_export):
    manifest = Manifest.read(good_export)
    (entry,) = manifest.graphs
    spec = deploy_spec(load_model(good_export))
    _check_against_graph(spec, onnx.load(str(good_export / entry.file), load_external_data=False), tuple(entry.resolution))
    assert spec.preprocessing.to_dict() == manifest.preprocessing


def test_sequence_spec_agrees_with_its_exported_graph():
    torch.manual_seed(0)
    model = create_model("seq_tiny_ega", depth=1).eval()
    spec = deploy_spec(model)
    _check_against_graph(spec, onnx_from_model(model, (8,)), (8,))
    assert spec.preprocessing is None and spec.patch_size is None


def test_only_vits_take_a_resolution_range():
    vit, seq = (deploy_spec(create_model(name, depth=1)) for name in ("vit_tiny_patch16", "seq_tiny_ega"))
    assert set(vit.input_dims()) == set(seq.input_dims()) == {0}  # the batch
    assert set(vit.input_dims(((32, 64), (32, 128)))) == {0, 3}  # the height does not vary: it stays static
    with pytest.raises(ExportError, match="needs a ViT"):
        seq.input_dims(((8,), (16,)))


def test_end_to_end_inputs_prepare_into_model_inputs():
    import numpy as np

    rng = np.random.default_rng(0)
    for name, resolution in (("vit_tiny_patch16", (32, 48)), ("seq_tiny_ega", (12,))):
        spec = deploy_spec(create_model(name, depth=1))
        rows = np.stack([spec.prepare(raw, resolution) for raw in spec.raw_inputs(2, resolution, rng)])
        assert rows.shape == spec.input_shape(resolution, 2) == spec.random_inputs(2, resolution, seed=0).shape
        assert rows.dtype == spec.random_inputs(2, resolution, seed=0).dtype == torch.empty((), dtype=spec.input_dtype).numpy().dtype
