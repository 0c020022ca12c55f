"""The dynamic quantizer's rule set: ONNX Runtime's ``quantize_dynamic`` quantizes ``MatMul``, not ``Gemm``."""

from __future__ import annotations

from collections.abc import Collection

from deploykit.graph.rules import RuleSet, optional_input, plain_gemm


def _gemm(op, a, weight):
    return op.Gemm(a, weight, optional_input("bias"), _outputs=["product"])


def _matmul_then_bias(op, a, weight, product, bias=None):
    # a @ W + b, the Gemm's own formula (no transposes, unit alpha and beta); the MatMul keeps the
    # Gemm's name, so the node selection made on the Gemm still names it.
    out = op.MatMul(a, weight)
    out.producer().name = product.producer().name
    if bias is None:
        return out
    out = op.Add(out, bias)
    out.producer().name = f"{product.producer().name}.bias"
    return out


def dynamic_quantizer_rules(nodes: Collection[str]) -> RuleSet:
    """The rule set respelling each plain ``Gemm`` named in ``nodes`` as ``MatMul`` + bias ``Add``."""

    def selected(context, product, **_) -> bool:
        return product.producer().name in nodes and plain_gemm(product.producer())

    def rules() -> list:
        from onnxscript.rewriter import pattern

        return [pattern.RewriteRule(_gemm, _matmul_then_bias, selected, name="GemmAsMatMulForDynamicQuantizer")]

    return RuleSet("dynamic quantizer", rules)
