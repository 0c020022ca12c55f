"""``serve-bench`` results in NVIDIA AIPerf's summary schema, so they can be laid beside AIPerf's
own: per level and side, a ``profile_export_aiperf.json`` and a ``profile_export_aiperf.csv``
in a directory named as AIPerf names a sweep's runs (``<side>/concurrency_8/``).

The JSON follows https://docs.nvidia.com/aiperf/reference/json-export-schema (schema 1.3:
per-metric blocks of ``unit``, ``avg``, ``min``, ``max``, ``p1``…``p99``, ``std``, ``count``,
``sum``, unset fields left out; ``run_info`` for the seed and the sweep point); the CSV the
layout of AIPerf's ``MetricsCsvExporter``: a table of distributions (``Metric`` then AIPerf's
``STAT_KEYS``), a blank row, a table of single values (``Metric``, ``Value``), names with units.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from deploykit._io import write_json_atomic, write_text_atomic
from deploykit.errors import ConfigError
from deploykit.serve.bench.records import BenchReport, Level, SideStats

SCHEMA_VERSION = "1.3"
JSON_FILE = "profile_export_aiperf.json"
CSV_FILE = "profile_export_aiperf.csv"
# AIPerf's STAT_KEYS: the columns of the CSV's distribution table, in its order
CSV_STATS = ("avg", "min", "max", "sum", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "std")
# AIPerf's metric tags with their CSV headers; latency is a record metric (a distribution), the
# rest derived or aggregate (``unit`` and ``avg`` only)
HEADERS = {
    "request_latency": "Request Latency",
    "request_throughput": "Request Throughput",
    "request_count": "Request Count",
    "benchmark_duration": "Benchmark Duration",
}


def metrics(side: SideStats) -> dict[str, dict]:
    """The AIPerf metric blocks of one side of one level."""
    return {
        "request_latency": {"unit": "ms", **side.latency.to_json()},
        "request_throughput": {"unit": "requests/sec", "avg": side.throughput_rps},
        "request_count": {"unit": "requests", "avg": float(side.requests)},
        "benchmark_duration": {"unit": "sec", "avg": side.requests / side.throughput_rps},
    }


def profile_export(level: Level, index: int, side: str, settings: dict) -> dict:
    """``profile_export_aiperf.json`` of one side of one level (the ``index``-th of the sweep)."""
    load, run_label = level.load, level.load.run_label()
    benchmark_id = f"deploykit-{side}-{run_label}"
    run_info = {
        "benchmark_id": benchmark_id,
        "sweep_id": None,
        "random_seed": getattr(load, "seed", None),
        "trial": 0,
        "run_label": run_label,
        "variation_label": run_label,
        "variation_index": index,
        "variation_values": {load.kind: load.value},
        "cli_command": None,
    }
    input_config = {**settings, "side": side, **load.to_json()}
    return {
        "schema_version": SCHEMA_VERSION,
        "benchmark_id": benchmark_id,
        "was_cancelled": False,
        "input_config": input_config,
        "run_info": run_info,
        **metrics(getattr(level, side)),
    }


def _number(value) -> str:
    # as AIPerf's CSV writes numbers: integers whole, other reals to two decimals, unset empty
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else f"{float(value):.2f}"


def _name(tag: str, unit: str) -> str:
    return HEADERS[tag] if unit in ("count", "requests") else f"{HEADERS[tag]} ({unit})"


def profile_csv(side: SideStats) -> str:
    """``profile_export_aiperf.csv`` of one side of one level."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    blocks = metrics(side)
    distributions = {tag: b for tag, b in blocks.items() if "p50" in b}
    writer.writerow(["Metric", *CSV_STATS])
    for tag, block in sorted(distributions.items()):
        writer.writerow([_name(tag, block["unit"]), *(_number(block.get(k)) for k in CSV_STATS)])
    writer.writerow([])
    writer.writerow(["Metric", "Value"])
    for tag, block in sorted(blocks.items()):
        if tag not in distributions:
            writer.writerow([_name(tag, block["unit"]), _number(block["avg"])])
    return buffer.getvalue()


def check_aiperf_dir(directory: str | os.PathLike) -> None:
    """Refuse, before any work, a destination that is there and is not a directory.

    Raises:
        ConfigError: ``directory`` names a file (or anything but a directory).
    """
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"cannot write AIPerf files under {directory}: it is not a directory")


def write_aiperf(report: BenchReport, directory: str | os.PathLike) -> Path:
    """Write both files per level and side under ``directory/<side>/<run label>/``; returns ``directory``."""
    check_aiperf_dir(directory)
    for index, level in enumerate(report.levels):
        for side in ("in_process", "served"):
            run = Path(directory) / side / level.load.run_label()
            run.mkdir(parents=True, exist_ok=True)
            write_json_atomic(run / JSON_FILE, profile_export(level, index, side, report.settings))
            write_text_atomic(run / CSV_FILE, profile_csv(getattr(level, side)))
    return Path(directory)
