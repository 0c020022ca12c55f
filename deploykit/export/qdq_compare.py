"""Where Q/DQ pairs sit in a quantized graph, read back node by node, and how two quantized graphs
of the same fp32 graph differ: deploykit's plan against NVIDIA Model Optimizer's ONNX PTQ.

``placement`` reads, for each matrix product (MatMul, Gemm, Conv), which of its inputs it reads
through a ``DequantizeLinear``, the type they were quantized to, each scale's shape (``()`` per
tensor, ``(C,)`` per channel) and the type the product runs in. ``compare`` lists every difference
between two placements of one fp32 graph (both writers keep the exporter's node names), and the
remainder's types (what neither quantizes), each with its reason from ``REASONS`` when deploykit's
plan record or rules explain it; a difference with no reason is ``unexplained``.

ModelOpt runs in a child process (``modelopt_quantize``): importing ``modelopt.onnx.quantization``
patches ONNX Runtime's calibrators in place, after which ONNX Runtime's own ``quantize_static``
(deploykit's int8 calibration) fails in that process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from deploykit.export.metadata import GraphMetadata

PRODUCTS = ("MatMul", "Gemm", "Conv")
_TYPE_NAMES = {v: k.lower() for k, v in TensorProto.DataType.items()}

# Why deploykit's plan differs from ModelOpt's, by kind of difference. The keys are what
# ``compare`` finds; a difference whose key is not here is unexplained.
REASONS: dict[str, str] = {
    # ModelOpt quantizes, deploykit keeps float: deploykit's per-node reasons (``int8_selection``).
    "float:table": "reads a positional table (tables and their readers stay fp32 in every deploykit plan)",
    "float:float-module": "inside a module that declares KeepsFloat (positional encodings, MoPE's EGA gate)",
    "float:sensitivity": "moved back to float by the agreement fallback (sensitivity pass) to meet the target",
    "float:pinned": "pinned to float by --keep-float",
    "float:attention": "attention product kept float (int8 plan's measured choice; the GPU plans quantize them)",
    # deploykit quantizes, ModelOpt keeps float.
    "quantized:Conv": "the patch embedding: ModelOpt's ViT default leaves Conv float; deploykit quantizes it "
    "(its sensitivity pass moves it back where it costs agreement)",
    # The remainder: what neither quantizes, in different types.
    "remainder:LayerNormalization": "deploykit keeps LayerNorm fp32 (a reduction fp16 cannot hold; the cast plans' rule), "
    "ModelOpt converts it to fp16",
    "remainder:Softmax": "deploykit keeps Softmax fp32 (the cast plans' rule), ModelOpt converts it to fp16",
    "remainder:encoding": "reads a positional table or sits in the encoding's module (rotation, table add, SaPE² bias, gate): "
    "fp32 in every deploykit plan",
    "remainder:residual": "the residual stream (and the class token joining it) stays fp32 where fp32 LayerNorm and encoding "
    "outputs meet it (the cast plans' rule: fp32 wins where the two meet)",
    "remainder:logits": "the head product and logits stay fp32 in deploykit (ModelOpt casts its fp16 logits back to fp32)",
}


@dataclass(frozen=True)
class QuantizedProduct:
    """One matrix product of a quantized graph.

    Attributes:
        op_type: MatMul, Gemm or Conv.
        quantized_inputs: the input positions read through a ``DequantizeLinear``.
        qdq_types: the type each of those was quantized to (``int8``, ``float8e4m3fn``).
        scale_shapes: each of those scales' shape: ``()`` per tensor, ``(C,)`` per channel.
        runs_in: the type of the product's output (``float``, ``float16``).
    """

    op_type: str
    quantized_inputs: tuple[int, ...]
    qdq_types: tuple[str, ...]
    scale_shapes: tuple[tuple[int, ...], ...]
    runs_in: str


@dataclass(frozen=True)
class Difference:
    """One way two placements differ: ``node`` (an ONNX name, or an op type for the remainder's
    counts), what differs (``deploykit`` / ``modelopt``), and why (``REASONS``; None: unexplained)."""

    node: str
    kind: str
    deploykit: str
    modelopt: str
    reason: str | None

    def line(self) -> str:
        return f"{self.node}: deploykit {self.deploykit}, ModelOpt {self.modelopt}: {self.reason or 'UNEXPLAINED'}"


def _types(proto: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(proto)
    values = (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)
    return {v.name: v.type.tensor_type.elem_type for v in values} | {t.name: t.data_type for t in proto.graph.initializer}


def placement(proto: onnx.ModelProto) -> dict[str, QuantizedProduct]:
    """Every matrix product of ``proto`` by node name, with where its Q/DQ pairs are."""
    producers = {o: n for n in proto.graph.node for o in n.output}
    weights = {t.name: t for t in proto.graph.initializer}
    types = _types(proto)
    out = {}
    for node in proto.graph.node:
        if node.op_type not in PRODUCTS:
            continue
        positions, qtypes, shapes = [], [], []
        for k, name in enumerate(node.input[:2]):
            dq = producers.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            positions.append(k)
            qtypes.append(_TYPE_NAMES.get(types.get(dq.input[0], 0), "?"))
            scale = weights.get(dq.input[1])
            shapes.append(tuple(scale.dims) if scale is not None else ())
        out[node.name] = QuantizedProduct(
            node.op_type, tuple(positions), tuple(qtypes), tuple(shapes), _TYPE_NAMES.get(types.get(node.output[0], 0), "?")
        )
    return out


def compare(deploykit_graph: onnx.ModelProto, modelopt_graph: onnx.ModelProto) -> list[Difference]:
    """Every difference between deploykit's quantized graph and ModelOpt's of the same fp32 graph:
    products quantized by one only, quantized inputs, types or scale shapes that differ, and the
    remainder's nodes (by op type) in a different type, each with its reason (``REASONS``)."""
    ours, theirs = placement(deploykit_graph), placement(modelopt_graph)
    record = GraphMetadata.of(deploykit_graph).quantization
    why_float = {e.onnx: (e.reason if e.reason in ("pinned", "sensitivity") else e.why) for e in (record.kept_float if record else ())}
    differences = []
    for name in sorted(set(ours) | set(theirs)):
        a, b = ours.get(name), theirs.get(name)
        if a is None or b is None:
            differences.append(Difference(name, "node", "present" if a else "absent", "present" if b else "absent", None))
            continue
        if bool(a.quantized_inputs) != bool(b.quantized_inputs):
            if b.quantized_inputs:
                key = f"float:{why_float.get(name, '')}"
                differences.append(Difference(name, "quantized", "float", "quantized", REASONS.get(key)))
            else:
                differences.append(Difference(name, "quantized", "quantized", "float", REASONS.get(f"quantized:{a.op_type}")))
            continue
        if not a.quantized_inputs:
            continue
        for field in ("quantized_inputs", "scale_shapes"):
            if getattr(a, field) != getattr(b, field):
                differences.append(Difference(name, field, str(getattr(a, field)), str(getattr(b, field)), None))
        if set(a.qdq_types) != set(b.qdq_types):
            differences.append(Difference(name, "qdq_types", str(a.qdq_types), str(b.qdq_types), None))
        if a.runs_in != b.runs_in:
            differences.append(Difference(name, "runs_in", a.runs_in, b.runs_in, None))
    return differences + _remainder_differences(deploykit_graph, modelopt_graph)


