"""Served vs in-process, level by level: the orchestration behind ``deploykit serve-bench``.

Both sides run the same export, backend and resolution, one image per request, under the same
load (``loadgen``: a concurrency, closed loop, or a request rate, open loop):

served, Triton
    ``deploykit serve`` in a child process (dynamic batching), loaded over gRPC on 127.0.0.1 by
    Triton's ``perf_analyzer`` when it is on ``PATH``, else by our own client, one preprocessed
    tensor per request to the logits model. Triton's per-model statistics are read before and
    after each level (``triton_stats``).
served, Ray (``ray=True``)
    ``deploykit serve --ray`` in a child process, loaded by our HTTP client with one PNG per
    request (what ``serve --ray`` takes), so the in-process side runs the whole pipeline
    (``Pipeline(image bytes)``: decode, preprocess, logits, top-k) on the same bytes.
in-process
    ``Pipeline.logits`` (Ray: ``Pipeline(...)``) from the load generator's threads, one image
    per call, no batching.

The levels are interleaved (in-process, then served, per level), each after an untimed warm-up,
so load from other users of the machine hits both sides alike. ``p99_ms`` adds, per side, a
search for the largest load whose p99 stays within it (``search``).
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from deploykit._lazy import lazy_import
from deploykit.errors import ConfigError, unknown_choice
from deploykit.inputs.resolutions import resolution_tag
from deploykit.serve import defaults
from deploykit.serve.bench.clients import GrpcClient, HttpImageClient, perf_analyzer_level
from deploykit.serve.bench.loadgen import Concurrency, RequestRate
from deploykit.serve.bench.records import BenchReport, Level, SideSearch, SideStats
from deploykit.serve.bench.search import largest_within
from deploykit.serve.bench.server import ServerProcess
from deploykit.serve.bench.triton_stats import model_stats_delta, snapshot
from deploykit.serve.pipeline import Pipeline
from deploykit.serve.triton_server import logits_model_name


@dataclass(frozen=True)
class BenchOptions:
    """What ``bench_serving`` measures.

    Attributes:
        concurrency: closed-loop levels, requests in flight at once.
        rates: open-loop levels, requests per second (after the concurrency levels).
        schedule, seed: the open loop's send times (``loadgen.send_times``).
        max_outstanding: the open loop's most unanswered requests (more due: dropped, counted).
        p99_ms: also search, per side, the largest rate (when ``rates`` are given, else
            concurrency) whose p99 stays within this, between the smallest and largest level.
        requests: requests per level and side (a warm-up precedes it).
        resolution: the exported ``(height, width)`` to load; default the export's first.
        backend: the pipeline backend of both sides.
        streams: inference streams of both sides' CPU runners (``Pipeline``'s ``streams``; None: profile's choice).
        max_batch_size, max_queue_delay_us: the server's dynamic batching.
        client: ``"auto"`` (``perf_analyzer`` when installed), ``"perf_analyzer"`` or ``"builtin"``.
        ray, replicas: serve on Ray Serve (``serve --ray``) with this many replicas instead of Triton.
    """

    concurrency: tuple[int, ...] = defaults.BENCH_CONCURRENCY
    rates: tuple[float, ...] = ()
    schedule: str = defaults.BENCH_SCHEDULE
    seed: int = 0
    max_outstanding: int = defaults.BENCH_MAX_OUTSTANDING
    p99_ms: float | None = None
    requests: int = defaults.BENCH_REQUESTS
    resolution: tuple[int, int] | None = None
    backend: str = defaults.BENCH_BACKEND
    streams: int | None = None
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    max_queue_delay_us: int = defaults.MAX_QUEUE_DELAY_US
    client: str = defaults.BENCH_CLIENT
    ray: bool = False
    replicas: int = defaults.RAY_REPLICAS

    def __post_init__(self) -> None:
        if not (self.concurrency or self.rates) or self.requests < 1:
            raise ConfigError(f"need a concurrency level or a request rate, and requests >= 1; got {self.requests} requests")
        if self.client not in defaults.BENCH_CLIENTS:
            raise ConfigError(unknown_choice("client", self.client, defaults.BENCH_CLIENTS))
        if self.ray and self.client == "perf_analyzer":
            raise ConfigError("perf_analyzer speaks KServe to Triton; a Ray Serve deployment is loaded by the builtin client")
        if self.p99_ms is not None and not self.p99_ms > 0:
            raise ConfigError(f"--p99-ms must be positive, got {self.p99_ms}")
        self.loads()  # each level's own checks, before any server starts

    def rate(self, per_s: float) -> RequestRate:
        return RequestRate(per_s, self.schedule, self.seed, self.max_outstanding)

    def loads(self) -> list[Concurrency | RequestRate]:
        return [Concurrency(c) for c in self.concurrency] + [self.rate(r) for r in self.rates]

    def search_space(self) -> tuple[Callable[[float], Concurrency | RequestRate], float, float, bool]:
        """``(make a load of a value, low, high, integer)`` of the p99 search: over the rates
        when given, else the concurrency levels; from 1 when there is a single level."""
        values, make, integer = (self.rates, self.rate, False) if self.rates else (self.concurrency, lambda v: Concurrency(int(v)), True)
        return make, (min(values) if len(values) > 1 else 1), max(values), integer


def _warm_up(load, call: Callable, items: Sequence) -> None:
    """Untimed requests before a level: connections, thread pools and sessions settle."""
    warmup = load.warmup()
    warmup.run(call, items[: 2 * warmup.value], "warm-up")


def _warmed(load, call: Callable, items: Sequence, client: str) -> SideStats:
    _warm_up(load, call, items)
    return load.run(call, items, client)


class TritonTarget:
    """The served side on Triton: one preprocessed tensor per request to the logits model."""

    def __init__(self, server: ServerProcess, model: str, perf_analyzer: str | None, workdir: Path, answer_shape: tuple):
        self.server, self.model, self.perf_analyzer, self.workdir = server, model, perf_analyzer, workdir
        self.answer_shape = answer_shape  # every served answer must have the in-process logits' shape

    @staticmethod
    def items(pipeline: Pipeline, res: tuple[int, int], count: int) -> np.ndarray:
        return np.random.default_rng(0).standard_normal((count, 1, pipeline.config.in_chans, *res), dtype=np.float32)

    @staticmethod
    def in_process(pipeline: Pipeline) -> Callable:
        return pipeline.logits

    def wait_ready(self, item) -> None:
        self.server.wait_ready()

    def measure(self, load, items: Sequence) -> tuple[SideStats, tuple, float | None]:
        """The served side at ``load``, and Triton's per-model statistics over it."""
        client = GrpcClient(self.server.grpc_url, self.model, answer_shape=self.answer_shape)
        requests = [client.prepare(x) for x in items]
        _warm_up(load, client, requests)
        before = snapshot(self.server.grpc_url)
        if self.perf_analyzer:
            stats = perf_analyzer_level(self.perf_analyzer, self.server.grpc_url, self.model, load, len(items), self.workdir)
        else:
            stats = load.run(client, requests, "builtin")
        models = model_stats_delta(before, snapshot(self.server.grpc_url))
        return stats, models, next((m.mean_batch for m in models if m.model == self.model), 0.0)


