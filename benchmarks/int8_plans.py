"""INT8 on ONNX Runtime CPU: latency of each plan against the fp32 graph, and the attention choice.

Two measurements, each written to ``benchmarks/results/`` with the command that made it and
the CPU's instruction sets (int8 speed depends on VNNI/AMX):

    python benchmarks/int8_plans.py speed       # every encoding × ViT-S/ViT-B × 224/384 × batch 1/8
    python benchmarks/int8_plans.py attention   # zoo: quantize the attention MatMuls or not, per encoding

``speed`` exports seeded (untrained) models as ``export`` does, in the ``fp32``, ``int8``,
``int8-dynamic`` and ``fp32-mha`` plans and the ``int8`` plan with its attention MatMuls quantized
too (``int8+attn``), then times them on ONNX Runtime with the project's session options,
interleaved round by round, one file per model: ``int8-speed-<model>.json``. Speed does not depend
on the weights, so calibration is short and no agreement target is set.

``attention`` answers the plan's open question per encoding (``ATTENTION_INT8`` in
``deploykit/export/int8_selection.py``) on accuracy: on every zoo model, test-split accuracy and top-1
agreement with fp32 at 1× and 2×, attention MatMuls float or int8 (both without the agreement
fallback, so the two differ in the attention products only); written to ``int8-attention.json``.
What quantizing them gains in speed is the ``int8+attn`` column of ``speed``.
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
from deploykit.encodings import encoding_name, list_encodings
from deploykit.export import onnx_from_model
from deploykit.export.bundle import planned_graphs
from deploykit.export.int8_static import Calibration, CalibrationOptions, quantize_static_int8
from deploykit.inputs.builtin import normalise, validation_inputs
from deploykit.nn import create_model
from deploykit.profile import Budget, LatencyStats, measure
from deploykit.runners.onnxrt import run_graph

RESULTS = Path(__file__).parent / "results"
PLANS = ("fp32", "int8", "int8-dynamic", "int8-mha", "fp32-mha")
SPEED_CALIBRATION = CalibrationOptions(samples=16, held_out=16, min_agreement=None)


def _command() -> str:
    return "python benchmarks/int8_plans.py " + " ".join(map(shlex.quote, sys.argv[1:]))


def speed(args) -> None:
    for model_name in args.models:
        path = args.output_dir / f"int8-speed-{model_name}{args.tag}.json"
        result = {
            "command": _command(),
            "environment": capture_environment(torch.device("cpu")),
            "inputs": "real images",
            "records": [],
            "complete": False,
        }
        for encoding in args.encodings or list_encodings():
            torch.manual_seed(0)
            model = create_model(model_name, encoding=encoding).eval()
            for r in args.resolutions:
                variants = _variants(model, (r, r), args.variants)
                for batch in args.batches:
                    result["records"] += _time_variants(variants, model, model_name, encoding, r, batch, args)
                    print("  ".join(f"{x['variant']} {x['ratio_vs_fp32']:.2f}" for x in result["records"][-len(variants) :]), flush=True)
            result["load_average_end"] = list(os.getloadavg())
            write_json_atomic(path, result)  # after each encoding: an interrupted run keeps what it measured
        result["complete"] = True
        write_json_atomic(path, result)


def _variants(model, resolution, only: list[str] | None = None) -> dict:
    """Plan name -> serialized graph: the plans as ``export`` writes them, and ``int8+attn``
    (with ``only``: fp32 and those)."""
    from deploykit.inputs.builtin import calibration_inputs

    wanted = lambda name: only is None or name == "fp32" or name in only
    fp32 = onnx_from_model(model, resolution)
    variants = dict(planned_graphs(fp32, model, resolution, [p for p in PLANS if wanted(p)], SPEED_CALIBRATION))
    if wanted("int8+attn"):
        calibration = Calibration(*calibration_inputs(model, resolution, SPEED_CALIBRATION.samples))
        variants["int8+attn"], _ = quantize_static_int8(fp32, calibration, attention=True)
    return {name: proto.SerializeToString() for name, proto in variants.items()}


def _time_variants(variants: dict, model, model_name, encoding, resolution, batch, args) -> list[dict]:
    """p50 etc. of every variant on one batch of real images, interleaved over ``args.rounds`` rounds.

    Real images, not seeded noise: on an Intel CPU, ONNX Runtime's fp32 graph of the default model
    at 384 took 2.3x as long on noise as on images (denormals and saturated softmax rows), which
    would flatter every ratio to fp32."""
    import onnxruntime as ort

    from deploykit.runners.onnxrt import session_options

    sessions = {n: ort.InferenceSession(g, session_options(), providers=["CPUExecutionProvider"]) for n, g in variants.items()}
    x = validation_inputs(model, (resolution, resolution), 0, batch)
    budget = Budget(duration_s=args.duration, rounds=args.rounds, warmup=args.warmup, min_iterations=args.min_iterations).per_round()
    samples = {n: [] for n in sessions}
    for _ in range(args.rounds):
        for name, session in sessions.items():
            samples[name] += measure(lambda s=session: s.run(None, {"images": x}), budget)
    stats = {n: LatencyStats.from_ns(v, batch) for n, v in samples.items()}
    return [
        dict(
            model=model_name,
            encoding=encoding,
            resolution=resolution,
            batch=batch,
            variant=n,
            **st.to_dict(),
            ratio_vs_fp32=st.p50_ms / stats["fp32"].p50_ms,
            min_ratio_vs_fp32=st.min_ms / stats["fp32"].min_ms,
        )
        for n, st in stats.items()
    ]


def attention(args) -> None:
    from deploykit.inputs.builtin import calibration_inputs
    from deploykit.inputs.datasets import get_dataset
    from deploykit.nn.checkpoint import load_model
    from deploykit.zoo.cards import eval_resolutions
    from deploykit.zoo.registry import list_zoo, model_dir

    records = []
    for name in args.zoo or list_zoo():
        model = load_model(model_dir(name))
        dataset = get_dataset(model.cfg.dataset)
        for r in eval_resolutions(model)[::2]:  # 1x and 2x
            fp32 = onnx_from_model(model, (r, r))
            images, labels = dataset.batch("test", range(dataset.size("test")), r)
            inputs = normalise(images, model.cfg.mean, model.cfg.std)
            reference = run_graph(fp32, inputs).argmax(-1)
            calibration = Calibration(*calibration_inputs(model, (r, r), 128))
            for quantized in (False, True):
                predicted = run_graph(quantize_static_int8(fp32, calibration, attention=quantized)[0], inputs).argmax(-1)
                records.append(
                    dict(
                        model=name,
                        encoding=encoding_name(model.cfg.encoding),
                        resolution=r,
                        attention_int8=quantized,
                        accuracy=float(np.mean(predicted == labels)),
                        fp32_accuracy=float(np.mean(reference == labels)),
                        agreement=float(np.mean(predicted == reference)),
                    )
                )
                print(records[-1], flush=True)
    write_json_atomic(
        args.output_dir / f"int8-attention{args.tag}.json",
        {"command": _command(), "environment": capture_environment(torch.device("cpu")), "records": records},
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["speed", "attention"])
    parser.add_argument("--models", nargs="+", default=["vit_small_patch16", "vit_base_patch16"])
    parser.add_argument("--encodings", nargs="+", default=None, help="default: every registered encoding")
    parser.add_argument("--resolutions", nargs="+", type=int, default=[224, 384])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per measurement")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--min-iterations", type=int, default=4)
    parser.add_argument("--zoo", nargs="+", default=None, help="attention: zoo models (default all)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="")
    parser.add_argument(
        "--variants", nargs="+", default=None, help="speed: only these (fp32 always), e.g. int8 int8+attn; default every plan"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    speed(args) if args.what == "speed" else attention(args)
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
