"""Served vs in-process: throughput and p50/p99 latency per concurrency, the sweep behind
``deploykit serve-bench``.

Both sides run the same export, backend and resolution, one preprocessed image per request:

served
    ``deploykit serve`` in a child process (Triton, dynamic batching), loaded over gRPC on
    127.0.0.1 by Triton's ``perf_analyzer`` when it is on ``PATH`` (its concurrency mode, a
    count window of ``requests``), else by our own bounded client (``concurrency`` threads, one
    gRPC channel each, ``requests`` requests in all). Triton's statistics give the mean merged batch.
in-process
    ``Pipeline.logits`` from ``concurrency`` threads, one image per call, no batching.

The levels are interleaved (in-process, then served, per concurrency), each after an untimed
warm-up, so load from other users of the machine hits both sides alike. Latency is per request
(``perf_counter_ns`` around the call); throughput is requests over the wall time of the level.
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from deploykit._io import write_output_json
from deploykit._lazy import lazy_import
from deploykit.catalog import OUTPUT_NAME
from deploykit.errors import ConfigError, DeployKitError, unknown_choice
from deploykit.resolutions import resolution_tag
from deploykit.serve import defaults
from deploykit.serve.classifier import INPUT_NAME
from deploykit.serve.door import free_loopback_ports
from deploykit.serve.pipeline import Pipeline
from deploykit.serve.triton_server import logits_model_name

STARTUP_TIMEOUT_S = 300


@dataclass(frozen=True)
class BenchOptions:
    """What ``bench_serving`` measures.

    Attributes:
        concurrency: the levels, requests in flight at once.
        requests: requests per level and side (the measurement; a warm-up of ``2 x concurrency`` precedes it).
        resolution: the exported ``(height, width)`` to load; default the export's first.
        backend: the pipeline backend of both sides.
        max_batch_size, max_queue_delay_us: the server's dynamic batching.
        client: ``"auto"`` (``perf_analyzer`` when installed), ``"perf_analyzer"`` or ``"builtin"``.
    """

    concurrency: tuple[int, ...] = defaults.BENCH_CONCURRENCY
    requests: int = defaults.BENCH_REQUESTS
    resolution: tuple[int, int] | None = None
    backend: str = defaults.BENCH_BACKEND
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    max_queue_delay_us: int = defaults.MAX_QUEUE_DELAY_US
    client: str = defaults.BENCH_CLIENT

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1 or self.requests < 1:
            raise ConfigError(f"need concurrency levels >= 1 and requests >= 1, got {list(self.concurrency)} and {self.requests}")
        if self.client not in defaults.BENCH_CLIENTS:
            raise ConfigError(unknown_choice("client", self.client, defaults.BENCH_CLIENTS))


@dataclass(frozen=True)
class SideSummary:
    """One side of one level as ``deploykit serve-bench`` prints it (read from the level's stats)."""

    throughput_rps: float
    p50_ms: float
    p99_ms: float

    @classmethod
    def of(cls, stats: dict) -> SideSummary:
        return cls(**{f.name: stats[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class LevelSummary:
    """One concurrency level: both sides, the server's mean merged batch and the throughput ratio."""

    concurrency: int
    in_process: SideSummary
    served: SideSummary
    mean_merged_batch: float
    served_vs_in_process: float


@dataclass
class BenchReport:
    """Per concurrency level, both sides' throughput (requests/s) and latency (ms).

    Attributes:
        levels: ``{"concurrency", "in_process": stats, "served": stats, "served_vs_in_process_throughput"}``
            per level, where stats holds ``requests``, ``throughput_rps``, ``p50_ms``, ``p99_ms``
            (served: also ``mean_merged_batch``).
        settings: what was measured (export, resolution, backend, batching, client).
        environment: CPU, versions, load averages at start and end, date.
    """

    levels: list[dict]
    settings: dict
    environment: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    def write_json(self, path: str | os.PathLike) -> Path:
        return write_output_json(path, self.to_json())

    def summary(self) -> list[LevelSummary]:
        """The levels, typed: what a reader needs without the JSON's keys."""
        return [
            LevelSummary(
                concurrency=level["concurrency"],
                in_process=SideSummary.of(level["in_process"]),
                served=SideSummary.of(level["served"]),
                mean_merged_batch=level["served"]["mean_merged_batch"],
                served_vs_in_process=level["served_vs_in_process_throughput"],
            )
            for level in self.levels
        ]


def latency_stats(latencies_ns: Sequence[int], wall_s: float) -> dict:
    """Throughput (requests over the level's wall time: they overlap) and latency percentiles of
    one level, the percentiles as ``profile`` computes them (``LatencyStats``)."""
    from deploykit.profile.timing import LatencyStats

    stats = LatencyStats.from_ns(latencies_ns)
    return {
        "requests": stats.n,
        "throughput_rps": stats.n / wall_s,
        "p50_ms": stats.p50_ms,
        "p99_ms": stats.p99_ms,
        "mean_ms": stats.mean_ms,
        "max_ms": stats.max_ms,
    }


def run_level(call: Callable[[np.ndarray], object], inputs: np.ndarray, concurrency: int) -> dict:
    """Send every row of ``inputs`` (``[N, 1, ...]``) once, from ``concurrency`` threads."""
    latencies = [0] * len(inputs)

    def one(i: int) -> None:
        start = time.perf_counter_ns()
        call(inputs[i])
        latencies[i] = time.perf_counter_ns() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(inputs))))
    return latency_stats(latencies, time.perf_counter() - start)


class GrpcClient:
    """Our loopback client: one gRPC channel per thread, so requests do not queue behind each
    other's HTTP/2 stream."""

    def __init__(self, url: str, model: str):
        self.grpc, self.url, self.model = lazy_import("tritonclient.grpc"), url, model
        self.local = threading.local()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if not hasattr(self.local, "client"):
            self.local.client = self.grpc.InferenceServerClient(self.url)
        tensor = self.grpc.InferInput(INPUT_NAME, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return self.local.client.infer(self.model, [tensor]).as_numpy(OUTPUT_NAME)

    def counts(self) -> tuple[int, int]:
        """Triton's ``(inference_count, execution_count)`` of the model so far."""
        stats = self.grpc.InferenceServerClient(self.url).get_inference_statistics(self.model, as_json=True)["model_stats"][0]
        return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def perf_analyzer_level(executable: str, url: str, model: str, concurrency: int, requests: int, workdir: Path) -> dict:
    """One level measured by Triton's ``perf_analyzer`` (concurrency mode, count window)."""
    report = workdir / f"perf_{concurrency}.csv"
    command = [
        executable,
        "-m",
        model,
        "-u",
        url,
        "-i",
        "grpc",
        "--concurrency-range",
        f"{concurrency}:{concurrency}",
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        str(requests),
        "-f",
        str(report),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DeployKitError(f"perf_analyzer failed at concurrency {concurrency}: {tail[0]}")
    with open(report, newline="") as f:
        row = next(csv.DictReader(f))
    return {
        "requests": requests,
        "throughput_rps": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1e3,
        "p99_ms": float(row["p99 latency"]) / 1e3,
        "client": "perf_analyzer",
    }


class ServerProcess:
    """``deploykit serve`` as a child process on free loopback ports; stopped by its pid."""

    def __init__(self, export_dir: Path, options: BenchOptions, log: Path):
        self.http, self.grpc, metrics = free_loopback_ports(3)
        command = [
            sys.executable,
            "-m",
            "deploykit",
            "serve",
            str(export_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.http),
            "--grpc-port",
            str(self.grpc),
            "--metrics-port",
            str(metrics),
            "--backend",
            options.backend,
            "--max-batch-size",
            str(options.max_batch_size),
            "--max-queue-delay-us",
            str(options.max_queue_delay_us),
        ]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until ``/v2/health/ready`` (every model loaded), the server exits, or the timeout."""
        client = lazy_import("tritonclient.grpc").InferenceServerClient(self.grpc_url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # its error line, as the log goes with the bench's temp dir
                raise DeployKitError(f"deploykit serve exited with {self.proc.returncode}: {self.last_line()}")
            try:
                if client.is_server_ready():
                    return
            except lazy_import("tritonclient.utils").InferenceServerException:
                pass  # not listening yet
            time.sleep(0.5)
        raise DeployKitError(f"deploykit serve was not ready after {timeout_s} s: {self.last_line()}")

    def last_line(self) -> str:
        """The server's last log line (its ``error:`` line when it failed)."""
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(no output)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the server stops its tritonserver, then exits
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def _served_level(server: ServerProcess, model: str, inputs: np.ndarray, concurrency: int, perf: str | None, workdir: Path) -> dict:
    client = GrpcClient(server.grpc_url, model)
    run_level(client, inputs[: 2 * concurrency], concurrency)  # untimed: connections and thread pools settle
    before = client.counts()
    if perf:
        stats = perf_analyzer_level(perf, server.grpc_url, model, concurrency, len(inputs), workdir)
    else:
        stats = {**run_level(client, inputs, concurrency), "client": "builtin"}
    after = client.counts()
    stats["mean_merged_batch"] = (after[0] - before[0]) / max(after[1] - before[1], 1)
    return stats


def _perf_analyzer(choice: str) -> str | None:
    found = shutil.which("perf_analyzer")
    if choice == "perf_analyzer" and not found:
        raise ConfigError("perf_analyzer is not on PATH (it ships with Triton's client SDK); use --client builtin")
    return found if choice != "builtin" else None


def bench_serving(
    export_dir: str | os.PathLike, options: BenchOptions = BenchOptions(), progress: Callable[[str], None] | None = None
) -> BenchReport:
    """Measure served and in-process throughput and p50/p99 at each concurrency level.

    Raises:
        DeployKitError: not an export directory, a resolution that was not exported, or the server
            did not start.
    """
    import torch

    from deploykit.profile.environment import capture_environment

    export_dir = Path(export_dir)
    perf = _perf_analyzer(options.client)
    with (
        Pipeline(export_dir, backend=options.backend, batch_size=options.max_batch_size) as pipeline,
        tempfile.TemporaryDirectory(prefix="serve_bench_") as tmp,
    ):
        res = options.resolution or pipeline.resolutions[0]
        if res not in pipeline.resolutions:
            raise ConfigError(
                f"{export_dir} has no graph at {resolution_tag(res)}; exported: {', '.join(map(resolution_tag, pipeline.resolutions))}"
            )
        inputs = np.random.default_rng(0).standard_normal((options.requests, 1, pipeline.config.in_chans, *res), dtype=np.float32)
        environment = capture_environment(torch.device("cpu"))
        server = ServerProcess(export_dir, options, Path(tmp) / "server.log")
        try:
            server.wait_ready()
            levels = []
            for concurrency in options.concurrency:
                if progress:
                    progress(f"concurrency {concurrency}")
                run_level(pipeline.logits, inputs[: 2 * concurrency], concurrency)  # untimed warm-up
                local = run_level(pipeline.logits, inputs, concurrency)
                served = _served_level(server, logits_model_name(res), inputs, concurrency, perf, Path(tmp))
                levels.append(
                    {
                        "concurrency": concurrency,
                        "in_process": local,
                        "served": served,
                        "served_vs_in_process_throughput": served["throughput_rps"] / local["throughput_rps"],
                    }
                )
        finally:
            server.stop()
    environment.update(load_average_end=list(os.getloadavg()), date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    settings = {
        "export_dir": str(export_dir),
        "resolution": list(res),
        "backend": options.backend,
        "requests_per_level": options.requests,
        "served": f"deploykit serve (Triton), gRPC, one image per request, dynamic batching max {options.max_batch_size}, "
        f"{options.max_queue_delay_us} us delay; client {'perf_analyzer' if perf else 'builtin'}",
        "in_process": "Pipeline.logits from N threads, one image per call",
    }
    return BenchReport(levels=levels, settings=settings, environment=environment)
