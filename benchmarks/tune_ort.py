"""A/B of ONNX Runtime CPU session settings against PyTorch eager, interleaved round by round so
load changes on a shared machine hit every variant alike. Writes
``benchmarks/results/tune-ort-<model>-<res>.json``.

    python benchmarks/tune_ort.py [--model vit_small_patch16] [--resolution 224] [--batches 1 8]

Variants: deploykit's defaults (``runners.onnxrt.session_options``: sequential execution, all
graph optimisations, ORT's thread count), two intra-op threads set explicitly, thread spinning
off, denormals as zero, parallel execution mode (to confirm design.md's pitfall), and the graph
after ``onnxruntime.transformers`` fusions (BiasGelu, SkipLayerNormalization), which changes
the graph rather than the session.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from deploykit._io import write_json_atomic
from deploykit.backends.environment import capture_environment, environment_line
from deploykit.export import BakedModel, onnx_from_model
from deploykit.nn import create_model
from deploykit.profile import Budget, LatencyStats, denormals_flushed, measure
from deploykit.runners.onnxrt import session_options

RESULTS = Path(__file__).parent / "results"
VARIANTS = {
    "default": {},
    "intra_op_2": {"intra_op_num_threads": 2},
    "no_spinning": {"session.intra_op.allow_spinning": "0"},
    "denormal_as_zero": {"session.set_denormal_as_zero": "1"},
    "parallel_mode": {"execution_mode": "parallel"},
    "fused_graph": {"fused_graph": True},
}


def _session(model_bytes: bytes, fused_bytes: bytes, settings: dict) -> ort.InferenceSession:
    opts = session_options()
    for key, value in settings.items():
        if key == "intra_op_num_threads":
            opts.intra_op_num_threads = value
        elif key == "execution_mode":
            opts.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        elif key != "fused_graph":
            opts.add_session_config_entry(key, value)
    source = fused_bytes if settings.get("fused_graph") else model_bytes
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def _fuse(model_bytes: bytes, cfg) -> bytes:
    import onnx
    from onnxruntime.transformers import optimizer

    fused = optimizer.optimize_model(
        onnx.load_from_string(model_bytes), model_type="vit", num_heads=cfg.num_heads, hidden_size=cfg.embed_dim, opt_level=0
    )
    return fused.model.SerializeToString()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_small_patch16")
    parser.add_argument("--encoding", default="ape")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per variant per round")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = create_model(args.model, encoding=args.encoding).eval()
    res = (args.resolution, args.resolution)
    model_bytes = onnx_from_model(model, res).SerializeToString()
    sessions = {name: _session(model_bytes, _fuse(model_bytes, model.cfg), s) for name, s in VARIANTS.items()}
    baked = BakedModel(model, res).eval()
    budget = Budget(duration_s=args.duration, warmup=2, min_iterations=3)
    results = {}
    with denormals_flushed():
        env = capture_environment(torch.device("cpu"))
        for batch in args.batches:
            x = np.random.default_rng(0).standard_normal((batch, 3, *res), dtype=np.float32)
            xt = torch.from_numpy(x)
            calls = {name: (lambda s=s, x=x: s.run(None, {"images": x})) for name, s in sessions.items()}
            calls["torch_eager"] = lambda xt=xt: torch.inference_mode()(baked)(xt)
            samples = {name: [] for name in calls}
            for round_ in range(args.rounds):
                for name, call in calls.items():
                    print(f"batch {batch} round {round_} {name}", file=sys.stderr, flush=True)
                    samples[name] += measure(call, budget)  # warm-up = the untimed calls after each switch
            stats = {name: LatencyStats.from_ns(s, batch) for name, s in samples.items()}
            torch_p50, torch_min = stats["torch_eager"].p50_ms, stats["torch_eager"].min_ms
            results[f"b{batch}"] = {
                name: {**st.to_dict(), "vs_torch_p50": st.p50_ms / torch_p50, "vs_torch_min": st.min_ms / torch_min}
                for name, st in stats.items()
            }
            for name, row in results[f"b{batch}"].items():
                print(
                    f"b{batch} {name:18s} p50 {row['p50_ms']:8.2f} ms  min {row['min_ms']:8.2f}  vs torch p50 {row['vs_torch_p50']:.3f} min {row['vs_torch_min']:.3f}"
                )
    env["load_average_end"] = list(__import__("os").getloadavg())
    out = RESULTS / f"tune-ort-{args.model}-{args.encoding}-{args.resolution}.json"
    write_json_atomic(
        out, dict(environment_line=environment_line(env), environment=env, variants=VARIANTS, args=vars(args), results=results)
    )
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
