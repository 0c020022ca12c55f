"""The canonical rule set: the exported file's own spelling, for every runtime.

Each rule computes the same values to the bit and only respells what the exporter writes op by op:
GELU as ``(x · 0.5) · (1 + erf(x/√2))``, the form ONNX Runtime's GeluFusion matches, and k's last
two axes swapped by one ``Transpose`` instead of a flattening reshape through shapes read at run
time. The export applies it before constant folding (the replacements add small ``Constant``
nodes); what one runtime alone prefers is that runtime's rule set, applied when it loads the graph
(``deploykit.graph``). The share of kernel time these ops take in ONNX Runtime is in its profiler
results (``benchmarks/results/ort-op-profile-*.json``).
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
        pattern.RewriteRule(_erf_gelu_as_exported, _erf_gelu_as_fused, name="ErfGeluAsFusable"),
        pattern.RewriteRule(_key_swapped_through_3d, _key_swapped, _key_swap_is_exact, name="KeySwapAsOneTranspose"),
    ]


CANONICAL = RuleSet("canonical", _rules)
