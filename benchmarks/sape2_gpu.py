"""SaPE² on an NVIDIA GPU: the Triton bias kernels (signatures once, then distances) against the
decomposed PyTorch reference, for ViT-B heads (12 × 64) at 224, 384 and 512 (patch 16, one class
token).

Per resolution, after checking the kernels against the float64 reference:

* latency (CUDA events, median of ``--iters`` after warm-up) of ``reference_bias``
  (``sape2_bias_reference`` in fp32) and ``triton_bias`` (``kernels.sape2_bias_triton``);
* peak extra memory of each (``torch.cuda.max_memory_allocated`` above the inputs).

(The fused attention kernel once timed here was removed: nothing called it. ``gpu_lent.py`` times
the bias kernel against its arithmetic floor.)

Usage: python benchmarks/sape2_gpu.py [--batch 8] [--iters 50] → benchmarks/results/sape2_gpu.json
Needs CUDA and Triton; not run in CI.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import deploykit
from deploykit._io import write_json_atomic
from deploykit.encodings.sape2 import MODES, sape2_bias_reference

RESULTS = Path(__file__).resolve().parent / "results" / "sape2_gpu.json"
HEADS, HEAD_DIM, PATCH, PREFIX = 12, 64, 16, 1


def median_ms(fn, iters: int, device: str, warmup: int = 3, before=None) -> float:
    """Median time of ``fn`` in ms: CUDA events around the call on a GPU, the wall clock on the
    CPU; ``before`` (an L2 flush) runs before each call, outside the timed span."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def peak_extra_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench(resolution: int, batch: int, iters: int, npos_max: int | None = None) -> dict:
    """One resolution: the error against float64 (first batch element), CUDA-event latencies, peak
    extra memory. ``npos_max``: the tables' entries (None: the grid's own, ``max(grid) + 1``)."""
    from deploykit.plugins.sape2.kernels import sape2_bias_triton

    grid = (resolution // PATCH, resolution // PATCH)
    tokens = PREFIX + grid[0] * grid[1]
    npos = npos_max or max(grid) + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(batch, HEADS, tokens, HEAD_DIM, device="cuda", generator=g) for _ in range(2))
    tx, ty = (torch.randn(HEAD_DIM, npos, device="cuda", generator=g) for _ in range(2))
    scale, mode = HEAD_DIM**-0.5, MODES.index("k")
    ref_bias = lambda: sape2_bias_reference(q, k, tx, ty, grid, scale, "k", PREFIX)
    tri_bias = lambda: sape2_bias_triton(q, k, tx, ty, grid, scale, mode, PREFIX)
    with torch.no_grad():
        q1, k1 = (t[:1].double() for t in (q, k))
        exact = sape2_bias_reference(q1, k1, tx.double(), ty.double(), grid, scale, "k", PREFIX)
        bias_err = (tri_bias()[:1].double() - exact).abs().max().item() / exact.abs().max().item()
        timings = {name: median_ms(fn, iters, "cuda", warmup=5) for name, fn in [("reference_bias", ref_bias), ("triton_bias", tri_bias)]}
        memory = {name: peak_extra_mib(fn) for name, fn in [("reference_bias", ref_bias), ("triton_bias", tri_bias)]}
    return {
        "resolution": resolution,
        "grid": grid,
        "npos_max": npos,
        "tokens": tokens,
        "batch": batch,
        "triton_bias_rel_err_vs_float64": bias_err,
        "latency_ms_p50": timings,
        "peak_extra_mib": memory,
        "speedup_triton_bias_over_reference": timings["reference_bias"] / timings["triton_bias"],
        "bias_mib_if_materialised": batch * HEADS * tokens**2 * 4 / 2**20,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[224, 384, 512])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton

    props = torch.cuda.get_device_properties(0)
    report = {
        "benchmark": "sape2_gpu",
        "shape": f"ViT-B heads {HEADS}x{HEAD_DIM}, patch {PATCH}, {PREFIX} prefix token, mode k",
        "environment": {
            "gpu": props.name,
            "sm": f"{props.major}.{props.minor}",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
            "deploykit": deploykit.__version__,
        },
        "results": [bench(r, args.batch, args.iters) for r in args.resolutions],
    }
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
