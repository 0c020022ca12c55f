"""SaPE² Triton kernel: matches the float64 reference under the CPU interpreter, compiles to PTX
for sm_90 without a GPU; the TensorRT plugin module imports without TensorRT."""

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from deploykit.errors import MissingDependencyError

ROOT = Path(__file__).resolve().parents[3]  # the repository


@pytest.fixture(scope="module")
def interpreted():
    """The kernels run by Triton's interpreter in a fresh process (the flag is read at import)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_interpret_sape2.py"))], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bias_kernels_match_reference_under_interpreter(interpreted):
    cases = interpreted["bias"]
    assert len(cases) == 12 and {c["mode"] for c in cases} == {0, 1, 2}
    assert {c["head_dim"] for c in cases} >= {32, 80, 128}
    assert any(c["npos_max"] - 1 < max(c["grid"]) for c in cases)  # tables clamped
    assert any(c["grid"][0] != c["grid"][1] for c in cases) and any(c["grid"][0] == c["grid"][1] for c in cases)
    for case in cases:
        # fp32 arithmetic inside: fp16 I/O costs one rounding of the output (2⁻¹¹ relative)
        tol = (2**-10 if case["dtype"] == "torch.float16" else 1e-6) * case["max_ref"]
        assert case["max_err"] <= tol, case
        assert case["out_dtype"] == case["dtype"], case
        assert case["diag_zero"] and case["symmetric"] and case["prefix_zero"], case
        assert case["max_ref"] > 1, case  # std-1 inputs: a real signal
        # the signatures, computed once per (image, head), in fp32: [B, h, N, W] and [B, h, N, H]
        (h, w), n = case["grid"], case["grid"][0] * case["grid"][1]
        assert case["signature_shapes"] == [[2, 2, n, w], [2, 2, n, h]], case
        assert case["signature_err"] <= 1e-5 * case["signature_max"], case


def test_cuda_op_runs_the_kernel_for_fp32_and_the_reference_for_float64(interpreted):
    route = interpreted["cuda_op"]
    assert route["float32"]["kernel_calls"] == 1 and route["float32"]["out_dtype"] == "torch.float32"
    assert route["float32"]["max_err"] <= 1e-5
    assert route["float64"]["kernel_calls"] == 0 and route["float64"]["out_dtype"] == "torch.float64"
    assert route["float64"]["max_err"] <= 1e-12


def _assembles(ptx: str, target_arch: str, arch: int) -> subprocess.CompletedProcess:
    """Triton's own ptxas (it runs without a GPU) on the PTX as the plugin hands it to TensorRT."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:  # the PTX and cubin go with it
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        return subprocess.run(
            [get_ptxas(arch).path, f"--gpu-name={target_arch}", str(source), "-o", f"{source}.cubin"], capture_output=True, text=True
        )


@pytest.mark.parametrize(
    "io_dtype, capability, target_arch", [("float32", 80, "sm_80"), ("float16", 90, "sm_90a"), ("float32", 120, "sm_120a")]
)
def test_kernel_compiles_for_the_gpu_with_exactly_the_parameters_the_plugin_passes(io_dtype, capability, target_arch):
    """Triton 3.3+ appends hidden scratch pointers to every kernel's parameters; a TensorRT AOT
    launch passes inputs, extra scalars and outputs only (3 here: zx, zy, bias). The PTX handed to TensorRT
    declares exactly those, targets the GPU asked for, and still assembles."""
    from triton.backends.compiler import GPUTarget

    from deploykit.plugins.sape2.kernels import compile_kernel, kernel_constants, launchable_ptx, ptx_parameters
    from deploykit.plugins.sape2.trt_plugin import LAUNCH_ARGS

    compiled = compile_kernel(io_dtype, kernel_constants((14, 14), 1), GPUTarget("cuda", capability, 32))
    name = compiled.metadata.name
    assert len(ptx_parameters(compiled.asm["ptx"], name)) > LAUNCH_ARGS  # what Triton 3.6 writes: the hazard is real
    ptx = launchable_ptx(compiled, LAUNCH_ARGS)
    assert ptx_parameters(ptx, name) == [f"{name}_param_{i}" for i in range(LAUNCH_ARGS)]
    assert f".target {target_arch}\n" in ptx
    proc = _assembles(ptx, target_arch, capability)
    assert proc.returncode == 0, proc.stderr


