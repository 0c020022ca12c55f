"""INT8 plans, step one: which MatMul/Gemm/Conv nodes of an fp32 graph are quantized, which stay
float and why, and the plan's record in the graph.

Encoding-aware selection (``select_nodes``): only MatMul, Gemm and Conv are candidates, so
LayerNorm, Softmax, the rotations and every other elementwise op stay float by construction.
Among the candidates these stay float too, each for a reason recorded in the graph:
``logits`` (the head: its output is the answer), ``table`` (a node reading a positional table),
``float-module`` (inside a module that declares ``KeepsFloat``: positional encodings and MoPE's
EGA gate, whose projection becomes a multiplicative gate on attention) and ``attention`` (the
q·kᵀ and attention·v products, unless the plan quantizes them; see ``ATTENTION_INT8``). Custom
ops (``deploykit::SaPE2Bias``) are model-local functions the quantizer never enters.

Pinned (``--keep-float PATTERN``, module paths with wildcards) nodes stay float too, reason
``pinned``; nodes the agreement fallback moves back have reason ``sensitivity``
(``deploykit.export.sensitivity``: one pass to measure, bisection to decide). Every node the plan
reports is named by its PyTorch module path with its ONNX name beside it
(``deploykit.export.names``: ``blocks.7.mlp.fc2 (node_Gemm_346)``).

The plans themselves: ``int8_static`` (``int8``, calibrated) and ``int8_dynamic``
(``int8-dynamic``); ``int8_check`` judges a plan against its fp32 graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from deploykit.catalog import TABLE_PREFIXES
from deploykit.export import names
from deploykit.export.metadata import GraphMetadata, KeptFloat, QuantizationRecord, copy_metadata

QUANTIZED_OP_TYPES = ("MatMul", "Gemm", "Conv")
# Whether the static plan quantizes the attention-score and attention-value MatMuls, per
# encoding, measured on the zoo (`python benchmarks/int8_plans.py attention`,
# results/int8-attention.json, 2000 test images): quantizing them lowered top-1 agreement with
# fp32 at 2x the training resolution for every encoding (ape 0.980 -> 0.878, rope-axial 0.994 ->
# 0.934, rope-mixed 0.991 -> 0.959, gridpe 0.992 -> 0.910, geope 0.987 -> 0.850, wepe 1.000 ->
# 0.996, mope 0.992 -> 0.973, sape2 0.987 -> 0.937, sape2+ape 0.993 -> 0.986), so all keep them
# float. What quantizing them would gain is the int8+attn column of the speed benchmark.
ATTENTION_INT8: dict[str, bool] = {
    "ape": False,
    "rope-axial": False,
    "rope-mixed": False,
    "gridpe": False,
    "geope": False,
    "wepe": False,
    "mope": False,
    "sape2": False,
    "sape2+ape": False,
}
# Ops between the head's product and the logits output that only move values around.
_SHAPE_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Transpose"})


@dataclass
class NodeSelection:
    """The candidate nodes of an fp32 graph: those to quantize, and those kept float with why
    (a policy reason, ``pinned`` or ``sensitivity``), plus what ``--keep-float`` pinned them with."""

    quantize: list[str] = field(default_factory=list)
    keep_float: dict[str, str] = field(default_factory=dict)  # node name -> reason
    pinned_by: dict[str, str] = field(default_factory=dict)  # node name -> the --keep-float pattern

    def record(self, modules: dict[str, str], noise: dict[str, float] | None = None, **plan: Any) -> QuantizationRecord:
        """The record of the plan: ``plan``'s fields (``QuantizationRecord``'s: the plan's name,
        calibration, ...) with this selection's counts, ``float_nodes`` (reason → ``module (onnx)``)
        and ``kept_float`` (one entry per float node: module, ONNX name, reason and why)."""
        reasons: dict[str, list[str]] = {}
        kept = []
        for name, reason in self.keep_float.items():
            reasons.setdefault(reason, []).append(names.describe(name, modules))
            if reason == "pinned":
                reason, why = "pinned", f"--keep-float {self.pinned_by[name]}"
            elif reason == "sensitivity":
                why = f"output error {noise[name]:.2e} when {quantized_word(plan.get('plan', 'int8'))} alone" if noise else ""
            else:
                reason, why = "policy", reason
            kept.append(KeptFloat(modules.get(name, ""), name, reason, why))
        return QuantizationRecord(**plan, quantized_nodes=len(self.quantize), float_nodes=reasons, kept_float=tuple(kept))


def quantized_word(plan: str) -> str:
    """What a plan's quantized products are called in its messages: ``fp8`` for the FP8 plans, else ``int8``."""
    return "fp8" if plan.startswith("fp8") else "int8"


