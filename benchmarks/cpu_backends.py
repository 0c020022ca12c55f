"""CPU backends side by side: ONNX Runtime and OpenVINO on deploykit's own graphs, in one interleaved run.

    python benchmarks/cpu_backends.py            # ViT-S/ViT-B × 224/384 × batch 1/8, and the default model at 384
    python benchmarks/cpu_backends.py --quick    # smoke: the default zoo model at 48, batch 1, a few calls

Lanes (every one on the same graph files, timed round by round so a load change hits all):
ORT ``fp32``, ``fp32-mha`` and ``int8``; OpenVINO ``f32`` (hint f32 on the fp32 graph),
``default`` (no hint: OpenVINO's own choice, bf16 on CPUs with AVX512-BF16/AMX, recorded as what
it resolved to: the anchor deploykit's plans are judged against) and ``int8`` (hint f32 on
deploykit's int8 Q/DQ graph); on a CPU with native bf16 also the ``openvino-bf16`` backend as
``profile`` and ``serve`` run it (hint bf16, the plan's fp32 nodes kept in f32) on the fp32 graph
and on the int8 graph (int8 products, bf16 float remainder). Seeded models: speed does
not depend on the weights, so calibration is short and no agreement target is set. Each lane's
cosine against the ORT fp32 output on the same inputs is recorded beside its p50.

Writes ``benchmarks/results/cpu-backends.json`` with the command, the environment (the CPU's
instruction sets and OpenVINO's capabilities) and one record per model × resolution × batch × lane,
then regenerates the README table (``make_readme.py``). ``--quick`` writes ``cpu-backends-quick.json``
and prints its table instead: a smoke run's numbers are not for the README (do not commit it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from deploykit._io import write_json_atomic
from deploykit.backends.environment import capture_environment
from deploykit.backends.openvino import OpenvinoBf16Runner, OpenvinoRunner, cpu_capabilities
from deploykit.backends.registry import available_backends
from deploykit.checks import row_cosines
from deploykit.errors import DeployKitError
from deploykit.export import onnx_from_model
from deploykit.export.bundle import planned_graphs
from deploykit.export.int8_static import CalibrationOptions
from deploykit.inputs.builtin import validation_inputs
from deploykit.nn import create_model, load_model
from deploykit.profile import Budget, LatencyStats, measure
from deploykit.runners.onnxrt import OnnxrtRunner
from deploykit.zoo.registry import DEFAULT_ZOO_MODEL, model_dir
from deploykit.zoo.resolve import resolve_model

RESULTS = Path(__file__).parent / "results"
SPEED_CALIBRATION = CalibrationOptions(samples=16, held_out=16, min_agreement=None)
# lane -> (runner factory, plan of the graph it runs)
LANES = {
    "ort fp32": (OnnxrtRunner, "fp32"),
    "ort fp32-mha": (OnnxrtRunner, "fp32-mha"),
    "ort int8": (OnnxrtRunner, "int8"),
    "openvino f32": (OpenvinoRunner, "fp32"),
    "openvino default": (lambda graph: OpenvinoRunner(graph, precision_hint=None), "fp32"),
    "openvino int8": (OpenvinoRunner, "int8"),
    "openvino-bf16 fp32": (OpenvinoBf16Runner, "fp32"),
    "openvino-bf16 int8": (OpenvinoBf16Runner, "int8"),
}


def usable_lanes(lanes: dict) -> dict:
    """The ``lanes`` (name -> (runner factory, plan)) whose backend, the name's first word, is
    usable here: ``openvino-bf16`` needs native bf16."""
    usable = available_backends()
    return {lane: spec for lane, spec in lanes.items() if lane.split()[0] in usable}


def lanes() -> dict:
    return usable_lanes(LANES)


def _command() -> str:
    return "python benchmarks/cpu_backends.py " + " ".join(map(shlex.quote, sys.argv[1:]))


def cells(quick: bool) -> list[tuple[str, object, int, list[int]]]:
    """``(label, model, resolution, batches)`` to measure."""
    if quick:
        return [(DEFAULT_ZOO_MODEL, load_model(model_dir(DEFAULT_ZOO_MODEL)), 48, [1])]
    torch.manual_seed(0)
    out = []
    for name in ("vit_small_patch16", "vit_base_patch16"):
        model = create_model(name, encoding="ape").eval()
        out += [(name, model, r, [1, 8]) for r in (224, 384)]
    # The default model (what `deploykit export` embeds) at 384: the README's `profile --resolution 384`.
    default, _ = resolve_model()
    return out + [(f"default ({DEFAULT_ZOO_MODEL})", default.eval(), 384, [1, 8])]


def graphs(model, resolution: int) -> dict[str, bytes]:
    """Plan -> serialized graph, each as ``export`` writes it."""
    fp32 = onnx_from_model(model, (resolution, resolution))
    plans = dict.fromkeys(plan for _, plan in lanes().values())
    return {p: g.SerializeToString() for p, g in planned_graphs(fp32, model, (resolution, resolution), plans, SPEED_CALIBRATION)}


def time_lanes(model, planned: dict[str, bytes], resolution: int, batch: int, budget: Budget, rounds: int) -> list[dict]:
    # Real images (the zoo's test split, or the bundled photos): seeded noise lies outside an int8
    # plan's calibrated ranges, so its cosine would say nothing about the plan.
    x = validation_inputs(model, (resolution, resolution), 0, batch)
    runners, plans, failed = {}, {}, []
    try:
        for lane, (factory, plan) in lanes().items():
            plans[lane] = plan
            runner = factory(planned[plan])
            try:  # a backend that cannot load a graph is a finding of the run, not its end
                runner.activate()
            except DeployKitError as err:
                print(f"  {lane}: {err}", flush=True)
                failed.append(dict(lane=lane, error=str(err)[:400]))
                continue
            runners[lane] = runner
        outputs = {lane: r.infer({"images": x})["logits"] for lane, r in runners.items()}
        samples = {lane: [] for lane in runners}
        for _ in range(rounds):
            for lane, runner in runners.items():
                samples[lane] += measure(lambda r=runner: r.infer({"images": x}), budget.per_round())
        stats = {lane: LatencyStats.from_ns(v, batch) for lane, v in samples.items()}
        base = stats["ort fp32"]
        return [
            dict(
                lane=lane,
                **stats[lane].to_dict(),
                ratio_vs_ort_fp32=stats[lane].p50_ms / base.p50_ms,
                min_ratio_vs_ort_fp32=stats[lane].min_ms / base.min_ms,
                cosine_vs_ort_fp32=float(row_cosines(outputs["ort fp32"].astype(np.float64), outputs[lane].astype(np.float64)).min()),
                provider=runners[lane].provider,
                plan=plans[lane],
                # OpenVINO: what it computes in and (bf16 hint) the encoding ops it ran below f32, and the
                # rest: with the plan, what profile's not_default_because reads
                **{
                    key: runners[lane].info.to_dict()[key]
                    for key in ("computes_in", "lowered_despite_mark", "lowered_elsewhere")
                    if key in runners[lane].info.to_dict()
                },
            )
            for lane in runners
        ] + failed
    finally:
        for runner in runners.values():
            if runner.is_active:
                runner.deactivate()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke: the default zoo model at 48, batch 1, a few calls")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per measurement")
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    budget = Budget(iterations=5, warmup=2, rounds=1) if args.quick else Budget(duration_s=args.duration, warmup=3, rounds=args.rounds)
    rounds = 1 if args.quick else args.rounds
    path = args.output_dir / f"cpu-backends{'-quick' if args.quick else ''}.json"
    environment = capture_environment(torch.device("cpu"))
    environment["openvino_capabilities"] = cpu_capabilities()
    result = {"command": _command(), "environment": environment, "records": [], "complete": False}
    start = time.perf_counter()
    with torch.inference_mode():
        for label, model, resolution, batches in cells(args.quick):
            planned = graphs(model, resolution)
            for batch in batches:
                rows = time_lanes(model, planned, resolution, batch, budget, rounds)
                result["records"] += [dict(model=label, resolution=resolution, batch=batch, **row) for row in rows]
                print(
                    f"{label} @ {resolution} b{batch}: "
                    + "  ".join(f"{r['lane']} {r['ratio_vs_ort_fp32']:.2f}" if "error" not in r else f"{r['lane']} failed" for r in rows),
                    flush=True,
                )
            result["load_average_end"] = list(os.getloadavg())
            write_json_atomic(path, result)  # after each cell: an interrupted run keeps what it measured
    result.update(complete=True, wall_s=round(time.perf_counter() - start))
    write_json_atomic(path, result)
    from make_readme import cpu_backends_table, write_readme  # benchmarks/ is on sys.path when run as a script

    if args.quick:  # a smoke run proves the script works; its numbers do not belong in the README
        print("\n".join(cpu_backends_table(result)))
    else:
        print(write_readme(args.output_dir, Path(__file__).with_name("README.md")), file=sys.stderr)


if __name__ == "__main__":
    main()
