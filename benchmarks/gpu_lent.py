"""Everything a lent GPU can check without TensorRT, in one prepared run, to one JSON report whose
first field is the device line.

The lent machine (the ``device`` tool: an H100 or H200, CUDA 13 driver, torch, Triton, no
TensorRT) runs the parts of the GPU path that are deploykit's own:

* ``sape2 kernels @ ...``: the SaPE² Triton bias kernel and fused attention against the float64
  reference (first batch element) and timed against the decomposed PyTorch reference with CUDA
  events (``sape2_gpu.bench``), ViT-B heads (12 × 64) at 224, 384 and 512 px, batch 8, and at 384
  px with tables sized for 2048 px, whose kernel needs more than 48 KiB of shared memory;
* ``goal: ...``: the bias kernel at least 5× faster than the reference at 384 px;
* ``sape2 plugin launch ...``: the kernel as the TensorRT plugin hands it over
  (``kernels.aot_kernel``: the plugin's own compile for this GPU's compute capability, PTX version
  capped at what the driver loads, parameters cut to the five TensorRT passes), loaded with
  ``cuModuleLoadData`` and launched with ``cuLaunchKernel`` with exactly those five parameters and
  the plugin's grid, block and shared memory, its output against the float64 reference. Above
  48 KiB the launch is tried first without the shared-memory opt-in (what it answers is recorded)
  and then with it. These run in a child process, so a faulting launch cannot poison the rest;
* ``encoding ... on cuda``: every encoding's trained zoo model through deploykit's torch runner on
  CUDA (fp32) against the float64 CPU reference on real inputs, at its own resolution and twice
  it, judged with validate's fp32 tolerance;
* ``profile torch cuda``: ``deploykit.profile`` of every encoding on a seeded ViT-B/16 in PyTorch on
  CUDA at 224, 384 and 512, batch 1 and 8: kernel p50, the positional step alone (CUDA events), ×APE.

Each check passes, fails (with the reason) or is skipped (with the reason); the report is
rewritten after every check, so a run stopped at its time limit still returns what it measured.
Exit code: 0 every check that ran passed, 1 a check failed, 2 no CUDA GPU is usable (said in one
``error:`` line) unless ``--dry-run``, which runs only the CPU half: the plugin's kernels compiled
for a Hopper stand-in target (parameters, shared memory of each shape) and the encodings' check in
fp32 on the CPU. The test suite runs the dry run (tests/test_gpu_lent.py).

    python benchmarks/gpu_lent.py --out benchmarks/results/gpu-lent.json     # on the GPU
    python benchmarks/gpu_lent.py --dry-run --out /tmp/gpu-lent.json          # anywhere

benchmarks/README.md gives the exact ``device`` call. deploykit need not be installed: the
script imports it from this checkout (the lent machine's Python has torch, Triton and onnx).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu-lent.json"
GOAL_SPEEDUP_AT_384 = 5.0  # issue 42: the bias kernel against the decomposed PyTorch reference, ViT-B heads


def use_checkout() -> str:
    """Import deploykit from this checkout when it is not installed, with ``plugins/`` as
    ``deploykit.plugins`` (the mapping pyproject's ``package-dir`` makes on install); says which."""
    source = "installed"
    if importlib.util.find_spec("deploykit") is None:
        sys.path.insert(0, str(ROOT))
        source = "this checkout, not installed"
    import deploykit

    if importlib.util.find_spec("deploykit.plugins") is None:
        spec = importlib.util.spec_from_file_location(
            "deploykit.plugins", ROOT / "plugins" / "__init__.py", submodule_search_locations=[str(ROOT / "plugins")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["deploykit.plugins"] = module
        spec.loader.exec_module(module)
        deploykit.plugins = module
    return source


DEPLOYKIT_SOURCE = use_checkout()

import torch  # noqa: E402
from checks import Checks, Failed  # noqa: E402

from deploykit._io import write_json_atomic  # noqa: E402
from deploykit.profile.environment import capture_environment, environment_line  # noqa: E402


@dataclass(frozen=True)
class KernelShape:
    """One SaPE² op instance: ViT-B heads, one class token, mode ``k``; ``npos_max`` entries per table."""

    label: str
    resolution: int
    npos_max: int
    batch: int = 8
    heads: int = 12
    head_dim: int = 64
    patch: int = 16
    prefix: int = 1

    @property
    def grid(self) -> tuple[int, int]:
        side = self.resolution // self.patch
        return side, side

    @property
    def tokens(self) -> int:
        return self.prefix + self.grid[0] * self.grid[1]

    def constants(self) -> dict:
        from deploykit.encodings.sape2 import MODES
        from deploykit.plugins.sape2.kernels import kernel_constants

        return kernel_constants(self.grid, self.prefix, self.head_dim, self.npos_max, self.head_dim**-0.5, MODES.index("k"))


SHAPES = (
    KernelShape("224", 224, 15),
    KernelShape("384", 384, 25),
    KernelShape("512", 512, 33),
    # A model whose tables reach 2048 px (grid 128), run at 384: in the hat form its kernel took
    # 73,728 bytes of shared memory, as ViT-S at 2048 px does; at a size the float64 reference checks.
    KernelShape("384, tables for 2048 px", 384, 129),
)
GOAL_SHAPE = SHAPES[1]
PROFILE_MODEL = "vit_base_patch16"
GROUPS = ("kernels", "launches", "encodings", "profile")
PROFILE_RESOLUTIONS = (224, 384, 512)


# ----------------------------------------------------------------------------------------------
# the CUDA driver API, as TensorRT's plugin launch uses it


class CudaDriver:
    """``libcuda`` through ctypes: load PTX, find its entry, launch it with an argument array."""

    MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self.lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        self.lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        self.lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self.check(self.lib.cuInit(0), "cuInit")

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(name))
        return name.value.decode() if name.value else f"CUresult {code}"

    def check(self, code: int, call: str) -> None:
        if code:
            raise Failed(f"{call} answered {self.error_name(code)}")

    def function(self, ptx: str, name: str) -> ctypes.c_void_p:
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), ptx.encode() + b"\0"), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(func), module, name.encode()), "cuModuleGetFunction")
        return func

    def allow_shared(self, func, nbytes: int) -> None:
        self.check(self.lib.cuFuncSetAttribute(func, self.MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes), "cuFuncSetAttribute")

    def launch(self, func, grid: tuple[int, int, int], block_x: int, shared: int, stream: int, pointers: list[int]) -> int:
        """``cuLaunchKernel`` with one device pointer per parameter; returns its CUresult."""
        values = (ctypes.c_void_p * len(pointers))(*pointers)
        size = ctypes.sizeof(ctypes.c_void_p)
        params = (ctypes.c_void_p * len(pointers))(*[ctypes.addressof(values) + i * size for i in range(len(pointers))])
        return self.lib.cuLaunchKernel(func, *grid, block_x, 1, 1, shared, stream, ctypes.addressof(params), None)


