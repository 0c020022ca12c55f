"""Top-1 agreement with PyTorch fp32 of the GPU plans (``fp8``, ``int8-fp16``) and of NVIDIA Model
Optimizer's graphs of the same mode, calibrated on the same images, on the zoo's test split.

    python benchmarks/gpu_plan_accuracy.py                          # every zoo model at 1× and 2× its training size
    python benchmarks/gpu_plan_accuracy.py --models shapes-ape --limit 500
    python benchmarks/gpu_plan_accuracy.py --quick      # smoke: the default model at 1×, 64 inputs, short calibration

The deploykit plans are made as ``deploykit export --precision fp8 --precision int8-fp16`` makes
them for a zoo model (calibrated on the train split, the fallback judged on the val split); ModelOpt's
(``modelopt.onnx.quantization.quantize``, ``quantize_mode`` ``fp8`` / ``int8``, its default
calibration method, ``calibration_eps=["cpu"]``) are calibrated on the same train-split images and
have no fallback. The test inputs are used by neither. ONNX Runtime's CPU provider runs every
graph (FP8 and INT8 Q/DQ, fp16 remainder): the numbers are the graphs' simulated arithmetic, not a
GPU's. Issue 53's goals: at least 99% agreement at 1× and 2×, and at least as close to fp32 as
ModelOpt's graph of the same mode.

Writes ``benchmarks/results/gpu-plan-accuracy.json`` (command, environment, one record per model ×
resolution × lane); ``--quick`` writes ``gpu-plan-accuracy-quick.json``, whose numbers are not for
the README (do not commit it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch

from deploykit._io import write_json_atomic
from deploykit.backends.environment import capture_environment
from deploykit.encodings import encoding_name
from deploykit.export import onnx_from_model
from deploykit.export.bundle import planned_graphs
from deploykit.export.int8_static import CalibrationOptions
from deploykit.export.qdq_compare import modelopt_quantize
from deploykit.inputs.builtin import DefaultCalibration, normalise
from deploykit.inputs.datasets import get_dataset
from deploykit.nn import load_model
from deploykit.runners.base import run_batched
from deploykit.runners.onnxrt import cpu_runner
from deploykit.zoo.cards import eval_resolutions
from deploykit.zoo.registry import DEFAULT_ZOO_MODEL, EVAL_SCALES, list_zoo, model_dir

RESULTS = Path(__file__).parent / "results"
SCALES = (1.0, 2.0)
PLANS = {"fp8": "fp8", "int8-fp16": "int8"}  # deploykit plan -> ModelOpt's quantize_mode of the same kind
BATCH = 100


def measure_model(name: str, limit: int | None, scales=SCALES, calibration: CalibrationOptions = CalibrationOptions()) -> list[dict]:
    model = load_model(model_dir(name)).eval()
    dataset = get_dataset(model.cfg.dataset)
    count = min(limit or dataset.size("test"), dataset.size("test"))
    records = []
    for resolution, scale in zip(eval_resolutions(model), EVAL_SCALES):
        if scale not in scales:
            continue
        shape = (resolution, resolution)
        fp32 = onnx_from_model(model, shape)
        graphs = {f"deploykit {plan}": graph for plan, graph in planned_graphs(fp32, model, shape, list(PLANS), calibration)}
        # the export's calibration inputs: the same draw (seeded) as planned_graphs took
        inputs, _, _ = DefaultCalibration().inputs(model, shape, calibration.samples, calibration.held_out)
        with tempfile.TemporaryDirectory(prefix="gpu-plan-accuracy-") as tmp:
            source = Path(tmp) / "fp32.onnx"
            onnx.save_model(fp32, str(source))
            for mode in PLANS.values():
                graphs[f"modelopt {mode}"] = modelopt_quantize(source, mode, inputs, Path(tmp) / f"{mode}.onnx")
        images, labels = dataset.batch("test", range(count), resolution)
        x = normalise(images, model.cfg.mean, model.cfg.std)
        with torch.inference_mode():
            reference = np.concatenate([model(torch.from_numpy(x[i : i + BATCH])).argmax(-1).numpy() for i in range(0, count, BATCH)])
        for lane, graph in graphs.items():
            with cpu_runner(graph) as runner:
                predicted = run_batched(runner, x, BATCH)["logits"].argmax(-1)
            agreement = float(np.mean(predicted == reference))
            records.append(
                dict(
                    model=name,
                    encoding=encoding_name(model.cfg.encoding),
                    resolution=resolution,
                    scale=scale,
                    lane=lane,
                    n=count,
                    agreement=agreement,
                    standard_error=float(np.sqrt(agreement * (1 - agreement) / count)),
                    accuracy=float(np.mean(predicted == labels)),
                    fp32_accuracy=float(np.mean(reference == labels)),
                    calibration_inputs=len(inputs),
                )
            )
            print(f"{name} @ {resolution} {lane}: agreement {agreement:.4f} ± {records[-1]['standard_error']:.4f}", flush=True)
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help="zoo models (default: every one)")
    parser.add_argument("--limit", type=int, default=None, help="first N test samples (default: the whole test split)")
    parser.add_argument("--quick", action="store_true", help="smoke: the default model at 1x, 64 inputs, short calibration")
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    path = args.output_dir / f"gpu-plan-accuracy{'-quick' if args.quick else ''}.json"
    if args.quick:
        args.models, args.limit = [DEFAULT_ZOO_MODEL], 64
    options = dict(scales=(1.0,), calibration=CalibrationOptions(samples=32, held_out=64)) if args.quick else {}
    command = "python benchmarks/gpu_plan_accuracy.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    result = {"command": command, "environment": capture_environment(torch.device("cpu")), "records": [], "complete": False}
    start = time.perf_counter()
    for name in args.models or list_zoo():
        result["records"] += measure_model(name, args.limit, **options)
        result["load_average_end"] = list(os.getloadavg())
        write_json_atomic(path, result)  # after each model: an interrupted run keeps what it measured
    result.update(complete=True, wall_s=round(time.perf_counter() - start))
    write_json_atomic(path, result)
    by_key = {(r["model"], r["resolution"], r["lane"]): r["agreement"] for r in result["records"]}
    low = [k for k, v in by_key.items() if k[2].startswith("deploykit") and v < 0.99]
    behind = [
        k
        for k, v in by_key.items()
        if k[2].startswith("deploykit") and v < by_key.get((k[0], k[1], f"modelopt {PLANS[k[2].split()[1]]}"), 0)
    ]
    print(f"{len(low)} deploykit lanes below 99.0%: {low}; {len(behind)} behind ModelOpt's graph of the same mode: {behind}")


if __name__ == "__main__":
    main()
