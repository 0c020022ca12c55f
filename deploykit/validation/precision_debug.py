"""Which products a cast plan (``fp16``) must keep in fp32 to pass validation: the smallest set
found, as Polygraphy's ``debug precision`` finds it, reported by module path and usable as
``--keep-float`` (``deploykit debug-precision``).

Each check writes the plan with a set of products (MatMul, Gemm, Conv) pinned to fp32
(``deploykit.graph.cast.CastPass``'s ``keep_fp32``) and judges it as ``validate`` does: ONNX Runtime on CPU
against the checkpoint's PyTorch model, on the validation inputs, with the plan's criteria.

1. **Bisection over graph order** (Polygraphy's): the shortest prefix of the products, in graph
   order, that passes when kept fp32: ``⌈log2 n⌉`` checks, given that more fp32 never hurts.
2. **Reduction**: each product of that prefix, last first, goes back to the plan's type if the
   plan still passes without it (one check each), so no product of the answer can be dropped alone.

``bf16`` is not debugged here: ONNX Runtime's CPU provider has no bf16 ``MatMul`` kernel.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto

from deploykit.errors import ConfigError, ExportError


@dataclass(frozen=True)
class PrecisionDebug:
    """What ``debug_precision`` found.

    Attributes:
        precision: the cast plan.
        resolution: the exported resolution checked.
        kept: the products to keep fp32, as ``module (onnx name)`` pairs, in graph order.
        patterns: one ``--keep-float`` pattern per product (its module path, or its ONNX name
            where the module has other products).
        checks: plan checks run.
        products: products the plan runs low.
    """

    precision: str
    resolution: tuple[int, ...]
    kept: tuple[tuple[str, str], ...]
    patterns: tuple[str, ...]
    checks: int
    products: int

    def keep_float_args(self) -> list[str]:
        return [arg for pattern in self.patterns for arg in ("--keep-float", pattern)]


def debug_precision(
    export_dir: str | os.PathLike,
    precision: str = "fp16",
    resolution: Sequence[int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> PrecisionDebug:
    """The smallest set of products ``precision`` must keep fp32 at ``resolution`` (default: the
    first exported) to pass its criteria against PyTorch (module docstring).

    Raises:
        ConfigError: not a cast plan, bf16, or a resolution not exported.
        ExportError: the plan fails even with every product fp32 (the cause lies outside them).
    """
    from deploykit.checks import check_runner
    from deploykit.export import names
    from deploykit.export.bundle import load_reference
    from deploykit.export.directory import ExportDir
    from deploykit.export.precision import check_precision
    from deploykit.graph.cast import LOW_PRECISION_OPS, CastPass
    from deploykit.inputs.builtin import VALIDATION_NOISE, VALIDATION_REAL
    from deploykit.runners.onnxrt import cpu_runner
    from deploykit.validation.run import References

    plan = check_precision(precision)
    if plan.low is None:
        raise ConfigError(f"debug-precision takes a cast plan (fp16); {precision} is not one")
    if plan.low == TensorProto.BFLOAT16:
        raise ConfigError("ONNX Runtime's CPU provider has no bf16 MatMul kernel: bf16 cannot be checked, so not debugged, here")
    directory = ExportDir(export_dir)
    manifest = directory.manifest()
    directory.check_reference(manifest)
    entry = manifest.graph(tuple(resolution), "fp32") if resolution else manifest.graphs_at("fp32")[0]
    fp32 = onnx.load(str(directory.graph(entry, manifest.encoding)))
    reference = References(VALIDATION_NOISE, VALIDATION_REAL).at(load_reference(Path(export_dir)), tuple(entry.resolution))
    low_nodes = CastPass(fp32, plan.low)._classify()
    products = [n.name for n in low_nodes if n.op_type in LOW_PRECISION_OPS]
    order = {n.name: k for k, n in enumerate(fp32.graph.node)}
    products.sort(key=order.get)
    checks = 0

    def passes(kept: Sequence[str]) -> bool:
        nonlocal checks
        checks += 1
        if progress:
            progress(f"check {checks}: {len(kept)} of {len(products)} products fp32")
        graph = CastPass(fp32, plan.low, keep_fp32=frozenset(kept)).rewrite()
        with cpu_runner(graph) as runner:
            return check_runner(runner, reference, plan, batch=4, exact=True).result.passed

    if passes([]):
        kept: list[str] = []
    elif not passes(products):
        raise ExportError(
            f"the {precision} plan at {'x'.join(map(str, entry.resolution))} fails even with every product fp32: "
            "what fails is outside the products (LayerNorm and Softmax are fp32 already)"
        )
    else:
        low, high = 0, len(products)  # products[:high] passes, products[:low] does not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if passes(products[:middle]) else (middle, high)
        kept = products[:high]
        for name in reversed(list(kept)):
            trial = [n for n in kept if n != name]
            if passes(trial):
                kept = trial
    modules = names.module_paths(fp32)
    per_module: dict[str, int] = {}
    for name in products:
        per_module[modules.get(name, "")] = per_module.get(modules.get(name, ""), 0) + 1
    patterns = tuple(modules[n] if modules.get(n) and per_module[modules[n]] == 1 else n for n in kept)
    return PrecisionDebug(precision, tuple(entry.resolution), tuple((modules.get(n, ""), n) for n in kept), patterns, checks, len(products))
