"""What this CPU is and which GEMM-relevant instruction sets it reports, read from /proc/cpuinfo:
benchmarks record it, and the OpenVINO runner decides from it whether int8 products saturate.
And ``denormals_flushed``: the calling thread's floating-point mode for CPU inference.

Why denormals matter here: a trained ViT's attention can be so peaked that softmax writes
probabilities below float32's normal range (1.2e-38). On x86 every product with such a value
takes a microcode assist, many times the normal cost; on held-out images of the default zoo model,
flushing them makes ONNX Runtime's fp32 graph several times faster per image with bit-identical
outputs (``benchmarks/results/denormals.json``, from ``benchmarks/denormals.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def available_memory() -> int | None:
    """Bytes of memory the kernel says can be had without swapping (``MemAvailable`` in
    /proc/meminfo); None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpuinfo() -> dict[str, str]:
    """First processor's fields from /proc/cpuinfo (empty off Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


# Instruction sets that decide which GEMM kernels run: int8 dot products (VNNI, AMX) make INT8 plans
# 2-4x faster than fp32; without them ONNX Runtime's int8 kernels gain much less.
_ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "sve",
    "i8mm",
    "bf16",
)


def cpu_instruction_sets(cpu: dict[str, str] | None = None) -> list[str]:
    """The GEMM-relevant instruction sets this CPU reports (``flags`` on x86, ``Features`` on Arm)."""
    cpu = cpuinfo() if cpu is None else cpu
    flags = set((cpu.get("flags") or cpu.get("Features") or "").split())
    return [f for f in _ISA_FLAGS if f in flags]


def flushing_denormals() -> bool:
    """Whether the calling thread flushes denormals now. PyTorch sets the mode but has no getter:
    a float32 denormal times one is zero only when the thread flushes (DAZ or FTZ)."""
    import numpy as np

    with np.errstate(all="ignore"):
        return bool(np.float32(1e-40) * np.float32(1.0) == 0)


@contextlib.contextmanager
def denormal_mode_kept() -> Iterator[None]:
    """Put the calling thread's denormal mode back after the block, whatever the block set: ONNX
    Runtime's ``session.set_denormal_as_zero`` also flushes, for good, the thread that creates the
    process's first session, which would change every later numpy and PyTorch result there."""
    import numpy as np
    import torch

    for dtype in (np.float16, np.float32, np.float64):
        np.finfo(dtype)  # numpy caches these on first use; made while flushing, they warn and say 0
    before = flushing_denormals()
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


@contextlib.contextmanager
def denormals_flushed() -> Iterator[bool]:
    """Flush denormals to zero (FTZ and DAZ) on the calling thread for the block, then put back the
    mode it had (the mode is per thread, so concurrent callers do not disturb each other). Yields
    whether the CPU supports it (x86 with SSE3, AArch64)."""
    import torch

    with denormal_mode_kept():
        yield torch.set_flush_denormal(True)


def int8_saturates() -> bool:
    """Whether int8 products saturate on this CPU: x86 without VNNI or AMX, where a pair of u8·s8
    products is summed in 16 bits (OpenVINO's "saturation (overflow) issue"; ONNX Runtime's u8s8
    kernels too, the reason for its quantizer's ``reduce_range``)."""
    isa = set(cpu_instruction_sets())
    return "sse4_2" in isa and not isa & {"avx512_vnni", "avx_vnni", "amx_int8"}
