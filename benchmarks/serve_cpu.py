"""Served (``deploykit serve``) vs in-process pipeline on CPU, measured as Triton's
``perf_analyzer`` and NVIDIA's AIPerf measure a server, with issue 43's goals judged in one run:

* ONNX Runtime plan, with ``--ort-streams`` streams on both sides (a lone call on a session of
  all the cores, a merged batch spread over the streams: ``StreamScheduler``): throughput and
  p50/p99 at concurrency 1, 8 and 32 (closed loop) and at request rates (open loop, Poisson,
  seeded), Triton's per-model statistics per level, the largest rate whose p99 stays within
  ``--p99-ms`` on each side;
* OpenVINO plan: served throughput at concurrency 32 against OpenVINO's own ``benchmark_app
  -hint throughput`` on the same ``.onnx`` at the same batch (one image per request), in the
  served plan's precision (f32) and, for the record, under benchmark_app's default precision.

Goals: served >= 0.9x in-process throughput at concurrency 8 and 32; served p50 at concurrency 1
within 1.3x in-process p50; served OpenVINO >= 0.8x benchmark_app's throughput. The ONNX Runtime
concurrency levels run on ``--repeats`` fresh servers and their goals take the median: a slower
spell of a shared machine during one side of one level moves a single ratio by a tenth.

    .venv/bin/python benchmarks/serve_cpu.py [--requests 256] [--depth 12] [--resolution 224]
    .venv/bin/python benchmarks/serve_cpu.py --requests 32 --depth 2 --output /tmp/serve_cpu.json   # a quick check

Writes ``--output`` (``benchmarks/results/serve_cpu.json``), AIPerf's files per side and level
beside it (``serve_cpu_aiperf/``) and the throughput-latency plot (``serve_cpu.png``). The model
is ViT-Tiny/16 with a learned APE (seeded, untrained: timing does not depend on the weights),
exported to a temporary directory. Run it on a quiet machine: both sides share its cores.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from deploykit._io import write_json_atomic
from deploykit.backends.environment import environment_line
from deploykit.export import export
from deploykit.export.manifest import Manifest
from deploykit.nn import create_model
from deploykit.runners.streams import machine_streams
from deploykit.serve.bench import BenchOptions, BenchReport, bench_serving
from deploykit.serve.bench.aiperf import write_aiperf
from deploykit.serve.bench.plot import plot_bench

RESULTS = Path(__file__).parent / "results"
THROUGHPUT_LINE = re.compile(r"Throughput:\s+([0-9.]+)\s+FPS")
STREAMS_LINE = re.compile(r"NUM_STREAMS:\s+(\d+)")
PRECISION_LINE = re.compile(r"INFERENCE_PRECISION_HINT:\s+<Type: '(\w+)'>")


@dataclass(frozen=True)
class Goal:
    """One of issue 43's bars: ``ratio`` (the median of ``runs``, one per fresh server) against
    ``bar`` (``at_least`` or at most)."""

    name: str
    ratio: float | None
    bar: float
    at_least: bool = True
    runs: tuple[float, ...] = ()

    @property
    def met(self) -> bool:
        return self.ratio is not None and (self.ratio >= self.bar if self.at_least else self.ratio <= self.bar)

    def to_json(self) -> dict:
        return {**asdict(self), "met": self.met}


@dataclass(frozen=True)
class BenchmarkApp:
    """What OpenVINO's ``benchmark_app`` measured on one graph file."""

    precision_asked: str | None
    precision: str | None
    streams: int | None
    throughput_fps: float
    command: str


def run_benchmark_app(onnx: Path, batch: int, res: tuple[int, int], seconds: int, precision: str | None) -> BenchmarkApp:
    """``benchmark_app -hint throughput`` (async requests over its own streams) on ``onnx`` at
    ``[batch, 3, H, W]``; its printed throughput is images per second."""
    executable = Path(sys.executable).with_name("benchmark_app")  # installed with the openvino package
    command = [str(executable), "-m", str(onnx), "-d", "CPU", "-hint", "throughput", "-t", str(seconds)]
    command += ["-shape", f"[{batch},3,{res[0]},{res[1]}]"]
    if precision:
        command += ["-infer_precision", precision]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout
    streams, resolved = STREAMS_LINE.search(out), PRECISION_LINE.search(out)
    return BenchmarkApp(
        precision_asked=precision,
        precision=resolved and resolved.group(1),
        streams=streams and int(streams.group(1)),
        throughput_fps=float(THROUGHPUT_LINE.search(out).group(1)),
        command=" ".join(command[1:]),
    )


def _level(report: BenchReport, concurrency: int):
    return next((level for level in report.levels if getattr(level.load, "requests_in_flight", None) == concurrency), None)


def _median_goal(name: str, runs: list[float | None], bar: float, at_least: bool = True) -> Goal:
    measured = tuple(r for r in runs if r is not None)
    return Goal(name, statistics.median(measured) if measured else None, bar, at_least, measured)


