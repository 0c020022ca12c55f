"""Where a served request's time goes at concurrency 1, from the client's socket to the runner.

One ``deploykit serve`` (Triton behind the bounded front; ``logits_<res>`` in Triton's Python
backend, as for any CPU plan) in this process. Each of ``--requests`` images goes, one request at a
time, to ``logits_<res>`` over gRPC through the front (the public port), then straight to Triton's
own loopback port (with its access token), the two taking turns image by image so that each sees
the machine as the other does; Triton's per-model statistics cover both. The same images run
through the same backend's runner in this process before the server starts. Each layer is the difference of two of these means:

    front             = client via front - client straight to Triton
    client + gRPC     = client straight to Triton - Triton's four phases below (the same for both paths)
    Triton queue      = Triton's queue time
    Triton in/out     = compute_input + compute_output (tensors into and out of the model's stub)
    Python backend    = compute_infer - runner (the stub's hop, the model's checks and top-k)
    runner            = the same runner in this process, on the same images (before the server starts)

    .venv/bin/python benchmarks/serve_overhead.py [--depth 12] [--resolution 224] [--requests 200] [--quick]

Writes ``--output`` (``benchmarks/results/serve_overhead.json``; with ``--quick``, a temporary
file, as it checks that the script runs, not what it measures). Run it on a quiet machine: the client, the front, Triton
and the model share its cores.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from deploykit._io import write_json_atomic
from deploykit.backends.environment import capture_environment, environment_line
from deploykit.export import export
from deploykit.nn import create_model
from deploykit.serve.bench.triton_stats import model_stats_delta, snapshot
from deploykit.serve.door import free_loopback_ports
from deploykit.serve.front import GRPC_TOKEN_KEY
from deploykit.serve.pipeline import Pipeline
from deploykit.serve.triton_server import ServerOptions, TritonServer, logits_model_name

RESULTS = Path(__file__).parent / "results"


def client(grpc, url: str, model: str, headers: dict | None = None):
    """``call(x) -> logits``: one gRPC request to ``model`` through ``url``."""
    channel = grpc.InferenceServerClient(url)

    def call(x):
        tensor = grpc.InferInput("images", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return channel.infer(model, [tensor], headers=headers).as_numpy("logits")

    return call


def interleaved_means_ms(calls: dict, inputs: np.ndarray) -> dict[str, float]:
    """Mean milliseconds of each call over every row of ``inputs``, the calls taking turns on each
    row (one untimed round first), so that each sees the machine as the others do."""
    for call in calls.values():
        call(inputs[:1])
    samples = {name: [] for name in calls}
    for i in range(len(inputs)):
        for name, call in calls.items():
            start = time.perf_counter_ns()
            call(inputs[i : i + 1])
            samples[name].append(time.perf_counter_ns() - start)
    return {name: float(np.mean(values)) / 1e6 for name, values in samples.items()}


def breakdown(export_dir: Path, resolution: tuple[int, int], requests: int) -> dict:
    import tritonclient.grpc as grpc

    inputs = np.random.default_rng(0).standard_normal((requests, 3, *resolution)).astype(np.float32)
    http, grpc_port, metrics = free_loopback_ports(3)
    options = ServerOptions(http_port=http, grpc_port=grpc_port, metrics_port=metrics, max_batch_size=8)
    model = logits_model_name(resolution)
    with Pipeline.for_server(export_dir, options) as pipeline:
        # the same runner in this process, before the server starts: a runner taking turns with the
        # served one would meet the other's thread pool still spinning after its call
        ms = interleaved_means_ms({"runner": pipeline.checked_logits}, inputs)
        with TritonServer(pipeline, options) as server:
            public = f"127.0.0.1:{grpc_port}"
            direct = f"127.0.0.1:{server._front.options.upstream_grpc}"
            calls = {
                "via front": client(grpc, public, model),
                "straight to Triton": client(grpc, direct, model, {GRPC_TOKEN_KEY: server._triton.get_access_token()}),
            }
            before = snapshot(public)
            ms.update(interleaved_means_ms(calls, inputs))
            (triton,) = [m for m in model_stats_delta(before, snapshot(public)) if m.model == model]
    inside = triton.queue_ms + triton.compute_input_ms + triton.compute_infer_ms + triton.compute_output_ms
    layers = {
        "front": ms["via front"] - ms["straight to Triton"],
        "client + gRPC + Triton's request handling": ms["straight to Triton"] - inside,
        "Triton queue": triton.queue_ms,
        "Triton tensors in/out": triton.compute_input_ms + triton.compute_output_ms,
        "Python backend (stub hop, checks, top-k)": triton.compute_infer_ms - ms["runner"],
        "runner": ms["runner"],
    }
    return {
        "client_via_front_ms": ms["via front"],
        "client_to_triton_ms": ms["straight to Triton"],
        "in_process_runner_ms": ms["runner"],
        "triton_ms": triton.to_json(),
        "layers_ms": layers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=12, help="ViT-Tiny/16 depth (12 = the full model)")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--output", type=Path, help="default: benchmarks/results/serve_overhead.json; with --quick, a temporary file")
    parser.add_argument("--quick", action="store_true", help="depth 1 at 32 px, 30 requests: that it runs, not what it measures")
    args = parser.parse_args()
    if args.quick:
        args.depth, args.resolution, args.requests = 1, 32, 30
    torch.manual_seed(0)
    res = (args.resolution, args.resolution)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=args.depth, img_size=args.resolution, num_classes=10).eval()
    with tempfile.TemporaryDirectory(prefix="serve_overhead_") as work:
        export(model, [res], Path(work) / "export")
        result = breakdown(Path(work) / "export", res, args.requests)
    environment = capture_environment(torch.device("cpu"))
    result.update(environment_line=environment_line(environment), model=f"vit_tiny_patch16 depth {args.depth}, ape, {res[0]} px")
    for name, ms in result["layers_ms"].items():
        print(f"{name:>32}: {ms:7.3f} ms")
    print(f"{'client via front':>32}: {result['client_via_front_ms']:7.3f} ms")
    output = args.output or (
        Path(tempfile.mkdtemp(prefix="serve_overhead_")) / "quick.json" if args.quick else RESULTS / "serve_overhead.json"
    )
    print(f"wrote {write_json_atomic(output, result)}")


if __name__ == "__main__":
    main()
