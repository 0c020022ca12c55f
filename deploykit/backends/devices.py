"""Which GPUs each engine backend runs on, and the check that refuses any other before anything
is loaded.

The CUDA driver is asked directly (``libcuda`` through ``ctypes``: what CUDA sees, so
``CUDA_VISIBLE_DEVICES`` holds) and NVML for the driver's version, so neither a CUDA toolkit nor
a CUDA build of torch is needed to know what the machine has.

Support, from NVIDIA's support matrices (checked against what the runtime says where it can):

=================  ======================================================  ===================
backend            compute capabilities                                    e.g.
=================  ======================================================  ===================
``trt``            7.5 and newer (TensorRT 10 and 11)                      T4, A100, L4, H100,
                                                                           B200, RTX 20-50xx
``rtx``            7.5, 8.6, 8.9, 12.0, 12.1 only (TensorRT-RTX 1.x)       RTX 20/30/40/50xx,
                                                                           RTX PRO, GB10
``ort-cuda``       what the installed onnxruntime-gpu's CUDA build runs    any CUDA GPU
=================  ======================================================  ===================

TensorRT-RTX is built for consumer and workstation GPUs: a data-centre GPU (A100 8.0, H100/H200
9.0, B200 10.0) is refused with a pointer to ``trt``. TensorRT-RTX also answers, from an
engine's header alone, whether that engine is valid on this system
(``IRuntime.get_engine_validity``); ``check_rtx_engine`` asks it before deserializing.

CUDA builds. Each TensorRT flavour ships one wheel per CUDA major (``tensorrt-cu12``,
``tensorrt-cu13``, ``tensorrt-rtx-cu12``...); the ``tensorrt`` and ``tensorrt-rtx`` metapackages
(deploykit's ``trt`` and ``rtx`` extras) install the CUDA 13 ones, which need an NVIDIA driver
R580 or newer, and ``trt-cu12`` / ``rtx-cu12`` the CUDA 12 ones (R525 or newer: CUDA's
minor-version compatibility). ``check_cuda_build`` compares the installed wheel's CUDA major with
the newest CUDA the driver runs (NVML) and, where the driver is older, says in one line what to
install, before TensorRT fails on its first CUDA call.

Which GPUs a TensorRT-RTX engine runs on is decided when it is built: the compute capabilities
set on ``IBuilderConfig`` (``num_compute_capabilities``, ``set_compute_capability``). Without
any, TensorRT-RTX builds for 8.0, 8.6, 8.9, 12.0 and later, never Turing: "To build engines for
Turing devices, a compute capability of 7.5 needs to be specified through the API", and NVIDIA
advises device-specific engines for Turing rather than portable ones that include it, which "can
impact performance" (TensorRT-RTX docs, CPU-Only AOT and TensorRT-RTX Engines; support matrix
1.x). So ``rtx_targets`` builds for every supported GPU but Turing, or, on a Turing GPU, for 7.5
alone, and ``check_rtx_targets`` refuses an engine whose recorded targets miss the GPU present.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

from deploykit import _nvml
from deploykit._nvml import driver_version
from deploykit.errors import ConfigError, DeployKitError, StaleEngineError
from deploykit.runners.table import TENSORRT_RTX, flavour

# CUDA major of a TensorRT wheel -> the oldest driver branch that runs it (CUDA toolkit release
# notes: 12.x from R525, 13.x from R580, by minor-version compatibility).
MIN_DRIVER = {12: "R525", 13: "R580"}

# IRuntime.get_engine_validity's diagnostics bits (TensorRT-RTX's EngineInvalidityDiagnostics, in
# its declaration order; a malformed file answers 32, checked in tests).
_INVALIDITY = {
    1: "TensorRT-RTX version mismatch",
    2: "unsupported compute capability",
    4: "CUDA driver too old",
    8: "CUDA runtime too old",
    16: "insufficient GPU memory",
    32: "malformed engine data",
    64: "CUDA error",
}


@dataclass(frozen=True)
class Device:
    """What the CUDA driver reports; every field None on a machine without one."""

    cuda_driver: str | None = None
    driver: str | None = None
    gpu: str | None = None
    compute_capability: str | None = None


def probe_device(ordinal: int = 0) -> Device:
    """Ask the CUDA driver for device ``ordinal`` (``Device()`` without a driver or a GPU)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return Device()
    version, dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    name = ctypes.create_string_buffer(256)
    if cuda.cuInit(0) != 0 or cuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return Device()
    cuda_driver = f"{version.value // 1000}.{version.value % 1000 // 10}"
    if cuda.cuDeviceGet(ctypes.byref(dev), ordinal) != 0 or cuda.cuDeviceGetName(name, len(name), dev) != 0:
        return Device(cuda_driver=cuda_driver, driver=driver_version())
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    return Device(cuda_driver, driver_version(), name.value.decode(), f"{major.value}.{minor.value}")


def supports(module: str, compute_capability: str) -> bool:
    """Whether engine flavour ``module`` runs on a GPU of ``compute_capability`` (``"8.9"``)."""
    return flavour(module).supports(compute_capability)


def supported_text(module: str) -> str:
    """``compute capability 7.5 and newer``: what engine flavour ``module`` runs on, in words."""
    return flavour(module).supported_text()


