"""Served (Triton via ``deploykit serve``, gRPC) vs in-process pipeline on CPU: throughput and
p50/p99 latency at concurrency 1, 8 and 32, in one run. Writes
``benchmarks/results/serve_cpu.json``.

    .venv/bin/python benchmarks/serve_cpu.py [--requests 192] [--depth 12] [--resolution 224]

Both sides run the same exported graph with ONNX Runtime on the same cores: the served side is
a ``deploykit serve`` child process (dynamic batching, max batch 32, 2 ms queue delay) that
clients call with ``tritonclient.grpc``, one preprocessed image per request; the in-process side
calls ``Pipeline.logits`` from the same number of threads, one image per call, no batching. The
levels are interleaved (in-process, then served, per concurrency) after an untimed warm-up of
each, so load from other users of the machine hits both alike. Latency is per request, timed
with ``perf_counter_ns`` around the call; throughput is requests / wall time of the level.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import deploykit
from deploykit._io import write_json_atomic
from deploykit.export import export
from deploykit.nn import create_model
from deploykit.serve.triton_server import logits_model_name

RESULTS = Path(__file__).parent / "results"
CONCURRENCY = (1, 8, 32)
SHARED_MACHINE_NOTE = "machine shared with other agents' jobs during this run: absolute numbers are noisy; compare ratios"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _stats(latencies_ns: list[int], wall_s: float) -> dict:
    ms = np.asarray(latencies_ns, dtype=np.float64) / 1e6
    return {"requests": len(ms), "throughput_rps": len(ms) / wall_s, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean()), "min_ms": float(ms.min()), "max_ms": float(ms.max())}


def _run_level(call, inputs: np.ndarray, concurrency: int) -> dict:
    """Send every input once from ``concurrency`` threads; per-request latency + wall time."""
    latencies = [0] * len(inputs)

    def one(i: int) -> None:
        start = time.perf_counter_ns()
        call(inputs[i : i + 1])
        latencies[i] = time.perf_counter_ns() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(inputs))))
    return _stats(latencies, time.perf_counter() - start)


class ServedClient:
    """One gRPC client per thread (the gRPC client is thread-safe, but one channel per thread
    keeps clients from queueing behind each other's HTTP/2 stream)."""

    def __init__(self, url: str, model: str):
        import tritonclient.grpc as grpcclient

        self.grpc, self.url, self.model = grpcclient, url, model
        self.local = threading.local()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if not hasattr(self.local, "client"):
            self.local.client = self.grpc.InferenceServerClient(self.url)
        tensor = self.grpc.InferInput("images", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return self.local.client.infer(self.model, [tensor]).as_numpy("logits")

    def counts(self) -> tuple[int, int]:
        stats = self.grpc.InferenceServerClient(self.url).get_inference_statistics(self.model, as_json=True)["model_stats"][0]
        return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def _start_server(export_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    http, grpc, metrics = _free_ports(3)
    cmd = [sys.executable, "-m", "deploykit", "serve", str(export_dir), "--host", "127.0.0.1", "--port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--backend", "ort", "--max-batch-size", "32",
           "--max-queue-delay-us", "2000"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if client.is_server_ready():
                return proc, f"127.0.0.1:{grpc}"
        except Exception:  # still starting: connection refused
            pass
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    raise TimeoutError("server did not become ready in 300 s")


def _environment(grpc_url: str) -> dict:
    import tritonclient.grpc as grpcclient

    meta = grpcclient.InferenceServerClient(grpc_url).get_server_metadata(as_json=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "onnxruntime": ort.__version__,
            "torch": torch.__version__, "tritonserver": meta.get("version"), "deploykit": deploykit.__version__,
            "load_average_start": list(os.getloadavg()), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "note": SHARED_MACHINE_NOTE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=192, help="requests per concurrency level and side")
    parser.add_argument("--depth", type=int, default=12, help="ViT-Tiny/16 depth (12 = the full model)")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--output", type=Path, default=RESULTS / "serve_cpu.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="serve_cpu_"))
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=args.depth, img_size=args.resolution).eval()
    res = (args.resolution, args.resolution)
    export(model, [res], work / "export")
    inputs = np.random.default_rng(0).standard_normal((args.requests, 3, *res), dtype=np.float32)

    proc, grpc_url = _start_server(work / "export", work / "server.log")
    try:
        environment = _environment(grpc_url)
        served = ServedClient(grpc_url, logits_model_name(res))
        with deploykit.load(work / "export", backend="ort") as pipeline:
            in_process = pipeline.logits
            np.testing.assert_allclose(served(inputs[:1]), in_process(inputs[:1]), rtol=1e-5, atol=1e-5)  # same model
            levels = []
            for concurrency in CONCURRENCY:
                _run_level(in_process, inputs[: 2 * concurrency], concurrency)  # untimed: thread pools settle
                local = _run_level(in_process, inputs, concurrency)
                _run_level(served, inputs[: 2 * concurrency], concurrency)
                before = served.counts()
                remote = _run_level(served, inputs, concurrency)
                after = served.counts()
                inferences, executions = after[0] - before[0], after[1] - before[1]
                remote["mean_merged_batch"] = inferences / max(executions, 1)
                levels.append({"concurrency": concurrency, "in_process": local, "served": remote,
                               "served_vs_in_process_throughput": remote["throughput_rps"] / local["throughput_rps"],
                               "served_vs_in_process_p50": remote["p50_ms"] / local["p50_ms"]})
                print(f"c={concurrency:>2}  in-process {local['throughput_rps']:7.1f} req/s p50 {local['p50_ms']:7.2f} ms "
                      f"p99 {local['p99_ms']:7.2f} ms | served {remote['throughput_rps']:7.1f} req/s p50 {remote['p50_ms']:7.2f} ms "
                      f"p99 {remote['p99_ms']:7.2f} ms (mean merged batch {remote['mean_merged_batch']:.1f})", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)  # the server stops its tritonserver and exits
        proc.wait(120)
    environment["load_average_end"] = list(os.getloadavg())
    env_line = (f"{environment['cpu']} ({environment['cores']} cores), python {environment['python']}, onnxruntime "
                f"{environment['onnxruntime']}, tritonserver {environment['tritonserver']}; {SHARED_MACHINE_NOTE}")
    result = {"environment_line": env_line, "environment": environment,
              "settings": {"model": f"vit_tiny_patch16 depth {args.depth}, ape", "resolution": list(res), "requests_per_level": args.requests,
                           "served": "deploykit serve (PyTriton), gRPC, one image per request, dynamic batching max 32, 2 ms delay",
                           "in_process": "Pipeline.logits from N threads, one image per call"},
              "levels": levels}
    write_json_atomic(args.output, result)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
