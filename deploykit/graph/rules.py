"""A named rule set (onnxscript pattern rules) and the small reads its rules share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RuleSet:
    """A runtime's preferred spelling: pattern rules applied in place to an ``onnx_ir`` model.

    Args:
        name: the runtime (or tool) the spelling is for.
        rules: builds the ``onnxscript.rewriter.pattern.RewriteRule`` list; called on first use,
            since onnxscript's rewriter costs about a second to import.
    """

    name: str
    rules: Callable[[], Sequence]

    def apply(self, model) -> int:
        """Rewrite ``model`` (``onnx_ir.Model``) in place; return how many places changed."""
        rules = list(self.rules())
        if not rules:
            return 0
        from onnxscript.rewriter import pattern

        return pattern.RewriteRuleSet(rules).apply_to_model(model)


def constant_ints(value) -> list[int] | None:
    """The integers an ``onnx_ir`` value holds when it is a constant, else None."""
    if value is None or value.const_value is None:
        return None
    return [int(v) for v in value.const_value.numpy().reshape(-1)]


def optional_input(name: str):
    """A pattern variable that also matches an omitted trailing input (then bound to None)."""
    from onnxscript.rewriter import pattern

    return pattern.Var(name, can_match_none=True)


def plain_gemm(node) -> bool:
    """Whether an ``onnx_ir`` Gemm node computes a plain ``a @ b + c``: no transposes, unit alpha and beta."""
    attrs = {name: attr.value for name, attr in node.attributes.items()}
    return not attrs.get("transA", 0) and not attrs.get("transB", 0) and attrs.get("alpha", 1.0) == attrs.get("beta", 1.0) == 1.0