# ----------------------------------------------------------------------------------------------
# the checks


def _sape2_inputs(shape: KernelShape, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(shape.batch, shape.heads, shape.tokens, shape.head_dim, device="cuda", generator=gen) for _ in range(2))
    tx, ty = (torch.randn(shape.head_dim, shape.npos_max, device="cuda", generator=gen) for _ in range(2))
    return q.to(dtype), k.to(dtype), tx, ty


def _exact_bias(shape: KernelShape, q, k, tx, ty):
    """The float64 reference bias of the first batch element."""
    from deploykit.encodings.sape2 import sape2_bias_reference

    q1, k1 = (t[:1].double() for t in (q, k))
    return sape2_bias_reference(q1, k1, tx.double(), ty.double(), shape.grid, shape.head_dim**-0.5, "k", shape.prefix)


def kernel_check(shape: KernelShape, iters: int):
    def check():
        from sape2_gpu import bench

        result = bench(shape.resolution, shape.batch, iters, npos_max=shape.npos_max)
        # fp32 arithmetic inside both kernels (the interpreter tests' bounds, here on silicon)
        if not (result["triton_bias_rel_err_vs_float64"] <= 1e-5 and result["fused_attention_max_abs_err_vs_float64"] <= 1e-4):
            raise Failed("a SaPE² kernel disagrees with the float64 reference", result)
        return result

    return check


