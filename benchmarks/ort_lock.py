"""Should ``Pipeline`` serialise ONNX Runtime calls? ``Pipeline.logits`` from N threads, one image
per call, with the runner behind the pipeline's per-runner lock (``OnnxrtRunner`` as it declares
itself) and with the same runner declared ``thread_safe`` (an ``InferenceSession`` is; calls then
run concurrently on ORT's shared thread pool). Interleaved rounds; prints the median throughput
and p50/p99 of each, and their ratio, per concurrency, and writes them to
``benchmarks/results/ort_lock.json`` with the machine's environment.

    .venv/bin/python benchmarks/ort_lock.py [--requests 96] [--rounds 3] [--depth 12] [--resolution 224]

The answer decides ``OnnxrtRunner.thread_safe``. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from deploykit._io import write_json_atomic
from deploykit.backends.environment import capture_environment
from deploykit.export import export
from deploykit.nn import create_model
from deploykit.runners.onnxrt import OnnxrtRunner
from deploykit.serve import Pipeline
from deploykit.serve.bench.loadgen import Concurrency

RESULTS = Path(__file__).parent / "results"


class ConcurrentOnnxrtRunner(OnnxrtRunner):
    """The same runner, declared safe for concurrent calls: the pipeline takes no lock for it."""

    thread_safe = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96, help="calls per level, round and variant")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--depth", type=int, default=12, help="ViT-Tiny/16 depth")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--output", type=Path, default=RESULTS / "ort_lock.json")
    args = parser.parse_args()
    result = {"command": "python benchmarks/ort_lock.py", "environment": capture_environment(torch.device("cpu")), "levels": []}

    torch.manual_seed(0)
    res = (args.resolution, args.resolution)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=args.depth, img_size=args.resolution).eval()
    inputs = np.random.default_rng(0).standard_normal((args.requests, 1, 3, *res), dtype=np.float32)
    factories = {"locked": OnnxrtRunner, "concurrent": ConcurrentOnnxrtRunner}
    with tempfile.TemporaryDirectory(prefix="ort_lock_") as work:
        export(model, [res], Path(work) / "export")
        pipes = {name: Pipeline(Path(work) / "export", backend=name, factories=factories) for name in factories}
        try:
            for concurrency in args.concurrency:
                stats = {name: [] for name in pipes}
                for _ in range(args.rounds):
                    for name, pipe in pipes.items():
                        Concurrency(concurrency).run(pipe.logits, inputs[: 2 * concurrency], "warm-up")  # untimed: pools settle
                        stats[name].append(Concurrency(concurrency).run(pipe.logits, inputs, "in-process"))
                median = {
                    name: {k: float(np.median([getattr(s, k) for s in runs])) for k in ("throughput_rps", "p50_ms", "p99_ms")}
                    for name, runs in stats.items()
                }
                ratio = median["concurrent"]["throughput_rps"] / median["locked"]["throughput_rps"]
                result["levels"].append({"concurrency": concurrency, **median, "concurrent_vs_locked_throughput": ratio})
                print(
                    f"c={concurrency:>2}  "
                    + "  |  ".join(
                        f"{name} {m['throughput_rps']:.1f} req/s p50 {m['p50_ms']:.1f} ms p99 {m['p99_ms']:.1f} ms"
                        for name, m in median.items()
                    )
                    + f"  |  concurrent/locked {ratio:.2f}",
                    flush=True,
                )
        finally:
            for pipe in pipes.values():
                pipe.close()
    print(f"wrote {write_json_atomic(args.output, result)}")


if __name__ == "__main__":
    main()
