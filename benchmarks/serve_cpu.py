"""Served (Triton via ``deploykit serve``) vs in-process pipeline on CPU: throughput and p50/p99
latency at concurrency 1, 8 and 32, with dynamic batching, in one run. Writes
``benchmarks/results/serve_cpu.json`` with the goal's verdict (served >= 0.9x in-process
throughput at concurrency 8 and 32).

    .venv/bin/python benchmarks/serve_cpu.py [--requests 256] [--depth 12] [--resolution 224]

The model is ViT-Tiny/16 with a learned APE (seeded, untrained: timing does not depend on the
weights), exported to a temporary directory; the measurement is ``deploykit serve-bench``'s
(``deploykit.serve.bench``: Triton's ``perf_analyzer`` when it is installed, else our own
bounded loopback client). Run it on a quiet machine: both sides share its cores.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from deploykit._io import write_json_atomic
from deploykit.export import export
from deploykit.nn import create_model
from deploykit.profile.environment import environment_line
from deploykit.serve.bench import BenchOptions, bench_serving

RESULTS = Path(__file__).parent / "results"
GOAL = {"served_vs_in_process_throughput_at_least": 0.9, "at_concurrency": [8, 32]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256, help="requests per concurrency level and side")
    parser.add_argument("--depth", type=int, default=12, help="ViT-Tiny/16 depth (12 = the full model)")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--output", type=Path, default=RESULTS / "serve_cpu.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=args.depth, img_size=args.resolution).eval()
    res = (args.resolution, args.resolution)
    with tempfile.TemporaryDirectory(prefix="serve_cpu_") as work:
        export(model, [res], Path(work) / "export")
        report = bench_serving(Path(work) / "export", BenchOptions(requests=args.requests, resolution=res), progress=print)
    ratios = {level["concurrency"]: level["served_vs_in_process_throughput"] for level in report.levels}
    goal_met = all(ratios[c] >= GOAL["served_vs_in_process_throughput_at_least"] for c in GOAL["at_concurrency"] if c in ratios)
    result = {
        "environment_line": environment_line(report.environment),
        **report.to_json(),
        "goal": {**GOAL, "met": goal_met},
        "model": f"vit_tiny_patch16 depth {args.depth}, ape",
    }
    for level in report.levels:
        print(
            f"c={level['concurrency']:>2}  served/in-process throughput {level['served_vs_in_process_throughput']:.2f}  "
            f"p99 in-process {level['in_process']['p99_ms']:.2f} ms, served {level['served']['p99_ms']:.2f} ms"
        )
    print(f"goal (served >= 0.9x in-process at 8 and 32): {'met' if goal_met else 'not met'}")
    print(f"wrote {write_json_atomic(args.output, result)}")


if __name__ == "__main__":
    main()
