"""Latency across resolutions, batches and backends, and what the positional encoding costs.

Method (``design.md`` "Profiling methodology"):

* every measurement starts with untimed warm-up calls, so each resolution, batch and backend
  switch is warmed (PyTorch's and ONNX Runtime's thread pools fight for the cores when they
  alternate call by call; the untimed calls let the other pool go idle first);
* CPU work is timed with ``perf_counter_ns``; PyTorch on CUDA with CUDA events;
* kernel-only (the model on a prepared input) and end-to-end (uint8 camera frames through
  ``deploykit.data.preprocess``, host copies, the model, softmax + top-5) side by side;
* the same trunk with a learned APE runs in the same session, so each encoding's cost is a
  ratio measured under the same load, and the positional step alone (table add, q/k rotation,
  or logits bias, over all blocks) shows where that cost goes;
* ``torch.set_flush_denormal(True)`` during timing runs: denormals in GELU can slow one variant
  by tens of percent for reasons that have nothing to do with the encoding.

A sequence model (MoPE + EGA) is profiled the same way with its length as the resolution: token
ids as the kernel input, and text → character ids → model → next-token top-5 as end-to-end.

Backends are ``"torch"`` (eager, the baseline) plus every name in
``deploykit.validate.RUNNER_FACTORIES`` (ONNX-based runners), so a runner added there is
profiled with no change here.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from deploykit._environment import capture_environment, environment_line
from deploykit.backends.plugins import Plugins
from deploykit.data import encode_chars, preprocess, random_inputs, random_token_inputs, sample_text
from deploykit.encodings import Hook, encoding_name, get_config
from deploykit.errors import ConfigError, DeployKitError, ExportError, ResolutionError
from deploykit.export.bundle import load_reference
from deploykit.export.manifest import Manifest
from deploykit.export.onnx_export import BakedModel, check_export_shape, onnx_from_model
from deploykit.export.precision import check_precision
from deploykit.nn.factory import Model, build_model
from deploykit.nn.sequence import SequenceConfig
from deploykit.nn.vit import VisionTransformer
from deploykit.resolutions import parse_resolution, resolution_tag

# The record schema (CSV column order); extra fields follow these.
RECORD_FIELDS = (
    "backend", "precision", "encoding", "resolution", "batch",
    "p50_ms", "p90_ms", "p95_ms", "p99_ms", "mean_ms", "std_ms", "min_ms", "max_ms", "n", "throughput_per_s",
)  # fmt: skip
TORCH_BACKEND = "torch"
BASELINE_ENCODING = "ape"
FP32 = "fp32"  # PyTorch eager runs this plan only; other plans are ratios to it
# End-to-end inputs: seeded uint8 frames of a common camera size (preprocessing cost depends on
# the size, not on the content, so no image files are needed).
FRAME_SHAPE = (480, 640, 3)


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one measurement, in milliseconds.

    Percentiles interpolate linearly between order statistics (numpy's default); ``std_ms`` is
    the sample standard deviation (``ddof=1``, 0 for a single sample). ``throughput_per_s`` is
    images per second over the whole measurement: ``batch * n / sum(samples)``.
    """

    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    std_ms: float
    min_ms: float
    max_ms: float
    n: int
    throughput_per_s: float

    @classmethod
    def from_ns(cls, samples_ns: Sequence[int], batch: int = 1) -> LatencyStats:
        ms = np.asarray(samples_ns, dtype=np.float64) / 1e6
        if ms.size == 0:
            raise ValueError("no samples")
        p50, p90, p95, p99 = np.percentile(ms, [50, 90, 95, 99])
        return cls(
            p50_ms=float(p50), p90_ms=float(p90), p95_ms=float(p95), p99_ms=float(p99),
            mean_ms=float(ms.mean()), std_ms=float(ms.std(ddof=1)) if ms.size > 1 else 0.0,
            min_ms=float(ms.min()), max_ms=float(ms.max()), n=int(ms.size),
            throughput_per_s=float(batch * ms.size / (ms.sum() / 1e3)),
        )  # fmt: skip

    def to_dict(self, prefix: str = "") -> dict[str, float | int]:
        return {prefix + k: v for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class Budget:
    """How long each measurement runs (one backend × encoding × resolution × batch × mode).

    Attributes:
        duration_s: stop after this many seconds of timed calls (ignored when ``iterations`` is set).
        iterations: exactly this many timed calls.
        warmup: untimed calls before each measurement (and after every backend switch).
        min_iterations: at least this many timed calls even when ``duration_s`` runs out.
        rounds: split each measurement into this many rounds, interleaving encodings, so a
            load change on a shared machine hits every encoding alike.
    """

    duration_s: float = 1.0
    iterations: int | None = None
    warmup: int = 3
    min_iterations: int = 5
    rounds: int = 1

    def __post_init__(self):
        problems = [f"{name} must be {rule}, got {value:g}" for name, value, ok, rule in (
            ("--duration", self.duration_s, self.duration_s > 0 and math.isfinite(self.duration_s), "a positive number of seconds"),
            ("--warmup", self.warmup, self.warmup >= 0, "0 or more calls"),
            ("min_iterations", self.min_iterations, self.min_iterations >= 1, "at least 1"),
            ("--rounds", self.rounds, self.rounds >= 1, "at least 1"),
            ("--iterations", self.iterations or 0, self.iterations is None or self.iterations >= 1, "at least 1"),
        ) if not ok]  # fmt: skip
        if problems:
            raise ConfigError("; ".join(problems))

    def per_round(self) -> Budget:
        iterations = None if self.iterations is None else max(1, math.ceil(self.iterations / self.rounds))
        min_iterations = max(1, math.ceil(self.min_iterations / self.rounds))
        return dataclasses.replace(self, duration_s=self.duration_s / self.rounds, iterations=iterations,
                                   min_iterations=min_iterations, rounds=1)  # fmt: skip


class CpuTimer:
    """Wall-clock time of a synchronous call."""

    name = "perf_counter_ns"

    def time_ns(self, fn: Callable[[], object]) -> int:
        start = time.perf_counter_ns()
        fn()
        return time.perf_counter_ns() - start


class CudaEventTimer:
    """GPU time between two CUDA events recorded around the call, on the current stream."""

    name = "cuda_events"

    def __init__(self):
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def time_ns(self, fn: Callable[[], object]) -> int:
        self._start.record()
        fn()
        self._end.record()
        self._end.synchronize()
        return round(self._start.elapsed_time(self._end) * 1e6)


def measure(fn: Callable[[], object], budget: Budget, timer=None) -> list[int]:
    """Warm up, then time ``fn`` until the budget is spent.

    Returns:
        Per-call latencies in nanoseconds.
    """
    timer = timer or CpuTimer()
    for _ in range(budget.warmup):
        fn()
    samples: list[int] = []
    deadline = time.perf_counter_ns() + int(budget.duration_s * 1e9)
    while True:
        samples.append(timer.time_ns(fn))
        if budget.iterations is not None:
            if len(samples) >= budget.iterations:
                return samples
        elif len(samples) >= budget.min_iterations and time.perf_counter_ns() >= deadline:
            return samples


@contextlib.contextmanager
def flush_denormal() -> Iterator[bool]:
    """Flush denormals to zero for the block (PyTorch has no getter; the default is off, so
    that is restored). Yields whether the CPU supports it."""
    supported = torch.set_flush_denormal(True)
    try:
        yield supported
    finally:
        torch.set_flush_denormal(False)


# ----------------------------------------------------------------------------------------------
# what is profiled


@dataclass
class Subject:
    """One model to profile, and ONNX graphs already exported for it. A subject made from a model
    builds the graphs it is asked for in memory (each precision plan as ``export`` writes it); one
    read from an export directory times only what was exported there.

    Attributes:
        model: the trunk with its encoding.
        graphs: ``(resolution, precision)`` → ``.onnx`` path (from an export directory).
        exported_only: refuse graphs that are not in ``graphs`` (an export directory's subject).
    """

    model: VisionTransformer
    graphs: dict[tuple[tuple[int, int], str], Path] = field(default_factory=dict)
    exported_only: bool = False
    baseline: bool = False  # the APE twin profile adds
    _built: dict[tuple[tuple[int, int], str], bytes] = field(default_factory=dict, repr=False)

    @property
    def encoding(self) -> str:
        return encoding_name(self.model.cfg.encoding)

    @property
    def resolutions(self) -> list[tuple[int, int]]:
        """The exported resolutions, in manifest order."""
        return list(dict.fromkeys(resolution for resolution, _ in self.graphs))

    def has(self, resolution: tuple[int, int], precision: str) -> bool:
        return not self.exported_only or (tuple(resolution), precision) in self.graphs

    def onnx(self, resolution: tuple[int, int], precision: str = FP32) -> Path | bytes:
        key = (tuple(resolution), precision)
        if key in self.graphs:
            return self.graphs[key]
        if self.exported_only:
            raise ConfigError(f"no {precision} graph at {resolution_tag(resolution)}; run deploykit export --precision {precision}")
        if key not in self._built:
            from deploykit.export.bundle import planned_graph

            fp32 = onnx_from_model(self.model, resolution)
            planned = fp32 if precision == FP32 else planned_graph(fp32, self.model, resolution, precision)
            self._built[key] = planned.SerializeToString()
        return self._built[key]

    @classmethod
    def from_export_dir(cls, directory: str | os.PathLike, precisions: Sequence[str] = (FP32,)) -> Subject:
        """The reference model and the (unchanged) graphs of each precision plan of an export directory."""
        from deploykit.export.manifest import checked_graph  # refuses files changed since export

        manifest = Manifest.read(directory)
        graphs = {(tuple(g.resolution), g.precision): checked_graph(Path(directory), g) for p in precisions for g in manifest.graphs_at(p)}
        return cls(load_reference(directory), graphs, exported_only=True)


def ape_twin(model: Model, max_length: int = 0) -> Model:
    """The same trunk (same weights) with a learned APE in place of the model's encoding (for a
    sequence model, a table covering at least ``max_length`` positions)."""
    changes = dict(encoding=get_config(BASELINE_ENCODING))
    if isinstance(model.cfg, SequenceConfig):
        changes["context"] = max(model.cfg.context, max_length)
    twin = build_model(dataclasses.replace(model.cfg, **changes)).eval()
    own = twin.state_dict()
    shared = {k: v for k, v in model.state_dict().items() if k in own and own[k].shape == v.shape and k != "pos_embed"}
    twin.load_state_dict(shared, strict=False)
    return twin


def parse_resolutions(values: Sequence[str]) -> list[tuple[int, int]]:
    """``["224", "384,512", "384x256"]`` → resolutions in order, duplicates dropped."""
    out = []
    for value in values:
        for part in str(value).split(","):
            try:
                out.append(parse_resolution(part.strip()))
            except ExportError as err:
                raise ResolutionError(str(err)) from None
    return list(dict.fromkeys(out))


def parse_counts(values: Sequence[str], what: str) -> list[int]:
    """``["1,8", "32"]`` → ``[1, 8, 32]``; each must be a positive integer."""
    out = []
    for value in values:
        for part in str(value).split(","):
            try:
                count = int(part)
            except ValueError:
                count = 0
            if count < 1:
                raise ConfigError(f"invalid {what} {part.strip()!r}; expected positive integers such as 1,8,32")
            out.append(count)
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------------------------
# analytic FLOPs (multiply-add = 2 FLOPs)


def gemm_shapes(cfg, resolution: tuple[int, int], batch: int) -> list[tuple[int, int, int, int]]:
    """Every matrix product of one forward as ``(count, m, k, n)`` (``count`` batched products of
    ``[m, k] @ [k, n]``): patch embedding, per block qkv / q·kᵀ / attn·v / proj / fc1 / fc2, head.
    For a sequence model (``resolution`` ``(T,)``): no patch embedding, EGA's energy projection
    per block, and the tied LM head over every position."""
    if isinstance(cfg, SequenceConfig):
        return _sequence_gemm_shapes(cfg, resolution[0], batch)
    gh, gw = resolution[0] // cfg.patch_size, resolution[1] // cfg.patch_size
    tokens = gh * gw + cfg.num_prefix_tokens
    d, heads, hidden, rows = cfg.embed_dim, cfg.num_heads, int(cfg.embed_dim * cfg.mlp_ratio), batch * tokens
    head_dim = d // heads
    block = [
        (1, rows, d, 3 * d),  # qkv
        (batch * heads, tokens, head_dim, tokens),  # q @ k^T
        (batch * heads, tokens, tokens, head_dim),  # softmax(.) @ v
        (1, rows, d, d),  # proj
        (1, rows, d, hidden),  # fc1
        (1, rows, hidden, d),  # fc2
    ]
    patch = (1, batch * gh * gw, cfg.in_chans * cfg.patch_size**2, d)
    head = (1, batch, d, cfg.num_classes)
    return [patch, *block * cfg.depth, head]


def _sequence_gemm_shapes(cfg: SequenceConfig, length: int, batch: int) -> list[tuple[int, int, int, int]]:
    d, heads, hidden, rows = cfg.embed_dim, cfg.num_heads, int(cfg.embed_dim * cfg.mlp_ratio), batch * length
    block = [(1, rows, d, 3 * d), (batch * heads, length, d // heads, length), (batch * heads, length, length, d // heads),
             (1, rows, d, d), (1, rows, d, hidden), (1, rows, hidden, d)]  # fmt: skip
    if cfg.attention == "ega":
        block.append((1, rows, d, heads))  # energy r = x w_E + b_E, one scalar per head
    return [*block * cfg.depth, (1, rows, d, cfg.vocab_size)]


def model_flops(cfg, resolution: tuple[int, int], batch: int) -> int:
    """FLOPs of one forward counted from the GEMMs (elementwise work, softmax, LayerNorm and the
    positional step are a few percent and left out, as in the usual ViT counts)."""
    return sum(2 * count * m * k * n for count, m, k, n in gemm_shapes(cfg, resolution, batch))


# ----------------------------------------------------------------------------------------------
# backends


def _device_timer(device: torch.device):
    """CUDA events for work queued on a GPU (wall-clock would time only the launches)."""
    return CudaEventTimer() if device.type == "cuda" else CpuTimer()


class _TorchTarget:
    """PyTorch eager on the baked model (tables built once per resolution, as in the ONNX graph)."""

    def __init__(self, model: VisionTransformer, resolution: tuple[int, int], device: torch.device):
        self.device = device
        # A float32 copy on the device: the caller's model is left as it was.
        self.module = BakedModel(copy.deepcopy(model).float().eval(), resolution).to(device).eval()
        self.timer = _device_timer(device)

    def kernel(self, images: np.ndarray) -> Callable[[], object]:
        x = torch.from_numpy(images).to(self.device)
        return lambda: self._forward(x)

    def infer_host(self, images: np.ndarray) -> np.ndarray:
        return self._forward(torch.from_numpy(images).to(self.device)).cpu().numpy()

    def details(self) -> dict:
        return {"provider": f"torch {torch.__version__} {self.device.type}"}

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.module(x)

    def close(self) -> None:
        self.module = None


class _RunnerTarget:
    """A runner from ``RUNNER_FACTORIES``; its ``infer`` returns host arrays, so wall-clock
    time is right on any device (kernel-only then includes that runner's own copies)."""

    timer = CpuTimer()

    def __init__(self, runner):
        self.runner = runner
        runner.activate()
        (self.input_name,) = runner.input_names()  # images, or tokens for a sequence model

    def kernel(self, inputs: np.ndarray) -> Callable[[], object]:
        feed = {self.input_name: np.ascontiguousarray(inputs)}
        return lambda: self.runner.infer(feed)

    def infer_host(self, inputs: np.ndarray) -> np.ndarray:
        return self.runner.infer({self.input_name: inputs})["logits"]

    def details(self) -> dict:
        """What ran (after measuring: an engine runner captures its CUDA graphs on first use)."""
        return self.runner.details

    def close(self) -> None:
        self.runner.deactivate()


def backend_names() -> list[str]:
    """Backends ``profile`` knows: PyTorch eager plus every registered ONNX runner."""
    from deploykit.backends.registry import RUNNER_FACTORIES

    return [TORCH_BACKEND, *RUNNER_FACTORIES]


class _Unavailable(Exception):
    """A subject cannot run on an engine backend here; the report notes why."""


def _open_target(backend: str, subject: Subject, resolution: tuple[int, int], precision: str, device: torch.device, engine: dict):
    if backend == TORCH_BACKEND:
        return _TorchTarget(subject.model, resolution, device)
    from deploykit.backends.engine_cache import ENGINE_MODULES
    from deploykit.backends.registry import create_runner

    if backend not in ENGINE_MODULES:
        return _RunnerTarget(create_runner(backend, subject.onnx(resolution, precision)))
    # An engine exists only beside a graph of an export directory (deploykit build wrote it).
    plan = "" if precision == FP32 else f" {precision}"
    where = f"{subject.encoding}{plan} on {backend} @ {resolution_tag(resolution)}"
    if (resolution, precision) not in subject.graphs:
        why = "the APE baseline is exported in memory, so no engine was built for it" if subject.baseline else \
            "no exported graph at this resolution, so no engine"  # fmt: skip
        raise _Unavailable(f"{where}: not profiled: {why}")
    try:
        return _RunnerTarget(create_runner(backend, subject.graphs[resolution, precision], **engine))
    except DeployKitError as err:  # no engine built, a stale one, no GPU: said, not a traceback
        raise _Unavailable(f"{where}: not profiled: {err}") from err


def _end_to_end(target, frames: list, resolution, cfg) -> Callable[[], object]:
    """Frames → preprocess → model → softmax → top-5, all host work and copies included (for a
    sequence model: texts → character ids → model → the last position's top-5)."""
    if isinstance(cfg, SequenceConfig):

        def run_text():
            ids = np.stack([encode_chars(text, cfg.vocab_size)[: resolution[0]] for text in frames])
            logits = target.infer_host(ids)[:, -1]
            return np.argsort(-logits, -1)[:, :5]  # softmax keeps the order

        return run_text

    def run():
        batch = np.stack([preprocess(f, resolution, cfg.mean, cfg.std) for f in frames])
        logits = target.infer_host(batch)
        shifted = np.exp(logits - logits.max(-1, keepdims=True))
        probs = shifted / shifted.sum(-1, keepdims=True)
        return np.argsort(-probs, -1)[:, :5]

    return run


def _pe_step(model: VisionTransformer, resolution, batch: int, device: torch.device) -> Callable[[], object]:
    """The positional step alone, over every block where it runs per block, on random activations."""
    if not isinstance(model, VisionTransformer):  # a sequence model: its table add
        table = model.shape_tables(resolution).model["pos_embed"].detach().to(device, torch.float32)
        x = torch.randn(batch, resolution[0], model.cfg.embed_dim, generator=torch.Generator().manual_seed(0)).to(device)
        return lambda: x + table
    cfg, pos_enc = model.cfg, copy.deepcopy(model.pos_enc).to(device)
    grid = model.grid(*resolution)
    tables = model.tables(grid, torch.float32, device)
    tokens = math.prod(grid) + cfg.num_prefix_tokens
    gen = torch.Generator().manual_seed(0)
    head_dim = cfg.embed_dim // cfg.num_heads
    x = torch.randn(batch, tokens, cfg.embed_dim, generator=gen).to(device)
    q, k = (torch.randn(batch, cfg.num_heads, tokens, head_dim, generator=gen).to(device) for _ in range(2))
    layer = lambda i: tables.layers[i] if tables.layers else {}  # noqa: E731
    # An encoding may use several hooks (SaPE²+APE: a table add and a logits bias per block).
    steps = []
    if pos_enc.uses(Hook.TOKENS):
        steps.append(lambda: pos_enc.apply_tokens(x, tables.model))
    if pos_enc.uses(Hook.QK):
        steps.append(lambda: [pos_enc.apply_qk(q, k, layer(i)) for i in range(cfg.depth)])
    if pos_enc.uses(Hook.LOGITS):
        steps.append(lambda: [pos_enc.logits_bias(q, k, layer(i), grid) for i in range(cfg.depth)])
    step = lambda: [s() for s in steps]  # noqa: E731

    def run():
        with torch.inference_mode():
            return step()

    return run


# ----------------------------------------------------------------------------------------------
# the report


@dataclass
class ProfileReport:
    """Records (one per backend × encoding × resolution × batch), the settings, the environment,
    and notes on what could not be profiled (an engine that was not built, no GPU) and why."""

    records: list[dict]
    settings: dict
    environment: dict
    notes: list[str] = field(default_factory=list)

    @property
    def environment_line(self) -> str:
        return environment_line(self.environment)

    def to_json(self) -> dict:
        return {"environment_line": self.environment_line, "environment": self.environment, "settings": self.settings,
                "records": self.records, "notes": self.notes}  # fmt: skip

    def write_json(self, path: str | os.PathLike) -> Path:
        from deploykit._io import write_json_atomic

        return write_json_atomic(path, self.to_json())

    def write_csv(self, path: str | os.PathLike) -> Path:
        from deploykit.profile_output import write_csv

        return write_csv(path, self.records)

    def plot(self, path: str | os.PathLike) -> Path:
        from deploykit.profile_output import plot_latency

        return plot_latency(path, self.records, title=self.settings.get("model", ""))


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this PyTorch build sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; choose one of: auto, cpu, cuda")
    return torch.device(device)


def _check_inputs(subjects: list[Subject], resolutions, batches, backends, precisions) -> None:
    if not resolutions:
        raise ResolutionError("no resolution to profile")
    for subject in subjects:
        for resolution in resolutions:
            check_export_shape(subject.model, resolution)  # ResolutionError with a hint, before any work
    for precision in precisions:
        check_precision(precision)
        missing = [resolution_tag(r) for r in resolutions if not subjects[0].has(r, precision)]
        if missing:
            raise ConfigError(f"no {precision} graph at {', '.join(missing)}; run deploykit export --precision {precision}")
    if not batches or min(batches) < 1:
        raise ConfigError(f"batch sizes must be positive integers, got {list(batches)}")
    known = backend_names()
    unknown = [b for b in backends if b not in known]
    if unknown or not backends:
        raise ConfigError(f"unknown backend {', '.join(unknown) or '(none)'}; choose from: {', '.join(known)}")
    encodings = [s.encoding for s in subjects]
    if len(set(encodings)) != len(encodings):
        raise ConfigError(f"each profiled model needs its own encoding, got {encodings}")


def profile(
    models: VisionTransformer | Subject | Sequence[VisionTransformer | Subject],
    *,
    resolutions: Sequence[tuple[int, int]],
    batches: Sequence[int] = (1,),
    backends: Sequence[str] = (TORCH_BACKEND, "ort"),
    precisions: Sequence[str] = (FP32,),
    budget: Budget = Budget(),
    compare_ape: bool = True,
    end_to_end: bool = True,
    device: str = "auto",
    label: str = "",
    progress: Callable[[str], None] | None = None,
    plugins: Plugins = Plugins(),
    cuda_graphs: bool = True,
) -> ProfileReport:
    """Profile models (one per encoding, same trunk) at each resolution, batch and backend.

    Args:
        models: a model, a ``Subject`` (model + exported graphs), or several with different encodings.
        resolutions: ``(height, width)`` pairs, multiples of the patch size.
        batches: batch sizes.
        backends: ``"torch"`` and/or names from ``RUNNER_FACTORIES``.
        precisions: precision plans the ONNX runners time, interleaved (an export directory's,
            or built in memory as ``export`` would write them); PyTorch eager runs fp32 only.
        budget: time per measurement.
        compare_ape: add the same trunk with a learned APE when no APE model is given, and
            report every encoding's latency as a ratio to it.
        end_to_end: also time preprocessing + copies + model + top-5 per batch.
        device: ``auto``, ``cpu`` or ``cuda`` for PyTorch (ONNX runners pick their own providers).
        label: the model's name for the report (e.g. ``vit_small_patch16``).
        plugins: for engine backends, the plugins the engines were built with.
        cuda_graphs: engine backends replay CUDA graphs where the engine allows it (each record
            says whether they did: ``cuda_graph``, ``cuda_graph_note``).

    Returns:
        The report; ``records`` follow ``RECORD_FIELDS`` (kernel-only latency) and then extra
        fields: ``e2e_*`` (end-to-end), ``pe_step_p50_ms`` and ``pe_share`` (positional step
        alone and its share of the kernel p50), ``ape_p50_ms`` and ``ratio_vs_ape``, ``gflops``
        and ``achieved_gflop_per_s``, ``fp32_p50_ms`` and ``ratio_vs_fp32``, ``provider`` (what
        ran it). On an engine backend only the engines ``deploykit build`` wrote are timed; what
        is missing is in ``notes``.

    Raises:
        ResolutionError: a resolution the model cannot take.
        ConfigError: unknown backend or device, bad batch or budget.
        DeployKitError: nothing could be profiled (the notes say why).
    """
    subjects = [m if isinstance(m, Subject) else Subject(m) for m in (models if isinstance(models, Sequence) else [models])]
    # A model's own shape: (height, width), or (T,) for a sequence model given "-r 256".
    resolutions = list(dict.fromkeys(subjects[0].model.check_shape(tuple(r)) for r in resolutions)) if resolutions else []
    if compare_ape and BASELINE_ENCODING not in [s.encoding for s in subjects]:
        subjects.append(Subject(ape_twin(subjects[0].model, max((r[0] for r in resolutions), default=0)), baseline=True))
    _check_inputs(subjects, resolutions, batches, backends, precisions)
    torch_device = _resolve_device(device)
    settings = dict(model=label, resolutions=[resolution_tag(r) for r in resolutions], batches=list(batches),
                    backends=list(backends), precisions=list(precisions), encodings=[s.encoding for s in subjects], device=str(torch_device),
                    budget=dataclasses.asdict(budget), end_to_end=end_to_end, flush_denormal=True)  # fmt: skip
    records: list[dict] = []
    notes: list[str] = []
    engine = dict(plugins=plugins, cuda_graph=cuda_graphs)
    with flush_denormal():
        environment = capture_environment(torch_device)
        for resolution in resolutions:
            records += _profile_resolution(subjects, resolution, batches, backends, precisions, budget, end_to_end, torch_device,
                                           progress, engine, notes)  # fmt: skip
    if not records:
        raise DeployKitError(f"nothing was profiled: {'; '.join(notes)}")
    environment["load_average_end"] = list(os.getloadavg())
    _add_ape_ratios(records)
    return ProfileReport(records, settings, environment, notes)


def _open_targets(backend, lanes, resolution, device, engine, progress, notes) -> list:
    """``((subject, precision), target)`` for every lane that can run on ``backend``; a note for each that cannot."""
    targets = []
    for subject, precision in lanes:
        if progress:
            progress(f"{backend} {subject.encoding} {precision} @ {resolution_tag(resolution)}: preparing")
        try:
            targets.append(((subject, precision), _open_target(backend, subject, resolution, precision, device, engine)))
        except _Unavailable as err:
            notes.append(str(err))
    return targets


def _profile_resolution(subjects, resolution, batches, backends, precisions, budget, end_to_end, device, progress, engine,
                        notes) -> list[dict]:  # fmt: skip
    tag = resolution_tag(resolution)
    cfg = subjects[0].model.cfg
    pe_steps = {}
    for subject in subjects:
        for batch in batches:
            step = _pe_step(subject.model, resolution, batch, device)
            pe_steps[subject.encoding, batch] = LatencyStats.from_ns(measure(step, budget, _device_timer(device)))
    rng = np.random.default_rng(0)
    records = []
    for backend in backends:
        # (subject, precision) lanes of this backend, interleaved round by round; PyTorch runs fp32 only.
        lanes = [(s, p) for p in ([FP32] if backend == TORCH_BACKEND else precisions) for s in subjects if s.has(resolution, p)]
        targets = []
        try:
            targets = _open_targets(backend, lanes, resolution, device, engine, progress, notes)
            for batch in batches:
                images, frames = _inputs(subjects[0].model, resolution, batch, rng)
                samples = {}
                for _ in range(budget.rounds):
                    for (subject, precision), target in targets:
                        if progress:
                            progress(f"{backend} {subject.encoding} {precision} @ {tag} batch {batch}")
                        lane = (subject.encoding, precision)
                        samples.setdefault((lane, "kernel"), []).extend(measure(target.kernel(images), budget.per_round(), target.timer))
                        if end_to_end:
                            samples.setdefault((lane, "e2e"), []).extend(
                                measure(_end_to_end(target, frames, resolution, subject.model.cfg), budget.per_round()))
                for (subject, precision), target in targets:
                    lane = (subject.encoding, precision)
                    kernel = LatencyStats.from_ns(samples[lane, "kernel"], batch)
                    e2e = LatencyStats.from_ns(samples[lane, "e2e"], batch) if end_to_end else None
                    records.append(_record(backend, precision, subject.encoding, tag, batch, kernel, e2e, pe_steps[subject.encoding, batch],
                                           model_flops(cfg, resolution, batch)) | target.details())  # fmt: skip
        finally:
            for _, target in targets:
                target.close()
    return records


def _inputs(model: Model, resolution, batch: int, rng: np.random.Generator) -> tuple[np.ndarray, list]:
    """Kernel inputs (seeded noise images or token ids) and end-to-end inputs (uint8 frames or texts)."""
    if isinstance(model.cfg, SequenceConfig):
        text = sample_text()
        starts = rng.integers(0, len(text), batch)
        texts = [(text * (resolution[0] // len(text) + 2))[s : s + resolution[0]] for s in starts]
        return random_token_inputs(batch, resolution[0], model.cfg.vocab_size, seed=batch), texts
    return random_inputs(batch, resolution, seed=batch), [rng.integers(0, 256, FRAME_SHAPE, dtype=np.uint8) for _ in range(batch)]


def _record(backend, precision, encoding, tag, batch, kernel: LatencyStats, e2e, pe_step: LatencyStats, flops: int) -> dict:
    record = dict(backend=backend, precision=precision, encoding=encoding, resolution=tag, batch=batch, **kernel.to_dict())
    if e2e is not None:
        record.update(e2e.to_dict("e2e_"))
    record.update(
        pe_step_p50_ms=pe_step.p50_ms,
        pe_share=pe_step.p50_ms / kernel.p50_ms,
        gflops=flops / 1e9,
        achieved_gflop_per_s=flops / 1e9 / (kernel.p50_ms / 1e3),
    )
    return record


def _add_ape_ratios(records: list[dict]) -> None:
    """``ape_p50_ms`` and ``ratio_vs_ape`` = p50 / APE p50 (same backend, precision, resolution,
    batch), and ``fp32_p50_ms`` and ``ratio_vs_fp32`` = p50 / the same lane's fp32 p50."""
    ape = {(r["backend"], r["precision"], r["resolution"], r["batch"]): r["p50_ms"] for r in records if r["encoding"] == BASELINE_ENCODING}
    fp32 = {(r["backend"], r["encoding"], r["resolution"], r["batch"]): r["p50_ms"] for r in records if r["precision"] == FP32}
    for r in records:
        base = ape.get((r["backend"], r["precision"], r["resolution"], r["batch"]))
        r["ape_p50_ms"] = base
        r["ratio_vs_ape"] = r["p50_ms"] / base if base else None
        full = fp32.get((r["backend"], r["encoding"], r["resolution"], r["batch"]))
        r["fp32_p50_ms"] = full
        r["ratio_vs_fp32"] = r["p50_ms"] / full if full else None