def goals(orts: list[BenchReport], openvino: BenchReport, app_f32: BenchmarkApp) -> list[Goal]:
    """Issue 43's goals, each a ratio measured in this run: the ONNX Runtime ones the median over
    ``orts`` (one report per fresh server, each level's sides taking turns)."""
    out = []
    for c in (8, 32):
        runs = [level and level.served_vs_in_process for level in (_level(ort, c) for ort in orts)]
        out.append(_median_goal(f"served >= 0.9x in-process throughput at concurrency {c}", runs, 0.9))
    ones = [_level(ort, 1) for ort in orts]
    runs = [one and one.served.p50_ms / one.in_process.p50_ms for one in ones]
    out.append(_median_goal("served p50 <= 1.3x in-process p50 at concurrency 1", runs, 1.3, False))
    served_ov = openvino.levels[-1].served.throughput_rps
    out.append(
        Goal("served OpenVINO >= 0.8x benchmark_app -hint throughput (f32, same file, same batch)", served_ov / app_f32.throughput_fps, 0.8)
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256, help="requests per level and side")
    parser.add_argument("--depth", type=int, default=12, help="ViT-Tiny/16 depth (12 = the full model)")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--rates", default="25,50,100", help="open-loop levels, requests/s")
    parser.add_argument("--p99-ms", type=float, default=100.0, help="the p99 search's limit")
    parser.add_argument(
        "--ort-streams", type=int, default=machine_streams(), help="the ONNX Runtime plan's inference streams, both sides (1: one session)"
    )
    parser.add_argument(
        "--openvino-streams", type=int, default=machine_streams(), help="the OpenVINO plan's inference streams (throughput mode)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="fresh servers the ONNX Runtime concurrency levels run on (goals: the median)"
    )
    parser.add_argument("--app-seconds", type=int, default=15, help="benchmark_app's run, per precision")
    parser.add_argument("--output", type=Path, default=RESULTS / "serve_cpu.json")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=args.depth, img_size=args.resolution).eval()
    res = (args.resolution, args.resolution)
    rates = tuple(float(r) for r in args.rates.split(",") if r)
    with tempfile.TemporaryDirectory(prefix="serve_cpu_") as work:
        export_dir = Path(work) / "export"
        export(model, [res], export_dir)
        onnx = export_dir / Manifest.read(export_dir).graph(res).file
        ort_options = BenchOptions(requests=args.requests, resolution=res, rates=rates, p99_ms=args.p99_ms, streams=args.ort_streams)
        ort = bench_serving(export_dir, ort_options, print)
        # a slower spell of a shared machine can hit one side of one level: the concurrency levels
        # again on fresh servers, the goals judged on the median
        again = replace(ort_options, rates=(), p99_ms=None)
        repeats = [bench_serving(export_dir, again, print) for _ in range(args.repeats - 1)]
        print(f"OpenVINO plan with {args.openvino_streams} inference streams, concurrency 8 and 32", flush=True)
        ov_options = BenchOptions(
            concurrency=(8, 32), requests=args.requests, resolution=res, backend="openvino", streams=args.openvino_streams
        )
        openvino = bench_serving(export_dir, ov_options, print)
        apps = [run_benchmark_app(onnx, 1, res, args.app_seconds, precision) for precision in ("f32", None)]
    verdicts = goals([ort, *repeats], openvino, apps[0])
    result = {
        "environment_line": environment_line(ort.environment),
        **ort.to_json(),
        "openvino": {**openvino.to_json(), "benchmark_app": [asdict(app) for app in apps]},
        "goals": [g.to_json() for g in verdicts],
        "repeats": [
            [
                {
                    "concurrency": c,
                    "served_vs_in_process_throughput": level.served_vs_in_process,
                    "in_process_p50_ms": level.in_process.p50_ms,
                    "served_p50_ms": level.served.p50_ms,
                }
                for c in ort_options.concurrency
                if (level := _level(report, c))
            ]
            for report in repeats
        ],
        "model": f"vit_tiny_patch16 depth {args.depth}, ape, {args.resolution} px",
    }
    for report in (ort, openvino):
        for level in report.levels:
            print(
                f"{report.settings['backend']:>8} {level.load.label()}: served/in-process throughput {level.served_vs_in_process:.2f}, "
                f"p50 in-process {level.in_process.p50_ms:.2f} ms, served {level.served.p50_ms:.2f} ms"
            )
    for app in apps:
        print(f"benchmark_app -hint throughput ({app.precision}, {app.streams} streams): {app.throughput_fps:.1f} images/s")
    for goal in verdicts:
        runs = f" (runs: {', '.join(f'{r:.2f}' for r in goal.runs)})" if len(goal.runs) > 1 else ""
        print(f"{'✓' if goal.met else '✗'} {goal.name}: {'–' if goal.ratio is None else f'{goal.ratio:.2f}'}{runs}")
    print(f"wrote {write_json_atomic(args.output, result)}")
    print(f"wrote {write_aiperf(ort, args.output.with_name(args.output.stem + '_aiperf'))}")
    print(f"wrote {plot_bench(ort, args.output.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