def _remainder_differences(ours: onnx.ModelProto, theirs: onnx.ModelProto) -> list[Difference]:
    """The nodes neither graph adds (same name in both) whose output types differ, counted by op
    type and classed by why deploykit keeps them fp32."""
    from deploykit.catalog import TABLE_PREFIXES
    from deploykit.export.names import node_scopes

    our_types, their_types = _types(ours), _types(theirs)
    their_nodes = {n.name: n for n in theirs.graph.node}
    graph_outputs = {o.name for o in ours.graph.output}
    float_modules = GraphMetadata.of(ours).float_modules or ()
    producers = {o: n for n in ours.graph.node for o in n.output}
    encoding: set[str] = set()  # reads a table, sits in an encoding's module, or computes from those alone
    classes: Counter = Counter()
    for node in ours.graph.node:
        live = [producers[i] for i in node.input if i in producers]
        if (
            any(i.startswith(TABLE_PREFIXES) for i in node.input)
            or any(scope == m or scope.startswith(m + ".") for scope in node_scopes(node) for m in float_modules)
            or (live and all(p.name in encoding for p in live))
        ):
            encoding.add(node.name)
        if node.op_type in PRODUCTS or node.op_type in ("QuantizeLinear", "DequantizeLinear", "Cast") or node.name not in their_nodes:
            continue
        in_encoding = node.name in encoding
        twin = their_nodes[node.name]
        mine = {our_types.get(o) for o in node.output}
        other = {their_types.get(o) for o in twin.output}
        if mine == other:
            continue
        if node.op_type in ("LayerNormalization", "Softmax"):
            key = node.op_type
        elif in_encoding or node.domain not in ("", "ai.onnx"):
            key = "encoding"
        elif set(node.output) & graph_outputs or _feeds_only_outputs(node, ours):
            key = "logits"
        elif mine == {TensorProto.FLOAT}:
            key = "residual"
        else:
            key = f"{node.op_type}:{sorted(mine)}"
        classes[(key, node.op_type, _names(mine), _names(other))] += 1
    return [
        Difference(f"{count} {op_type}", "remainder", ours_t, theirs_t, REASONS.get(f"remainder:{key}"))
        for (key, op_type, ours_t, theirs_t), count in sorted(classes.items())
    ]


def _names(types: set) -> str:
    return "/".join(sorted(_TYPE_NAMES.get(t, "?") for t in types))


def _feeds_only_outputs(node: onnx.NodeProto, proto: onnx.ModelProto) -> bool:
    outputs = {o.name for o in proto.graph.output}
    readers = [n for n in proto.graph.node if set(node.output) & set(n.input)]
    return bool(readers) and all(set(r.output) & outputs or r.op_type in ("Gemm", "Cast") for r in readers)


def modelopt_quantize(fp32_path: Path, mode: str, calibration: np.ndarray, output: Path, method: str | None = None) -> onnx.ModelProto:
    """ModelOpt's ONNX PTQ (``modelopt.onnx.quantization.quantize``, ``quantize_mode`` ``int8`` or
    ``fp8``, calibrated on CPU on ``calibration``) of the fp32 graph at ``fp32_path``, written to
    ``output``, run in a child process (module docstring)."""
    input_name = onnx.load(str(fp32_path), load_external_data=False).graph.input[0].name
    with tempfile.TemporaryDirectory(prefix="deploykit-modelopt-") as tmp:
        data = Path(tmp) / "calibration.npy"
        np.save(data, calibration)
        args = dict(fp32=str(fp32_path), mode=mode, data=str(data), input=input_name, output=str(output), method=method)
        done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0 or not output.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"ModelOpt's quantize failed: {tail[0]}")
    return onnx.load(str(output))


_CHILD = """
import json, sys
import numpy as np
from modelopt.onnx.quantization import quantize
a = json.loads(sys.argv[1])
quantize(a["fp32"], quantize_mode=a["mode"], calibration_data={a["input"]: np.load(a["data"])}, calibration_eps=["cpu"],
         calibration_method=a["method"], output_path=a["output"], log_level="ERROR")
"""
