"""``DeploySpec``: one per architecture, the only place that tells the architectures apart, and
agreeing with the graphs export writes; the names a graph is made of, defined once
(``deploykit.catalog``) and never branched on outside the spec."""

from __future__ import annotations

import ast
from pathlib import Path

import onnx
import pytest
import torch
from onnx import helper

from deploykit import catalog
from deploykit.backends import TorchRunner
from deploykit.catalog import OUTPUT_NAME, TABLE_PREFIX
from deploykit.errors import ExportError
from deploykit.export.manifest import Manifest
from deploykit.export.metadata import GraphMetadata
from deploykit.export.names import TRUNK_SCOPE
from deploykit.export.onnx_export import BakedModel, onnx_from_model
from deploykit.nn import create_model, load_model
from deploykit.nn.factory import build_model
from deploykit.nn.spec import BATCH_AXIS, SPECS, SequenceSpec, VitSpec, block_paths, deploy_spec

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


# The names a graph is made of (its input per architecture, its output, its tables, the sequence
# model's architecture tag), and what holds them on a model; a headless ViT's output kind.
GRAPH_NAMES = {
    catalog.IMAGES_INPUT,
    catalog.TOKENS_INPUT,
    catalog.OUTPUT_NAME,
    catalog.SEQUENCE_ARCHITECTURE,
    TABLE_PREFIX,
    TABLE_PREFIX.rstrip("."),
    "features",
}
NAME_HOLDERS = {"input_name", "output_kind", "IMAGES_INPUT", "TOKENS_INPUT", "OUTPUT_NAME"}
# Module- or class-level strings equal to a graph name that name something else.
OTHER_MEANINGS = {("deploykit/encodings/base.py", "Hook"): "where an encoding acts (the token sequence, the attention logits)"}


def _is_name(node: ast.expr) -> bool:
    """A literal graph name, or what holds one (``model.input_name``, ``OUTPUT_NAME``)."""
    if isinstance(node, ast.Constant):
        return node.value in GRAPH_NAMES
    return (node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)) in NAME_HOLDERS


def name_branches(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """Comparisons with a graph name, and outputs indexed by a literal name, in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(_is_name(o) for o in (node.left, *node.comparators)):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and _is_name(node.slice):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{path.relative_to(root)}:{line}: {code}" for line, code in sorted(found)]


@pytest.mark.parametrize(
    "scan, hint",
    [
        (architecture_branches, "ask deploykit.nn.spec.deploy_spec(model)"),
        (name_branches, "ask deploykit.nn.spec.deploy_spec(model), or take model.input_kind or catalog.OUTPUT_NAME,"),
    ],
)
def test_no_branches_outside_the_spec(scan, hint):
    """Per-architecture code goes through ``deploy_spec``, as Optimum's ``OnnxConfig``s: no
    ``isinstance`` on a model class, and no comparison with a graph name (``answers_top_k``,
    ``input_kind`` instead); an output is read by ``catalog.OUTPUT_NAME``, not by its spelling."""
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if path != SPEC_MODULE for line in scan(path)]
    assert not found, f"{hint} instead of:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "scan, source",
    [
        (
            architecture_branches,
            "isinstance(model.cfg, SequenceConfig)\n"
            "not isinstance(model, nn.VisionTransformer)\n"
            "isinstance(cfg, (ViTConfig, SequenceConfig))\n"
            'hasattr(model, "grid")\n'
            'hasattr(self.model, "pos_enc")\n'
            "isinstance(x, dict)\n"
            'hasattr(os, "sched_getaffinity")\n',
        ),
        (
            name_branches,
            'model.input_name == "tokens"\n'
            'if model.output_kind != "logits": pass\n'
            "spec.input_name in (IMAGES_INPUT, TOKENS_INPUT)\n"
            'outputs["logits"]\n'
            'kind == "features"\n'
            'hook == "qk"\n'
            'outputs["blocks.0"]\n'
            "outputs[OUTPUT_NAME]\n",
        ),
    ],
)
def test_the_scans_see_branches(tmp_path, scan, source):
    """The scans above are not vacuous: each finds every form of branch it forbids (the first five
    lines) and nothing else."""
    path = tmp_path / "branches.py"
    path.write_text(source)
    assert [line.split(": ", 1)[0] for line in scan(path, tmp_path)] == [f"branches.py:{i}" for i in range(1, 6)]


def _definitions(path: Path) -> list[tuple[str, str, str]]:
    """``(scope, name, value)`` of each string constant assigned at module or class level."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    scopes = [("", tree.body)] + [(n.name, n.body) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    for scope, body in scopes:
        for node in body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [(scope, ast.unparse(t), node.value.value) for t in targets]
    return found


def test_graph_names_are_defined_once():
    """Each graph name is spelled once, in ``deploykit.catalog``; every other module imports it."""
    spelled = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE.parent))
        for scope, name, value in _definitions(path):
            if value in GRAPH_NAMES and (where, scope) not in OTHER_MEANINGS:
                spelled.setdefault(value, []).append(f"{where}: {name}")
    assert all(len(places) == 1 and places[0].startswith("deploykit/catalog.py") for places in spelled.values()), spelled
    assert set(spelled) >= {catalog.IMAGES_INPUT, catalog.TOKENS_INPUT, OUTPUT_NAME, catalog.SEQUENCE_ARCHITECTURE, TABLE_PREFIX}


def test_exported_names_are_the_catalogs(good_export):
    """The graph carries the catalog's names: its tables under ``TABLE_PREFIX`` (``BakedModel.pe_tables``),
    its trunk's scopes under ``TRUNK_SCOPE`` (``BakedModel.model``), one block output per
    ``block_paths`` entry, which the PyTorch runner returns under the same paths."""
    model = load_model(good_export)
    (entry,) = Manifest.read(good_export).graphs
    proto = onnx.load(str(good_export / entry.file), load_external_data=False)
    assert any(i.name.startswith(TABLE_PREFIX) for i in proto.graph.initializer)
    assert dict(BakedModel(model, tuple(entry.resolution)).named_children())[TRUNK_SCOPE] is model
    assert len(GraphMetadata.of(proto).block_outputs) == len(block_paths(model)) == model.cfg.depth
    x = deploy_spec(model).random_inputs(1, tuple(entry.resolution), seed=0)
    with TorchRunner(model, return_blocks=True) as runner:
        assert set(runner.infer({model.input_name: x})) == {OUTPUT_NAME, *block_paths(model)}


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
