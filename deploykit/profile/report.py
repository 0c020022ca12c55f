"""What a profile run produces: one record per backend × precision × encoding × resolution ×
batch, the ratios between records, and the report that holds them (written by
``deploykit.profile.output``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from deploykit._io import write_output_json
from deploykit.profile.environment import environment_line
from deploykit.profile.timing import LatencyStats

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
TORCH_BACKEND = "torch"
BASELINE_ENCODING = "ape"
FP32 = "fp32"  # PyTorch eager runs this plan only; other plans are ratios to it


def make_record(backend, precision, encoding, tag, batch, kernel: LatencyStats, e2e, pe_step: LatencyStats | None, flops: int) -> dict:
    """One record: ``RECORD_FIELDS`` from the kernel-only stats, then ``e2e_*`` (end-to-end),
    ``pe_step_p50_ms`` and ``pe_share``, ``gflops`` and ``achieved_gflop_per_s``.

    The positional step is timed alone in PyTorch eager only (inside an ONNX graph or an engine
    it cannot be run alone), so ``pe_step`` is given for ``torch`` records, and ``pe_share`` is
    that step's p50 over PyTorch eager's own kernel p50: both measured in the same runtime. Other
    backends' records hold None there; their encoding's cost is ``ratio_vs_ape``.
    """
    record = dict(backend=backend, precision=precision, encoding=encoding, resolution=tag, batch=batch, **kernel.to_dict())
    if e2e is not None:
        record.update(e2e.to_dict("e2e_"))
    record.update(
        pe_step_p50_ms=None if pe_step is None else pe_step.p50_ms,
        pe_share=None if pe_step is None else pe_step.p50_ms / kernel.p50_ms,
        gflops=flops / 1e9,
        achieved_gflop_per_s=flops / 1e9 / (kernel.p50_ms / 1e3),
    )
    return record


def add_ratios(records: list[dict]) -> None:
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


@dataclass
class ProfileReport:
    """Records (one per backend × encoding × resolution × batch), the settings, the environment,
    and notes on what could not be profiled (an engine that was not built, no GPU) and why."""

    records: list[dict]
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
            "records": self.records,
            "notes": self.notes,
            "advice": self.advice,
        }

    def write_json(self, path: str | os.PathLike) -> Path:
        return write_output_json(path, self.to_json())