def check_device(module: str, device: Device) -> None:
    """Refuse, in one line naming what to use instead, a machine whose GPU ``module`` does not run on.

    Raises:
        DeployKitError: no CUDA GPU, or one of a compute capability ``module`` does not support.
    """
    problem = device_problem(module, device)
    if problem:
        raise DeployKitError(problem)


def device_problem(module: str, device: Device) -> str | None:
    """Why engine flavour ``module`` cannot run on ``device``, naming what to use instead; None when it can."""
    wanted = flavour(module)
    if device.compute_capability is None:
        return f"the {wanted.tag} runner needs a CUDA GPU (the CUDA driver reports none here); on this machine use --backend ort"
    if not wanted.supports(device.compute_capability):
        return (
            f"{device.gpu} (compute capability {device.compute_capability}) is not supported by {wanted.tag} ({wanted.supported_text()}); "
            f"use --backend {wanted.instead}"
        )
    return None


def check_rtx_engine(runtime, data: bytes, what: str) -> None:
    """Ask TensorRT-RTX whether the engine ``data`` is valid on this system, from its header.

    Raises:
        DeployKitError: TensorRT-RTX says it is not, naming its reasons and the fix (rebuild).
    """
    validity, diagnostics = runtime.get_engine_validity(data)
    if validity.name != "INVALID":
        return
    reasons = [text for bit, text in _INVALIDITY.items() if diagnostics & bit] or [f"diagnostics {diagnostics:#x}"]
    raise DeployKitError(
        f"{what} is not valid on this system according to TensorRT-RTX ({', '.join(reasons)}); rebuild it here with deploykit build --backend rtx --rebuild"
    )


def cuda_build(module: str) -> tuple[str, str, int] | None:
    """The installed wheel that provides ``module`` (or its ``_bindings``), its version and the
    CUDA major it was built for, read from its name (``tensorrt_rtx_cu13``); None when not installed
    or the name carries no CUDA major."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    providers = packages_distributions()
    for name in (*providers.get(module, ()), *providers.get(f"{module}_bindings", ())):
        found = re.search(r"[-_]cu(\d+)(?:$|[-_])", name)
        if found:
            try:
                return name, version(name), int(found.group(1))
            except PackageNotFoundError:
                continue
    return None


def cuda_build_problem(module: str) -> str | None:
    """Why the installed ``module`` cannot run on this driver (a wheel for a newer CUDA than the
    driver runs), with what to install instead; None when it can, or there is no driver to ask."""
    runs = _nvml.cuda_driver_version()
    build = cuda_build(module) if runs is not None else None
    if build is None:
        return None
    wheel, version, major = build
    driver_major = int(runs.split(".")[0])
    if major <= driver_major:
        return None
    tag, needs = flavour(module).tag, MIN_DRIVER.get(major, f"for CUDA {major}")
    said = f"{wheel} {version} is a CUDA {major} build (NVIDIA driver {needs} or newer), but this driver ({_nvml.driver_version()}) runs CUDA {runs} at most"
    if driver_major in MIN_DRIVER:
        # The metapackage too: left installed, it pulls the CUDA 13 wheel back on the next upgrade.
        uninstall = f"pip uninstall {module} {wheel} {wheel}_bindings {wheel}_libs"
        return (
            f"{said}: {uninstall} and pip install 'deploykit[{tag}-cu{driver_major}]' (its CUDA {driver_major} build), or update the driver"
        )
    return f"{said}: update the driver to {needs} (or {MIN_DRIVER[min(MIN_DRIVER)]} and pip install 'deploykit[{tag}-cu{min(MIN_DRIVER)}]')"


def check_cuda_build(module: str) -> None:
    """Refuse, in one line naming what to install, a TensorRT wheel this driver cannot run.

    Raises:
        DeployKitError: the installed wheel is built for a newer CUDA than the driver runs.
    """
    problem = cuda_build_problem(module)
    if problem:
        raise DeployKitError(problem)


def rtx_targets(device: Device, asked: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The compute capabilities a TensorRT-RTX engine is built for: ``asked`` when given, else
    the GPU's own when only a device-specific engine runs on it (Turing, 7.5), else its flavour's
    ``portable_targets``.

    Raises:
        ConfigError: an asked capability TensorRT-RTX does not run on.
    """
    unsupported = [cc for cc in asked if not TENSORRT_RTX.supports(cc)]
    if unsupported:
        raise ConfigError(f"TensorRT-RTX cannot build for compute capability {unsupported[0]} ({TENSORRT_RTX.supported_text()})")
    if asked:
        return tuple(dict.fromkeys(asked))
    cc = device.compute_capability
    if cc is not None and TENSORRT_RTX.supports(cc) and cc not in TENSORRT_RTX.portable_targets:
        return (cc,)
    return TENSORRT_RTX.portable_targets


def check_rtx_targets(device: Device, targets: list[str] | tuple[str, ...], what: str, hint: str) -> None:
    """Refuse, in one line, a TensorRT-RTX engine built for ``targets`` (empty: TensorRT-RTX's
    default, its flavour's ``default_targets``) when the GPU here is not among them; nothing without a GPU.

    Raises:
        StaleEngineError: the GPU's compute capability is not one the engine was built for.
    """
    cc = device.compute_capability
    built_for = tuple(targets) or TENSORRT_RTX.default_targets
    if cc is None or cc in built_for:
        return
    raise StaleEngineError(
        f"{what} was built for compute capabilities {', '.join(built_for)}, not for the {device.gpu} here ({cc}); {hint}"
    )
