"""``serve-bench --plot``: throughput against p50 and p99 latency per level, served and
in-process, one panel per load kind (concurrency, request rate). Needs the ``plot`` extra."""

from __future__ import annotations

import os
from pathlib import Path

from deploykit._io import output_file
from deploykit._lazy import lazy_import
from deploykit.serve.bench.records import BenchReport

SIDES = {"in_process": "in-process", "served": "served"}


def plot_bench(report: BenchReport, path: str | os.PathLike) -> Path:
    """PNG: x throughput (requests/s), y latency (ms, log); per side a p50 line and a p99 line
    through the levels, each point labelled with its load."""
    lazy_import("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    kinds = list(dict.fromkeys(level.load.kind for level in report.levels))
    figure = Figure(figsize=(6.4 * len(kinds), 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(kinds), squeeze=False)[0]
    for ax, kind in zip(axes, kinds):
        levels = [level for level in report.levels if level.load.kind == kind]
        for side, side_label in SIDES.items():
            stats = [getattr(level, side) for level in levels]
            xs = [s.throughput_rps for s in stats]
            p50 = ax.plot(xs, [s.p50_ms for s in stats], marker="o", label=f"{side_label} p50")[0]
            ax.plot(xs, [s.p99_ms for s in stats], marker="^", linestyle="--", color=p50.get_color(), label=f"{side_label} p99")
            for x, s, level in zip(xs, stats, levels):
                ax.annotate(f"{level.load.value:g}", (x, s.p99_ms), textcoords="offset points", xytext=(3, 3), fontsize="x-small")
        title = f"serve-bench, {kind} levels (each point labelled with its level)"
        ax.set(xlabel="throughput (requests/s)", ylabel="latency (ms)", yscale="log", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    with output_file(path) as tmp:
        figure.savefig(tmp, format="png", dpi=110)
    return Path(path)
