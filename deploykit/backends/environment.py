"""What a timing was measured on: CPU, GPU, library versions, thread settings, load.

Everything is read without importing optional packages (versions come from package metadata),
so capturing the environment never pulls in TensorRT.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

from deploykit._nvml import clocks, driver_version
from deploykit.runners.cpu import cpu_instruction_sets, cpuinfo
from deploykit.runners.onnxrt import session_options

# Distributions whose versions change timings; absent ones are left out.
_PACKAGES = ("deploykit", "torch", "onnxruntime", "onnxruntime-gpu", "openvino", "onnx", "numpy", "tensorrt", "tensorrt-rtx")
# Thread-count variables that OpenMP, MKL and OpenBLAS read at start-up.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ORT_NUM_THREADS")


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _gpu(device: torch.device) -> dict | None:
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    info = {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
        "capability": f"{props.major}.{props.minor}",
    }
    info.update(driver=driver_version() or "unknown (no NVML)", **(clocks(device.index or 0) or {}))
    return info


def capture_environment(device: torch.device) -> dict:
    """CPU model, cores, clock, GPU (when ``device`` is CUDA), versions, thread settings, load."""
    cpu = cpuinfo()
    opts = session_options()
    return {
        "cpu": cpu.get("model name") or platform.processor() or platform.machine(),
        "cpu_mhz": cpu.get("cpu MHz"),
        "cpu_instruction_sets": cpu_instruction_sets(cpu),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "gpu": _gpu(device),
        "versions": _versions(),
        "threads": {
            "torch_intra_op": torch.get_num_threads(),
            "torch_inter_op": torch.get_num_interop_threads(),
            "ort_intra_op": opts.intra_op_num_threads,
            "ort_inter_op": opts.inter_op_num_threads,
            "ort_execution_mode": str(opts.execution_mode).rsplit(".", 1)[-1],
            **{var: os.environ[var] for var in _THREAD_VARS if var in os.environ},
        },
        "flush_denormal": "denormals flushed to zero on the calling thread during timing; ONNX Runtime flushes its own threads always",
        "load_average_start": list(os.getloadavg()),
    }


def environment_line(env: dict) -> str:
    """One line for logs and README tables."""
    gpu = env.get("gpu")
    gpu_part = f"{gpu['name']} (driver {gpu.get('driver', '?')}, CUDA {gpu.get('cuda')})" if gpu else "no GPU"
    versions = env.get("versions", {})
    libs = ", ".join(
        f"{k} {versions[k]}" for k in ("torch", "onnxruntime", "onnxruntime-gpu", "openvino", "tensorrt", "numpy") if k in versions
    )
    threads = env.get("threads", {})
    load = env.get("load_average_start") or [float("nan")]
    isa = " ".join(env.get("cpu_instruction_sets") or []) or "instruction sets not recorded"
    return (
        f"{env.get('cpu')} × {env.get('usable_cores')} cores ({isa}), {gpu_part}; {libs}; torch threads "
        f"{threads.get('torch_intra_op')}, ORT intra-op {threads.get('ort_intra_op') or 'default'}; "
        f"flush-denormal on; load avg {load[0]:.2f} at start"
    )
