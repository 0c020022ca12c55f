"""Top-1 agreement with fp32 of every CPU plan ``deploykit serve`` can take by default, on the zoo's test split.

    python benchmarks/cpu_plan_accuracy.py                          # every zoo model at 1× and 2× its training size
    python benchmarks/cpu_plan_accuracy.py --models shapes-ape --limit 200
    python benchmarks/cpu_plan_accuracy.py --quick      # smoke: the default model at 1×, 64 inputs, short calibration

``serve`` on a CPU runs the plan ``deploykit profile`` measured fastest among the validated ones,
and which one that is depends on the machine (ONNX Runtime's int8 on one CPU, OpenVINO's bf16 on
another). So every candidate is measured, not only this machine's choice: ONNX Runtime ``fp32-mha``
and ``int8``, OpenVINO (hint f32) on the ``fp32`` and ``int8`` graphs and, on a CPU with native
bf16, the ``openvino-bf16`` backend on both. The int8 plan is made as ``deploykit export
--precision int8`` makes it for a zoo model (calibrated on the train split, its fallback judged on
the val split); the test inputs are used by neither. Each lane's predictions are compared with the
fp32 PyTorch model's, with the binomial standard error. Issue 25's goal: at least 99.0% at 1× and
2× for every plan chosen by default.

Writes ``benchmarks/results/cpu-plan-accuracy.json`` (command, environment with the CPU's
instruction sets, one record per model × resolution × lane); ``--quick`` writes
``cpu-plan-accuracy-quick.json``, whose numbers are not for the README (do not commit it).
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
from cpu_backends import usable_lanes  # benchmarks/ is on sys.path when run as a script

from deploykit._io import write_json_atomic
from deploykit.backends.environment import capture_environment
from deploykit.backends.openvino import OpenvinoBf16Runner, OpenvinoRunner
from deploykit.encodings import encoding_name
from deploykit.errors import DeployKitError
from deploykit.export import onnx_from_model
from deploykit.export.bundle import planned_graphs
from deploykit.export.int8_static import CalibrationOptions
from deploykit.inputs.builtin import normalise
from deploykit.inputs.datasets import get_dataset
from deploykit.nn import load_model
from deploykit.runners.base import run_batched
from deploykit.runners.onnxrt import OnnxrtRunner
from deploykit.zoo.cards import eval_resolutions
from deploykit.zoo.registry import DEFAULT_ZOO_MODEL, EVAL_SCALES, list_zoo, model_dir

RESULTS = Path(__file__).parent / "results"
SCALES = (1.0, 2.0)
# lane -> (runner factory, plan of the graph it runs): every plan profile may choose on a CPU
LANES = {
    "ort fp32-mha": (OnnxrtRunner, "fp32-mha"),
    "ort int8": (OnnxrtRunner, "int8"),
    "openvino fp32": (OpenvinoRunner, "fp32"),
    "openvino int8": (OpenvinoRunner, "int8"),
    "openvino-bf16 fp32": (OpenvinoBf16Runner, "fp32"),
    "openvino-bf16 int8": (OpenvinoBf16Runner, "int8"),
}
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
        graphs = {"fp32": fp32, **dict(planned_graphs(fp32, model, shape, ["int8", "fp32-mha"], calibration))}
        images, labels = dataset.batch("test", range(count), resolution)
        x = normalise(images, model.cfg.mean, model.cfg.std)
        with torch.inference_mode():
            reference = np.concatenate([model(torch.from_numpy(x[i : i + BATCH])).argmax(-1).numpy() for i in range(0, count, BATCH)])
        for lane, (factory, plan) in usable_lanes(LANES).items():
            record = dict(model=name, encoding=encoding_name(model.cfg.encoding), resolution=resolution, scale=scale, lane=lane, n=count)
            runner = factory(graphs[plan].SerializeToString())
            try:
                runner.activate()
            except DeployKitError as err:  # a backend that cannot load a graph is a finding, not the end
                records.append(dict(record, error=str(err)[:400]))
                continue
            try:
                predicted = run_batched(runner, x, BATCH)["logits"].argmax(-1)
                provider = runner.provider  # what ran it: known while active only
                # OpenVINO under bf16: the encoding ops it ran below f32 anyway (profile refuses such a run)
                lowered = {k: v for k, v in runner.info.to_dict().items() if k in ("lowered_despite_mark", "lowered_elsewhere")}
            finally:
                runner.deactivate()
            agreement = float(np.mean(predicted == reference))
            records.append(
                dict(
                    record,
                    agreement=agreement,
                    standard_error=float(np.sqrt(agreement * (1 - agreement) / count)),
                    accuracy=float(np.mean(predicted == labels)),
                    fp32_accuracy=float(np.mean(reference == labels)),
                    provider=provider,
                    **lowered,
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
    path = args.output_dir / f"cpu-plan-accuracy{'-quick' if args.quick else ''}.json"
    if args.quick:
        args.models, args.limit = [DEFAULT_ZOO_MODEL], 64
    options = dict(scales=(1.0,), calibration=CalibrationOptions(samples=16, held_out=16, min_agreement=None)) if args.quick else {}
    command = "python benchmarks/cpu_plan_accuracy.py " + " ".join(map(shlex.quote, sys.argv[1:]))
    result = {"command": command, "environment": capture_environment(torch.device("cpu")), "records": [], "complete": False}
    start = time.perf_counter()
    for name in args.models or list_zoo():
        result["records"] += measure_model(name, args.limit, **options)
        result["load_average_end"] = list(os.getloadavg())
        write_json_atomic(path, result)  # after each model: an interrupted run keeps what it measured
    result.update(complete=True, wall_s=round(time.perf_counter() - start))
    write_json_atomic(path, result)
    low = [r for r in result["records"] if r.get("agreement", 1.0) < 0.99]
    print(
        f"{len(low)} of {len(result['records'])} lanes below 99.0%: "
        + "; ".join(f"{r['model']} @ {r['resolution']} {r['lane']}" for r in low)
    )


if __name__ == "__main__":
    main()
