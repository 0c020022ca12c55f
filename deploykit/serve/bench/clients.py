"""What loads the served side: our own clients (gRPC to Triton, HTTP to Ray Serve), each a
``call(item)`` the load generators drive, or Triton's ``perf_analyzer`` as a child process."""

from __future__ import annotations

import csv
import http.client
import math
import subprocess
import threading
from pathlib import Path

import numpy as np

from deploykit._lazy import lazy_import
from deploykit.answers import unranked
from deploykit.catalog import OUTPUT_NAME
from deploykit.errors import DeployKitError, one_line
from deploykit.serve import defaults
from deploykit.serve.bench.records import LatencyMs, SideStats
from deploykit.serve.classifier import INPUT_NAME


class GrpcClient:
    """Our loopback Triton client: requests serialized once before the level (``prepare``, as
    ``perf_analyzer`` prepares its input data), sent as bytes over one gRPC channel per thread, so
    requests do not queue behind each other's HTTP/2 stream and the client spends its share of the
    machine on sending, not on building protobufs.

    Every answer is checked (a server answering NaN, or logits of another shape, fast would
    otherwise be reported as faster than in-process) and waited for at most ``timeout_s``.

    Args:
        url, model: the server's gRPC ``host:port`` and the logits model.
        timeout_s: longest wait for one answer.
        answer_shape: the logits' shape in-process for one image; None: not compared.
    """

    METHOD = "/inference.GRPCInferenceService/ModelInfer"

    def __init__(self, url: str, model: str, timeout_s: float = defaults.BENCH_REQUEST_TIMEOUT_S, answer_shape: tuple | None = None):
        self.url, self.model, self.timeout_s, self.answer_shape = url, model, timeout_s, answer_shape
        self.grpc, self.service = lazy_import("grpc"), lazy_import("tritonclient.grpc.service_pb2")
        self.local = threading.local()

    def prepare(self, x: np.ndarray) -> bytes:
        """The serialized ``ModelInferRequest`` of one float32 input tensor."""
        request = self.service.ModelInferRequest(model_name=self.model)
        request.inputs.add(name=INPUT_NAME, datatype="FP32", shape=list(x.shape))
        request.outputs.add(name=OUTPUT_NAME)
        request.raw_input_contents.append(np.ascontiguousarray(x, np.float32).tobytes())
        return request.SerializeToString()

    def __call__(self, request: bytes) -> np.ndarray:
        if not hasattr(self.local, "infer"):
            channel = self.grpc.insecure_channel(
                self.url, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
            )
            self.local.infer = channel.unary_unary(self.METHOD, response_deserializer=self.service.ModelInferResponse.FromString)
        """The logits of one prepared request.

        Raises:
            DeployKitError: no answer within ``timeout_s``, a refusal, or an answer that is not
                finite logits of ``answer_shape``.
        """
        try:
            answer = self.local.infer(request, timeout=self.timeout_s)
        except self.grpc.RpcError as err:
            if err.code() == self.grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeployKitError(f"the server at {self.url} did not answer within {self.timeout_s:g} s") from None
            raise DeployKitError(one_line(f"the server at {self.url} answered {err.code().name}: {err.details()}", 300)) from None
        return self._checked(answer)

    def _checked(self, answer) -> np.ndarray:
        shape = tuple(answer.outputs[0].shape) if answer.outputs and answer.raw_output_contents else None
        raw = answer.raw_output_contents[0] if shape is not None else b""
        if shape is None or len(raw) != 4 * math.prod(shape) or (self.answer_shape is not None and shape != tuple(self.answer_shape)):
            got = "no logits" if shape is None else f"{len(raw)} bytes as logits of shape {list(shape)}"
            raise DeployKitError(f"the server at {self.url} answered {got}; in-process gives {list(self.answer_shape or ())}")
        logits = np.frombuffer(raw, np.float32).reshape(shape)
        rows = logits.reshape(logits.shape[0] if logits.ndim and logits.shape[0] else 1, -1)  # [B, classes], as unranked reads
        problem = unranked(rows, f"served {self.model} at {self.url}")
        if problem:
            raise DeployKitError(problem)
        return logits


class HttpImageClient:
    """Our client of ``deploykit serve --ray``: ``POST /`` with one encoded image as the body,
    one keep-alive connection per thread; any answer but 200 fails the request."""

    def __init__(self, host: str, port: int, timeout_s: float = defaults.BENCH_REQUEST_TIMEOUT_S):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.local = threading.local()

    def __call__(self, image: bytes) -> bytes:
        if not hasattr(self.local, "connection"):
            self.local.connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        connection = self.local.connection
        try:
            connection.request("POST", "/", body=image, headers={"Content-Type": "application/octet-stream"})
            response = connection.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException):
            connection.close()  # the next request opens a fresh one
            raise
        if response.status != 200:
            raise DeployKitError(f"http://{self.host}:{self.port}/ answered {response.status}: {body[:200].decode(errors='replace')}")
        return body


def perf_analyzer_level(executable: str, url: str, model: str, load, requests: int, workdir: Path) -> SideStats:
    """One level measured by Triton's ``perf_analyzer`` over gRPC (a count window of
    ``requests``), at ``load``'s concurrency or request rate; its CSV gives latencies in µs."""
    report = workdir / f"perf_{load.run_label()}.csv"
    command = [executable, "-m", model, "-u", url, "-i", "grpc", *load.perf_analyzer_args()]
    command += ["--measurement-mode", "count_windows", "--measurement-request-count", str(requests), "-f", str(report)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DeployKitError(f"perf_analyzer failed at {load.label().strip()}: {tail[0]}")
    with open(report, newline="") as f:
        row = next(csv.DictReader(f))
    ms = {f"p{p}": float(row[f"p{p} latency"]) / 1e3 for p in (50, 90, 95, 99)}
    if "Avg latency" in row:
        ms["avg"] = float(row["Avg latency"]) / 1e3
    return SideStats(LatencyMs(count=requests, **ms), float(row["Inferences/Second"]), "perf_analyzer", sent=requests)
