"""ONNX nodes named the way users know them: by the PyTorch module that produced them.

The dynamo exporter records, on every node, the module scopes it was traced in
(``pkg.torch.onnx.name_scopes``: ``['', 'model.blocks.7', 'model.blocks.7.mlp',
'model.blocks.7.mlp.fc2', 'linear_3']``, the last entry the traced operation). The deepest module
scope, without the ``model.`` that ``BakedModel`` puts in front of the trunk, is the path of
``model.named_modules()``: ``blocks.7.mlp.fc2``. Graph rewrites keep the metadata of the node they
replace, and ONNX Runtime's quantizer keeps node names, so a quantized graph's nodes are named
through the fp32 graph they came from.
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterable

import onnx

from deploykit.errors import ConfigError

SCOPES_KEY = "pkg.torch.onnx.name_scopes"
# BakedModel / RangeBakedModel hold the trained trunk as ``model``: the exporter's scope of every
# trunk module is ``model.`` and its path in ``named_modules()``.
TRUNK_SCOPE = "model"


def node_scopes(node: onnx.NodeProto) -> list[str]:
    """The exporter's name scopes of ``node`` (outermost first; the last is the traced op), or ``[]``."""
    for prop in node.metadata_props:
        if prop.key == SCOPES_KEY:
            return ast.literal_eval(prop.value)
    return []


def module_path(node: onnx.NodeProto) -> str:
    """``blocks.7.mlp.fc2``: the deepest PyTorch module ``node`` was traced in (``""`` when the
    graph carries no scopes, or the node belongs to no submodule)."""
    modules = [s for s in node_scopes(node)[:-1] if s == TRUNK_SCOPE or s.startswith(TRUNK_SCOPE + ".")]
    return modules[-1][len(TRUNK_SCOPE) + 1 :] if modules else ""


def trunk_scope(path: str) -> str:
    """The exporter's scope of the trunk's module at ``path`` (``blocks.0`` → ``model.blocks.0``):
    the inverse of ``module_path``."""
    return f"{TRUNK_SCOPE}.{path}"


def module_paths(proto: onnx.ModelProto) -> dict[str, str]:
    """Node name → module path, for every node of the graph."""
    return {node.name: module_path(node) for node in proto.graph.node}


def describe(name: str, modules: dict[str, str]) -> str:
    """``blocks.7.mlp.fc2 (node_Gemm_346)``; the ONNX name alone when no module is known."""
    module = modules.get(name, "")
    return f"{module} ({name})" if module else name


def matching_nodes(patterns: Iterable[str], candidates: Iterable[str], modules: dict[str, str]) -> dict[str, str]:
    """The candidate nodes each pattern matches, by module path or ONNX name (``fnmatch``
    wildcards: ``blocks.*.mlp.fc2``, ``blocks.1[01].*``), as node → the first pattern matching it.

    Raises:
        ConfigError: a pattern that matches none of the candidates (names a few module paths).
    """
    candidates = list(candidates)
    found: dict[str, str] = {}
    for pattern in patterns:
        hits = [n for n in candidates if fnmatch.fnmatchcase(modules.get(n, ""), pattern) or fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            known = list(dict.fromkeys(modules.get(n) or n for n in candidates))
            shown = ", ".join(known[:6]) + (f" and {len(known) - 6} more" if len(known) > 6 else "")
            raise ConfigError(f"--keep-float {pattern!r} matches no quantizable layer; they are: {shown}")
        for node in hits:
            found.setdefault(node, pattern)
    return found