class RayTarget:
    """The served side on Ray Serve: one encoded PNG per ``POST /``."""

    def __init__(self, server: ServerProcess):
        self.server, self.client = server, HttpImageClient("127.0.0.1", server.http)

    @staticmethod
    def items(pipeline: Pipeline, res: tuple[int, int], count: int) -> list[bytes]:
        image_module = lazy_import("PIL.Image")
        pixels = np.random.default_rng(0).integers(0, 256, (count, *res, 3), dtype=np.uint8)
        out = []
        for image in pixels:
            buffer = io.BytesIO()
            image_module.fromarray(image).save(buffer, format="PNG")  # lossless: both sides see the same pixels
            out.append(buffer.getvalue())
        return out

    @staticmethod
    def in_process(pipeline: Pipeline) -> Callable:
        return pipeline

    def wait_ready(self, item: bytes) -> None:
        self.server.wait_ready(probe=lambda: self.client(item))

    def measure(self, load, items: Sequence) -> tuple[SideStats, tuple, float | None]:
        return _warmed(load, self.client, items, "builtin"), (), None


def _perf_analyzer(choice: str) -> str | None:
    found = shutil.which("perf_analyzer")
    if choice == "perf_analyzer" and not found:
        raise ConfigError("perf_analyzer is not on PATH (it ships with Triton's client SDK); use --client builtin")
    return found if choice != "builtin" else None


