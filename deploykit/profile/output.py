"""Writing a profile's records: CSV, the latency-vs-resolution plot, and the terminal table."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from pathlib import Path

from deploykit._io import output_file, write_output_text
from deploykit._lazy import lazy_import
from deploykit.inputs.resolutions import parse_resolution
from deploykit.profile.report import RECORD_FIELDS, TORCH_BACKEND, ProfileRecord, ProfileReport


def write_csv(path: str | os.PathLike, records: Sequence[ProfileRecord]) -> Path:
    """One row per record: ``RECORD_FIELDS`` first, then the extra fields in first-seen order."""
    records = [r.to_dict() for r in records]
    extras = list(dict.fromkeys(k for r in records for k in r if k not in RECORD_FIELDS))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[*RECORD_FIELDS, *extras], lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in records)
    return write_output_text(path, buffer.getvalue())


def _pixels(tag: str) -> float:
    """x position of a resolution tag: the side of the square with the same pixel count."""
    height, width = parse_resolution(tag)
    return (height * width) ** 0.5


def plot_latency(path: str | os.PathLike, records: Sequence[ProfileRecord], title: str = "") -> Path:
    """PNG of kernel-only p50 latency (whisker up to p90) against resolution, one line per
    backend × precision × encoding, one panel per batch size. Needs the ``plot`` extra (matplotlib)."""
    lazy_import("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    batches = sorted({r.batch for r in records})
    figure = Figure(figsize=(6.4 * len(batches), 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(batches), squeeze=False)[0]
    for ax, batch in zip(axes, batches):
        rows = [r for r in records if r.batch == batch]
        lane = lambda r: (r.backend, r.precision, r.encoding)
        for backend, precision, encoding in dict.fromkeys(map(lane, rows)):
            line = sorted((_pixels(r.resolution), r.p50_ms, r.kernel.p90_ms) for r in rows if lane(r) == (backend, precision, encoding))
            xs, p50, p90 = zip(*line)
            ax.errorbar(
                xs,
                p50,
                yerr=[[0] * len(p50), [b - a for a, b in zip(p50, p90)]],
                marker="o",
                capsize=3,
                linestyle="-" if backend == TORCH_BACKEND else "--",
                label=f"{backend} {precision} · {encoding}",
            )
        ax.set(xlabel="resolution (px, square side)", ylabel="latency p50 (ms), whisker to p90", title=f"{title} batch {batch}".strip())
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    with output_file(path) as tmp:
        figure.savefig(tmp, format="png", dpi=110)
    return Path(path)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}" if value < 100 else f"{value:.0f}"


def _verdict(record: ProfileRecord) -> str:
    """``✓`` validated, ``✓ fastest`` the cell's fastest validated plan, ``✗`` failed, ``–`` not checked."""
    if record.validated is None:
        return "–"
    return ("✓ fastest" if record.fastest_validated else "✓") if record.validated else "✗"


def render_table(report: ProfileReport, title: str = "latency"):
    """A rich ``Table``: kernel-only and end-to-end latency side by side, ratio to APE, PE share."""
    from rich.table import Table

    table = Table(title=title, caption=report.environment_line, caption_justify="left")
    for name in ("backend", "precision", "encoding", "res (px)", "batch"):
        table.add_column(name)
    for name in (
        "p50 (ms)",
        "p90 (ms)",
        "p99 (ms)",
        "mean ± std (ms)",
        "n (calls)",
        "img/s",
        "e2e p50 (ms)",
        "e2e img/s",
        "×APE",
        "×fp32",
        "PE share",
        "GFLOP/s",
        "valid",
    ):
        table.add_column(name, justify="right")
    ratio = lambda value: "–" if value is None else f"{value:.3f}"
    for r in report.records:
        kernel, e2e = r.kernel, r.e2e
        table.add_row(
            r.backend,
            r.precision,
            r.encoding,
            r.resolution,
            str(r.batch),
            _ms(kernel.p50_ms),
            _ms(kernel.p90_ms),
            _ms(kernel.p99_ms),
            f"{_ms(kernel.mean_ms)} ± {_ms(kernel.std_ms)}",
            str(kernel.n),
            f"{kernel.throughput_per_s:.1f}",
            _ms(None if e2e is None else e2e.p50_ms),
            "–" if e2e is None else f"{e2e.throughput_per_s:.1f}",
            ratio(r.ratio_vs_ape),
            ratio(r.ratio_vs_fp32),
            "–" if r.pe_share is None else f"{r.pe_share:.1%}",
            f"{r.achieved_gflop_per_s:.1f}",
            _verdict(r),
        )
    return table
