"""Plans for GPUs: INT8 or FP8 Q/DQ on the matrix products over an fp16 or bf16 remainder.

``int8`` keeps everything but its quantized products in fp32: right on ONNX Runtime's CPU kernels,
but TensorRT 11 (strongly typed) then runs the remainder in fp32, slower than the ``fp16`` plan.
These plans are what a GPU user picks:

* ``int8-fp16``: the ``int8`` plan's Q/DQ pairs (weights per output channel, activations per
  tensor, symmetric), calibrated and checked the same way;
* ``fp8``: the same pairs in FP8 E4M3 (``float8e4m3fn``), with the scale
  granularity NVIDIA's Model Optimizer writes for ViTs (its ONNX PTQ, ``quantize_mode="fp8"``,
  read on deploykit's graphs: per-tensor activation scales, per-output-channel weight scales);
  an FP8 scale is the tensor's absolute maximum over 448, E4M3's largest finite value.

In both, attention's two batched products (q·kᵀ and attention·v) are quantized too (TensorRT
fuses FP8/INT8 attention only where Q/DQ sit on them; ``--int8-attention`` off does not apply,
``--keep-float`` and the agreement fallback do). What stays float is decided as for ``int8``
(``int8_selection``: tables and their readers, rotations, SaPE²'s op, MoPE's gate, the logits),
and the remainder is written by the cast plans' pass (``deploykit.graph.cast.CastPass``): the products and
what follows them in the low type; LayerNorm, Softmax, tables and their readers, custom ops and
the logits in fp32. Each ``DequantizeLinear`` feeding only low products gives the low type
directly (its scale stored in it), so no Cast sits between a DQ and its product.

Q/DQ on fp16/bf16 tensors and FP8 types need opset 19: these graphs are written at opset 19
(every op deploykit exports reads the same from 18 to 19: 19 only adds types and attributes
with the old defaults). ONNX Runtime's CPU kernels run both graphs (FP8 and fp16
``DequantizeLinear``, fp16 products), so they are checked as the ``int8`` plan is. A bf16
remainder (``precision.with_remainder(..., BFLOAT16)`` writes one) is not offered as a plan: ONNX Runtime's
CPU provider has no bf16 ``MatMul`` or ``DequantizeLinear`` kernel, so the export could not check it.

The sensitivity pass and the fallback judge the Q/DQ graph with an fp32 remainder (the nodes
moved back are the same ones); the plan's final check runs the graph as written.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

# Opset of the plans' graphs (fp16/bf16 and FP8 in QuantizeLinear/DequantizeLinear).
QDQ_OPSET = 19
# E4M3 (float8e4m3fn): the largest finite value, and INT8's symmetric range.
FP8_MAX = 448.0
INT8_MAX = 127.0
_QDQ = ("QuantizeLinear", "DequantizeLinear")


def at_opset(proto: onnx.ModelProto, version: int = QDQ_OPSET) -> onnx.ModelProto:
    """``proto`` (changed in place, and returned) importing the default domain at ``version`` or
    above, model-local functions included (their bodies are read at the model's opset)."""
    for imports in (proto.opset_import, *(f.opset_import for f in proto.functions)):
        for entry in imports:
            if entry.domain in ("", "ai.onnx") and entry.version < version:
                entry.version = version
    return proto


def int8_to_fp8(qdq: onnx.ModelProto, fp32: onnx.ModelProto) -> onnx.ModelProto:
    """The int8 Q/DQ graph ``qdq`` (ONNX Runtime's symmetric QDQ form of ``fp32``) with every pair
    in FP8 E4M3: an activation's scale becomes its calibrated absolute maximum over 448 (the int8
    scale is that maximum over 127); a weight is re-quantized from its fp32 value, per channel
    along the axis the int8 form used, and stored in FP8 with its ``DequantizeLinear``."""
    out = onnx.ModelProto()
    out.CopyFrom(qdq)
    at_opset(out)
    graph = out.graph
    weights = {t.name: t for t in graph.initializer}
    fp32_nodes = {n.name: n for n in fp32.graph.node}
    fp32_weights = {t.name: t for t in fp32.graph.initializer}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for k, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, k))
    added: dict[str, onnx.TensorProto] = {}

    def add(tensor: onnx.TensorProto) -> str:
        added.setdefault(tensor.name, tensor)
        return tensor.name

    for node in graph.node:
        if node.op_type not in _QDQ:
            continue
        if node.input[0] in weights and node.op_type == "DequantizeLinear":
            source = _float_weight(node, readers, fp32_nodes, fp32_weights)
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            per_channel = numpy_helper.to_array(weights[node.input[1]]).ndim > 0
            values, scale = fp8_weight(numpy_helper.to_array(source), axis if per_channel else None)
            node.input[0] = add(numpy_helper.from_array(values, f"{source.name}_fp8"))
            node.input[1] = add(numpy_helper.from_array(scale, f"{source.name}_fp8_scale"))
        else:
            scale = numpy_helper.to_array(weights[node.input[1]]).astype(np.float32)
            node.input[1] = add(numpy_helper.from_array((scale * (INT8_MAX / FP8_MAX)).astype(np.float32), f"{node.input[1]}_fp8"))
        zero = np.zeros(numpy_helper.to_array(added[node.input[1]]).shape, np.float32)
        zero_name = f"{node.input[1]}_zero_point"
        node.input[2:] = [add(numpy_helper.from_array(_to_fp8(zero), zero_name))]
    graph.initializer.extend(added.values())
    _drop_unread_initializers(graph)
    return out


def fp8_weight(weight: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``(E4M3 values, float32 scale)`` of ``weight``: per channel along ``axis`` (None: one
    scale), each channel's absolute maximum mapped to 448 (an all-zero channel gets scale 1)."""
    weight = weight.astype(np.float32)
    if axis is None:
        amax = np.abs(weight).max(keepdims=True)
    else:
        amax = np.abs(weight).max(axis=tuple(d for d in range(weight.ndim) if d != axis % weight.ndim), keepdims=True)
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    values = _to_fp8(weight / scale)
    return values, (scale.reshape(-1) if axis is not None else scale.reshape(()))


def _to_fp8(values: np.ndarray) -> np.ndarray:
    """Round to E4M3, saturating at ±448 as QuantizeLinear does (numpy's cast would give NaN)."""
    import ml_dtypes

    return np.clip(values, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def _float_weight(dq: onnx.NodeProto, readers: dict, fp32_nodes: dict, fp32_weights: dict) -> onnx.TensorProto:
    """The fp32 weight a weight ``DequantizeLinear`` stands for: what its reader reads at the same
    input in the fp32 graph (the quantizer keeps node names)."""
    for node, k in readers.get(dq.output[0], ()):
        twin = fp32_nodes.get(node.name)
        if twin is not None and k < len(twin.input) and twin.input[k] in fp32_weights:
            return fp32_weights[twin.input[k]]
    raise ValueError(f"no fp32 weight found for {dq.name or dq.output[0]}")


def _drop_unread_initializers(graph: onnx.GraphProto) -> None:
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def qdq_type(proto: onnx.ModelProto) -> int | None:
    """The element type the graph's Q/DQ pairs quantize to (``TensorProto.INT8``,
    ``FLOAT8E4M3FN``...), from their zero points; None when the graph has none."""
    weights = {t.name: t for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type in _QDQ and len(node.input) > 2 and node.input[2] in weights:
            return weights[node.input[2]].data_type
    return None


TYPE_NAMES = {TensorProto.INT8: "int8", TensorProto.FLOAT8E4M3FN: "float8e4m3fn", TensorProto.UINT8: "uint8"}
