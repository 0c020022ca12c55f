"""Where ONNX Runtime spends its kernel time on an exported model, by op type, with and without
deploykit's rewrites (the canonical rule set at export, ``deploykit/graph/canonical.py``), measured in the same run.
Writes ``benchmarks/results/ort-op-profile-<model>-<encoding>-<res>-b<batch>.json``.

    python benchmarks/ort_op_profile.py [--model vit_small_patch16] [--encoding ape] [--resolution 224] [--batch 8]

Per variant: ONNX Runtime's own profiler over ``--runs`` calls after two untimed ones, kernel
time summed per op type of the optimised graph (what ORT actually ran: ``Gemm``, ``BiasGelu``,
``FusedMatMul``...), the share of GEMM-like ops, and the op counts of the optimised graph.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import onnxruntime as ort
import torch

from deploykit._io import write_json_atomic
from deploykit.backends.environment import capture_environment, environment_line
from deploykit.export import onnx_from_model
from deploykit.graph import RuleSet
from deploykit.inputs.resolutions import parse_resolution, resolution_tag
from deploykit.nn import create_model
from deploykit.runners.onnxrt import session_options

RESULTS = Path(__file__).parent / "results"
GEMM_OPS = ("MatMul", "FusedMatMul", "Gemm", "Conv")


def profile_graph(proto: onnx.ModelProto, images: np.ndarray, runs: int, workdir: Path, tag: str) -> dict:
    options = session_options()
    options.enable_profiling = True
    options.profile_file_prefix = str(workdir / tag)
    options.optimized_model_filepath = str(workdir / f"{tag}.optimised.onnx")
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: images}
    for _ in range(2):
        session.run(None, feed)
    wall = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        session.run(None, feed)
        wall.append((time.perf_counter_ns() - start) / 1e6)
    events = json.loads(Path(session.end_profiling()).read_text())
    per_op: Counter = Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_op[event["args"]["op_name"]] += event["dur"]
    total = sum(per_op.values())
    ops = Counter(n.op_type for n in onnx.load(str(workdir / f"{tag}.optimised.onnx")).graph.node)
    return dict(
        kernel_share={op: us / total for op, us in per_op.most_common()},
        gemm_share=sum(per_op[op] for op in GEMM_OPS) / total,
        optimised_op_counts=dict(ops.most_common()),
        p50_ms_profiled=float(np.median(wall)),
        runs=runs,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_small_patch16")
    parser.add_argument("--encoding", default="ape")
    parser.add_argument("--resolution", default="224")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    resolution = parse_resolution(args.resolution)
    torch.manual_seed(0)
    model = create_model(args.model, encoding=args.encoding).eval()
    images = np.random.default_rng(0).standard_normal((args.batch, 3, *resolution)).astype(np.float32)
    environment = capture_environment(torch.device("cpu"))
    variants = {}
    with tempfile.TemporaryDirectory() as tmp:
        with mock.patch("deploykit.export.onnx_export.CANONICAL", RuleSet("as exported", list)):
            plain = onnx_from_model(model, resolution)
        rewritten = onnx_from_model(model, resolution)
        for tag, proto in (("as_exported", plain), ("runtime_rewrites", rewritten)):
            print(f"profiling {tag}", file=sys.stderr, flush=True)
            variants[tag] = profile_graph(proto, images, args.runs, Path(tmp), tag)
    ratio = variants["runtime_rewrites"]["p50_ms_profiled"] / variants["as_exported"]["p50_ms_profiled"]
    data = dict(
        command="python benchmarks/ort_op_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        environment_line=environment_line(environment),
        environment=environment,
        args={k: str(v) for k, v in vars(args).items()},
        variants=variants,
        rewritten_over_exported_p50=ratio,
        note="p50 under the profiler (which adds overhead to both alike); kernel shares exclude session overhead",
    )
    name = f"ort-op-profile-{args.model}-{args.encoding}-{resolution_tag(resolution)}-b{args.batch}.json"
    path = write_json_atomic(args.output_dir / name, data)
    for tag, v in variants.items():
        top = ", ".join(f"{op} {share:.1%}" for op, share in list(v["kernel_share"].items())[:6])
        print(f"{tag}: p50 {v['p50_ms_profiled']:.1f} ms, GEMM-like {v['gemm_share']:.1%}; {top}", file=sys.stderr)
    print(f"rewritten / as exported p50: {ratio:.3f}; wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