def goal_check(results: dict):
    def check():
        found = results.get(GOAL_SHAPE.label)
        if found is None:
            raise Failed(f"the {GOAL_SHAPE.label} px kernel check did not pass, so there is no speed to judge")
        speedup = found["speedup_triton_bias_over_reference"]
        details = {"speedup": speedup, "goal": GOAL_SPEEDUP_AT_384, "latency_ms_p50": found["latency_ms_p50"]}
        if speedup < GOAL_SPEEDUP_AT_384:
            raise Failed(f"the bias kernel is {speedup:.2f}x the reference at 384 px, below the {GOAL_SPEEDUP_AT_384:g}x goal", details)
        return details

    return check


def plugin_launch(shape: KernelShape, io_dtype: str, target, ptx_version: int | None):
    """The plugin's kernel for ``target`` (``kernels.AotKernel``) and what the report says of it."""
    from deploykit.plugins.sape2 import kernels
    from deploykit.plugins.sape2.trt_plugin import LAUNCH_ARGS

    kernel = kernels.aot_kernel(io_dtype, shape.constants(), target, ptx_version, LAUNCH_ARGS)
    header = {line.split()[0]: line.split()[1] for line in kernel.ptx.splitlines() if line.startswith((".version", ".target"))}
    details = {
        "io": io_dtype,
        "entry": kernel.name,
        "parameters": len(kernels.ptx_parameters(kernel.ptx, kernel.name)),
        "ptx_version": header.get(".version"),
        "ptx_target": header.get(".target"),
        "grid": [kernel.grid_x, kernel.grid_y, shape.batch * shape.heads],
        "block_x": kernel.block_x,
        "shared_mem": kernel.shared_mem,
    }
    return kernel, details


def plugin_launch_check(shape: KernelShape, io_dtype: str):
    def check():
        from deploykit.plugins.sape2 import kernels
        from deploykit.plugins.sape2.kernels import SHARED_MEM_OPT_IN, device_target, driver_ptx_version

        target = device_target()
        kernel, details = plugin_launch(shape, io_dtype, target, driver_ptx_version(target))
        driver = CudaDriver()
        func = driver.function(kernel.ptx, kernel.name)
        dtype = getattr(torch, io_dtype)
        q, k, tx, ty = _sape2_inputs(shape, dtype)
        out = torch.full((shape.batch, shape.heads, shape.tokens, shape.tokens), float("nan"), dtype=dtype, device="cuda")
        grid = tuple(details["grid"])
        pointers = [t.data_ptr() for t in (q, k, tx, ty, out)]
        stream = torch.cuda.current_stream().cuda_stream
        torch.cuda.synchronize()
        if kernel.shared_mem > SHARED_MEM_OPT_IN:
            code = driver.launch(func, grid, kernel.block_x, kernel.shared_mem, stream, pointers)
            torch.cuda.synchronize()
            details["launch_without_shared_opt_in"] = driver.error_name(code) if code else "CUDA_SUCCESS"
            driver.allow_shared(func, kernel.shared_mem)
        driver.check(driver.launch(func, grid, kernel.block_x, kernel.shared_mem, stream, pointers), "cuLaunchKernel")
        torch.cuda.synchronize()
        exact = _exact_bias(shape, q, k, tx, ty)
        details["rel_err_vs_float64"] = ((out[:1].double() - exact).abs().max() / exact.abs().max()).item()
        jit = kernels.sape2_bias_triton(q, k, tx, ty, shape.grid, shape.head_dim**-0.5, 1, shape.prefix)
        details["max_abs_vs_triton_launch"] = (out.double() - jit.double()).abs().max().item()
        details["nan_left"] = int(torch.isnan(out).sum())
        # fp32 arithmetic inside; fp16 output costs one rounding (2⁻¹¹ relative)
        bound = 2**-10 if io_dtype == "float16" else 1e-5
        if details["nan_left"] or not details["rel_err_vs_float64"] <= bound:
            raise Failed("the plugin's kernel, launched as TensorRT launches it, disagrees with the float64 reference", details)
        return details

    return check


