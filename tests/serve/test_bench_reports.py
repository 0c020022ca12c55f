"""What serve-bench writes and prints, from typed records (no server): the AIPerf summary files
checked against AIPerf's published field lists, Triton's per-model statistics as deltas of its
statistics extension, the printed table, the plot, and our HTTP client of ``serve --ray``."""

from __future__ import annotations

import csv
import http.server
import io
import json
import threading

import numpy as np
import pytest

from deploykit.errors import DeployKitError
from deploykit.serve.bench.aiperf import CSV_FILE, JSON_FILE, write_aiperf
from deploykit.serve.bench.clients import HttpImageClient
from deploykit.serve.bench.loadgen import Concurrency, RequestRate
from deploykit.serve.bench.records import BenchReport, LatencyMs, Level, SideStats
from deploykit.serve.bench.triton_stats import model_stats_delta
from tests.serve.stub_triton import StubTriton

# https://docs.nvidia.com/aiperf/reference/json-export-schema, "Per-metric stats fields":
# "unit" (always present), "avg", "min", "max", "p1, p5, p10, p25, p50, p75, p90, p95, p99",
# "std", "count" (record metrics only), "sum"; derived/aggregate metrics carry "only unit + avg".
PUBLISHED_STATS_FIELDS = {"unit", "avg", "min", "max", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "std", "count", "sum"}
PUBLISHED_SCALAR_FIELDS = {"unit", "avg"}
# The same page, "Top-level fields" and "run_info" (schema 1.3).
PUBLISHED_TOP_LEVEL = {
    "schema_version", "aiperf_version", "benchmark_id", "start_time", "end_time", "was_cancelled",
    "input_config", "run_info", "telemetry_data", "error_summary",
}  # fmt: skip
PUBLISHED_RUN_INFO = {
    "benchmark_id", "sweep_id", "random_seed", "trial", "run_label", "variation_label", "variation_index",
    "variation_values", "cli_command",
}  # fmt: skip
# https://github.com/ai-dynamo/aiperf/blob/main/src/aiperf/common/constants.py, STAT_KEYS: the
# columns after "Metric" of profile_export_aiperf.csv's distribution table
# (src/aiperf/exporters/metrics_csv_exporter.py); its single values under "Metric", "Value".
PUBLISHED_CSV_STAT_KEYS = ["avg", "min", "max", "sum", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "std"]


def _side(latencies_ms, throughput: float, client: str = "builtin") -> SideStats:
    return SideStats(LatencyMs.from_ns(np.asarray(latencies_ms) * 1e6), throughput, client, sent=len(latencies_ms))


def _report() -> BenchReport:
    rng = np.random.default_rng(0)
    levels = (
        Level(Concurrency(8), _side(rng.uniform(2, 4, 50), 400.0), _side(rng.uniform(3, 6, 50), 380.0), (), 3.5),
        Level(RequestRate(100, "poisson", seed=7), _side(rng.uniform(1, 2, 40), 99.0), _side(rng.uniform(2, 9, 40), 97.0), (), 1.2),
    )
    return BenchReport(levels, {"backend": "ort", "resolution": [48, 48]})


def test_aiperf_json_holds_only_published_fields_and_every_stats_field_of_a_record_metric(tmp_path):
    report = _report()
    write_aiperf(report, tmp_path)
    export = json.loads((tmp_path / "served" / "request_rate_100" / JSON_FILE).read_text())
    metrics = {k: v for k, v in export.items() if isinstance(v, dict) and "unit" in v}
    assert set(export) - set(metrics) <= PUBLISHED_TOP_LEVEL and set(export["run_info"]) == PUBLISHED_RUN_INFO
    assert set(metrics["request_latency"]) == PUBLISHED_STATS_FIELDS  # a record metric: the full set
    for tag in ("request_throughput", "request_count", "benchmark_duration"):
        assert set(metrics[tag]) == PUBLISHED_SCALAR_FIELDS
    served = report.levels[1].served
    latency = metrics["request_latency"]
    assert latency["unit"] == "ms" and latency["count"] == 40 and latency["p99"] == served.p99_ms
    assert metrics["request_throughput"] == {"unit": "requests/sec", "avg": 97.0}
    assert export["run_info"]["random_seed"] == 7 and export["run_info"]["variation_values"] == {"rate": 100}
    assert (tmp_path / "in_process" / "concurrency_8" / JSON_FILE).is_file()


def test_aiperf_csv_has_the_published_columns_and_sections(tmp_path):
    write_aiperf(_report(), tmp_path)
    rows = list(csv.reader(io.StringIO((tmp_path / "served" / "concurrency_8" / CSV_FILE).read_text())))
    assert rows[0] == ["Metric", *PUBLISHED_CSV_STAT_KEYS]
    assert rows[1][0] == "Request Latency (ms)" and len(rows[1]) == len(rows[0])
    assert rows[2] == [] and rows[3] == ["Metric", "Value"]
    values = {name: value for name, value in rows[4:]}
    assert values["Request Throughput (requests/sec)"] == "380.00" and values["Request Count"] == "50.00"


