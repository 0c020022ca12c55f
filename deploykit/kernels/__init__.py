"""deploykit's compiled kernels for the CPU runtimes: custom-op libraries built on this machine,
once, and given to the sessions that need them: ONNX Runtime's CPU provider (a custom-op library
in C) and OpenVINO's CPU plugin (an extension in C++ against the headers its wheel ships).

One op today: ``deploykit::SaPE2Distance`` (``sape2_distance.c``), SaPE²'s pairwise distances of
signatures, the part of ``deploykit::SaPE2Bias`` that plain ONNX ops compute as a chain of passes
over ``[B, h, T, T]`` (product, corrections, clamp, square root, sum: one op and one memory pass
at a time). A graph with ``SaPE2Bias`` nodes is split for it as TensorRT's plugin form is
(``deploykit.graph.plugin_nodes``): the signature stage stays the exported function's plain ONNX,
the distances run in the kernel, which writes each element once. The exported file is untouched:
any ONNX Runtime without deploykit runs the function body.

OpenVINO's extension computes the same kernel (``openvino_sape2.cpp``: an op with ``evaluate`` on
threads of its own, and its mapping from the ONNX frontend).

Each library is compiled with the system's compiler (``$CC``/``cc``, ``$CXX``/``c++`` for
OpenVINO's) for this CPU (``-march=native``) into a per-user cache keyed by the sources, the
compiler, the runtime's version and the CPU's flags, and checked against numpy on a small case
before a session uses it. Without a compiler, or where the check fails, ``compiled_library`` says
why and the runner keeps the function body.
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
OPENVINO_SOURCE = Path(__file__).with_name("openvino_sape2.cpp")
OPS = frozenset({("deploykit", "SaPE2Distance")})  # (domain, op type) the libraries compute
RUNTIMES = ("onnxruntime", "openvino")
# What loads a library: a runtime, or ctypes alone (``buffers``: the plain-buffer entries PyTorch's
# CPU op calls, in the ONNX Runtime library's file, checked without importing ONNX Runtime).
LOADERS = (*RUNTIMES, "buffers")
MIN_ORT = (1, 17)  # KernelContext_ParallelFor (OrtApi version 17)
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC")


@dataclass(frozen=True)
class CompiledLibrary:
    """The outcome of building the library: ``path`` when it is usable, else ``reason`` (one line)."""

    path: Path | None
    reason: str = ""


def cache_dir() -> Path:
    """Where built libraries are kept: ``$DEPLOYKIT_CACHE``, else ``$XDG_CACHE_HOME/deploykit``
    (``~/.cache/deploykit``), under ``cpu-kernels``; where that cannot be written (a read-only
    home), a folder of this user's in the temporary directory."""
    root = os.environ.get("DEPLOYKIT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deploykit"
    wanted = Path(root) / "cpu-kernels"
    try:
        wanted.mkdir(parents=True, exist_ok=True)
        if os.access(wanted, os.W_OK):
            return wanted
    except OSError:
        pass
    private = Path(tempfile.gettempdir()) / f"deploykit-{os.getuid()}"
    try:
        private.mkdir(mode=0o700, exist_ok=True)
        owned = private.stat()
    except OSError:
        return wanted  # the build fails there and says why
    # a library is loaded from here: only a folder of this user's that nobody else can write
    return private / "cpu-kernels" if owned.st_uid == os.getuid() and not owned.st_mode & 0o022 else wanted


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler(runtime: str = "onnxruntime") -> str | None:
    variable, default = ("CC", "cc") if runtime == "onnxruntime" else ("CXX", "c++")
    return shutil.which(os.environ.get(variable) or default)


def _openvino_paths() -> tuple[Path, list[Path]]:
    """OpenVINO's headers and the two libraries an extension links (the runtime, the ONNX frontend)."""
    import openvino

    root = Path(openvino.__file__).parent
    libs = [next(iter(sorted((root / "libs").glob(f"{name}.so*"))), None) for name in ("libopenvino", "libopenvino_onnx_frontend")]
    if not (root / "include" / "openvino" / "op" / "op.hpp").is_file() or None in libs:
        raise RuntimeError(f"the openvino package at {root} has no C++ headers or libraries to build an extension against")
    return root / "include", libs


def _command(runtime: str, compiler: str, out: Path) -> tuple[list[str], list[str]]:
    """The compile command for ``runtime``'s library, and what else its cache key depends on."""
    if runtime == "onnxruntime":
        return [compiler, *FLAGS, str(SOURCE), "-o", str(out), "-lm", "-lpthread"], [SOURCE.read_text()]
    import openvino

    include, libs = _openvino_paths()
    command = [compiler, "-std=c++17", *FLAGS, f"-I{include}", str(OPENVINO_SOURCE), "-x", "c", str(SOURCE), "-x", "none"]
    command += [*map(str, libs), f"-Wl,-rpath,{libs[0].parent}", "-lm", "-lpthread", "-o", str(out)]
    return command, [SOURCE.read_text(), OPENVINO_SOURCE.read_text(), openvino.get_version()]


def build(compiler: str, out_dir: Path, runtime: str = "onnxruntime") -> Path:
    """Compile ``runtime``'s library with ``compiler`` into ``out_dir`` (unless a build of the same
    sources, compiler, runtime and CPU is there) and return its path; written under a temporary
    name and renamed, so concurrent builds never see half a file.

    Raises:
        RuntimeError: the compiler failed (its first error line), or OpenVINO has no headers.
    """
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()[:1]
    _, inputs = _command(runtime, compiler, out_dir)
    key = hashlib.sha256("\0".join([runtime, *inputs, *version, " ".join(FLAGS), _cpu_flags()]).encode()).hexdigest()[:16]
    target = out_dir / f"libdeploykit_{runtime}_{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(_command(runtime, compiler, built)[0], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["no output"]
            raise RuntimeError(f"{Path(compiler).name} failed: {errors[0].strip()}")
        os.replace(built, target)
    return target


def torch_distances(zx, zy, num_prefix_tokens: int):
    """The kernel on CPU fp32 torch tensors (``Zx`` ``[..., N, W]``, ``Zy`` ``[..., N, H]``), on
    torch's intra-op thread count, into a new ``[..., P + N, P + N]`` tensor; None where the
    library does not build here (the caller computes the distances its own way)."""
    import torch

    library = compiled_library("buffers")
    if library.path is None:
        return None
    fn = _entry(str(library.path), "deploykit_sape2_distance_threads")
    zx, zy = zx.contiguous(), zy.contiguous()
    *lead, n, w = zx.shape
    t = num_prefix_tokens + n
    out = torch.empty(*lead, t, t, dtype=torch.float32)
    heads = int(np.prod(lead)) if lead else 1
    if fn(zx.data_ptr(), zy.data_ptr(), heads, n, w, zy.shape[-1], num_prefix_tokens, out.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError("SaPE2Distance: out of memory")
    return out


def torch_signatures(q, k, table_x, table_y, grid_h: int, grid_w: int, num_prefix_tokens: int, scale: float, mode: int):
    """SaPE²'s axis signatures in the kernel on CPU fp32 torch tensors (``q``, ``k`` ``[..., P + N,
    d]``, tables ``[d, M]``), on torch's intra-op thread count: ``Zx`` ``[..., N, W]`` and ``Zy``
    ``[..., N, H]``; None where the library does not build here."""
    import torch

    library = compiled_library("buffers")
    if library.path is None:
        return None
    fn = _signature_entry(str(library.path), threads=True)
    q, k, table_x, table_y = (t.contiguous() for t in (q, k, table_x, table_y))
    *lead, _, d = q.shape
    n = grid_h * grid_w
    zx, zy = torch.empty(*lead, n, grid_w), torch.empty(*lead, n, grid_h)
    heads = int(np.prod(lead)) if lead else 1
    pointers = (t.data_ptr() for t in (q, k, table_x, table_y))
    if fn(
        *pointers,
        heads,
        d,
        table_x.shape[-1],
        grid_h,
        grid_w,
        num_prefix_tokens,
        scale,
        mode,
        zx.data_ptr(),
        zy.data_ptr(),
        torch.get_num_threads(),
    ):
        raise MemoryError("SaPE2Signatures: out of memory")
    return zx, zy


@functools.cache
def _entry(library: str, name: str):
    """The library's plain-buffer entry ``name`` (``..._threads`` takes a thread count last), loaded once."""
    fn = getattr(ctypes.CDLL(library), name)
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5 + [ctypes.c_void_p] + ([ctypes.c_int] if name.endswith("_threads") else [])
    fn.restype = ctypes.c_int
    return fn


def distances(library: Path, zx: np.ndarray, zy: np.ndarray, num_prefix_tokens: int) -> np.ndarray:
    """The kernel on numpy arrays, on the calling thread (the library's plain-buffer entry):
    ``Zx`` ``[B, h, N, W]``, ``Zy`` ``[B, h, N, H]`` fp32 to ``[B, h, P + N, P + N]``."""
    fn = _entry(str(library), "deploykit_sape2_distance")
    zx, zy = (np.ascontiguousarray(z, dtype=np.float32) for z in (zx, zy))
    (b, h, n, w), rows = zx.shape, zy.shape[-1]
    if zy.shape[:3] != (b, h, n):
        raise ValueError(f"Zx {zx.shape} and Zy {zy.shape} disagree on [B, h, N]")
    t = num_prefix_tokens + n
    out = np.empty((b, h, t, t), np.float32)
    if fn(zx.ctypes.data, zy.ctypes.data, b * h, n, w, rows, num_prefix_tokens, out.ctypes.data) != 0:
        raise MemoryError("SaPE2Distance: out of memory")
    return out


CHECK_GRID = (2, 3, 1)  # grid_h, grid_w, prefix tokens of the check: non-square, one prefix token


def _check_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The check's signatures (two heads) and the float64 direct distances they must give."""
    grid_h, grid_w, prefix = CHECK_GRID
    rng = np.random.default_rng(0)
    zx = rng.standard_normal((1, 2, grid_h * grid_w, grid_w)).astype(np.float32)
    zy = rng.standard_normal((1, 2, grid_h * grid_w, grid_h)).astype(np.float32)
    want = np.zeros((1, 2, prefix + grid_h * grid_w, prefix + grid_h * grid_w))
    for z in (zx.astype(np.float64), zy.astype(np.float64)):
        want[:, :, prefix:, prefix:] += np.sqrt(((z[:, :, :, None, :] - z[:, :, None, :, :]) ** 2).sum(-1))
    return zx, zy, want


def _check_case(threads: int | None = None):
    """The check as a small SaPE2Distance graph, its inputs, and the distances it must give."""
    from onnx import TensorProto, helper

    grid_h, grid_w, prefix = CHECK_GRID
    zx, zy, want = _check_inputs()
    node = helper.make_node(
        "SaPE2Distance", ["zx", "zy"], ["d"], domain="deploykit", grid_h=grid_h, grid_w=grid_w, num_prefix_tokens=prefix
    )
    if threads is not None:  # OpenVINO's op: its share of the cores
        node.attribute.append(helper.make_attribute("threads", threads))
    graph = helper.make_graph(
        [node],
        "check",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape)) for n, v in (("zx", zx), ("zy", zy))],
        [helper.make_tensor_value_info("d", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("deploykit", 1)])
    return model.SerializeToString(), {"zx": zx, "zy": zy}, want


