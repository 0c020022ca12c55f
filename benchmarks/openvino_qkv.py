"""What handing OpenVINO each attention's qkv as three products changes, against the packed form.

    python benchmarks/openvino_qkv.py            # seeded ViT-S/16 at 224 and 384 (batch 8), the default model at 384 (batch 1)
    python benchmarks/openvino_qkv.py --quick    # smoke: the default zoo model at 48, batch 1, fp32, a few calls

deploykit's graphs compute qkv as one product, reshaped to ``[B, N, 3, h, d]`` and permuted to
``[3, B, h, N, d]``; OpenVINO runs that permute on its own. ``openvino_source`` hands OpenVINO
three products instead (``deploykit.graph.openvino.THREE_PRODUCTS``), whose per-tensor transposes it folds into its
attention kernel. Two variants of every OpenVINO lane (f32 hint, OpenVINO's default, bf16 hint)
on the same plan, the same real inputs, interleaved round by round: ``three products`` (the
runner as it is) and ``packed`` (the same runner with the rewrite switched off). Recorded: each
variant's p50 and their ratio in the same run, and the largest difference between their outputs
(0 under the f32 hint: the same products).

Writes ``benchmarks/results/openvino-qkv.json`` (``openvino-qkv-quick.json`` with ``--quick``),
with the CPU's instruction sets.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from results_file import write_results

import deploykit.graph.openvino as openvino_rules
from deploykit.backends.openvino import OpenvinoBf16Runner, OpenvinoRunner
from deploykit.backends.registry import available_backends
from deploykit.export import onnx_from_model
from deploykit.export.bundle import planned_graphs
from deploykit.export.int8_static import CalibrationOptions
from deploykit.graph import RuleSet
from deploykit.inputs.builtin import validation_inputs
from deploykit.nn import create_model
from deploykit.profile.timing import Budget, LatencyStats, measure
from deploykit.zoo.resolve import resolve_model

RESULTS = Path(__file__).parent / "results"
SPEED_CALIBRATION = CalibrationOptions(samples=16, held_out=16, min_agreement=None)
LANES = {
    "openvino f32": OpenvinoRunner,
    "openvino default": lambda graph: OpenvinoRunner(graph, precision_hint=None),
    "openvino-bf16": OpenvinoBf16Runner,
}


def _activated(factory, graph: bytes, packed: bool):
    runner = factory(graph)
    if packed:  # the runner as it was: OpenVINO reads qkv as one product and the 5-D permute
        with mock.patch.object(openvino_rules, "THREE_PRODUCTS", RuleSet("packed qkv", list)):
            runner.activate()
    else:
        runner.activate()
    return runner


def measure_cell(model, label: str, resolution: int, batch: int, plans: list[str], budget: Budget) -> list[dict]:
    shape = (resolution, resolution)
    with torch.inference_mode():
        fp32 = onnx_from_model(model, shape)
        graphs = {p: g.SerializeToString() for p, g in planned_graphs(fp32, model, shape, plans, SPEED_CALIBRATION)}
    x = validation_inputs(model, shape, 0, batch)
    usable = {lane: f for lane, f in LANES.items() if lane.split()[0] in available_backends()}
    runners = {
        (plan, lane, variant): _activated(factory, graphs[plan], variant == "packed")
        for plan in graphs
        for lane, factory in usable.items()
        for variant in ("packed", "three products")
    }
    outputs = {key: r.infer({"images": x})["logits"] for key, r in runners.items()}
    samples = {key: [] for key in runners}
    for _ in range(budget.rounds):
        for key, runner in runners.items():
            samples[key] += measure(lambda r=runner: r.infer({"images": x}), budget.per_round())
    records = []
    for plan in graphs:
        for lane in usable:
            packed, split = (LatencyStats.from_ns(samples[plan, lane, v], batch) for v in ("packed", "three products"))
            difference = np.abs(outputs[plan, lane, "three products"] - outputs[plan, lane, "packed"]).max()
            records.append(
                dict(
                    model=label,
                    resolution=resolution,
                    batch=batch,
                    plan=plan,
                    lane=lane,
                    packed_p50_ms=packed.p50_ms,
                    three_products_p50_ms=split.p50_ms,
                    ratio_three_products_vs_packed=split.p50_ms / packed.p50_ms,
                    min_ratio=split.min_ms / packed.min_ms,
                    max_abs_output_difference=float(difference),
                )
            )
            print(
                f"{label} @ {resolution} b{batch} {plan} {lane}: {packed.p50_ms:.1f} -> {split.p50_ms:.1f} ms "
                f"({records[-1]['ratio_three_products_vs_packed']:.3f}x), outputs differ by at most {difference:.3g}",
                flush=True,
            )
    for runner in runners.values():
        runner.deactivate()
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke: the default zoo model at 48, batch 1, fp32, a few calls")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per measurement")
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    default, label = resolve_model()
    if args.quick:
        cells = [(default.eval(), label, 48, 1, ["fp32"])]
        budget = Budget(duration_s=0.05, warmup=1, min_iterations=2, rounds=1)
    else:
        torch.manual_seed(0)
        vit_s = create_model("vit_small_patch16", encoding="ape").eval()
        cells = [
            (vit_s, "vit_small_patch16 ape (seeded)", 224, 8, ["fp32", "int8"]),
            (vit_s, "vit_small_patch16 ape (seeded)", 384, 8, ["fp32", "int8"]),
            (default.eval(), label, 384, 1, ["fp32", "int8"]),
        ]
        budget = Budget(duration_s=args.duration, warmup=2, min_iterations=5, rounds=args.rounds)
    write_results(
        __file__,
        argv,
        args.output_dir,
        args.quick,
        lambda: dict(records=[record for cell in cells for record in measure_cell(*cell, budget)]),
    )


if __name__ == "__main__":
    main()