def _search(options: BenchOptions, side: str, measure: Callable, progress: Callable[[str], None] | None) -> SideSearch:
    """The p99 search of one side; ``measure(load)`` returns its ``SideStats``."""
    make, low, high, integer = options.search_space()
    seen: dict[float, SideStats] = {}

    def p99(value: float) -> float:
        load = make(value)
        if progress:
            progress(f"p99 search, {side.replace('_', '-')}: {load.label().strip()}")
        seen[value] = measure(load)
        return seen[value].p99_ms

    result = largest_within(p99, options.p99_ms, low, high, integer=integer)
    kind = make(high).kind
    return SideSearch(side, kind, result, None if result.best is None else seen[result.best].throughput_rps)


def bench_serving(
    export_dir: str | os.PathLike, options: BenchOptions = BenchOptions(), progress: Callable[[str], None] | None = None
) -> BenchReport:
    """Measure served and in-process throughput and latency at each level (and, with
    ``p99_ms``, the largest load within it).

    Raises:
        DeployKitError: not an export directory, a resolution that was not exported, or the server
            did not start.
    """
    import torch

    from deploykit.backends.environment import capture_environment

    export_dir = Path(export_dir)
    perf = None if options.ray else _perf_analyzer(options.client)
    target_kind = RayTarget if options.ray else TritonTarget
    with (
        Pipeline(export_dir, backend=options.backend, batch_size=options.max_batch_size, streams=options.streams) as pipeline,
        tempfile.TemporaryDirectory(prefix="serve_bench_") as tmp,
    ):
        res = options.resolution or pipeline.resolutions[0]
        if res not in pipeline.resolutions:
            raise ConfigError(
                f"{export_dir} has no graph at {resolution_tag(res)}; exported: {', '.join(map(resolution_tag, pipeline.resolutions))}"
            )
        items, local = target_kind.items(pipeline, res, options.requests), target_kind.in_process(pipeline)
        environment = capture_environment(torch.device("cpu"))
        server = ServerProcess(export_dir, options, Path(tmp) / "server.log")
        try:
            if options.ray:
                target = RayTarget(server)
            else:
                target = TritonTarget(server, logits_model_name(res), perf, Path(tmp), np.shape(local(items[0])))
            target.wait_ready(items[0])
            levels = []
            for load in options.loads():
                if progress:
                    progress(load.label().strip())
                in_process = _warmed(load, local, items, "in-process")
                served, models, batch = target.measure(load, items)
                levels.append(Level(load, in_process, served, models, batch))
            searches = ()
            if options.p99_ms is not None:
                searches = (
                    _search(options, "in_process", lambda load: _warmed(load, local, items, "in-process"), progress),
                    _search(options, "served", lambda load: target.measure(load, items)[0], progress),
                )
        finally:
            server.stop()
    environment.update(load_average_end=list(os.getloadavg()), date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return BenchReport(tuple(levels), _settings(export_dir, res, options, perf), environment, searches)


def _settings(export_dir: Path, res: tuple[int, int], options: BenchOptions, perf: str | None) -> dict:
    client = "perf_analyzer" if perf else "builtin"
    if options.ray:
        served = f"deploykit serve --ray ({options.replicas} replicas), HTTP POST of one PNG per request, @serve.batch max "
        in_process = "Pipeline(image bytes) from the load's threads: decode, preprocess, logits, top-k"
    else:
        served = "deploykit serve (Triton), gRPC, one preprocessed image per request, dynamic batching max "
        in_process = "Pipeline.logits from the load's threads, one image per call"
    return {
        "export_dir": str(export_dir),
        "resolution": list(res),
        "backend": options.backend,
        "streams": options.streams,
        "requests_per_level": options.requests,
        "served": f"{served}{options.max_batch_size}, {options.max_queue_delay_us} us delay; client {client}",
        "in_process": in_process,
        "target": "ray" if options.ray else "triton",
        "open_loop": {"schedule": options.schedule, "seed": options.seed, "max_outstanding": options.max_outstanding},
    }
