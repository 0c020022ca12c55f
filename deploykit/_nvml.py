"""NVIDIA driver and GPU facts, read one way: NVML through NVIDIA's own binding (``nvidia-ml-py``,
imported as ``pynvml``).

NVML is the library ``nvidia-smi`` itself reads; calling it directly needs no binary on ``PATH``,
no subprocess or timeout and no parsing of CSV text, and NVIDIA maintains the binding with the
driver's API, so neither a hand-written ``ctypes`` declaration nor a command's output format can
drift from it. Without a driver every answer is None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pynvml


@contextlib.contextmanager
def _session() -> Iterator[bool]:
    """NVML initialised for the block; yields False when there is no driver (nothing to ask)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        yield False
        return
    try:
        yield True
    finally:
        pynvml.nvmlShutdown()


def driver_version() -> str | None:
    """The NVIDIA driver's version (``"570.133.20"``), None without a driver."""
    with _session() as ok:
        return _text(pynvml.nvmlSystemGetDriverVersion()) if ok else None


def cuda_driver_version() -> str | None:
    """The newest CUDA version the driver supports (``"12.4"``), None without a driver."""
    with _session() as ok:
        if not ok:
            return None
        version = pynvml.nvmlSystemGetCudaDriverVersion_v2()
    return f"{version // 1000}.{version % 1000 // 10}"


def clocks(index: int = 0) -> dict[str, str] | None:
    """The GPU's current SM clock, its maximum and the memory clock (``"1410 MHz"``), None
    without a driver or that GPU (``index`` in NVML's order, as ``nvidia-smi -i`` counts)."""
    with _session() as ok:
        if not ok:
            return None
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            sm = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
            sm_max = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
            mem = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        except pynvml.NVMLError:
            return None
    return {"clock_sm": f"{sm} MHz", "clock_sm_max": f"{sm_max} MHz", "clock_mem": f"{mem} MHz"}


def _text(value: str | bytes) -> str:
    # Bindings before 11.515 return bytes.
    return value.decode() if isinstance(value, bytes) else value
