"""TensorRT plugin ``deploykit::SaPE2Distance``: a quickly deployable plugin (``tensorrt.plugin``)
whose kernel is ``kernels.sape2_distance_kernel`` compiled ahead of time to PTX, so a built engine
runs without Python or Triton.

Why the plugin is the distance stage only: an AOT implementation hands TensorRT exactly one
kernel (``@trtp.aot_impl`` returns one kernel name, one PTX/CUBIN, one ``KernelLaunchParams`` and
scalar extra arguments; ``IPluginV3QuickAOTBuild.get_kernel`` returns one ``(name, code)``) and
has no workspace, so it cannot compute the signatures once in a first launch and read them in a
second. Recomputing them inside every output tile (the earlier form) costs 40-70 times their
arithmetic. So the graph TensorRT is given (``deploykit.graph.plugin_nodes``) keeps the signature
stage as plain ONNX ops, once per (image, head), and the plugin node reads ``Zx`` ``[B, h, N, W]``
and ``Zy`` ``[B, h, N, H]`` (fp32) and writes the ``[B, h, T, T]`` bias (fp32; a ``CastLike``
after it restores q's dtype).

``register()`` adds the plugin to TensorRT's registry (call it before parsing the ONNX model);
importing this module imports neither TensorRT nor Triton. The kernel is compiled when the engine
is built, for the GPU it is built on (its compute capability, as Triton's driver reports it) and
in a PTX version the installed driver loads; its parameter list is cut to, and checked against,
exactly what the plugin launch passes (``kernels.launchable_ptx``). The node's attributes (grid,
prefix tokens) are compile-time constants of the kernel, so the engine holds one PTX per SaPE²
node configuration; the batch dimension stays dynamic (grid z = B·h).
"""

from __future__ import annotations

import importlib

from deploykit._lazy import lazy_import

PLUGIN_ID = "deploykit::SaPE2Distance"
# What the launch passes: zx, zy (inputs), no extra scalars, the bias (output).
LAUNCH_ARGS = 3
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


def _define(trt, trtp) -> None:
    from deploykit.plugins.sape2 import kernels

    @trtp.register(PLUGIN_ID)
    def _describe(zx: trtp.TensorDesc, zy: trtp.TensorDesc, grid_h: int, grid_w: int, num_prefix_tokens: int) -> trtp.TensorDesc:
        # bias [B, h, T, T] fp32 from zx [B, h, N, W], T = P + N
        out = zx.like()
        out.shape_expr[2] = zx.shape_expr[2] + num_prefix_tokens
        out.shape_expr[3] = zx.shape_expr[2] + num_prefix_tokens
        return out

    @trtp.autotune(PLUGIN_ID)
    def _combinations(zx, zy, outputs):
        # The signatures and the distances stay fp32 whatever the plan's precision (spec §8.7).
        return [trtp.AutoTuneCombination("FP32, FP32, FP32", "LINEAR")]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(zx, zy, grid_h: int, grid_w: int, num_prefix_tokens: int, outputs, tactic):
        consts = kernels.kernel_constants((grid_h, grid_w), num_prefix_tokens)
        target = kernels.device_target()  # the GPU this engine is being built on
        kernel = kernels.aot_kernel("float32", consts, target, kernels.driver_ptx_version(target), LAUNCH_ARGS)
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y = kernel.grid_x, kernel.grid_y
        launch.grid_z = zx.shape_expr[0] * zx.shape_expr[1]  # B·h, B dynamic
        launch.block_x = kernel.block_x
        launch.shared_mem = kernel.shared_mem
        return kernel.name, kernel.ptx, launch, trtp.SymIntExprs(0)
