"""``deploykit serve`` from start to end, each test with a server process of its own: the plan
served (``--precision``), what it says while starting, a graceful stop on SIGTERM under load, and
a non-zero exit in one line when the inference server dies under it."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from serve_reference import ort_logits
from server_process import free_ports, process_tree, stop, stop_leftovers, tritonserver_pid, wait_until

# Triton's log records: "I1125 19:34:34.061105 7711 file.cc:117] message" (W, E for the other levels)
TRITON_RECORD = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]*\] ")


def start(export_dir: Path, log_dir: Path, *options: str, host: str = "127.0.0.1"):
    """``deploykit serve`` in a child process, stdout and stderr in files; waits until ready."""
    http, grpc, metrics = free_ports(3)
    out, err = log_dir / "stdout.log", log_dir / "stderr.log"
    cmd = [sys.executable, "-m", "deploykit", "serve", str(export_dir), "--host", host, "--port", str(http)]
    cmd += ["--grpc-port", str(grpc), "--metrics-port", str(metrics), *options]
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL)

    def ready() -> bool:
        connection = http_client(http)
        connection.request("GET", "/v2/health/ready")
        return connection.getresponse().status == 200

    wait_until(ready, proc, 300, err)
    return proc, http, out, err


def http_client(port: int) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=120)


def infer_logits(port: int, x: np.ndarray, model: str = "logits_32") -> tuple[str, np.ndarray | None]:
    """One request on a connection of its own: ``("ok", logits)``, ``("shutting down", None)``
    (503), ``("refused", None)`` (nothing listens), or ``("cut: <why>", None)``."""
    body = json.dumps({"inputs": [{"name": "images", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}).encode()
    connection = http_client(port)
    try:
        try:
            connection.connect()
        except ConnectionRefusedError:
            return "refused", None
        connection.request("POST", f"/v2/models/{model}/infer", body=body, headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        payload = answer.read()
    except (OSError, http.client.HTTPException) as err:
        return f"cut: {err!r}", None
    finally:
        connection.close()
    if answer.status == 503:
        return "shutting down", None
    if answer.status != 200:
        return f"cut: HTTP {answer.status} {payload[:200]!r}", None
    (logits,) = [o for o in json.loads(payload)["outputs"] if o["name"] == "logits"]
    return "ok", np.asarray(logits["data"], np.float32).reshape(logits["shape"])


@pytest.mark.slow
def test_sigterm_answers_every_request_in_flight_then_exits_0(plans_export_dir, tmp_path):
    """Served with ``--precision int8`` (answers equal to the int8 graph run directly), loaded by 12
    clients; SIGTERM mid-way. Every request is answered (200, or 503 once draining) or refused
    at connect once the port is closed: none is cut; the process exits 0 within the bound."""
    proc, port, _, err = start(plans_export_dir, tmp_path, "--precision", "int8", "--max-queue-delay-us", "20000", "--drain-timeout", "120")
    tree = process_tree(proc.pid)
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((16, 1, 3, 32, 32), dtype=np.float32)
    expected = ort_logits(plans_export_dir, inputs[:, 0], "int8")
    status, logits = infer_logits(port, inputs[0])
    assert status == "ok" and np.allclose(logits, expected[:1], rtol=1e-5, atol=1e-5), (status, logits, expected[0])
    if np.array_equal(expected[:1], ort_logits(plans_export_dir, inputs[0], "fp32")):
        pytest.fail("the int8 graph answers like fp32 here: the plan served is not told apart")

    results, signalled, lock = [], threading.Event(), threading.Lock()

    def client(worker: int) -> None:
        for i in range(60):  # bounded: at most 12 x 60 requests
            k = (worker + i) % len(inputs)
            started_before_signal = not signalled.is_set()
            status, logits = infer_logits(port, inputs[k])
            with lock:
                results.append((started_before_signal, signalled.is_set(), status))
            if status == "ok":
                np.testing.assert_allclose(logits[0], expected[k], rtol=1e-5, atol=1e-5)
            if status in ("refused", "shutting down") or status.startswith("cut"):
                return

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(client, w) for w in range(12)]
        deadline = time.monotonic() + 300
        while len(results) < 48 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        signalled.set()
        proc.send_signal(signal.SIGTERM)
        for future in futures:
            future.result()
    code = proc.wait(180)
    stop_leftovers(tree)
    cut = [r for r in results if r[2].startswith("cut")]
    spanning = [r for r in results if r[0] and r[1] and r[2] == "ok"]  # sent before the signal, answered after it
    summary = {s: sum(r[2] == s for r in results) for s in ("ok", "shutting down", "refused")}
    print(f"drain: {summary}, in flight at the signal and answered: {len(spanning)}, cut: {len(cut)}")
    assert not cut, f"{len(cut)} cut: {cut[:3]}; {summary}"
    assert spanning, f"no request was in flight at the signal: {summary}"
    assert code == 0, err.read_text()[-3000:]
    assert "Traceback" not in err.read_text()


@pytest.mark.slow
def test_a_dead_inference_server_ends_serve_non_zero_in_one_line(export_dir, tmp_path):
    """Bound to every interface: one warning line says nothing authenticates clients; Triton's own
    log stays quiet (warning level, CPU-host noise hidden); then tritonserver is killed."""
    proc, _, out, err = start(export_dir, tmp_path, host="0.0.0.0")
    tree = process_tree(proc.pid)
    try:
        said = err.read_text().splitlines()
        warnings = [line for line in said if line.startswith("warning: ")]
        assert len(warnings) == 1 and "serving on 0.0.0.0" in warnings[0] and "authenticating proxy" in warnings[0], said
        triton_lines = [line for line in said + out.read_text().splitlines() if TRITON_RECORD.match(line)]
        assert not triton_lines, triton_lines
        assert len(said) <= 12, said  # backends, skips, the warning and the ready line
        os.kill(tritonserver_pid(proc.pid), signal.SIGKILL)
        code = proc.wait(180)
    finally:
        if proc.poll() is None:
            stop(proc, tree)
    stop_leftovers(tree)
    lines = err.read_text().strip().splitlines()
    assert code == 1, lines[-5:]
    assert lines[-1] == "error: the inference server (tritonserver) exited unexpectedly; its log above says why", lines[-5:]
    assert "Traceback" not in err.read_text() + out.read_text()


LOG = [
    'W1125 19:34:34.040159 7711 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory"',
    'I1125 19:34:34.061105 7711 cuda_memory_manager.cc:117] "CUDA memory pool disabled"',
    'E1125 19:34:34.065074 7711 server.cc:241] "CudaDriverHelper has not been initialized."',
    "I1125 19:34:38.487576 7711 server.cc:604] ",
    "+------------------+------+",
    'W1125 19:34:40.000000 7711 model.cc:12] "model config changed"',
    "continued warning",
    'E1125 19:34:41.000000 7711 http_server.cc:99] "failed to parse"',
]


@pytest.mark.parametrize(
    "verbosity, gpu, shown",
    [
        (-1, False, [7]),
        (0, False, [5, 6, 7]),
        (0, True, [0, 2, 5, 6, 7]),
        (1, False, list(range(len(LOG)))),
    ],
)
def test_triton_log_levels(tmp_path, verbosity, gpu, shown):
    from deploykit.serve.triton_log import TritonLog

    log = TritonLog(tmp_path / "triton.log", verbosity, gpu)
    assert [i for i, line in enumerate(LOG) if log.wanted(line)] == shown
