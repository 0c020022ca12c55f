"""ONNX Runtime's rule set: the spelling its fusions recognise for what the exporter writes op by op.

Each rule keeps the graph in plain ONNX ops (TensorRT, TensorRT-RTX and ONNX Runtime all parse
the result) and computes the same values; it only changes the spelling to the one a runtime's
fusion recognises: GELU as one Gelu instead of Div, Erf, Add, Mul, Mul; a linear layer's bias
inside its Gemm instead of a separate Add; in attention, one Transpose of k instead of a reshape
through a run-time shape. The share of kernel time these ops take before and after is in ONNX
Runtime's profiler results (``benchmarks/results/ort-op-profile-*.json``); the key swap leaves ONNX
Runtime's outputs identical to the bit.
"""

from __future__ import annotations

import math

from deploykit.graph.rules import RuleSet

_SQRT2 = math.sqrt(2.0)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # the open slice bounds torch.onnx writes


def _erf_gelu_as_exported(op, x):
    # torch.onnx writes GELU as x · (0.5 · (1 + erf(x/√2))) ...
    return op.Mul(x, op.Mul(0.5, op.Add(op.Erf(op.Div(x, _SQRT2)), 1.0)))


def _erf_gelu_as_fused(op, x):
    # ... while ONNX Runtime's GeluFusion matches (x · 0.5) · (1 + erf(x/√2)) only; then its
    # BiasGeluFusion also absorbs the preceding bias add. Scaling by 0.5 is exact, so the two
    # spellings give the same float32 values.
    half = op.Mul(x, op.Constant(value_float=0.5))
    return op.Mul(half, op.Add(op.Erf(op.Div(x, op.Constant(value_float=_SQRT2))), op.Constant(value_float=1.0)))


def _linear_3d(op, x, weight, bias):
    return op.Add(op.MatMul(x, weight), bias)


def _linear_3d_is_static(context, x, weight, bias, **_) -> bool:
    shape = x.shape
    return (
        shape is not None
        and len(shape) == 3
        and all(isinstance(d, int) for d in shape[1:])
        and weight.const_value is not None
        and len(weight.shape) == 2
        and bias.const_value is not None
        and len(bias.shape) == 1
    )


def _linear_as_gemm(op, x, weight, bias):
    # ONNX Runtime fuses MatMul + Add into Gemm only for 2-D inputs, and leaves a [B, T, D]
    # linear layer as a GEMM plus a separate pass over its output for the bias. Flattening the
    # batch and token axes (a free reshape) gives one Gemm with the bias applied in its epilogue.
    tokens, features = x.shape[1], x.shape[2]
    flat = op.Reshape(x, op.Constant(value_ints=[-1, features]))
    out = op.Gemm(flat, weight, bias)
    return op.Reshape(out, op.Constant(value_ints=[-1, tokens, weight.shape[1]]))


def _key_swapped_through_3d(op, key, last_start, last_end, second_start, second_end, first_start, first_end, lead):
    # torch.onnx's scaled_dot_product_attention swaps k's last two axes by flattening the leading
    # ones, a 3-D Transpose, and a reshape back, with the shapes read at run time. ONNX Runtime
    # copies k twice that way and cannot see the swap as a transposed MatMul operand.
    shape = op.Shape(key)
    last = op.Slice(shape, last_start, last_end)
    second_last = op.Slice(shape, second_start, second_end)
    first = op.Slice(shape, first_start, first_end)
    flat = op.Reshape(key, op.Concat(lead, second_last, last, axis=0))
    return op.Reshape(op.Transpose(flat, perm=[0, 2, 1]), op.Concat(first, last, second_last, axis=0))


def _key_swap_is_exact(context, key, last_start, last_end, second_start, second_end, first_start, first_end, lead, **_) -> bool:
    # The swap is the exporter's only when every bound is the constant it writes: shape[-1:],
    # shape[-2:-1], shape[:-2] and a -1 leading dimension. Then it moves the same values as one
    # Transpose of the last two axes, which needs k's rank.
    expected = (
        (last_start, [-1]),
        (last_end, [_INT64_MAX]),
        (second_start, [-2]),
        (second_end, [-1]),
        (first_start, [_INT64_MIN]),
        (first_end, [-2]),
        (lead, [-1]),
    )
    for value, want in expected:
        if value.const_value is None or value.const_value.numpy().tolist() != want:
            return False
    return key.shape is not None and len(key.shape) >= 2


def _key_swapped(op, key, **_):
    rank = len(key.shape)
    return op.Transpose(key, perm=[*range(rank - 2), rank - 1, rank - 2])


def _rules() -> list:
    from onnxscript.rewriter import pattern

    return [
        pattern.RewriteRule(_erf_gelu_as_exported, _erf_gelu_as_fused, name="ErfGeluForOrtFusion"),
        pattern.RewriteRule(_linear_3d, _linear_as_gemm, _linear_3d_is_static, name="Linear3dAsGemm"),
        pattern.RewriteRule(_key_swapped_through_3d, _key_swapped, _key_swap_is_exact, name="KeySwapAsOneTranspose"),
    ]


# Applied by the export, before constant folding (the replacements add small Constant nodes): the
# written file is ONNX Runtime's form, the one Triton's ONNX Runtime backend loads as it is and
# TensorRT parses. OpenVINO and the dynamic quantizer take the linears back to their own spelling
# (``deploykit.graph.openvino``, ``deploykit.graph.dynamic_quantizer``).
ONNXRUNTIME = RuleSet("onnxruntime", _rules)