def test_ptx_version_is_capped_at_what_the_driver_loads(monkeypatch):
    """Triton 3.6's ptxas writes PTX 8.7, which a CUDA 12.4 driver refuses; the plugin writes 8.4 there."""
    from triton.backends.compiler import GPUTarget

    from deploykit import _nvml
    from deploykit.plugins.sape2.kernels import compile_kernel, driver_ptx_version, kernel_constants, launchable_ptx

    target = GPUTarget("cuda", 90, 32)
    monkeypatch.setattr(_nvml, "cuda_driver_version", lambda: "12.4")
    assert driver_ptx_version(target) == 84
    monkeypatch.setattr(_nvml, "cuda_driver_version", lambda: "13.0")
    assert driver_ptx_version(target) == 87  # the driver takes more than this ptxas writes
    monkeypatch.setattr(_nvml, "cuda_driver_version", lambda: None)
    assert driver_ptx_version(target) is None  # no driver (building for another machine): Triton's own choice
    compiled = compile_kernel("float32", kernel_constants((4, 4), 1), target, ptx_version=84)
    ptx = launchable_ptx(compiled, 3)
    assert ".version 8.4\n" in ptx and _assembles(ptx, "sm_90a", 90).returncode == 0


def test_a_kernel_that_reads_a_parameter_the_launch_does_not_pass_is_refused():
    from types import SimpleNamespace

    from triton.backends.compiler import GPUTarget

    from deploykit.plugins.sape2.kernels import compile_kernel, kernel_constants, launchable_ptx

    compiled = compile_kernel("float32", kernel_constants((4, 4), 1), GPUTarget("cuda", 80, 32))
    name = compiled.metadata.name
    reads_scratch = compiled.asm["ptx"].replace("{", f"{{\n\tld.param.u64 %rd999, [{name}_param_3];", 1)
    edited = SimpleNamespace(asm={"ptx": reads_scratch}, metadata=compiled.metadata)
    with pytest.raises(ValueError, match=rf"{name} needs parameters beyond the 3 the plugin passes \({name}_param_3\)"):
        launchable_ptx(edited, 3)
    with pytest.raises(ValueError, match="takes 5 parameters, but the plugin passes 6"):
        launchable_ptx(compiled, 6)


def test_the_plugin_hash_follows_the_triton_that_compiles_its_kernel(monkeypatch):
    import importlib.metadata

    from deploykit.backends.plugins import Plugins

    before = Plugins.resolve(["sape2"]).sha256()
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "3.9.0" if dist == "triton" else real(dist))
    assert Plugins.resolve(["sape2"]).sha256() != before


def test_tensorrt_plugin_module_imports_without_tensorrt():
    module = importlib.import_module("deploykit.plugins.sape2.trt_plugin")
    assert module.PLUGIN_ID == "deploykit::SaPE2Distance"
    if importlib.util.find_spec("tensorrt") is None:
        with pytest.raises(MissingDependencyError, match=r"deploykit\[trt\]"):
            module.register()


def test_tensorrt_plugin_registers():
    pytest.importorskip("tensorrt", reason="TensorRT not installed (pip install 'deploykit[trt]'); needs an NVIDIA GPU machine")
    from deploykit.plugins.sape2.trt_plugin import register

    assert register() == "deploykit::SaPE2Distance"
    assert register() == "deploykit::SaPE2Distance"  # idempotent: a second trtp.register would raise


class _Expr:
    """A ``trtp.ShapeExpr`` as documented: build-time constant or symbolic, closed under ``*`` and ``+``."""

    def __init__(self, value=None, name=None):
        self.value, self.name = value, name

    @property
    def is_constant(self):
        return self.value is not None

    def constant_value(self):
        if self.value is None:
            raise RuntimeError("not a constant")
        return self.value

    def __mul__(self, other):
        if self.is_constant and other.is_constant:
            return _Expr(self.value * other.value)
        return _Expr(name=f"{self.name or self.value}*{other.name or other.value}")

    def __add__(self, other):
        other = other if isinstance(other, _Expr) else _Expr(other)
        if self.is_constant and other.is_constant:
            return _Expr(self.value + other.value)
        return _Expr(name=f"{self.name or self.value}+{other.name or other.value}")


class _Desc:
    def __init__(self, dtype, shape):
        self.dtype, self.shape_expr = dtype, list(shape)

    def like(self):
        return _Desc(self.dtype, self.shape_expr)


def _stand_in_tensorrt():
    """``tensorrt`` and ``tensorrt.plugin`` reduced to the documented calls the plugin makes;
    the decorators record the functions so the test can call them as TensorRT would.

    A stand-in because no real class exists here to autospec: ``tensorrt.plugin`` ships with full
    TensorRT only. tensorrt_lean carries a copy of it, but that copy imports ``tensorrt`` and
    needs builder types the lean runtime lacks (``TensorFormat``, ``ITensor``); TensorRT-RTX has
    no quickly deployable plugins (no ``IPluginV3QuickAOTBuild``)."""
    import types

    defined = {}
    trt = types.ModuleType("tensorrt")
    trt.float16, trt.float32 = "FP16", "FP32"
    trtp = types.ModuleType("tensorrt.plugin")
    for kind in ("register", "autotune", "aot_impl"):
        setattr(trtp, kind, lambda plugin_id, kind=kind: lambda fn: defined.setdefault((kind, plugin_id), fn))
    trtp.TensorDesc = _Desc
    trtp.AutoTuneCombination = lambda types_, layout: (types_, layout)
    trtp.KernelLaunchParams = types.SimpleNamespace
    trtp.SymIntExprs = lambda n: [None] * n
    trt.plugin = trtp
    return trt, trtp, defined


