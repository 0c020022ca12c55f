"""SaPE² Triton kernel: matches the float64 reference under the CPU interpreter, compiles to PTX
for sm_90 without a GPU; the TensorRT plugin module imports without TensorRT."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton not installed (pip install 'deploykit[triton]')")

from deploykit.errors import MissingDependencyError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreted():
    """The kernels run by Triton's interpreter in a fresh process (the flag is read at import)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_interpret_sape2.py"))], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bias_kernel_matches_reference_under_interpreter(interpreted):
    cases = interpreted["bias"]
    assert len(cases) == 9
    for case in cases:
        # fp32 arithmetic inside: fp16 I/O costs one rounding of the output (2⁻¹¹ relative)
        tol = (2**-10 if case["dtype"] == "torch.float16" else 1e-6) * case["max_ref"]
        assert case["max_err"] <= tol, case
        assert case["out_dtype"] == case["dtype"], case
        assert case["diag_zero"] and case["prefix_zero"], case
        assert case["max_ref"] > 1, case  # std-1 inputs: a real signal


def test_fused_attention_matches_reference_under_interpreter(interpreted):
    cases = interpreted["fused"]
    assert len(cases) == 2
    for case in cases:
        assert case["max_err"] <= 1e-5, case
        assert case["bias_max"] > 1 and case["spread"] > 0.1, case  # the bias changes the attention


def test_cuda_op_runs_the_kernel_for_fp32_and_the_reference_for_float64(interpreted):
    route = interpreted["cuda_op"]
    assert route["float32"]["kernel_calls"] == 1 and route["float32"]["out_dtype"] == "torch.float32"
    assert route["float32"]["max_err"] <= 1e-5
    assert route["float64"]["kernel_calls"] == 0 and route["float64"]["out_dtype"] == "torch.float64"
    assert route["float64"]["max_err"] <= 1e-12


@pytest.mark.parametrize("io_dtype", ["float32", "float16"])
def test_bias_kernel_compiles_to_sm90_ptx_without_a_gpu(io_dtype):
    from deploykit.plugins.sape2.kernels import compile_kernel, kernel_constants

    compiled = compile_kernel(io_dtype, "float32", kernel_constants((14, 14), 1, 64, 15, 0.125, 1))
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx and f".entry {compiled.metadata.name}(" in ptx
    version = next(line for line in ptx.splitlines() if line.startswith(".version"))
    assert tuple(int(v) for v in version.split()[1].split(".")) <= (8, 7)  # Triton 3.6's PTX ISA, CUDA 12.8 drivers
    assert compiled.metadata.num_warps >= 1


def test_tensorrt_plugin_module_imports_without_tensorrt():
    module = importlib.import_module("deploykit.plugins.sape2.trt_plugin")
    assert module.PLUGIN_ID == "deploykit::SaPE2Bias"
    if importlib.util.find_spec("tensorrt") is None:
        with pytest.raises(MissingDependencyError, match=r"deploykit\[trt\]"):
            module.register()


def test_tensorrt_plugin_registers():
    pytest.importorskip("tensorrt", reason="TensorRT not installed (pip install 'deploykit[trt]'); needs an NVIDIA GPU machine")
    from deploykit.plugins.sape2.trt_plugin import register

    assert register() == "deploykit::SaPE2Bias"
    assert register() == "deploykit::SaPE2Bias"  # idempotent: a second trtp.register would raise


class _Expr:
    """A ``trtp.ShapeExpr`` as documented: build-time constant or symbolic, closed under ``*``."""

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


class _Desc:
    def __init__(self, dtype, shape):
        self.dtype, self.shape_expr = dtype, list(shape)

    def like(self):
        return _Desc(self.dtype, self.shape_expr)


def _stand_in_tensorrt():
    """``tensorrt`` and ``tensorrt.plugin`` reduced to the documented calls the plugin makes;
    the decorators record the functions so the test can call them as TensorRT would."""
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
    from deploykit.plugins.sape2 import trt_plugin

    trt, trtp, defined = _stand_in_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(trt_plugin, "_registered", False)
    assert trt_plugin.register() == "deploykit::SaPE2Bias"
    plugin = "deploykit::SaPE2Bias"
    assert {kind for kind, pid in defined if pid == plugin} == {"register", "autotune", "aot_impl"}

    batch, heads, tokens, head_dim = _Expr(name="B"), _Expr(6), _Expr(197), _Expr(64)
    q = _Desc(trt.float16, [batch, heads, tokens, head_dim])
    table = _Desc(trt.float32, [_Expr(64), _Expr(15)])
    out = defined[("register", plugin)](q, q, table, table, 14, 14, 1, 0.125, 1)
    assert out.shape_expr[3] is tokens and out.shape_expr[2] is tokens  # [B, h, T, T]

    name, ptx, launch, extra = defined[("aot_impl", plugin)](q, q, table, table, 14, 14, 1, 0.125, 1, [out], 0)
    assert f".entry {name}(" in ptx and ".target sm_90" in ptx
    assert launch.grid_x == launch.grid_y == 7  # ceil(197 / 32) token tiles
    assert launch.grid_z.name == "B*6" and launch.block_x % 32 == 0 and extra == []
    # fp16 I/O compiles a different kernel from fp32 I/O (the tables stay fp32)
    q32 = _Desc(trt.float32, [batch, heads, tokens, head_dim])
    assert defined[("aot_impl", plugin)](q32, q32, table, table, 14, 14, 1, 0.125, 1, [out], 0)[1] != ptx

    dynamic = _Desc(trt.float16, [batch, heads, tokens, _Expr(name="d")])
    with pytest.raises(ValueError, match="static head dim"):
        defined[("aot_impl", plugin)](dynamic, dynamic, table, table, 14, 14, 1, 0.125, 1, [out], 0)