def _self_check(library: Path, runtime: str = "onnxruntime") -> str:
    """``""`` when the library loads into ``runtime`` (a runtime of ``LOADERS``) and its op equals
    numpy's direct distances on a small case; else why not."""
    if runtime == "buffers":
        zx, zy, want = _check_inputs()
        got = distances(library, zx, zy, CHECK_GRID[2])
        threaded = np.empty_like(got)
        fn = _entry(str(library), "deploykit_sape2_distance_threads")
        fn(
            zx.ctypes.data,
            zy.ctypes.data,
            zx.shape[0] * zx.shape[1],
            zx.shape[2],
            zx.shape[3],
            zy.shape[3],
            CHECK_GRID[2],
            threaded.ctypes.data,
            2,
        )
        same = np.array_equal(got, threaded)
        return (
            "" if same and np.allclose(got, want, rtol=1e-5, atol=1e-6) else "its plain-buffer entries disagree with numpy on a small case"
        )
    graph, feed, want = _check_case(None if runtime == "onnxruntime" else 2)
    if runtime == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.register_custom_ops_library(str(library))
        got = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"]).run(None, feed)[0]
        if not _signatures_agree(library, options):
            return "its SaPE2Signatures disagrees with its own plain-buffer entry on a small case"
    else:
        import openvino as ov

        core = ov.Core()
        core.add_extension(str(library))
        got = core.compile_model(core.read_model(graph, b""), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(feed)[0]
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
        return "its SaPE2Distance disagrees with numpy on a small case"
    return ""


def _signatures_agree(library: Path, options) -> bool:
    """Whether ONNX Runtime's ``SaPE2Signatures`` gives what the library's plain-buffer entry gives
    on a small case (the attribute and shape plumbing; the tests judge the arithmetic against
    float64 PyTorch)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    grid_h, grid_w, prefix = CHECK_GRID
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal((1, 2, prefix + grid_h * grid_w, 4)).astype(np.float32) for _ in range(2))
    tx, ty = (rng.standard_normal((4, 5)).astype(np.float32) for _ in range(2))
    attrs = {"grid_h": grid_h, "grid_w": grid_w, "num_prefix_tokens": prefix, "scale": 0.75, "mode": 2}
    node = helper.make_node("SaPE2Signatures", ["q", "k", "tx", "ty"], ["zx", "zy"], domain="deploykit", **attrs)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("q", "k", "tx", "ty")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("zx", "zy")]
    graph = helper.make_model(
        helper.make_graph([node], "check", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("deploykit", 1)],
    )
    zx, zy = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"q": q, "k": k, "tx": tx, "ty": ty}
    )
    want = signatures(library, q, k, tx, ty, grid_h, grid_w, prefix, attrs["scale"], attrs["mode"])
    return all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip((zx, zy), want, strict=True))


def signatures(library: Path, q: np.ndarray, k: np.ndarray, table_x: np.ndarray, table_y: np.ndarray, grid_h: int, grid_w: int,
               num_prefix_tokens: int, scale: float, mode: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """SaPE²'s axis signatures (Eq. 9-14) in the library's plain-buffer entry, on the calling thread:
    ``q``, ``k`` ``[B, h, P + N, d]`` and tables ``[d, M]`` fp32 to ``Zx`` ``[B, h, N, W]`` and ``Zy``
    ``[B, h, N, H]``; ``mode`` an index into SaPE²'s modes (q, k, k_swap)."""
    fn = _signature_entry(str(library))
    q, k, table_x, table_y = (np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, table_x, table_y))
    b, h, t, d = q.shape
    n = grid_h * grid_w
    if k.shape != q.shape or t != num_prefix_tokens + n or table_x.shape[0] != d or table_y.shape != table_x.shape:
        raise ValueError(f"q {q.shape}, k {k.shape}, tables {table_x.shape} {table_y.shape} do not fit a {grid_h}x{grid_w} grid")
    zx, zy = np.empty((b, h, n, grid_w), np.float32), np.empty((b, h, n, grid_h), np.float32)
    for i, j in np.ndindex(b, h):
        args = (q[i, j], k[i, j], table_x, table_y)
        if fn(
            *(a.ctypes.data for a in args),
            d,
            table_x.shape[1],
            grid_h,
            grid_w,
            num_prefix_tokens,
            scale,
            mode,
            zx[i, j].ctypes.data,
            zy[i, j].ctypes.data,
        ):
            raise MemoryError("SaPE2Signatures: out of memory")
    return zx, zy


