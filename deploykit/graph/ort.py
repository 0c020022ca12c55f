"""ONNX Runtime's rule set: 3-D linear layers as the 2-D ``Gemm`` its fusions want, applied at load.

ONNX Runtime fuses ``MatMul`` + bias ``Add`` into ``Gemm`` only for 2-D inputs; over [B, T, D] it
runs a GEMM and then a separate pass over the output for the bias. The rule flattens the batch and
token axes around one ``Gemm`` that applies the bias in its epilogue. No other runtime wants that
spelling (OpenVINO's low-precision passes and ONNX Runtime's dynamic quantizer both read the 3-D
``MatMul``), so the exported file keeps the canonical form (``deploykit.graph.canonical``) and
``prepare_for_onnxruntime`` applies this set in memory where ONNX Runtime is handed a graph: its
runners, and the file ``package triton`` writes for Triton's ONNX Runtime backend. The share of
kernel time before and after is in ONNX Runtime's profiler results
(``benchmarks/results/ort-op-profile-*.json``).
"""

from __future__ import annotations

import onnx

from deploykit.graph.rules import RuleSet


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
    # Flattening the batch and token axes is a free reshape (row-major, same elements).
    tokens, features = x.shape[1], x.shape[2]
    flat = op.Reshape(x, op.Constant(value_ints=[-1, features]))
    out = op.Gemm(flat, weight, bias)
    return op.Reshape(out, op.Constant(value_ints=[-1, tokens, weight.shape[1]]))


def _rules() -> list:
    from onnxscript.rewriter import pattern

    return [pattern.RewriteRule(_linear_3d, _linear_as_gemm, _linear_3d_is_static, name="Linear3dAsGemm")]


ONNXRUNTIME = RuleSet("onnxruntime", _rules)


def prepare_for_onnxruntime(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with ONNX Runtime's rule set applied, as a new graph; ``proto`` itself when no rule
    matched (then ONNX Runtime may read the file it came from)."""
    import onnx_ir as ir

    model = ir.from_proto(proto)
    return ir.to_proto(model) if ONNXRUNTIME.apply(model) else proto
