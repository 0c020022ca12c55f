"""The machine's fp32 GEMM throughput at a model's own GEMM shapes: the roofline a deployed
model is measured against.

Every distinct ``[m, k] @ [k, n]`` product of one forward (``deploykit.profile.gemm_shapes``:
patch embedding, qkv, q·kᵀ, attn·v, proj, fc1, fc2, head) is timed alone with PyTorch and with
numpy, best of the two per shape. The roofline is the model's GEMM FLOPs divided by the summed
time of its GEMMs run this way: what the model would take if everything but its matrix products
were free and every product ran as fast as the best library runs it in isolation.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from deploykit.profile import Budget, LatencyStats, flush_denormal, gemm_shapes, measure


def _gemm_seconds(count: int, m: int, k: int, n: int, budget: Budget) -> dict[str, float]:
    """p50 seconds of one (batched) product with torch and with numpy."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(count, m, k, generator=gen), torch.randn(count, k, n, generator=gen)
    a_np, b_np = a.numpy(), b.numpy()
    out = torch.empty(count, m, n)
    out_np = np.empty((count, m, n), dtype=np.float32)

    def run_torch():
        with torch.inference_mode():
            torch.matmul(a, b, out=out)

    times = {}
    for name, fn in (("torch", run_torch), ("numpy", lambda: np.matmul(a_np, b_np, out=out_np))):
        times[name] = LatencyStats.from_ns(measure(fn, budget)).p50_ms / 1e3
    return times


def gemm_roofline(cfg, resolution: tuple[int, int], batch: int, budget: Budget = Budget(duration_s=0.2, warmup=2, min_iterations=3)) -> dict:
    """Measured fp32 GEMM throughput at the model's shapes.

    Returns:
        ``gflop_per_s`` (the roofline, best library per shape), ``torch_gflop_per_s`` and
        ``numpy_gflop_per_s`` (each library alone), and ``shapes`` (distinct products with how
        often each occurs and its best GFLOP/s).
    """
    occurrences = Counter(gemm_shapes(cfg, resolution, batch))
    total_flops = sum(2 * c * m * k * n * times for (c, m, k, n), times in occurrences.items())
    seconds = {"best": 0.0, "torch": 0.0, "numpy": 0.0}
    shapes = []
    with flush_denormal():
        for (c, m, k, n), times in occurrences.items():
            per_lib = _gemm_seconds(c, m, k, n, budget)
            best = min(per_lib.values())
            seconds["best"] += best * times
            seconds["torch"] += per_lib["torch"] * times
            seconds["numpy"] += per_lib["numpy"] * times
            shapes.append(dict(count=c, m=m, k=k, n=n, occurrences=times, best_gflop_per_s=2 * c * m * k * n / best / 1e9,
                               best_library=min(per_lib, key=per_lib.get)))  # fmt: skip
    return {
        "gflop_per_s": total_flops / seconds["best"] / 1e9,
        "torch_gflop_per_s": total_flops / seconds["torch"] / 1e9,
        "numpy_gflop_per_s": total_flops / seconds["numpy"] / 1e9,
        "shapes": shapes,
    }
