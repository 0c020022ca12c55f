"""``deploykit serve`` (Triton, or ``--ray``: Ray Serve) as a child process on free loopback
ports, waited for until it answers, stopped by its pid."""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from deploykit._lazy import lazy_import
from deploykit.errors import DeployKitError
from deploykit.serve.door import free_loopback_ports

STARTUP_TIMEOUT_S = 300


class ServerProcess:
    """``deploykit serve`` with the bench's backend and batching (``BenchOptions``)."""

    def __init__(self, export_dir: Path, options, log: Path):
        self.http, self.grpc, metrics = free_loopback_ports(3)
        self.ray = options.ray
        command = [sys.executable, "-m", "deploykit", "serve", str(export_dir), "--host", "127.0.0.1", "--port", str(self.http)]
        if self.ray:  # the gRPC and metrics ports are Triton's
            command += ["--ray", "--replicas", str(options.replicas)]
        else:
            command += ["--grpc-port", str(self.grpc), "--metrics-port", str(metrics)]
        command += ["--backend", options.backend, "--max-batch-size", str(options.max_batch_size)]
        command += ["--max-queue-delay-us", str(options.max_queue_delay_us)]
        if options.streams is not None:
            command += ["--streams", str(options.streams)]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def wait_ready(self, probe: Callable[[], None] | None = None, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until the server answers (Triton: ``/v2/health/ready``, every model loaded; Ray:
        ``probe()``, a request, returns), it exits, or the timeout."""
        ready = probe or self._triton_ready
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # its error line, as the log goes with the bench's temp dir
                raise DeployKitError(f"deploykit serve exited with {self.proc.returncode}: {self.last_line()}")
            try:
                ready()
                return
            except (OSError, http.client.HTTPException, DeployKitError, lazy_import("tritonclient.utils").InferenceServerException):
                pass  # not listening, or not every model loaded yet
            time.sleep(0.5)
        raise DeployKitError(f"deploykit serve was not ready after {timeout_s} s: {self.last_line()}")

    def _triton_ready(self) -> None:
        if not lazy_import("tritonclient.grpc").InferenceServerClient(self.grpc_url).is_server_ready():
            raise DeployKitError("not ready")

    def last_line(self) -> str:
        """The server's last log line (its ``error:`` line when it failed)."""
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(no output)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            # Triton's server stops its tritonserver on SIGTERM; serve --ray shuts Ray down on
            # Ctrl-C (KeyboardInterrupt) only, and SIGTERM would leave Ray's processes behind
            self.proc.send_signal(signal.SIGINT if self.ray else signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
