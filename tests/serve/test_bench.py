"""``deploykit serve-bench``: the served-vs-in-process sweep runs end to end on a tiny budget
(a real server, our loopback client), and reads Triton's ``perf_analyzer`` report format."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys

import pytest

from deploykit.cli import main
from deploykit.serve.bench import perf_analyzer_level

pytest.importorskip("pytriton", reason="needs the serve extra: pip install 'deploykit[serve]'")
pytest.importorskip("tritonclient.grpc", reason="needs the serve extra")


@pytest.mark.slow
def test_serve_bench_measures_both_sides_at_each_level(export_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    try:
        main(
            [
                "serve-bench",
                str(export_dir),
                "--concurrency",
                "1,3",
                "--requests",
                "6",
                "-r",
                "48",
                "--client",
                "builtin",
                "--max-batch-size",
                "4",
                "--json",
                str(out),
            ]
        )
    except SystemExit as exit_:
        assert exit_.code in (0, None)
    report = json.loads(out.read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        for side in ("in_process", "served"):
            stats = level[side]
            assert stats["requests"] == 6 and stats["throughput_rps"] > 0 and 0 < stats["p50_ms"] <= stats["p99_ms"]
        served = level["served"]
        assert served["client"] == "builtin"
        assert 1 <= served["mean_merged_batch"] <= 4  # Triton's own counters: the requests reached the server
        assert level["served_vs_in_process_throughput"] == pytest.approx(served["throughput_rps"] / level["in_process"]["throughput_rps"])
    assert report["settings"]["resolution"] == [48, 48] and "load_average_end" in report["environment"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("concurrency")]
    assert len(lines) == 2 and "served/in-process" in lines[0]


def test_serve_bench_refuses_missing_perf_analyzer_in_one_line(export_dir, capsys):
    if shutil.which("perf_analyzer"):
        pytest.skip("perf_analyzer is installed here")
    with pytest.raises(SystemExit) as exit_:
        main(["serve-bench", str(export_dir), "--client", "perf_analyzer"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.strip().splitlines() == [err.strip()] and "perf_analyzer is not on PATH" in err


def test_perf_analyzer_report_is_read_in_its_documented_csv_format(tmp_path):
    """A stand-in executable that checks the arguments we pass and writes the CSV layout of
    Triton's perf_analyzer docs (latencies in microseconds); the real tool is not installed here."""
    fake = tmp_path / "perf_analyzer"
    fake.write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
assert args[args.index("-m") + 1] == "logits_224" and args[args.index("-i") + 1] == "grpc"
assert args[args.index("--concurrency-range") + 1] == "8:8" and args[args.index("--measurement-request-count") + 1] == "100"
with open(args[args.index("-f") + 1], "w") as f:
    f.write("Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
            "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\\n")
    f.write("8,412.5,225,2148,64,206,11781,19,0,13891,18795,19753,21018\\n")
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    stats = perf_analyzer_level(str(fake), "127.0.0.1:1", "logits_224", 8, 100, tmp_path)
    assert stats == {"requests": 100, "throughput_rps": 412.5, "p50_ms": 13.891, "p99_ms": 21.018, "client": "perf_analyzer"}
    assert os.path.exists(tmp_path / "perf_8.csv")


def test_a_server_that_cannot_start_is_reported_with_its_own_error_line(export_dir, tmp_path):
    """The server's log lives in the bench's temporary directory, gone when the bench fails: the
    error carries the server's last line instead of pointing at a deleted file."""
    from deploykit.errors import DeployKitError
    from deploykit.serve.bench import BenchOptions, ServerProcess

    server = ServerProcess(export_dir, BenchOptions(backend="no-such-backend"), tmp_path / "server.log")
    try:
        with pytest.raises(DeployKitError, match=r"exited with 1: error: .*no-such-backend"):
            server.wait_ready()
    finally:
        server.stop()
