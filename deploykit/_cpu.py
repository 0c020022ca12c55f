"""What this CPU is and which GEMM-relevant instruction sets it reports, read from /proc/cpuinfo:
benchmarks record it, and the OpenVINO runner decides from it whether int8 products saturate."""

from __future__ import annotations


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
