"""What a profile run produces: one typed record per backend × precision × encoding × resolution ×
batch (a dict only in the JSON and CSV it writes), the ratios between records, and the report that
holds them (written by ``deploykit.profile.output``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from deploykit._io import write_output_json
from deploykit.backends.environment import environment_line
from deploykit.profile.timing import LatencyStats
from deploykit.runners.table import REFERENCE

# The record schema (CSV column order); extra fields follow these.
RECORD_FIELDS = (
    "backend",
    "precision",
    "encoding",
    "resolution",
    "batch",
    "p50_ms",
    "p90_ms",
    "p95_ms",
    "p99_ms",
    "mean_ms",
    "std_ms",
    "min_ms",
    "max_ms",
    "n",
    "throughput_per_s",
)
TORCH_BACKEND = REFERENCE  # PyTorch eager, which runs the model itself
BASELINE_ENCODING = "ape"
FP32 = "fp32"  # PyTorch eager runs this plan only; other plans are ratios to it


@dataclass(frozen=True)
class Verdict:
    """Whether a runner target passed its plan's check against the PyTorch reference before it was
    timed (``deploykit.profile.choice.check_target``).

    Attributes:
        validated: it passed.
        validation_failures: what failed, one line each.
        quality_check: a calibrated plan held to its own export-time target again as this runner
            runs it: the measured metrics, ``met`` and the target's thresholds; None when not checked.
        quality_unchecked: why that target could not be checked again, or None.
    """

    validated: bool
    validation_failures: tuple[str, ...] = ()
    quality_check: Mapping[str, Any] | None = None
    quality_unchecked: str | None = None

    def to_dict(self) -> dict:
        data: dict = {"validated": self.validated, "validation_failures": list(self.validation_failures)}
        if self.quality_unchecked is not None:
            data["quality_unchecked"] = self.quality_unchecked
        if self.quality_check is not None:
            data["quality_check"] = dict(self.quality_check)
        return data


@dataclass(frozen=True)
class ProfileRecord:
    """One measurement: a backend × precision plan × encoding × resolution × batch.

    ``to_dict`` is its JSON object and CSV row: ``RECORD_FIELDS`` from the kernel-only stats, then
    ``e2e_*`` (end-to-end), ``pe_step_p50_ms`` and ``pe_share``, ``gflops`` and
    ``achieved_gflop_per_s``, what the runner reported (``run``), the verdict, the ratios and
    ``fastest_validated``.

    The positional step is timed alone in PyTorch eager only (inside an ONNX graph or an engine
    it cannot be run alone), so ``pe_step`` is given for ``torch`` records, and ``pe_share`` is
    that step's p50 over PyTorch eager's own kernel p50: both measured in the same runtime. Other
    backends' records hold None there; their encoding's cost is ``ratio_vs_ape``.
    """

    backend: str
    precision: str
    encoding: str
    resolution: str  # resolution tag ("224", "384x256")
    batch: int
    kernel: LatencyStats
    e2e: LatencyStats | None = None
    pe_step: LatencyStats | None = None
    flops: int = 0  # of one call at this batch (``deploykit.profile.flops``)
    run: Mapping[str, Any] = field(default_factory=dict)  # what the runner reported (its ``details``)
    verdict: Verdict | None = None  # None: not checked (PyTorch eager, or validate_plans off)
    ape_p50_ms: float | None = None  # the APE twin's p50 in the same backend, plan, resolution, batch
    fp32_p50_ms: float | None = None  # the same lane's fp32 p50
    fastest_validated: bool | None = None  # None: not marked yet (``choice.mark_fastest``)

    @property
    def p50_ms(self) -> float:
        return self.kernel.p50_ms

    @property
    def pe_step_p50_ms(self) -> float | None:
        return None if self.pe_step is None else self.pe_step.p50_ms

    @property
    def pe_share(self) -> float | None:
        return None if self.pe_step is None else self.pe_step.p50_ms / self.kernel.p50_ms

    @property
    def gflops(self) -> float:
        return self.flops / 1e9

    @property
    def achieved_gflop_per_s(self) -> float:
        return self.gflops / (self.kernel.p50_ms / 1e3)

    @property
    def ratio_vs_ape(self) -> float | None:
        return self.p50_ms / self.ape_p50_ms if self.ape_p50_ms else None

    @property
    def ratio_vs_fp32(self) -> float | None:
        return self.p50_ms / self.fp32_p50_ms if self.fp32_p50_ms else None

    @property
    def validated(self) -> bool | None:
        return None if self.verdict is None else self.verdict.validated

    @property
    def cell(self) -> tuple[str, str, int]:
        """(encoding, resolution, batch): the records a choice is made among."""
        return self.encoding, self.resolution, self.batch

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProfileRecord:
        """A record read back from a results file (``to_dict``'s JSON object). A file holds only the
        positional step's p50, so ``pe_step`` comes back None; a file written before records named
        their plan holds fp32 records; the keys no field reads (a sweep's roofline) go to ``run``."""
        stats = lambda prefix: LatencyStats(**{f.name: data[prefix + f.name] for f in fields(LatencyStats)})
        verdict = None
        if "validated" in data:
            verdict = Verdict(
                data["validated"], tuple(data.get("validation_failures", ())), data.get("quality_check"), data.get("quality_unchecked")
            )
        # to_dict's keys: the identity and kernel stats, the e2e stats, the verdict's, and the rest
        read = {*RECORD_FIELDS, *("e2e_" + f.name for f in fields(LatencyStats)), *(f.name for f in fields(Verdict))}
        read |= {"pe_step_p50_ms", "pe_share", "gflops", "achieved_gflop_per_s", "ape_p50_ms", "ratio_vs_ape", "fp32_p50_ms"}
        read |= {"ratio_vs_fp32", "fastest_validated"}
        return cls(
            data["backend"],
            data.get("precision", FP32),
            data["encoding"],
            str(data["resolution"]),
            data["batch"],
            stats(""),
            e2e=stats("e2e_") if "e2e_p50_ms" in data else None,
            flops=round(data.get("gflops", 0) * 1e9),
            run={key: value for key, value in data.items() if key not in read},
            verdict=verdict,
            ape_p50_ms=data.get("ape_p50_ms"),
            fp32_p50_ms=data.get("fp32_p50_ms"),
            fastest_validated=data.get("fastest_validated"),
        )

    def to_dict(self) -> dict:
        record = dict(
            backend=self.backend,
            precision=self.precision,
            encoding=self.encoding,
            resolution=self.resolution,
            batch=self.batch,
            **self.kernel.to_dict(),
        )
        if self.e2e is not None:
            record.update(self.e2e.to_dict("e2e_"))
        record.update(
            pe_step_p50_ms=self.pe_step_p50_ms,
            pe_share=self.pe_share,
            gflops=self.gflops,
            achieved_gflop_per_s=self.achieved_gflop_per_s,
        )
        record.update(self.run)
        if self.verdict is not None:
            record.update(self.verdict.to_dict())
        record.update(
            ape_p50_ms=self.ape_p50_ms, ratio_vs_ape=self.ratio_vs_ape, fp32_p50_ms=self.fp32_p50_ms, ratio_vs_fp32=self.ratio_vs_fp32
        )
        if self.fastest_validated is not None:
            record["fastest_validated"] = self.fastest_validated
        return record


def add_ratios(records: list[ProfileRecord]) -> list[ProfileRecord]:
    """``records`` with ``ape_p50_ms`` (ratio_vs_ape = p50 / the APE twin's p50 in the same
    backend, precision, resolution, batch) and ``fp32_p50_ms`` (ratio_vs_fp32 = p50 / the same
    lane's fp32 p50) set, where such a record exists."""
    ape = {(r.backend, r.precision, r.resolution, r.batch): r.p50_ms for r in records if r.encoding == BASELINE_ENCODING}
    fp32 = {(r.backend, r.encoding, r.resolution, r.batch): r.p50_ms for r in records if r.precision == FP32}
    return [
        replace(
            r,
            ape_p50_ms=ape.get((r.backend, r.precision, r.resolution, r.batch)),
            fp32_p50_ms=fp32.get((r.backend, r.encoding, r.resolution, r.batch)),
        )
        for r in records
    ]


@dataclass
class ProfileReport:
    """Records (one per backend × encoding × resolution × batch), the settings, the environment,
    and notes on what could not be profiled (an engine that was not built, no GPU) and why."""

    records: list[ProfileRecord]
    settings: dict
    environment: dict
    notes: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)  # each cell's fastest validated plan; plans slower than fp32
    choice_file: Path | None = None  # where profile() wrote an export directory's choice (not in the JSON)

    @property
    def environment_line(self) -> str:
        return environment_line(self.environment)

    def to_json(self) -> dict:
        return {
            "environment_line": self.environment_line,
            "environment": self.environment,
            "settings": self.settings,
            "records": [r.to_dict() for r in self.records],
            "notes": self.notes,
            "advice": self.advice,
        }

    def write_json(self, path: str | os.PathLike) -> Path:
        return write_output_json(path, self.to_json())
