"""Triton's own log, shown at the level ``deploykit serve`` was asked for.

tritonserver writes every record (``I1125 19:34:34.061105 7711 file.cc:117] "message"``, tables
on the lines after) to a file in the server's workspace; a thread follows the file and copies to
stderr the records of the levels wanted: errors with ``-q``, warnings and errors by default,
everything with ``-v``. On a machine without an NVIDIA driver, the records that only say CUDA,
pinned memory, NVML or DCGM are unavailable (about ten lines, two of them E-level, before the
server is ready) are shown only with ``-v``.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

RECORD = re.compile(r"^([IWE])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]*\] ")
# What Triton says on a CPU-only machine about GPU facilities it cannot use (none of it an error there).
NO_GPU_NOISE = re.compile(r"CUDA|CudaDriverHelper|pinned (?:system )?memory|NVML|DCGM", re.IGNORECASE)
LEVELS = {"E": -1, "W": 0, "I": 1}


class TritonLog:
    """Follows tritonserver's log file from a daemon thread (``start`` / ``stop``).

    Args:
        path: the file tritonserver writes (``--log-file``); it may not exist yet.
        verbosity: -1 errors only, 0 warnings and errors, 1 and more every record.
        gpu: whether an NVIDIA driver is present (else GPU-facility records count as info).
    """

    def __init__(self, path: Path, verbosity: int = 0, gpu: bool = False):
        self.path, self.verbosity, self.gpu = Path(path), verbosity, gpu
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="deploykit-triton-log", daemon=True)
        self._show = False

    def start(self) -> TritonLog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Copy what is left in the file, then stop following it."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def wanted(self, line: str) -> bool:
        """Whether ``line`` is shown: a record's first line decides for the lines that follow it."""
        match = RECORD.match(line)
        if match:
            level = LEVELS[match.group(1)]
            if not self.gpu and level < 1 and NO_GPU_NOISE.search(line):
                level = 1
            self._show = level <= self.verbosity
        return self._show

    def _follow(self) -> None:
        handle = None
        try:
            while handle is None and not self._stopped.wait(0.1):
                try:
                    handle = open(self.path, encoding="utf-8", errors="replace")
                except FileNotFoundError:
                    continue
            if handle is None:
                return
            pending = ""
            while True:
                chunk = handle.read()
                if chunk:
                    *lines, pending = (pending + chunk).split("\n")
                    text = "".join(line + "\n" for line in lines if self.wanted(line))
                    if text:
                        sys.stderr.write(text)
                        sys.stderr.flush()
                elif self._stopped.is_set():
                    return
                else:
                    time.sleep(0.1)
        finally:
            if handle is not None:
                handle.close()