def aot_compile_check(target_label: str = "sm_90 (a Hopper stand-in, no GPU needed)"):
    """CPU half of the launch checks: each shape's plugin kernel compiles for Hopper with exactly
    the launch's parameters, within the 48 KiB of shared memory a launch gets without opting in."""

    def check():
        from triton.backends.compiler import GPUTarget

        from deploykit.plugins.sape2.kernels import SHARED_MEM_OPT_IN
        from deploykit.plugins.sape2.trt_plugin import LAUNCH_ARGS

        rows = []
        for shape in SHAPES:
            _, details = plugin_launch(shape, "float32", GPUTarget("cuda", 90, 32), None)
            rows.append({"shape": shape.label, **details})
        wrong = [r["shape"] for r in rows if r["parameters"] != LAUNCH_ARGS]
        above = [r["shape"] for r in rows if r["shared_mem"] > SHARED_MEM_OPT_IN]
        if wrong or above:
            raise Failed(
                f"parameters other than {LAUNCH_ARGS}: {wrong}; above 48 KiB, which needs the launch to opt in: {above}", {"rows": rows}
            )
        return {"target": target_label, "rows": rows}

    return check


def encoding_check(encoding: str, device: str):
    """The zoo's trained model through the torch runner on ``device`` (fp32) against float64 on the CPU."""

    def check():
        from deploykit.backends import TorchRunner
        from deploykit.checks import Reference, judge
        from deploykit.export.precision import PLANS
        from deploykit.inputs.builtin import validation_inputs
        from deploykit.zoo.resolve import resolve_model

        model, _ = resolve_model(encoding=encoding)
        rows, failures = [], []
        for scale in (1, 2):
            shape = tuple(s * scale for s in model.default_shape)
            x = validation_inputs(model, shape, num_random=2, num_real=8)
            with TorchRunner(model, torch.float64) as reference:
                expected = reference.infer({"images": x})["logits"]
            with TorchRunner(model, torch.float32, device=device) as runner:
                got = runner.infer({"images": x})["logits"]
            result = judge(Reference.of_outputs(expected, 8), got, PLANS["fp32"].criteria).result
            row = {
                "shape": list(shape),
                **{k: result.metrics[k] for k in ("max_abs", "cosine", "top1_agreement")},
                "failures": list(result.failures),
            }
            rows.append(row)
            failures += [f"{shape[0]}x{shape[1]}: {f}" for f in result.failures]
        details = {"rows": rows, "tf32": _tf32_flags()}
        if failures:
            raise Failed("; ".join(failures), details)
        return details

    return check


def _tf32_flags() -> dict:
    return {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}


def profile_check(seconds: float):
    def check():
        from deploykit.encodings import list_encodings
        from deploykit.nn import create_model
        from deploykit.profile import profile
        from deploykit.profile.timing import Budget

        models = []
        for encoding in list_encodings():
            torch.manual_seed(0)
            models.append(create_model(PROFILE_MODEL, encoding=encoding).eval())
        report = profile(
            models,
            resolutions=[(r, r) for r in PROFILE_RESOLUTIONS],
            batches=[1, 8],
            backends=["torch"],
            device="cuda",
            end_to_end=False,
            validate_plans=False,
            budget=Budget(duration_s=seconds, rounds=2, warmup=3, min_iterations=6),
            label=PROFILE_MODEL,
        )
        keys = ("encoding", "resolution", "batch", "p50_ms", "min_ms", "n", "ratio_vs_ape", "pe_step_p50_ms", "pe_share", "provider")
        rows = [{k: r.get(k) for k in keys} for r in report.to_json()["records"]]
        return {
            "model": PROFILE_MODEL,
            "timer": "cuda_events for the positional step; wall clock with copies for the model",
            "records": rows,
        }

    return check


# ----------------------------------------------------------------------------------------------
# the run