def select_nodes(proto: onnx.ModelProto, attention: bool, keep_float: Sequence[str] = ()) -> NodeSelection:
    """Split the graph's MatMul/Gemm/Conv nodes into quantized and float (module docstring).

    Args:
        proto: an fp32 graph written by ``onnx_from_model`` (names every node; records
            ``deploykit.float_modules``).
        attention: quantize the products of two activations (q·kᵀ, attention·v) too.
        keep_float: ``--keep-float`` patterns: module paths (wildcards) or ONNX names kept float.

    Raises:
        ConfigError: a ``keep_float`` pattern that matches no MatMul/Gemm/Conv node.
    """
    graph = proto.graph
    float_modules = GraphMetadata.of(proto).float_modules
    weights = {i.name for i in graph.initializer}
    head = _head_nodes(proto)
    selection = NodeSelection()
    candidates = [n for n in graph.node if n.op_type in QUANTIZED_OP_TYPES and n.domain in ("", "ai.onnx")]
    pinned = names.matching_nodes(keep_float, [n.name for n in candidates], names.module_paths(proto))
    for node in candidates:
        if node.name in head:
            reason = "logits"
        elif any(name.startswith(TABLE_PREFIXES) for name in node.input):
            reason = "table"
        elif any(scope == m or scope.startswith(m + ".") for scope in names.node_scopes(node) for m in float_modules):
            reason = "float-module"
        elif not attention and not any(name in weights for name in node.input):
            reason = "attention"
        elif node.name in pinned:
            reason = "pinned"
            selection.pinned_by[node.name] = pinned[node.name]
        else:
            selection.quantize.append(node.name)
            continue
        selection.keep_float[node.name] = reason
    return selection


def attention_int8(proto: onnx.ModelProto, override: bool | None = None) -> bool:
    """``override``, else the measured choice for the graph's encoding (``ATTENTION_INT8``;
    float when unmeasured)."""
    if override is not None:
        return override
    return ATTENTION_INT8.get(GraphMetadata.of(proto).encoding or "", False)


def _head_nodes(proto: onnx.ModelProto) -> set[str]:
    """Nodes whose output reaches a graph output through shape ops only (the head's product)."""
    import onnx_ir as ir

    found, frontier = set(), list(ir.from_proto(proto).graph.outputs)
    while frontier:
        node = frontier.pop().producer()
        if node is None or node.name in found:
            continue
        found.add(node.name)
        if node.op_type in _SHAPE_OPS:
            frontier.append(node.inputs[0])
    return found


def looks_untrained(proto: onnx.ModelProto) -> bool:
    """Whether the graph's weights are still at their initial values where training always moves
    them: every LayerNormalization at scale 1 and shift 0, and every linear layer's bias 0 (deploykit's,
    timm's and PyTorch's initialisation). A plan checked on such weights proves nothing."""
    weights = {i.name: i for i in proto.graph.initializer}

    def constant(name: str, value: float) -> bool | None:
        return bool(np.all(numpy_helper.to_array(weights[name]) == value)) if name in weights else None

    products = {n.output[0] for n in proto.graph.node if n.op_type == "MatMul"}
    checks = []
    for node in proto.graph.node:
        if node.op_type == "LayerNormalization":
            checks += [constant(node.input[1], 1.0), constant(node.input[2], 0.0) if len(node.input) > 2 else None]
        elif node.op_type == "Gemm" and len(node.input) > 2:
            checks.append(constant(node.input[2], 0.0))
        elif node.op_type == "Add" and products & set(node.input):  # a linear layer's bias, after its MatMul
            checks += [constant(name, 0.0) for name in node.input if name in weights and len(weights[name].dims) == 1]
    checks = [c for c in checks if c is not None]
    return bool(checks) and all(checks)


def with_plan_record(out: onnx.ModelProto, original: onnx.ModelProto, record: QuantizationRecord) -> onnx.ModelProto:
    """``out``, a quantizer's rewrite of ``original``, with ``original``'s metadata put back (the
    quantizer keeps it only partly) and the plan's ``record`` added (``quantization``)."""
    copy_metadata(original, out)
    GraphMetadata.update(out, quantization=record)
    out.producer_name, out.producer_version = original.producer_name, original.producer_version
    return out
