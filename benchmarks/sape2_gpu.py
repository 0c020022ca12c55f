"""SaPE² on an NVIDIA GPU: the Triton bias kernel and the fused attention against the decomposed
PyTorch reference, for ViT-B heads (12 × 64) at 224, 384 and 512 (patch 16, one class token).

Per resolution, after checking each kernel against the float64 reference:

* latency (CUDA events, median of ``--iters`` after warm-up) of
  ``reference_bias`` (``sape2_bias_reference`` in fp32), ``triton_bias`` (``kernels``),
  ``reference_attention`` (reference bias + SDPA) and ``fused_attention`` (``fused``);
* peak extra memory of each (``torch.cuda.max_memory_allocated`` above the inputs).

Goals (issue 5): bias kernel ≥ 5× faster than the reference at 384; the fused variant's extra
memory O(N) per head (i.e. no N×N tensor).

Usage: python benchmarks/sape2_gpu.py [--batch 8] [--iters 50] → benchmarks/results/sape2_gpu.json
Needs CUDA and Triton; not run in CI.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import deploykit
from deploykit._io import write_json_atomic
from deploykit.encodings.sape2 import MODES, sape2_bias_reference

RESULTS = Path(__file__).resolve().parent / "results" / "sape2_gpu.json"
HEADS, HEAD_DIM, PATCH, PREFIX = 12, 64, 16, 1


def cuda_time(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_extra_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench(resolution: int, batch: int, iters: int, npos_max: int | None = None) -> dict:
    """One resolution: errors against float64 (first batch element), CUDA-event latencies, peak
    extra memory. ``npos_max``: the tables' entries (None: the grid's own, ``max(grid) + 1``); a
    table sized for a larger resolution costs the kernel more shared memory at the same grid."""
    from deploykit.plugins.sape2.fused import sape2_attention_triton
    from deploykit.plugins.sape2.kernels import kernel_constants, sape2_bias_triton

    grid = (resolution // PATCH, resolution // PATCH)
    tokens = PREFIX + grid[0] * grid[1]
    npos = npos_max or max(grid) + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, HEADS, tokens, HEAD_DIM, device="cuda", generator=g) for _ in range(3))
    tx, ty = (torch.randn(HEAD_DIM, npos, device="cuda", generator=g) for _ in range(2))
    scale, mode = HEAD_DIM**-0.5, MODES.index("k")
    ref_bias = lambda: sape2_bias_reference(q, k, tx, ty, grid, scale, "k", PREFIX)
    tri_bias = lambda: sape2_bias_triton(q, k, tx, ty, grid, scale, mode, PREFIX)
    ref_attn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=ref_bias() * scale)
    fused = lambda: sape2_attention_triton(q, k, v, tx, ty, grid, scale, mode, PREFIX)
    with torch.no_grad():
        q1, k1, v1 = (t[:1].double() for t in (q, k, v))
        exact = sape2_bias_reference(q1, k1, tx.double(), ty.double(), grid, scale, "k", PREFIX)
        bias_err = (tri_bias()[:1].double() - exact).abs().max().item() / exact.abs().max().item()
        exact_attn = F.scaled_dot_product_attention(q1, k1, v1, attn_mask=exact * scale)
        attn_err = (fused()[:1].double() - exact_attn).abs().max().item()
        # The interpolation's two forms (kernels.py), each checked and timed: the default is one.
        forms = {}
        for name, gather in (("hat", False), ("gather", True)):
            form = lambda gather=gather: sape2_bias_triton(q, k, tx, ty, grid, scale, mode, PREFIX, gather)
            err = (form()[:1].double() - exact).abs().max().item() / exact.abs().max().item()
            forms[name] = {"bias_ms_p50": cuda_time(form, iters), "rel_err_vs_float64": err}
        timings = {
            name: cuda_time(fn, iters)
            for name, fn in [
                ("reference_bias", ref_bias),
                ("triton_bias", tri_bias),
                ("reference_attention", ref_attn),
                ("fused_attention", fused),
            ]
        }
        memory = {
            name: peak_extra_mib(fn)
            for name, fn in [
                ("reference_bias", ref_bias),
                ("triton_bias", tri_bias),
                ("reference_attention", ref_attn),
                ("fused_attention", fused),
            ]
        }
    return {
        "resolution": resolution,
        "grid": grid,
        "npos_max": npos,
        "tokens": tokens,
        "batch": batch,
        "triton_bias_rel_err_vs_float64": bias_err,
        "fused_attention_max_abs_err_vs_float64": attn_err,
        "latency_ms_p50": timings,
        "peak_extra_mib": memory,
        "default_form": "gather" if kernel_constants(grid, PREFIX, HEAD_DIM, npos, scale, mode)["GATHER"] else "hat",
        "forms": forms,
        "speedup_triton_bias_over_reference": timings["reference_bias"] / timings["triton_bias"],
        "speedup_fused_over_reference_attention": timings["reference_attention"] / timings["fused_attention"],
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