def launch_worker_main(out: Path) -> int:
    """The plugin-launch checks, in a child process: a launch that faults poisons only this context."""
    checks = Checks(on_item=lambda items: write_json_atomic(out, items))
    torch.zeros(1, device="cuda")  # torch's primary context, current on this thread, is where the module loads
    for shape in SHAPES:
        checks.run(f"sape2 plugin launch @ {shape.label} fp32", plugin_launch_check(shape, "float32"))
    checks.run(f"sape2 plugin launch @ {GOAL_SHAPE.label} fp16", plugin_launch_check(GOAL_SHAPE, "float16"))
    write_json_atomic(out, checks.items)
    return 0


def run_launch_worker(timeout_s: float) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="gpu_lent_") as work:
        out = Path(work) / "launches.json"
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--launch-worker", str(out)], stdin=subprocess.DEVNULL, timeout=max(timeout_s, 1)
            )
            code = f"exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            code = f"ran past {timeout_s:.0f} s"
        items = json.loads(out.read_text()) if out.is_file() else []
        if len(items) < len(SHAPES) + 1:
            items.append(
                {"name": "sape2 plugin launches", "status": "failed", "reason": f"the launch worker {code} after {len(items)} check(s)"}
            )
        return items


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def gpu_problem() -> str | None:
    """Why no CUDA GPU can be used here, or None."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build: it cannot reach a GPU even where one is present"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--dry-run", action="store_true", help="the CPU half only: the plugin's compiles, the encodings on the CPU")
    parser.add_argument("--budget-s", type=float, default=420, help="checks still to start after this many seconds are skipped")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per kernel latency")
    parser.add_argument("--profile-seconds", type=float, default=0.5, help="profile's time per measurement")
    parser.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS), help="run only these groups of checks")
    parser.add_argument("--launch-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.launch_worker:
        return launch_worker_main(args.launch_worker)

    start = time.perf_counter()
    problem = gpu_problem()
    if problem and not args.dry_run:
        print(f"error: no GPU checks can run: {problem}; --dry-run runs the CPU half", file=sys.stderr)
        return 2
    device = torch.device("cpu" if problem else "cuda")
    environment = capture_environment(device)
    report = {
        "device": environment_line(environment),
        "command": "python benchmarks/gpu_lent.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv)),
        "dry_run": bool(problem),
        "deploykit": DEPLOYKIT_SOURCE,
        "triton": _version("triton"),
        "summary": {},
        "checks": [],
        "environment": environment,
        "wall_s": None,
    }

    def write(items: list[dict]) -> None:
        report["checks"], report["summary"] = items, checks.counts()
        report["wall_s"] = round(time.perf_counter() - start, 1)
        write_json_atomic(args.out, report)

    checks = Checks(deadline=start + args.budget_s, on_item=write)
    no_gpu = f"needs a CUDA GPU (dry run: {problem})" if problem else None
    if "kernels" in args.only or "launches" in args.only:
        checks.run("sape2 plugin kernels compile for Hopper with the launch's parameters", aot_compile_check())
    if "kernels" in args.only:
        speed = {}
        for shape in SHAPES:
            found = checks.run(f"sape2 kernels @ {shape.label}", kernel_check(shape, args.iters), skip=no_gpu)
            if found:
                speed[shape.label] = found
        checks.run(f"goal: bias kernel >= {GOAL_SPEEDUP_AT_384:g}x the reference @ {GOAL_SHAPE.label}", goal_check(speed), skip=no_gpu)
    if "launches" in args.only:
        if no_gpu or time.perf_counter() > checks.deadline:
            checks.run("sape2 plugin launches", None, skip=no_gpu)  # the deadline's reason where there is a GPU
        else:
            for item in run_launch_worker(checks.deadline - time.perf_counter()):
                checks.add(item)
    if "encodings" in args.only:
        from deploykit.encodings import list_encodings

        for encoding in list_encodings():
            checks.run(f"encoding {encoding} on {device.type} against float64", encoding_check(encoding, device.type))
    if "profile" in args.only:
        checks.run(f"profile torch cuda {PROFILE_MODEL}", profile_check(args.profile_seconds), skip=no_gpu)
    write(checks.items)
    counts = checks.counts()
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped in {report['wall_s']} s; wrote {args.out}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
