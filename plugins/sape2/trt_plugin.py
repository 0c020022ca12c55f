"""TensorRT plugin ``deploykit::SaPE2Bias``: a quickly deployable plugin (``tensorrt.plugin``) whose
kernel is ``kernels.sape2_bias_kernel`` compiled ahead of time to PTX, so a built engine runs
without Python or Triton.

``register()`` adds the plugin to TensorRT's registry (call it before parsing the ONNX model);
importing this module imports neither TensorRT nor Triton. TensorRT's ONNX parser uses it only
for nodes that carry ``plugin_namespace`` and have no model-local function to inline instead:
``deploykit build`` hands the parser the graph marked so (``deploykit.export.plugin_nodes``).

The kernel is compiled when the engine is built, for the GPU it is built on (its compute
capability, as Triton's driver reports it) and in a PTX version the installed driver loads; its
parameter list is cut to, and checked against, exactly what the plugin launch passes
(``kernels.launchable_ptx``). The node's attributes (grid, prefix tokens, gate scale, mode) are
compile-time constants of the kernel, so the engine holds one PTX per SaPE² node configuration;
the batch dimension stays dynamic (grid z = B·h).
"""

from __future__ import annotations

import importlib

from deploykit._lazy import lazy_import

PLUGIN_ID = "deploykit::SaPE2Bias"
# What the launch passes: q, k, table_x, table_y (inputs), no extra scalars, the bias (output).
LAUNCH_ARGS = 5
_registered = False


def register() -> str:
    """Register the plugin with TensorRT (idempotent) and return its id.

    Raises:
        MissingDependencyError: TensorRT (``deploykit[trt]``) or Triton (``deploykit[triton]``)
            is not installed.
    """
    global _registered
    if _registered:
        return PLUGIN_ID
    trt = lazy_import("tensorrt", extra="trt")
    lazy_import("triton")
    trtp = importlib.import_module("tensorrt.plugin")
    _define(trt, trtp)
    _registered = True
    return PLUGIN_ID


def _build_constant(expr, what: str) -> int:
    """The value of a ``trtp.ShapeExpr`` that must be fixed when the engine is built (it is a
    compile-time constant of the kernel)."""
    if not expr.is_constant:
        raise ValueError(f"SaPE2Bias needs a static {what} to compile its kernel; the exported graph has one")
    return int(expr.constant_value())


def _define(trt, trtp) -> None:
    from deploykit.plugins.sape2 import kernels

    @trtp.register(PLUGIN_ID)
    def _describe(
        q: trtp.TensorDesc,
        k: trtp.TensorDesc,
        table_x: trtp.TensorDesc,
        table_y: trtp.TensorDesc,
        grid_h: int,
        grid_w: int,
        num_prefix_tokens: int,
        scale: float,
        mode: int,
    ) -> trtp.TensorDesc:
        # bias [B, h, T, T] in q's dtype, from q [B, h, T, d]
        out = q.like()
        out.shape_expr[3] = q.shape_expr[2]
        return out

    @trtp.autotune(PLUGIN_ID)
    def _combinations(q, k, table_x, table_y, outputs):
        # q, k and the output share fp32 or fp16; tables stay fp32 (design: never fp16 tables).
        return [trtp.AutoTuneCombination("FP32|FP16, FP32|FP16, FP32, FP32, FP32|FP16", "LINEAR")]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(q, k, table_x, table_y, grid_h: int, grid_w: int, num_prefix_tokens: int, scale: float, mode: int, outputs, tactic):
        io = "float16" if q.dtype == trt.float16 else "float32"
        head_dim, npos_max = _build_constant(q.shape_expr[3], "head dim"), _build_constant(table_x.shape_expr[1], "table size")
        consts = kernels.kernel_constants((grid_h, grid_w), num_prefix_tokens, head_dim, npos_max, scale, mode)
        target = kernels.device_target()  # the GPU this engine is being built on
        kernel = kernels.aot_kernel(io, consts, target, kernels.driver_ptx_version(target), LAUNCH_ARGS)
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y = kernel.grid_x, kernel.grid_y
        launch.grid_z = q.shape_expr[0] * q.shape_expr[1]  # B·h, B dynamic
        launch.block_x = kernel.block_x
        launch.shared_mem = kernel.shared_mem
        return kernel.name, kernel.ptx, launch, trtp.SymIntExprs(0)