@functools.cache
def _signature_entry(library: str, threads: bool = False):
    """The library's plain-buffer signatures entry: one (b, h) (``deploykit_sape2_signatures``), or
    ``bh`` of them on a given number of threads (``..._threads``)."""
    lib = ctypes.CDLL(library)
    if threads:
        fn = lib.deploykit_sape2_signatures_threads
        fn.argtypes = (
            [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
        )
    else:
        fn = lib.deploykit_sape2_signatures
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int64] + [ctypes.c_void_p] * 2
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def compiled_library(runtime: str = "onnxruntime") -> CompiledLibrary:
    """The library ``runtime`` (one of ``LOADERS``) loads, for this machine, built on first use
    (``build``) and checked (``_self_check``); once per process and loader."""
    if runtime not in LOADERS:
        raise ValueError(f"no compiled library for {runtime!r}: one of {', '.join(LOADERS)}")
    if runtime == "onnxruntime":
        import onnxruntime as ort

        version = tuple(int(p) for p in ort.__version__.split(".")[:2] if p.isdigit())
        if version < MIN_ORT:
            return CompiledLibrary(None, f"onnxruntime {ort.__version__} is older than {'.'.join(map(str, MIN_ORT))}")
    source = runtime if runtime in RUNTIMES else RUNTIMES[0]  # the buffers' entries are in ONNX Runtime's file
    compiler = _compiler(source)
    if compiler is None:
        name = (os.environ.get("CC") or "cc") if source == "onnxruntime" else (os.environ.get("CXX") or "c++")
        return CompiledLibrary(None, f"no {'C' if source == 'onnxruntime' else 'C++'} compiler ({name}) on PATH")
    try:
        path = build(compiler, cache_dir(), source)
        problem = _self_check(path, runtime)
    except (OSError, RuntimeError) as err:
        return CompiledLibrary(None, str(err).splitlines()[0])
    except Exception as err:  # the runtime refusing the library raises its own types (OpenVINO's first line names only its source file)
        return CompiledLibrary(None, f"{runtime} cannot use it: {' '.join(str(err).split())[:300]}")
    return CompiledLibrary(None, problem) if problem else CompiledLibrary(path)
