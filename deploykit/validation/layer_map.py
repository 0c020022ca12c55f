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
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from deploykit.checks import Tolerance, first_divergent
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
    scopes = next((p.value for p in node.metadata_props if p.key == NAME_SCOPES), None)
    if scopes is None:
        return ""
    try:
        names = [s for s in ast.literal_eval(scopes) if s]
    except (ValueError, SyntaxError):
        return ""
    module = names[-2] if len(names) >= 2 else ""  # the last scope is the op itself
    return module.removeprefix(_EXPORT_WRAPPER) if module != _EXPORT_WRAPPER.rstrip(".") else ""


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
