"""The first divergent layer in the engine's own terms: engine layers → ONNX nodes → module names.

Users cannot map Polygraphy's layer indices back to the model (NVIDIA/TensorRT#4616). Each link
is read from what the tools already record:

- ONNX node → module: torch's exporter stores each node's module scopes in its metadata
  (``pkg.torch.onnx.name_scopes``: ``['', 'model.blocks.2', 'model.blocks.2.mlp', 'linear']``);
  the deepest scope but the op's own is the module (``blocks.2.mlp``; ``BakedModel``'s ``model.``
  prefix dropped, so the names are the model's own ``named_modules``).
- engine layer → ONNX nodes: TensorRT's parser names each layer after its node, and a fused
  layer after the nodes it holds (``node_a + node_b``; Myelin's ``{ForeignNode[node_a...node_z]}``
  spans the nodes from the first to the last, in graph order) (``layer_nodes``).

``first_divergent_node`` walks the nodes in graph order and names the first whose outputs leave
the tolerance, given each tensor's reference and actual values (``polygraphy run --trt-outputs
mark all`` or a runner on a graph whose outputs are all marked, ``runners.onnxrt.with_outputs``).

``validate`` has no per-node reference in float64 (PyTorch runs modules, not ONNX nodes), so it
compares module outputs: each module's output is the output of the last node, in graph order,
whose scopes hold the module (``module_outputs``), compared with the module's float64 output
(``TorchRunner(return_modules=...)``). ``node_errors`` measures each such node, ``DivergentLayer``
names the first that leaves the tolerance, and ``node_data`` writes the errors in the form Model
Explorer overlays on the graph (``model_explorer.node_data_builder``: graph id → ``results``, node
id → ``{"value": ...}``; ``model-explorer-onnx`` names a graph and its nodes as the ONNX file does).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from deploykit.checks import Tolerance, first_divergent, row_cosines
from deploykit.export.metadata import GraphMetadata
from deploykit.runners.onnxrt import with_outputs

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
_EXPORT_WRAPPER = "model."  # deploykit.export.onnx_export.BakedModel holds the model as ``model``
_FOREIGN = re.compile(r"ForeignNode\[(?P<first>[^\]]+?)\.\.\.(?P<last>[^\]]+)\]")


@dataclass(frozen=True)
class NodeOrigin:
    """One ONNX node and where it comes from."""

    node: str
    op_type: str
    module: str  # "" where the exporter recorded no scope
    outputs: tuple[str, ...]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DivergentNode:
    """The first node whose output leaves the tolerance, and the engine layer that holds it."""

    origin: NodeOrigin
    tensor: str
    layer: str | None

    def describe(self) -> str:
        where = f"{self.origin.node} ({self.origin.op_type}) of {self.origin.module or 'the top level'}"
        return where + (f", in engine layer {self.layer!r}" if self.layer else "") + f": tensor {self.tensor}"


def node_origins(proto: onnx.ModelProto) -> list[NodeOrigin]:
    """Every node of the main graph, in graph order, with its module."""
    return [NodeOrigin(n.name, n.op_type, _module(n), tuple(o for o in n.output if o)) for n in proto.graph.node]


def _module(node: onnx.NodeProto) -> str:
    scopes = _scopes(node)
    return scopes[-1] if scopes else ""


def _scopes(node: onnx.NodeProto) -> list[str]:
    """The modules a node lies in, outermost first, as the model names them (``blocks.2``,
    ``blocks.2.mlp``, ``blocks.2.mlp.fc1``); empty where the exporter recorded none."""
    scopes = next((p.value for p in node.metadata_props if p.key == NAME_SCOPES), None)
    if scopes is None:
        return []
    try:
        names = [s for s in ast.literal_eval(scopes) if s]
    except (ValueError, SyntaxError):
        return []
    modules = names[:-1]  # the last scope is the op itself
    wrapper = _EXPORT_WRAPPER.rstrip(".")
    return [m.removeprefix(_EXPORT_WRAPPER) for m in modules if m != wrapper]


def module_outputs(proto: onnx.ModelProto, modules: Iterable[str]) -> dict[str, NodeOrigin]:
    """For each of ``modules`` the exporter recorded, the node that computes its output: the last
    node, in graph order, whose scopes hold the module (its own nodes or its children's). In graph
    order of those nodes; a module no node lies in is left out, and of modules whose output one
    node computes (``mlp`` and its last child ``mlp.fc2``) only the innermost is kept."""
    wanted, last = set(modules), {}
    for position, (node, origin) in enumerate(zip(proto.graph.node, node_origins(proto), strict=True)):
        for module in wanted.intersection(_scopes(node)):
            last[module] = (position, origin)
    innermost = {}
    for module, (position, origin) in last.items():
        if position not in innermost or module.count(".") > innermost[position][0].count("."):
            innermost[position] = (module, origin)
    return {module: origin for _, (module, origin) in sorted(innermost.items())}


def module_nodes(proto: onnx.ModelProto, outputs: Mapping[str, NodeOrigin]) -> dict[str, list[str]]:
    """For each module of ``outputs`` (``module_outputs``, in graph order), its nodes after the
    previous module's output node, up to its own: what computes its output from the last one
    compared (``blocks.2.mlp.fc1``: its MatMul and Add)."""
    nodes = list(proto.graph.node)
    at = {node.name: i for i, node in enumerate(nodes)}
    held, previous = {}, -1
    for module, origin in outputs.items():
        end = at[origin.node]
        held[module] = [n.name for n in nodes[previous + 1 : end + 1] if module in _scopes(n)] or [origin.node]
        previous = end
    return held


def layer_nodes(layer: str, order: Sequence[str]) -> list[str]:
    """The ONNX nodes an engine layer named ``layer`` holds, in graph ``order``: those its name
    mentions, and every node from the first to the last of a Myelin ``ForeignNode[a...b]``."""
    position = {name: i for i, name in enumerate(order)}
    held = set()
    for span in _FOREIGN.finditer(layer):
        first, last = span["first"].strip(), span["last"].strip()
        if first in position and last in position:
            held.update(order[position[first] : position[last] + 1])
    held.update(token for token in re.split(r"[\s+{}\[\]]+|\.\.\.", layer) if token in position)
    return sorted(held, key=position.__getitem__)


def layer_of(node: str, layers: Sequence[str], order: Sequence[str]) -> str | None:
    """The engine layer that holds ``node`` (the first, if a layer name is ambiguous), or None."""
    return next((layer for layer in layers if node in layer_nodes(layer, order)), None)


def first_divergent_node(
    origins: Sequence[NodeOrigin],
    reference: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    tolerance: Tolerance,
    layers: Sequence[str] = (),
) -> DivergentNode | None:
    """The first node, in graph order, one of whose float outputs present in both ``reference``
    and ``actual`` leaves ``tolerance`` (judged as block outputs are: ``checks.first_divergent``),
    with the engine layer of ``layers`` that holds it; None when every compared output keeps it."""
    order = [o.node for o in origins]
    for origin in origins:
        for tensor in origin.outputs:
            ref, act = reference.get(tensor), actual.get(tensor)
            if ref is None or act is None or not np.issubdtype(np.asarray(ref).dtype, np.floating) or np.shape(ref) != np.shape(act):
                continue
            rows = np.asarray(ref).reshape(len(ref), -1) if np.ndim(ref) > 1 else np.asarray(ref).reshape(1, -1)
            got = np.asarray(act).reshape(rows.shape)
            if first_divergent([rows], [got], tolerance) is not None:
                return DivergentNode(origin, tensor, layer_of(origin.node, layers, order))
    return None


def marked_graph(onnx_path: Path) -> tuple[bytes, list[str]]:
    """The graph with its recorded block outputs (``deploykit.block_outputs`` metadata) also
    marked as graph outputs (``runners.onnxrt.with_outputs``, as the int8 plan check marks them), and
    their names; ``(b"", [])`` when none were recorded."""
    proto = onnx.load(str(onnx_path))
    names = list(GraphMetadata.of(proto).block_outputs)
    if not names:
        return b"", []
    return with_outputs(proto, names).SerializeToString(), names


@dataclass(frozen=True)
class NodeError:
    """A node's output against its module's float64 output: the error measured there."""

    node: str
    op_type: str
    module: str
    tensor: str
    max_abs: float
    cosine: float  # worst per-input cosine
    diverged: bool  # leaves the tolerance as block outputs are judged (``checks.first_divergent``)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DivergentLayer:
    """The first divergent layer of a failing check, in the engine's terms where it has them: the
    engine layer (None for a runner without layers, such as ONNX Runtime), the ONNX nodes it holds
    (where there is no layer, the module's nodes since the last output compared: ``module_nodes``),
    the model's module, the tensor compared and the error measured there."""

    layer: str | None
    nodes: list[str]
    module: str
    tensor: str
    max_abs: float
    cosine: float

    @classmethod
    def of(
        cls, errors: Sequence[NodeError], layers: Sequence[str], order: Sequence[str], held: Mapping[str, list[str]] | None = None
    ) -> DivergentLayer | None:
        """The first of ``errors`` (in graph order) that diverged, with the engine layer of
        ``layers`` holding its node (nodes in graph ``order``), or else the nodes ``held`` names
        for its module (``module_nodes``); None when none diverged."""
        first = next((e for e in errors if e.diverged), None)
        if first is None:
            return None
        layer = layer_of(first.node, layers, order)
        nodes = layer_nodes(layer, order) if layer else list((held or {}).get(first.module, [first.node]))
        return cls(layer, nodes, first.module, first.tensor, first.max_abs, first.cosine)

    def describe(self) -> str:
        nodes = f"ONNX node{'s' if len(self.nodes) > 1 else ''} {', '.join(self.nodes)}"
        where = f"engine layer {self.layer!r} ({nodes})" if self.layer else nodes
        return f"{where} of {self.module}: max abs {self.max_abs:.3g}, cosine {self.cosine:.6f} at {self.tensor}"


def node_errors(
    outputs: Mapping[str, NodeOrigin],
    reference: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    tolerance: Tolerance,
    num_real: int = 0,
) -> list[NodeError]:
    """The error at each module's output node (``module_outputs``: module → node, in graph order)
    with the module's reference output in ``reference`` (by module) and the runner's in ``actual``
    (by tensor); a module whose output is missing on either side (a tuple output is not kept) or
    of another shape is not measured."""
    errors = []
    for module, origin in outputs.items():
        tensor = origin.outputs[0] if origin.outputs else ""
        ref, act = reference.get(module), actual.get(tensor)
        if ref is None or act is None or np.shape(ref) != np.shape(act) or not np.issubdtype(np.asarray(ref).dtype, np.floating):
            continue
        ref, act = np.asarray(ref, dtype=np.float64), np.asarray(act, dtype=np.float64)
        rows = (len(ref), -1) if ref.ndim > 1 else (1, -1)
        ref, act = ref.reshape(rows), act.reshape(rows)
        diverged = first_divergent([ref], [act], tolerance, num_real) is not None
        max_abs, cosine = float(np.abs(act - ref).max()), float(row_cosines(ref, act).min())
        errors.append(NodeError(origin.node, origin.op_type, module, tensor, max_abs, cosine, diverged))
    return errors


# Model Explorer's node data colours: within the tolerance, outside it, and the first divergent node.
_KEPT, _LEFT, _FIRST = "#c8e6c9", "#ff8a65", "#d32f2f"


def node_data(graph_id: str, errors: Sequence[NodeError], first: DivergentLayer | None) -> dict:
    """Model Explorer's node data for one graph (``ModelNodeData``: graph id → ``GraphNodeData``):
    each measured node's max abs error as its value, coloured by whether it left the tolerance
    (``NodeError.diverged``: judged on a relative scale, so no one threshold on the value says it),
    and the first divergent layer's nodes flagged in their own colour."""
    flagged = set(first.nodes) if first else set()
    results = {}
    for e in errors:
        results[e.node] = {"value": e.max_abs, "bgColor": _FIRST if e.node in flagged else (_LEFT if e.diverged else _KEPT)}
    return {graph_id or "main_graph": {"results": results}}


def network_layers(trt, proto: onnx.ModelProto) -> list[str]:
    """The layer names TensorRT's (or TensorRT-RTX's, ``trt``) ONNX parser makes of ``proto``:
    each named after its node, as the engine's layers are before fusion; empty when it cannot parse."""
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(proto.SerializeToString()):
        return []
    return [network.get_layer(i).name for i in range(network.num_layers)]
