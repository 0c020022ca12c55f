"""deploykit's compiled kernels for ONNX Runtime's CPU provider: a custom-op library built from
C on this machine, once, and registered with the sessions that need it.

One op today: ``deploykit::SaPE2Distance`` (``sape2_distance.c``), SaPE²'s pairwise distances of
signatures, the part of ``deploykit::SaPE2Bias`` that plain ONNX ops compute as a chain of passes
over ``[B, h, T, T]`` (product, corrections, clamp, square root, sum: one op and one memory pass
at a time). A graph with ``SaPE2Bias`` nodes is split for it as TensorRT's plugin form is
(``deploykit.graph.plugin_nodes``): the signature stage stays the exported function's plain ONNX,
the distances run in the kernel, which writes each element once. The exported file is untouched:
any ONNX Runtime without deploykit runs the function body.

The library is compiled with the system's C compiler (``$CC``, else ``cc``) for this CPU
(``-march=native``) into a per-user cache keyed by the source, the compiler and the CPU's flags,
and checked against numpy on a small case before a session uses it. Without a compiler, or where
the check fails, ``compiled_library`` says why and the runner keeps the function body.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("sape2_distance.c")
OPS = frozenset({("deploykit", "SaPE2Distance")})  # (domain, op type) the library registers
MIN_ORT = (1, 17)  # KernelContext_ParallelFor (OrtApi version 17)
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC")


@dataclass(frozen=True)
class CompiledLibrary:
    """The outcome of building the library: ``path`` when it is usable, else ``reason`` (one line)."""

    path: Path | None
    reason: str = ""


def cache_dir() -> Path:
    """Where built libraries are kept: ``$DEPLOYKIT_CACHE``, else ``$XDG_CACHE_HOME/deploykit``
    (``~/.cache/deploykit``), under ``ort-kernels``."""
    root = os.environ.get("DEPLOYKIT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deploykit"
    return Path(root) / "ort-kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def build(compiler: str, out_dir: Path) -> Path:
    """Compile the library with ``compiler`` into ``out_dir`` (unless a build of the same source,
    compiler and CPU is there) and return its path; written under a temporary name and renamed, so
    concurrent builds never see half a file.

    Raises:
        RuntimeError: the compiler failed (its first error line).
    """
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *version, " ".join(FLAGS), _cpu_flags()]).encode()).hexdigest()[:16]
    target = out_dir / f"libdeploykit_ort_{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["no output"]
            raise RuntimeError(f"{Path(compiler).name} failed: {errors[0].strip()}")
        os.replace(built, target)
    return target


def distances(library: Path, zx: np.ndarray, zy: np.ndarray, num_prefix_tokens: int) -> np.ndarray:
    """The kernel on numpy arrays, on the calling thread (the library's plain-buffer entry):
    ``Zx`` ``[B, h, N, W]``, ``Zy`` ``[B, h, N, H]`` fp32 to ``[B, h, P + N, P + N]``."""
    fn = ctypes.CDLL(str(library)).deploykit_sape2_distance
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    zx, zy = (np.ascontiguousarray(z, dtype=np.float32) for z in (zx, zy))
    (b, h, n, w), rows = zx.shape, zy.shape[-1]
    if zy.shape[:3] != (b, h, n):
        raise ValueError(f"Zx {zx.shape} and Zy {zy.shape} disagree on [B, h, N]")
    t = num_prefix_tokens + n
    out = np.empty((b, h, t, t), np.float32)
    if fn(zx.ctypes.data, zy.ctypes.data, b * h, n, w, rows, num_prefix_tokens, out.ctypes.data) != 0:
        raise MemoryError("SaPE2Distance: out of memory")
    return out


def _self_check(library: Path) -> str:
    """``""`` when the library registers with this ONNX Runtime and its op equals numpy's direct
    distances on a small case (prefix token, non-square grid, two heads); else why not."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    grid_h, grid_w, prefix = 2, 3, 1
    rng = np.random.default_rng(0)
    zx = rng.standard_normal((1, 2, grid_h * grid_w, grid_w)).astype(np.float32)
    zy = rng.standard_normal((1, 2, grid_h * grid_w, grid_h)).astype(np.float32)
    node = helper.make_node(
        "SaPE2Distance", ["zx", "zy"], ["d"], domain="deploykit", grid_h=grid_h, grid_w=grid_w, num_prefix_tokens=prefix
    )
    graph = helper.make_graph(
        [node],
        "check",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape)) for n, v in (("zx", zx), ("zy", zy))],
        [helper.make_tensor_value_info("d", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("deploykit", 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    got = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, {"zx": zx, "zy": zy})[0]
    want = np.zeros_like(got, dtype=np.float64)
    for z in (zx.astype(np.float64), zy.astype(np.float64)):
        want[:, :, prefix:, prefix:] += np.sqrt(((z[:, :, :, None, :] - z[:, :, None, :, :]) ** 2).sum(-1))
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
        return "its SaPE2Distance disagrees with numpy on a small case"
    return ""


@functools.cache
def compiled_library() -> CompiledLibrary:
    """The library for this machine, built on first use (``build``) and checked (``_self_check``);
    once per process."""
    import onnxruntime as ort

    version = tuple(int(p) for p in ort.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_ORT:
        return CompiledLibrary(None, f"onnxruntime {ort.__version__} is older than {'.'.join(map(str, MIN_ORT))}")
    compiler = _compiler()
    if compiler is None:
        return CompiledLibrary(None, f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH")
    try:
        path = build(compiler, cache_dir())
        problem = _self_check(path)
    except (OSError, RuntimeError) as err:
        return CompiledLibrary(None, str(err).splitlines()[0])
    except Exception as err:  # ONNX Runtime refusing the library raises its own Fail type
        return CompiledLibrary(None, f"onnxruntime cannot use it: {str(err).splitlines()[0]}")
    return CompiledLibrary(None, problem) if problem else CompiledLibrary(path)
