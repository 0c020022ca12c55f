"""What ``serve-bench`` measured, as typed records: one ``Level`` per load (a concurrency or a
request rate), each side's ``SideStats`` with its latency distribution, Triton's per-model
``ModelStats`` deltas, and the p99 searches. Dicts appear only in ``to_json``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Protocol

import numpy as np

from deploykit._io import write_output_json

# AIPerf's percentiles (the keys of a ``profile_export_aiperf.json`` stats block), so a side's
# distribution can be laid beside AIPerf's own without recomputing anything.
PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)


@dataclass(frozen=True)
class LatencyMs:
    """A latency distribution in milliseconds, in AIPerf's stats-block names.

    A field is None where the load generator did not report it (``perf_analyzer``'s CSV gives
    p50/p90/p95/p99 and the mean only), as AIPerf omits unset fields. ``std`` is the sample
    standard deviation (``ddof=1``); percentiles interpolate linearly (numpy's default).
    """

    count: int
    avg: float | None = None
    min: float | None = None
    max: float | None = None
    sum: float | None = None
    std: float | None = None
    p1: float | None = None
    p5: float | None = None
    p10: float | None = None
    p25: float | None = None
    p50: float | None = None
    p75: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None

    @classmethod
    def from_ns(cls, samples_ns: Sequence[int]) -> LatencyMs:
        ms = np.asarray(samples_ns, dtype=np.float64) / 1e6
        if ms.size == 0:
            return cls(count=0)
        percentiles = dict(zip((f"p{p}" for p in PERCENTILES), map(float, np.percentile(ms, PERCENTILES))))
        return cls(
            count=int(ms.size),
            avg=float(ms.mean()),
            min=float(ms.min()),
            max=float(ms.max()),
            sum=float(ms.sum()),
            std=float(ms.std(ddof=1)) if ms.size > 1 else 0.0,
            **percentiles,
        )

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class SideStats:
    """One side (served or in-process) of one level.

    Attributes:
        latency: per completed request, from its send to its answer.
        throughput_rps: completed requests over the level's wall time (they overlap).
        client: who generated the load (``builtin``, ``perf_analyzer``, ``in-process``).
        sent: requests sent; open loop: the schedule's requests less the ``dropped`` ones.
        dropped: open loop: requests not sent because ``max_outstanding`` were unanswered.
        late: open loop: requests sent more than ``LATE_AFTER_S`` after their scheduled time
            (the client could not keep the schedule).
    """

    latency: LatencyMs
    throughput_rps: float
    client: str
    sent: int
    dropped: int = 0
    late: int = 0

    @property
    def requests(self) -> int:
        return self.latency.count

    @property
    def p50_ms(self) -> float:
        return self.latency.p50

    @property
    def p99_ms(self) -> float:
        return self.latency.p99

    def to_json(self) -> dict:
        out = {"requests": self.requests, "throughput_rps": self.throughput_rps, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms}
        if self.latency.avg is not None:
            out.update(mean_ms=self.latency.avg, max_ms=self.latency.max)
        return {
            **out,
            "latency_ms": self.latency.to_json(),
            "client": self.client,
            "sent": self.sent,
            "dropped": self.dropped,
            "late": self.late,
        }


@dataclass(frozen=True)
class ModelStats:
    """Triton's inference statistics of one model over one level (after minus before).

    Times are means per successful request in milliseconds, as ``perf_analyzer`` reports its
    server-side breakdown; ``mean_batch`` is inferences per execution (what dynamic batching merged).
    """

    model: str
    requests: int
    executions: int
    inferences: int
    queue_ms: float
    compute_input_ms: float
    compute_infer_ms: float
    compute_output_ms: float

    @property
    def mean_batch(self) -> float:
        return self.inferences / max(self.executions, 1)

    def to_json(self) -> dict:
        return {**asdict(self), "mean_batch": self.mean_batch}


class Load(Protocol):
    """What a level's load says of itself (``loadgen.Concurrency``, ``loadgen.RequestRate``)."""

    kind: str
    value: float

    def label(self) -> str: ...

    def run_label(self) -> str: ...

    def to_json(self) -> dict: ...


@dataclass(frozen=True)
class Level:
    """One load level, both sides measured under the same load.

    Attributes:
        load: closed loop (``Concurrency``) or open loop (``RequestRate``), from ``loadgen``.
        models: Triton's per-model statistics over the served side (empty when serving on Ray).
        mean_merged_batch: the served model's inferences per execution (None on Ray).
    """

    load: Load
    in_process: SideStats
    served: SideStats
    models: tuple[ModelStats, ...] = ()
    mean_merged_batch: float | None = None

    @property
    def served_vs_in_process(self) -> float:
        return self.served.throughput_rps / self.in_process.throughput_rps

    def to_json(self) -> dict:
        served = self.served.to_json()
        if self.mean_merged_batch is not None:
            served["mean_merged_batch"] = self.mean_merged_batch
        return {
            **self.load.to_json(),
            "in_process": self.in_process.to_json(),
            "served": served,
            "served_vs_in_process_throughput": self.served_vs_in_process,
            "triton_models": [m.to_json() for m in self.models],
        }


@dataclass(frozen=True)
class Probe:
    """One measurement of a search: the load value and the p99 it gave."""

    value: float
    p99_ms: float
    within: bool


@dataclass(frozen=True)
class SearchResult:
    """The largest load whose p99 stayed within ``limit_ms`` (None: not even the lowest)."""

    limit_ms: float
    best: float | None
    probes: tuple[Probe, ...]


@dataclass(frozen=True)
class SideSearch:
    """A p99 search of one side, with the throughput measured at the load it found."""

    side: str
    kind: str
    result: SearchResult
    best_throughput_rps: float | None

    def to_json(self) -> dict:
        return {
            "side": self.side,
            "kind": self.kind,
            "p99_limit_ms": self.result.limit_ms,
            "largest_within": self.result.best,
            "throughput_rps_at_largest": self.best_throughput_rps,
            "probes": [asdict(p) for p in self.result.probes],
        }


@dataclass(frozen=True)
class BenchReport:
    """Per level, both sides' throughput (requests/s) and latency (ms), Triton's per-model
    statistics, and the p99 searches.

    Attributes:
        levels: concurrency levels first, then request rates, in the order asked.
        searches: ``--p99-ms``'s searches, in-process and served (empty when not asked).
        settings: what was measured (export, resolution, backend, batching, client, target).
        environment: CPU, versions, load averages at start and end, date.
    """

    levels: tuple[Level, ...]
    settings: dict
    environment: dict = field(default_factory=dict)
    searches: tuple[SideSearch, ...] = ()

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {
            **out,
            "levels": [level.to_json() for level in self.levels],
            "searches": [s.to_json() for s in self.searches],
        }

    def write_json(self, path: str | os.PathLike) -> Path:
        return write_output_json(path, self.to_json())
