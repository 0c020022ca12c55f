"""Accuracy of the fp16 (and bf16) precision plans, measured without TensorRT.

For every registered encoding, the embedded default model (vit_tiny_patch16, deterministic
weights) is exported at 224 with the fp16/bf16 plans and compared with fp32 PyTorch on the
validation inputs (seeded noise + the bundled real images): worst per-sample cosine of the
logits and top-1 agreement.

Two ways to run a planned graph on CPU:

* ``ort``: the planned graph as written, in ONNX Runtime CPU. Its x86 kernels for MatMul, Conv,
  Add, ... have no fp16 versions, so ORT inserts Casts and computes those nodes in fp32; weights
  are still fp16-rounded and our explicit Casts still round, but results between two fp16 nodes
  are not. Optimistic. ORT CPU has no bf16 MatMul at all, so bf16 runs only in the emulation.
* ``emulated``: the plan with every fp16/bf16 tensor held in fp32 but rounded to the low type
  after the node that produces it (Cast → low → Cast back; graph optimisation off so ORT keeps
  the pairs). Products accumulate in fp32 and every stored value is rounded, which is how
  TensorRT runs fp16 GEMMs; the closest CPU stand-in for the engine.

Usage: python benchmarks/precision_accuracy.py [--out benchmarks/results/precision_accuracy.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

import deploykit
from deploykit.backends import TorchRunner
from deploykit.checks import Reference, judge
from deploykit.encodings import list_encodings
from deploykit.export import onnx_from_model
from deploykit.export.precision import PLANS, PRECISIONS, apply_precision
from deploykit.inputs.builtin import random_inputs, real_inputs
from deploykit.nn.checkpoint import DEFAULT_MODEL, default_model
from deploykit.runners.base import run_batched

RESOLUTION = (224, 224)
NUM_RANDOM, NUM_REAL = 24, 8


def emulate_rounding(proto: onnx.ModelProto, low: int) -> onnx.ModelProto:
    """The planned graph in fp32 with every ``low`` tensor rounded through ``low`` where it is made."""
    inferred = onnx.shape_inference.infer_shapes(proto).graph
    low_tensors = {v.name for v in [*inferred.value_info, *inferred.output] if v.type.tensor_type.elem_type == low}
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for init in out.graph.initializer:
        if init.data_type == low:  # exact: every low value is an fp32 value
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name))
    nodes = []
    for node in out.graph.node:
        rounded = [o for o in node.output if o in low_tensors]
        for name in rounded:
            node.output[list(node.output).index(name)] = f"{name}.exact"
        if node.op_type == "Cast":
            next(a for a in node.attribute if a.name == "to").i = TensorProto.FLOAT
        nodes.append(node)
        for name in rounded:
            nodes.append(helper.make_node("Cast", [f"{name}.exact"], [f"{name}.low"], to=low))
            nodes.append(helper.make_node("Cast", [f"{name}.low"], [name], to=TensorProto.FLOAT))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    del out.graph.value_info[:]
    return out


def run_graph(proto: onnx.ModelProto, inputs: np.ndarray, optimize: bool) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(["logits"], {"images": inputs[i : i + 8]})[0] for i in range(0, len(inputs), 8)])


def measure(encoding: str) -> list[dict]:
    model = default_model(encoding=encoding)
    inputs = np.concatenate([random_inputs(NUM_RANDOM, RESOLUTION, seed=0), real_inputs(RESOLUTION, model.cfg.preprocessing, NUM_REAL)])
    with TorchRunner(model, dtype=torch.float32) as runner:
        reference = run_batched(runner, inputs, 8)["logits"]
    fp32 = onnx_from_model(model, RESOLUTION)
    rows = []
    for precision in ("fp16", "bf16"):
        planned = apply_precision(fp32, precision)
        runs = {
            "emulated": lambda p=planned, precision=precision: run_graph(emulate_rounding(p, PRECISIONS[precision]), inputs, optimize=False)
        }
        if precision == "fp16":
            runs["ort"] = lambda p=planned: run_graph(p, inputs, optimize=True)
        for how, run in runs.items():
            actual = run()
            judged = judge(Reference.of_outputs(reference, NUM_REAL), actual, PLANS[precision].criteria).result
            real = {**judged.metrics, "passed": judged.passed}
            everything = judge(Reference.of_outputs(reference), actual, PLANS[precision].criteria).result.metrics
            rows.append(
                dict(
                    encoding=encoding,
                    precision=precision,
                    run=how,
                    cosine_min=real["cosine"],
                    max_abs=real["max_abs"],
                    top1_real=real["top1_agreement"],
                    top1_all=everything["top1_agreement"],
                    logits_abs_max=float(np.abs(reference).max()),
                    passes_tolerance=real["passed"],
                )
            )
            print(
                f"{encoding:<11} {precision} {how:<9} cos {real['cosine']:.6f}  max|Δ| {real['max_abs']:.2e}  "
                f"top1 real {real['top1_agreement']:.0%} all {everything['top1_agreement']:.0%}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "precision_accuracy.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = [row for encoding in list_encodings() for row in measure(encoding)]
    env = dict(
        python=sys.version.split()[0],
        torch=torch.__version__,
        onnxruntime=ort.__version__,
        onnx=onnx.__version__,
        deploykit=deploykit.__version__,
        platform=platform.platform(),
        cpu=platform.processor() or platform.machine(),
    )
    result = dict(
        environment=env,
        model=DEFAULT_MODEL,
        resolution=list(RESOLUTION),
        num_random=NUM_RANDOM,
        num_real=NUM_REAL,
        reference="fp32 PyTorch eager",
        goals=dict(cosine_min=0.999, top1=0.99),
        rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