def test_aiperf_refuses_a_file_where_its_directory_goes(tmp_path):
    (tmp_path / "taken").write_text("mine")
    with pytest.raises(DeployKitError, match="not a directory"):
        write_aiperf(_report(), tmp_path / "taken")
    assert (tmp_path / "taken").read_text() == "mine"


def _stats(name: str, success: int, executions: int, inferences: int, ns: dict) -> dict:
    """One model's entry as Triton's statistics extension sends it in protobuf's JSON mapping
    (64-bit counters as strings, zero fields left out)."""
    inference_stats = {"success": {"count": str(success), "ns": str(sum(ns.values()))}}
    inference_stats.update({phase: {"count": str(success), "ns": str(v)} for phase, v in ns.items()})
    return {
        "name": name,
        "version": "1",
        "inference_count": str(inferences),
        "execution_count": str(executions),
        "inference_stats": inference_stats,
    }


def test_triton_statistics_are_the_difference_per_model_over_the_level():
    before = {"model_stats": [_stats("logits_48", 10, 10, 10, {"queue": 1_000_000}), {"name": "idle_32", "version": "1"}]}
    after = {
        "model_stats": [
            _stats("logits_48", 30, 15, 30, {"queue": 5_000_000, "compute_input": 200_000, "compute_infer": 40_000_000}),
            {"name": "idle_32", "version": "1"},
        ]
    }
    (logits,) = model_stats_delta(before, after)  # the idle model answered nothing: left out
    assert (logits.model, logits.requests, logits.executions, logits.inferences) == ("logits_48", 20, 5, 20)
    assert logits.mean_batch == 4.0
    assert logits.queue_ms == pytest.approx(4.0 / 20) and logits.compute_infer_ms == pytest.approx(40.0 / 20)
    assert logits.compute_input_ms == pytest.approx(0.2 / 20) and logits.compute_output_ms == 0.0


def test_the_printed_table_has_one_line_per_level_and_the_server_breakdown(capsys):
    from dataclasses import replace

    from deploykit.cli import render as cli_render
    from deploykit.serve.bench.records import ModelStats, SearchResult, SideSearch

    report = _report()
    model = ModelStats("logits_48", 50, 14, 50, 0.5, 0.1, 2.0, 0.05)
    search = SideSearch("served", "rate", SearchResult(20.0, 150.0, ()), 140.0)
    cli_render.bench(replace(report, levels=(replace(report.levels[0], models=(model,)), report.levels[1]), searches=(search,)))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("concurrency   8:") and "served/in-process 0.95" in lines[0]
    assert lines[1].strip().startswith("triton logits_48: 50 requests in 14 executions") and "infer 2.00 ms" in lines[1]
    assert lines[2].startswith("rate") and "dropped 0, late 0" in lines[2]
    assert lines[3] == "largest rate with p99 <= 20 ms, served: rate 150 (140.0 req/s)"


def test_report_json_keeps_the_level_keys_and_adds_the_distribution():
    level = _report().to_json()["levels"][0]
    assert level["concurrency"] == 8 and level["served"]["mean_merged_batch"] == 3.5
    assert level["served_vs_in_process_throughput"] == pytest.approx(380 / 400)
    assert set(level["served"]["latency_ms"]) == PUBLISHED_STATS_FIELDS - {"unit"}


def test_plot_writes_a_png_per_load_kind(tmp_path):
    from deploykit.serve.bench.plot import plot_bench

    out = plot_bench(_report(), tmp_path / "bench.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def ray_stand_in():
    """An HTTP server in this process answering ``POST /`` as ``serve --ray`` does (a JSON
    prediction), recording each body."""
    stub = StubTriton(answers={"/": (200, {"classes": [3], "scores": [0.9]})})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), stub.handler())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield stub, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_ray_client_posts_each_image_once_under_load(ray_stand_in):
    stub, port = ray_stand_in
    images = [bytes([i]) * 64 for i in range(9)]
    stats = Concurrency(3).run(HttpImageClient("127.0.0.1", port), images, "builtin")
    assert stats.requests == 9 and sorted(f.body for f in stub.seen) == sorted(images)
    assert {(f.method, f.path) for f in stub.seen} == {("POST", "/")}


def test_ray_client_fails_a_request_the_deployment_refuses(ray_stand_in):
    stub, port = ray_stand_in
    stub.answers["/"] = (400, {"error": "not an image"})
    with pytest.raises(DeployKitError, match="answered 400.*not an image"):
        HttpImageClient("127.0.0.1", port)(b"junk")