def test_plugin_aot_impl_compiles_the_node_kernel_through_the_documented_api(monkeypatch):
    from triton.backends.compiler import GPUTarget

    from deploykit.plugins.sape2 import kernels, trt_plugin

    # The GPU the engine is built on (an RTX 4090) and its driver (CUDA 12.4: PTX 8.4 at most).
    monkeypatch.setattr(kernels, "device_target", lambda: GPUTarget("cuda", 89, 32))
    monkeypatch.setattr(kernels, "driver_ptx_version", lambda target: 84)
    trt, trtp, defined = _stand_in_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(trt_plugin, "_registered", False)
    plugin = "deploykit::SaPE2Distance"
    assert trt_plugin.register() == plugin
    assert {kind for kind, pid in defined if pid == plugin} == {"register", "autotune", "aot_impl"}

    # zx [B, 6, 196, 14], zy [B, 6, 196, 14]: a 14x14 grid's signatures, one class token
    batch, heads, patches, side = _Expr(name="B"), _Expr(6), _Expr(196), _Expr(14)
    zx = _Desc(trt.float32, [batch, heads, patches, side])
    out = defined[("register", plugin)](zx, zx, 14, 14, 1)
    assert out.dtype == trt.float32 and out.shape_expr[:2] == [batch, heads]
    assert out.shape_expr[2].constant_value() == out.shape_expr[3].constant_value() == 197  # [B, h, T, T], T = P + N

    name, ptx, launch, extra = defined[("aot_impl", plugin)](zx, zx, 14, 14, 1, [out], 0)
    assert ".target sm_89\n" in ptx and ".version 8.4\n" in ptx
    assert kernels.ptx_parameters(ptx, name) == [f"{name}_param_{i}" for i in range(3)]  # zx, zy, bias
    assert launch.grid_x == launch.grid_y == 7  # ceil(197 / 32) token tiles
    assert launch.grid_z.name == "B*6" and launch.block_x % 32 == 0 and extra == []
    # the grid is compiled into the kernel: another grid, another PTX
    assert defined[("aot_impl", plugin)](zx, zx, 7, 28, 1, [out], 0)[1] != ptx


@pytest.mark.slow
@pytest.mark.parametrize("grid, prefix", [((14, 14), 1), ((24, 24), 1), ((32, 32), 0), ((16, 40), 1), ((128, 128), 1)])
def test_every_instance_fits_the_shared_memory_a_launch_gets_without_opting_in(grid, prefix):
    """A TensorRT AOT launch passes the kernel's shared-memory size but need not raise the function's
    48 KiB default first; on an H200 a 72 KiB instance launched without it was refused
    (benchmarks/results/gpu-lent.json). The distance kernel holds no table: every grid stays within 48 KiB."""
    from triton.backends.compiler import GPUTarget

    from deploykit.plugins.sape2.kernels import SHARED_MEM_OPT_IN, aot_kernel, kernel_constants
    from deploykit.plugins.sape2.trt_plugin import LAUNCH_ARGS

    kernel = aot_kernel("float32", kernel_constants(grid, prefix), GPUTarget("cuda", 90, 32), None, LAUNCH_ARGS)
    assert kernel.shared_mem <= SHARED_MEM_OPT_IN, (grid, kernel.shared_mem)
    tokens = prefix + grid[0] * grid[1]
    assert (kernel.grid_x, kernel.grid_y) == (-(-tokens // 32),) * 2


def test_the_kernel_build_says_in_one_line_what_this_host_lacks(monkeypatch):
    """Issue 54: without a CUDA torch Triton raised "0 active drivers", without a C compiler
    "Failed to find C compiler", both from deep inside the engine build."""
    import shutil

    import torch

    from deploykit.plugins.sape2 import kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MissingDependencyError) as err:
        kernels.device_target()
    assert str(err.value) == (
        f"the SaPE² plugin compiles its kernel when the engine is built and needs a CUDA build of torch that sees a GPU "
        f"(torch {torch.__version__} sees none)"
    )
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(MissingDependencyError, match=r"sees none\) and a C compiler \(gcc or clang on PATH, or CC\) for Triton's"):
        kernels.device_target()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernels.build_needs() == ["a C compiler (gcc or clang on PATH, or CC) for Triton's launcher stubs"]
