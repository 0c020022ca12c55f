"""What ONNX Runtime's streams with a wide session (``deploykit.runners.streams.StreamScheduler``)
give a served CPU plan, against one session of all the cores (``streams=1``), under the loads one
Triton instance sees:

* ``lone image``: one caller, batch 1, back to back (a request alone at concurrency 1): ms per call;
* ``merged batch of 16``: one caller, batch 16 (what the dynamic batcher hands the instance at
  concurrency 32): images/s;
* ``batches of 1 and 7 in turn``: one caller (the batcher's pattern at concurrency 8, where the
  first request of a round runs alone): images/s;
* ``32 callers, one image each``: the in-process pipeline at concurrency 32: images/s.

Variants: ``one session`` (``streams=1``), ``streams + wide`` (``streams=machine_streams()``, as
served), and ``streams + wide, spinning`` (the same, the wide session's threads left spinning after
each call: what ``session.force_spinning_stop`` removes). Each variant runs in a process of its own
per round (ONNX Runtime's thread pools of two runners in one process contend), rounds interleaved.

    .venv/bin/python benchmarks/stream_spread.py [--rounds 3] [--seconds 3] [--depth 12] [--resolution 224]

Writes ``benchmarks/results/stream-spread.json`` (``--quick``: ``stream-spread-quick.json``, one
short round). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from results_file import write_results  # benchmarks/ is on sys.path when run as a script

from deploykit.runners.streams import machine_streams

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("one session", "streams + wide", "streams + wide, spinning")
LOADS = ("lone image ms", "merged batch of 16 images/s", "batches of 1 and 7 in turn images/s", "32 callers images/s")


def _images_per_s(call, images_per_call: int, seconds: float, callers: int = 1) -> float:
    deadline, counts = time.perf_counter() + seconds, [0] * callers

    def loop(slot: int) -> None:
        while time.perf_counter() < deadline:
            counts[slot] += call()

    start = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(callers)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return sum(counts) * images_per_call / (time.perf_counter() - start)


def child(variant: str, graph: str, seconds: float, res: tuple[int, int]) -> dict:
    """One variant's loads in this process."""
    from deploykit.runners import onnxrt

    if variant.endswith("spinning"):
        onnxrt.wide_session_options = onnxrt.session_options  # the wide session as any other
    runner = onnxrt.OnnxrtRunner(graph, streams=1 if variant == "one session" else machine_streams())
    rng = np.random.default_rng(0)
    one, seven, sixteen = (rng.standard_normal((n, 3, *res), dtype=np.float32) for n in (1, 7, 16))
    with runner:
        for x in (one, seven, sixteen):
            runner.infer({"images": x})  # first-call allocations
        lone = _images_per_s(lambda: runner.infer({"images": one}) and 1, 1, seconds)
        return {
            LOADS[0]: 1e3 / lone,
            LOADS[1]: _images_per_s(lambda: runner.infer({"images": sixteen}) and 1, 16, seconds),
            LOADS[2]: _images_per_s(lambda: (runner.infer({"images": one}), runner.infer({"images": seven})) and 1, 8, seconds),
            LOADS[3]: _images_per_s(lambda: runner.infer({"images": one}) and 1, 1, seconds, callers=32),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per load, variant and round")
    parser.add_argument("--depth", type=int, default=12, help="ViT-Tiny/16 depth")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--quick", action="store_true", help="one round of 0.5 s per load, written beside as -quick")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "GRAPH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    res = (args.resolution, args.resolution)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.seconds, res)))
        return
    if args.quick:
        args.rounds, args.seconds = 1, 0.5

    def measured() -> dict:
        import torch

        from deploykit.export import export
        from deploykit.export.manifest import Manifest
        from deploykit.nn import create_model

        torch.manual_seed(0)
        model = create_model("vit_tiny_patch16", encoding="ape", depth=args.depth, img_size=args.resolution).eval()
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        with tempfile.TemporaryDirectory(prefix="stream_spread_") as work:
            export(model, [res], Path(work))
            graph = str(Path(work) / Manifest.read(Path(work)).graph(res).file)
            for r in range(args.rounds):
                for variant in VARIANTS:  # interleaved: a load change hits every variant alike
                    command = [sys.executable, __file__, "--child", variant, graph, "--seconds", str(args.seconds)]
                    command += ["--resolution", str(args.resolution)]
                    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                    runs[variant].append(json.loads(out.strip().splitlines()[-1]))
                    print(f"round {r + 1} {variant}: {runs[variant][-1]}", flush=True)
        medians = {v: {load: statistics.median(run[load] for run in runs[v]) for load in LOADS} for v in VARIANTS}
        base = medians["one session"]
        ratios = {
            v: {load: (base[load] / m[load] if load.endswith("ms") else m[load] / base[load]) for load, _ in m.items()}
            for v, m in medians.items()
            if v != "one session"
        }
        for v, r in ratios.items():
            print(f"{v} against one session (>1: better): " + ", ".join(f"{load} {x:.2f}" for load, x in r.items()))
        return {
            "model": f"vit_tiny_patch16 depth {args.depth}, ape, {args.resolution} px, ONNX Runtime fp32",
            "streams": machine_streams(),
            "rounds": args.rounds,
            "seconds_per_load": args.seconds,
            "medians": medians,
            "against_one_session": ratios,
            "runs": runs,
        }

    write_results(__file__, None, RESULTS, args.quick, measured)


if __name__ == "__main__":
    main()
