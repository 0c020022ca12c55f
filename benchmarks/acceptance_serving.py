"""The serving checks of ``gpu_acceptance.py``: ``deploykit serve`` on an engine backend under
concurrent load, and a real ``tritonserver`` loading the ``package triton`` repository; each
answer compared with ONNX Runtime's in-process one."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from checks import Failed

from deploykit.errors import one_line


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def serving_check(out: Path, backend: str, requests: int = 200, concurrency: int = 16):
    """``deploykit serve --backend <engine>`` under ``concurrency`` concurrent requests: answers
    equal ONNX Runtime's in-process answers (fp32 tolerance) and the server's own sequential ones."""

    def check():
        import tritonclient.http as httpclient

        import deploykit
        from deploykit.checks import Reference, judge
        from deploykit.export.precision import PLANS
        from deploykit.serve.triton_server import logits_model_name

        http, grpc, metrics = _free_ports(3)
        cmd = [
            sys.executable,
            "-m",
            "deploykit",
            "serve",
            str(out),
            "--port",
            str(http),
            "--grpc-port",
            str(grpc),
            "--metrics-port",
            str(metrics),
            "--backend",
            backend,
        ]
        log = out / f"serve-{backend}.log"
        with open(log, "wb") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{http}", concurrency=concurrency)
            _wait_ready(client, proc, log)
            with deploykit.load(out, backend="ort") as pipeline:
                resolution = pipeline.resolutions[0]
                inputs = np.random.default_rng(0).standard_normal((requests, 3, *resolution), dtype=np.float32)
                expected = pipeline.logits(inputs)

            def call(i):
                tensor = httpclient.InferInput("images", [1, 3, *resolution], "FP32")
                tensor.set_data_from_numpy(inputs[i : i + 1])
                return client.infer(logits_model_name(resolution), [tensor]).as_numpy("logits")[0]

            sequential = np.stack([call(i) for i in range(requests)])
            with ThreadPoolExecutor(concurrency) as pool:
                concurrent = np.stack(list(pool.map(call, range(requests))))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        vs_ort = judge(Reference.of_outputs(expected, requests), concurrent, PLANS["fp32"].criteria).result
        vs_sequential = float(np.abs(concurrent - sequential).max())
        details = {
            "requests": requests,
            "concurrency": concurrency,
            "max_abs_vs_ort": vs_ort.metrics["max_abs"],
            "top1_vs_ort": vs_ort.metrics["top1_agreement"],
            "max_abs_concurrent_vs_sequential": vs_sequential,
        }
        if not vs_ort.passed or vs_sequential > PLANS["fp32"].tolerance.max_abs:
            raise Failed("served answers differ", details)
        return details

    return check


def tritonserver_check(out: Path):
    """The repository ``deploykit package triton`` writes, loaded by a real ``tritonserver``
    (the TensorRT engines the trt worker built, with a batch profile), answering one request per
    model kind like ONNX Runtime in-process."""

    def check():
        import tritonclient.http as httpclient

        import deploykit
        from deploykit.checks import Reference, judge
        from deploykit.export.precision import PLANS
        from deploykit.serve.triton_repo import package_triton

        repo = package_triton(out, Path(tempfile.mkdtemp(prefix="triton_repo_")) / "repo")
        http, grpc, metrics = _free_ports(3)
        log = repo.parent / "tritonserver.log"
        cmd = ["tritonserver", f"--model-repository={repo}", f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}"]
        with open(log, "wb") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
            _wait_ready(client, proc, log)
            with deploykit.load(out, backend="ort") as pipeline:
                resolution = pipeline.resolutions[0]
                images = np.random.default_rng(0).standard_normal((1, 3, *resolution), dtype=np.float32)
                expected = pipeline.logits(images)
            tag = "x".join(map(str, resolution)) if resolution[0] != resolution[1] else str(resolution[0])
            answers = {}
            for model in (f"vit_{tag}_trt", f"vit_{tag}_onnx"):
                tensor = httpclient.InferInput("images", [1, 3, *resolution], "FP32")
                tensor.set_data_from_numpy(images)
                answers[model] = judge(
                    Reference.of_outputs(expected, 1), client.infer(model, [tensor]).as_numpy("logits"), PLANS["fp32"].criteria
                ).result
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        if not all(a.passed for a in answers.values()):
            raise Failed(
                "tritonserver's answers differ from ONNX Runtime's",
                {m: {**a.metrics, "failures": list(a.failures)} for m, a in answers.items()},
            )
        return {m: {"max_abs": a.metrics["max_abs"]} for m, a in answers.items()}

    return check


def _wait_ready(client, proc, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Failed(f"deploykit serve exited with {proc.returncode}: {one_line(log.read_text()[-600:])}")
        try:
            if client.is_server_ready():
                return
        except Exception:  # still starting: connection refused
            pass
        time.sleep(0.5)
    raise Failed(f"deploykit serve was not ready within {timeout_s:.0f} s")
