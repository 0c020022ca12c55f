"""Timing primitives: how one measurement is taken and summarised.

Warm-up calls first, then timed calls until the budget is spent; ``perf_counter_ns`` for work
that is finished when the call returns, CUDA events for work queued on a GPU; denormals flushed
to zero while timing (denormals in GELU can slow one variant by tens of percent for reasons that
have nothing to do with the encoding).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deploykit.errors import ConfigError
from deploykit.profile import defaults
from deploykit.runners.cpu import denormals_flushed  # noqa: F401  (profile's timing mode; exported here)


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
            p50_ms=float(p50),
            p90_ms=float(p90),
            p95_ms=float(p95),
            p99_ms=float(p99),
            mean_ms=float(ms.mean()),
            std_ms=float(ms.std(ddof=1)) if ms.size > 1 else 0.0,
            min_ms=float(ms.min()),
            max_ms=float(ms.max()),
            n=int(ms.size),
            throughput_per_s=float(batch * ms.size / (ms.sum() / 1e3)),
        )

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

    duration_s: float = defaults.DURATION_S
    iterations: int | None = None
    warmup: int = defaults.WARMUP
    min_iterations: int = 5
    rounds: int = defaults.ROUNDS

    def __post_init__(self):
        problems = [
            f"{name} must be {rule}, got {value:g}"
            for name, value, ok, rule in (
                ("--duration", self.duration_s, self.duration_s > 0 and math.isfinite(self.duration_s), "a positive number of seconds"),
                ("--warmup", self.warmup, self.warmup >= 0, "0 or more calls"),
                ("min_iterations", self.min_iterations, self.min_iterations >= 1, "at least 1"),
                ("--rounds", self.rounds, self.rounds >= 1, "at least 1"),
                ("--iterations", self.iterations or 0, self.iterations is None or self.iterations >= 1, "at least 1"),
            )
            if not ok
        ]
        if problems:
            raise ConfigError("; ".join(problems))

    def per_round(self) -> Budget:
        iterations = None if self.iterations is None else max(1, math.ceil(self.iterations / self.rounds))
        min_iterations = max(1, math.ceil(self.min_iterations / self.rounds))
        return dataclasses.replace(
            self, duration_s=self.duration_s / self.rounds, iterations=iterations, min_iterations=min_iterations, rounds=1
        )


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


def device_timer(device: torch.device):
    """CUDA events for work queued on a GPU (wall-clock would time only the launches)."""
    return CudaEventTimer() if device.type == "cuda" else CpuTimer()


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
