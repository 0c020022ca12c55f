"""``deploykit serve-bench``: the served-vs-in-process sweep runs end to end on a tiny budget
(a real server, our loopback client), by concurrency and by request rate with a p99 search, and
reads Triton's ``perf_analyzer`` report format."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys

import pytest

from deploykit.cli import main
from deploykit.serve.bench import perf_analyzer_level
from deploykit.serve.bench.aiperf import JSON_FILE
from deploykit.serve.bench.loadgen import Concurrency, RequestRate


def test_serve_bench_refuses_missing_perf_analyzer_in_one_line(export_dir, capsys):
    if shutil.which("perf_analyzer"):
        pytest.skip("perf_analyzer is installed here")
    with pytest.raises(SystemExit) as exit_:
        main(["serve-bench", str(export_dir), "--client", "perf_analyzer"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.strip().splitlines() == [err.strip()] and "perf_analyzer is not on PATH" in err


def _fake_perf_analyzer(tmp_path, expected_args: list[str], first_column: str):
    """A stand-in executable that checks the arguments we pass and writes the CSV layout of
    Triton's perf_analyzer docs (latencies in microseconds); the real tool is not installed here."""
    fake = tmp_path / "perf_analyzer"
    fake.write_text(f"""#!{sys.executable}
import sys
args = sys.argv[1:]
assert args[args.index("-m") + 1] == "logits_224" and args[args.index("-i") + 1] == "grpc"
for name, value in zip({expected_args!r}[::2], {expected_args!r}[1::2]):
    assert args[args.index(name) + 1] == value, (name, args)
assert args[args.index("--measurement-request-count") + 1] == "100"
with open(args[args.index("-f") + 1], "w") as f:
    f.write("{first_column},Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
            "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\\n")
    f.write("8,412.5,225,2148,64,206,11781,19,0,13891,18795,19753,21018\\n")
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return str(fake)


def test_perf_analyzer_report_is_read_in_its_documented_csv_format(tmp_path):
    fake = _fake_perf_analyzer(tmp_path, ["--concurrency-range", "8:8"], "Concurrency")
    stats = perf_analyzer_level(fake, "127.0.0.1:1", "logits_224", Concurrency(8), 100, tmp_path)
    assert (stats.requests, stats.throughput_rps, stats.p50_ms, stats.p99_ms, stats.client) == (100, 412.5, 13.891, 21.018, "perf_analyzer")
    assert stats.latency.p90 == 18.795 and stats.latency.avg is None  # not in this CSV: left out, as AIPerf leaves unset fields
    assert os.path.exists(tmp_path / "perf_concurrency_8.csv")


def test_perf_analyzer_runs_a_request_rate_with_its_distribution(tmp_path):
    args = ["--request-rate-range", "50:50", "--request-distribution", "poisson", "--max-threads", "64"]
    stats = perf_analyzer_level(
        _fake_perf_analyzer(tmp_path, args, "Request Rate"), "127.0.0.1:1", "logits_224", RequestRate(50), 100, tmp_path
    )
    assert stats.throughput_rps == 412.5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rate", "0"], "invalid rate '0'"),
        (["--ray", "--client", "perf_analyzer"], "perf_analyzer speaks KServe to Triton"),
        (["--rate", "10", "--schedule", "bursty"], "Invalid value for '--schedule'"),
    ],
)
def test_serve_bench_refuses_bad_load_options_in_one_line(export_dir, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(["serve-bench", str(export_dir), *args])
    assert exit_.value.code != 0 and message in capsys.readouterr().err


def test_serve_bench_refuses_a_file_where_the_aiperf_directory_goes_before_measuring(export_dir, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        main(["serve-bench", str(export_dir), "--aiperf", str(taken), "--client", "builtin"])
    assert exit_.value.code == 1 and "not a directory" in capsys.readouterr().err and taken.read_text() == "mine"


@pytest.mark.slow
def test_serve_bench_measures_both_sides_by_concurrency_and_rate_and_searches_p99(export_dir, tmp_path, capsys):
    """One server for every mode (its start is most of the time): concurrency 1 and 3 (closed
    loop), 20 and 40 requests/s (open loop), a p99 search over the rates, AIPerf's files, two
    inference streams on both sides."""
    out, aiperf = tmp_path / "bench.json", tmp_path / "aiperf"
    try:
        main(
            ["serve-bench", str(export_dir), "--concurrency", "1,3", "--rate", "20,40", "--p99-ms", "5000", "--requests", "6"]
            + ["-r", "48", "--client", "builtin", "--max-batch-size", "4", "--json", str(out), "--aiperf", str(aiperf), "--streams", "2"]
        )
    except SystemExit as exit_:
        assert exit_.code in (0, None)
    report = json.loads(out.read_text())
    assert [level.get("concurrency", level.get("rate_rps")) for level in report["levels"]] == [1, 3, 20, 40]
    for level in report["levels"]:
        for side in ("in_process", "served"):
            stats = level[side]
            assert stats["sent"] + stats["dropped"] == 6 and stats["requests"] == stats["sent"]
            assert stats["throughput_rps"] > 0 and 0 < stats["p50_ms"] <= stats["p99_ms"]
        served = level["served"]
        assert served["client"] == "builtin"
        assert 1 <= served["mean_merged_batch"] <= 4  # Triton's own counters: the requests reached the server
        assert level["served_vs_in_process_throughput"] == pytest.approx(served["throughput_rps"] / level["in_process"]["throughput_rps"])
        (logits,) = [m for m in level["triton_models"] if m["model"] == "logits_48"]
        assert logits["requests"] == served["requests"] and logits["compute_infer_ms"] > 0  # Triton saw exactly our requests
    assert report["settings"]["resolution"] == [48, 48] and "load_average_end" in report["environment"]
    assert report["settings"]["streams"] == 2  # both sides: the server child accepted --streams 2
    # a limit no tiny model misses: both sides' searches end at the highest rate, after the two bounds
    assert [(s["side"], s["largest_within"], len(s["probes"])) for s in report["searches"]] == [("in_process", 40, 2), ("served", 40, 2)]
    exported = json.loads((aiperf / "served" / "request_rate_40" / JSON_FILE).read_text())
    assert exported["request_latency"]["count"] == report["levels"][3]["served"]["requests"]
    printed = capsys.readouterr().out.splitlines()
    assert len([line for line in printed if line.startswith("concurrency")]) == 2 and "served/in-process" in printed[0]
    assert len([line for line in printed if line.startswith("rate")]) == 2
    assert sum("triton logits_48" in line for line in printed) == 4
    assert "largest rate with p99 <= 5000 ms, served: rate 40 (" in printed[-1]


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


def test_the_builtin_clients_prepared_request_is_what_the_front_checks_and_forwards():
    """A request serialized once before a level (``GrpcClient.prepare``) parses as the
    ``ModelInferRequest`` the front checks: the logits model, the image's shape, its bytes."""
    import numpy as np
    from tritonclient.grpc import service_pb2

    from deploykit.serve.bench.clients import GrpcClient
    from deploykit.serve.requests import check_grpc_infer

    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8), dtype=np.float32)
    request = service_pb2.ModelInferRequest.FromString(GrpcClient("127.0.0.1:1", "logits_8").prepare(x))
    check_grpc_infer(request)  # raises RequestRejected for anything the front refuses
    assert request.model_name == "logits_8" and [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [
        ("images", "FP32", [1, 3, 8, 8])
    ]
    np.testing.assert_array_equal(np.frombuffer(request.raw_input_contents[0], np.float32).reshape(x.shape), x)


@pytest.fixture
def logits_server():
    """A gRPC server answering every ``ModelInfer`` with ``answers["logits"]`` (a float32 array)
    as its one raw output, fast: what a broken server looks like to the benchmark."""
    from concurrent import futures

    import grpc
    import numpy as np
    from tritonclient.grpc import service_pb2

    answers = {"logits": np.zeros((1, 10), np.float32)}

    def infer(request: bytes, context) -> bytes:
        logits = answers["logits"]
        response = service_pb2.ModelInferResponse(model_name="logits_8")
        response.outputs.add(name="logits", datatype="FP32", shape=list(logits.shape))
        response.raw_output_contents.append(logits.tobytes())
        return response.SerializeToString()

    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelInfer": grpc.unary_unary_rpc_method_handler(infer)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", answers
    finally:
        server.stop(None)


def test_the_builtin_client_reports_wrong_answers_as_wrong_not_fast(logits_server):
    """Item 10 of issue 52: a server answering NaN logits of the wrong shape came out 2.6x faster
    than in-process. Every answer is checked against the in-process logits' shape and for NaN/Inf,
    and the level fails in one line."""
    import numpy as np

    from deploykit.errors import DeployKitError
    from deploykit.serve.bench.clients import GrpcClient
    from deploykit.serve.bench.loadgen import closed_loop

    url, answers = logits_server
    client = GrpcClient(url, "logits_8", answer_shape=(1, 10))
    requests = [client.prepare(np.zeros((1, 3, 8, 8), np.float32))] * 4
    assert closed_loop(client, requests, 2, "builtin").sent == 4  # the control: right answers pass
    for logits, message in [
        (np.full((1, 3), np.nan, np.float32), r"answered 12 bytes as logits of shape \[1, 3\]; in-process gives \[1, 10\]"),
        (np.full((1, 10), np.nan, np.float32), r"served logits_8 at .* answered NaN/Inf for 1 of 1 images"),
    ]:
        answers["logits"] = logits
        with pytest.raises(DeployKitError, match=message):
            closed_loop(client, requests, 2, "builtin")


def test_the_builtin_client_gives_up_on_a_server_that_never_answers():
    """A listener that accepts and never answers hung serve-bench; each request now waits at most
    the client's timeout."""
    import socket

    import numpy as np

    from deploykit.errors import DeployKitError
    from deploykit.serve.bench.clients import GrpcClient

    with socket.create_server(("127.0.0.1", 0)) as silent:
        client = GrpcClient(f"127.0.0.1:{silent.getsockname()[1]}", "logits_8", timeout_s=0.5)
        with pytest.raises(DeployKitError, match=r"did not answer within 0\.5 s"):
            client(client.prepare(np.zeros((1, 3, 8, 8), np.float32)))
