"""The machine's fp32 GEMM throughput at a model's own GEMM shapes: the roofline a deployed
model is measured against.

Every distinct ``[m, k] @ [k, n]`` product of one forward (``deploykit.profile.gemm_shapes``:
patch embedding, qkv, q·kᵀ, attn·v, proj, fc1, fc2, head) is timed alone with PyTorch, with
numpy and with ONNX Runtime (a one-node MatMul graph, its right operand an initializer as model
weights are, so MLAS pre-packs it), best of the three per shape. The roofline is the model's
GEMM FLOPs divided by the summed time of its GEMMs run this way: what the model would take if
everything but its matrix products were free and every product ran as fast as the best library
runs it in isolation.

    python benchmarks/roofline.py --update benchmarks/results/cpu-full-vit_small_patch16.json

re-measures the roofline of every resolution × batch in a sweep file and refreshes its
``roofline_fraction`` fields (the sweep itself calls ``gemm_roofline``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from deploykit.profile import Budget, LatencyStats, denormals_flushed, gemm_shapes, measure

LIBRARIES = ("torch", "numpy", "onnxruntime")


def _ort_matmul(a: np.ndarray, b: np.ndarray):
    """A call running ``a @ b`` in ONNX Runtime with ``b`` as an initializer (2-D when unbatched)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from deploykit.runners.onnxrt import session_options

    if len(a) == 1:
        a, b = a[0], b[0]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])],
        "gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, list(a.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    feed = {"a": np.ascontiguousarray(a)}
    return lambda: session.run(None, feed)


def _gemm_seconds(count: int, m: int, k: int, n: int, budget: Budget) -> dict[str, float]:
    """p50 seconds of one (batched) product with each library."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(count, m, k, generator=gen), torch.randn(count, k, n, generator=gen)
    a_np, b_np = a.numpy(), b.numpy()
    out = torch.empty(count, m, n)
    out_np = np.empty((count, m, n), dtype=np.float32)

    def run_torch():
        with torch.inference_mode():
            torch.matmul(a, b, out=out)

    times = {}
    for name, fn in (("torch", run_torch), ("numpy", lambda: np.matmul(a_np, b_np, out=out_np)), ("onnxruntime", _ort_matmul(a_np, b_np))):
        times[name] = LatencyStats.from_ns(measure(fn, budget)).p50_ms / 1e3
    return times


def gemm_roofline(
    cfg, resolution: tuple[int, int], batch: int, budget: Budget = Budget(duration_s=0.2, warmup=2, min_iterations=3)
) -> dict:
    """Measured fp32 GEMM throughput at the model's shapes.

    Returns:
        ``gflop_per_s`` (the roofline, best library per shape), ``<library>_gflop_per_s`` for
        each of ``LIBRARIES`` alone, and ``shapes`` (distinct products with how often each
        occurs, its best GFLOP/s and which library gave it).
    """
    occurrences = Counter(gemm_shapes(cfg, resolution, batch))
    total_flops = sum(2 * c * m * k * n * times for (c, m, k, n), times in occurrences.items())
    seconds = dict.fromkeys(("best", *LIBRARIES), 0.0)
    shapes = []
    with denormals_flushed():
        for (c, m, k, n), times in occurrences.items():
            per_lib = _gemm_seconds(c, m, k, n, budget)
            best = min(per_lib.values())
            seconds["best"] += best * times
            for name in LIBRARIES:
                seconds[name] += per_lib[name] * times
            shapes.append(
                dict(
                    count=c,
                    m=m,
                    k=k,
                    n=n,
                    occurrences=times,
                    best_gflop_per_s=2 * c * m * k * n / best / 1e9,
                    best_library=min(per_lib, key=per_lib.get),
                )
            )
    return {
        "gflop_per_s": total_flops / seconds["best"] / 1e9,
        **{f"{name}_gflop_per_s": total_flops / seconds[name] / 1e9 for name in LIBRARIES},
        "shapes": shapes,
    }


def update_sweep(path: Path) -> dict:
    """Re-measure the roofline of every resolution × batch of a sweep file; refresh its fractions."""
    from deploykit._io import write_json_atomic
    from deploykit.inputs.resolutions import parse_resolution
    from deploykit.nn import create_model

    data = json.loads(path.read_text())
    cfg = create_model(data["model"]).cfg
    roofline = {}
    for key in sorted({f"{r['resolution']}/b{r['batch']}" for r in data["records"]}):
        resolution, batch = key.split("/b")
        print(f"GEMM roofline {key}", file=sys.stderr, flush=True)
        roofline[key] = gemm_roofline(cfg, parse_resolution(resolution), int(batch))
    for record in data["records"]:
        record["roofline_gflop_per_s"] = roofline[f"{record['resolution']}/b{record['batch']}"]["gflop_per_s"]
        record["roofline_fraction"] = record["achieved_gflop_per_s"] / record["roofline_gflop_per_s"]
    data["roofline"] = roofline
    data["roofline_command"] = f"python benchmarks/roofline.py --update {path}"
    write_json_atomic(path, data)
    return data


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", type=Path, nargs="+", required=True, help="sweep result files to refresh")
    for sweep_file in parser.parse_args().update:
        update_sweep(sweep_file)
        print(f"updated {sweep_file}", file=sys.stderr)
