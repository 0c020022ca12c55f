"""Engines beside their graphs, each with a fingerprint that says what it was built from and for.

``model_224_fp16.onnx`` built for TensorRT gives ``model_224_fp16.trt.engine`` and
``model_224_fp16.trt.json`` (the fingerprint; ``.rtx.`` for TensorRT-RTX). An engine is only
valid for the exact graph, shapes, build settings, TensorRT/CUDA/driver versions, GPU and plugin
sources it was built with, so ``EngineFromPath`` recomputes the fingerprint for the current
machine and refuses any difference in one line naming the fields, instead of running an engine
that may be wrong or crash. Nothing here rebuilds or overwrites an engine, and nothing is
imported or loaded from what a fingerprint file says: plugins come from the caller and are
checked against the recorded hash (``deploykit.backends.plugins``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deploykit._io import write_json_atomic
from deploykit._nvml import driver_version
from deploykit.backends._polygraphy import import_trt
from deploykit.backends.plugins import Plugins, check_plugins
from deploykit.backends.tensorrt import BuildOptions
from deploykit.errors import StaleEngineError

# TensorRT flavour -> the tag in engine file names and in ``--backend``.
BACKEND_TAGS = {"tensorrt": "trt", "tensorrt_rtx": "rtx"}
ENGINE_MODULES = {tag: module for module, tag in BACKEND_TAGS.items()}  # ``--backend`` tag -> flavour
_MAX_VALUE_CHARS = 40  # keep the one-line refusal readable when a hash differs


@dataclass(frozen=True)
class Fingerprint:
    """What an engine depends on. Two fingerprints that differ in any field mean "rebuild".

    Attributes:
        onnx_sha256: the graph the engine was built from (covers tables, weights, precision casts).
        encoding: the encoding config recorded in the graph's metadata (JSON).
        precision: the graph's precision plan (fp32, fp16, bf16).
        shapes: input name → ``[min, opt, max]`` shapes of the optimization profile.
        build: the build settings (``BuildOptions`` fields that change the engine).
        module: ``tensorrt`` or ``tensorrt_rtx``.
        trt_version: version of that module.
        cuda_driver: CUDA version the driver supports (``cuDriverGetVersion``), None without a driver.
        driver: NVIDIA driver version (NVML), None without a driver.
        gpu: GPU name, None without a GPU; None for TensorRT-RTX, whose engines are built ahead of
            time for every supported compute capability and compiled for the GPU on first load.
        compute_capability: ``"8.9"``-style, None as for ``gpu``.
        plugin_sha256: hash of the plugins loaded for the build (Python sources and shared
            libraries, ``Plugins.sha256``), None without plugins.
    """

    onnx_sha256: str
    encoding: str
    precision: str
    shapes: dict[str, list[list[int]]]
    build: dict
    module: str
    trt_version: str
    cuda_driver: str | None
    driver: str | None
    gpu: str | None
    compute_capability: str | None
    plugin_sha256: str | None

    def diff(self, other: Fingerprint) -> list[str]:
        """Names of the fields whose values differ."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def explain(self, current: Fingerprint) -> str:
        """``field (built X, now Y)`` for each differing field (``build.max_batch`` inside dicts), on one line."""
        parts = []
        for name in self.diff(current):
            built, now = getattr(self, name), getattr(current, name)
            if isinstance(built, dict) and isinstance(now, dict):
                keys = [k for k in sorted({*built, *now}) if built.get(k) != now.get(k)]
                parts += [f"{name}.{k} (built {_short(built.get(k))}, now {_short(now.get(k))})" for k in keys]
            else:
                parts.append(f"{name} (built {_short(built)}, now {_short(now)})")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Fingerprint:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"fields {sorted(set(data) ^ names)} missing or unexpected")
        return cls(**data)


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."


def engine_paths(onnx_path: str | os.PathLike, module: str) -> tuple[Path, Path]:
    """``(engine, fingerprint)`` paths beside ``onnx_path`` for TensorRT flavour ``module``."""
    onnx_path = Path(onnx_path)
    stem = onnx_path.with_suffix("")
    tag = BACKEND_TAGS[module]
    return stem.with_name(f"{stem.name}.{tag}.engine"), stem.with_name(f"{stem.name}.{tag}.json")


def profile_shapes(input_name: str, sample_shapes: Sequence[Sequence[int]], options: BuildOptions) -> dict[str, list[list[int]]]:
    """The input's profile ``[min, opt, max]``: per-sample shapes (``[C, H, W]`` images, ``[T]``
    tokens; three of them, equal unless the graph covers a resolution range) with the options'
    batches in front."""
    batches = (options.min_batch, options.opt_batch, options.max_batch)
    return {input_name: [[b, *sample] for b, sample in zip(batches, sample_shapes)]}


def build_settings(options: BuildOptions) -> dict:
    """The ``BuildOptions`` fields that change the engine (not where the timing cache lives;
    a range's sample shapes are in the fingerprint's profile shapes already, plugin libraries in
    its plugin hash, which does not depend on where they are)."""
    skip = ("timing_cache", "module", "sample_shapes", "plugin_libraries")
    return {k: v for k, v in dataclasses.asdict(options).items() if k not in skip}


@dataclass(frozen=True)
class Device:
    """What the CUDA driver reports; every field None on a machine without one."""

    cuda_driver: str | None = None
    driver: str | None = None
    gpu: str | None = None
    compute_capability: str | None = None


def probe_device(ordinal: int = 0) -> Device:
    """Ask the CUDA driver (``libcuda``: what CUDA sees, so ``CUDA_VISIBLE_DEVICES`` holds) and NVML
    (``deploykit._nvml``: the driver version), so no CUDA toolkit or torch build is needed."""
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


def current_fingerprint(
    onnx_path: str | os.PathLike,
    graph_meta: dict,
    shapes: dict,
    options: BuildOptions,
    plugins: Plugins = Plugins(),
    device: Device | None = None,
) -> Fingerprint:
    """The fingerprint an engine built now, here, from ``onnx_path`` would have.

    Args:
        onnx_path: the graph.
        graph_meta: its metadata (``deploykit.encoding_config``, ``deploykit.precision``).
        shapes: the optimization profile, from ``profile_shapes``.
        options: the build settings.
        plugins: the plugins loaded for the build.
        device: what ``probe_device()`` reports (passed in by tests).
    """
    from deploykit.export.manifest import sha256_file

    device = probe_device() if device is None else device
    portable = options.module == "tensorrt_rtx"
    return Fingerprint(
        onnx_sha256=sha256_file(onnx_path),
        encoding=graph_meta.get("deploykit.encoding_config", ""),
        precision=graph_meta.get("deploykit.precision", "fp32"),
        # As JSON stores them (tuples become lists), so a fingerprint read back compares equal.
        shapes=json.loads(json.dumps(shapes)),
        build=json.loads(json.dumps(build_settings(options))),
        module=options.module,
        trt_version=import_trt(options.module).__version__,
        cuda_driver=device.cuda_driver,
        driver=device.driver,
        gpu=None if portable else device.gpu,
        compute_capability=None if portable else device.compute_capability,
        plugin_sha256=plugins.sha256(),
    )


def write_fingerprint(path: str | os.PathLike, fingerprint: Fingerprint, engine_sha256: str, plugins: Plugins = Plugins()) -> None:
    """Store the fingerprint with the engine's own hash and where its plugins came from (named
    in messages only: nothing is ever loaded from these paths)."""
    record = {"fingerprint": fingerprint.to_dict(), "engine_sha256": engine_sha256, "plugins": plugins.describe()}
    write_json_atomic(path, record)


def read_fingerprint(path: str | os.PathLike) -> tuple[Fingerprint, str, list[str]]:
    """``(fingerprint, engine_sha256, plugins it was built with, as described)`` from a fingerprint file.

    Raises:
        StaleEngineError: the file is missing or unreadable (an engine without one is never used).
    """
    path = Path(path)
    try:
        record = json.loads(path.read_text())
        return Fingerprint.from_dict(record["fingerprint"]), record["engine_sha256"], [str(p) for p in record["plugins"]]
    except FileNotFoundError:
        raise StaleEngineError(f"engine fingerprint {path} is missing; rebuild with deploykit build --rebuild") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise StaleEngineError(f"engine fingerprint {path} is unreadable ({err}); rebuild with deploykit build --rebuild") from err


def graph_metadata(onnx_path: str | os.PathLike) -> dict[str, str]:
    """The ``metadata_props`` of an ONNX file, without loading external weight files."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    return {p.key: p.value for p in proto.metadata_props}


def check_fingerprint(engine: Path, stored: Fingerprint, current: Fingerprint, hint: str) -> None:
    """Raise ``StaleEngineError`` naming every field where ``stored`` and ``current`` differ."""
    if stored.diff(current):
        raise StaleEngineError(f"{engine} does not match: {stored.explain(current)}; {hint}")


class EngineFromPath:
    """Load the engine ``deploykit build`` wrote beside a graph, refusing a stale one.

    Args:
        onnx_path: the graph the engine was built from (``model_224_fp16.onnx``).
        module: ``"tensorrt"`` or ``"tensorrt_rtx"``.
        device: what ``probe_device()`` reports; probed when None.
        plugins: the plugins to load before the engine is deserialized; they must be the ones the
            engine was built with (checked by hash before anything is imported or loaded).
    """

    def __init__(self, onnx_path: str | os.PathLike, module: str, device: Device | None = None, plugins: Plugins = Plugins()) -> None:
        self.onnx_path = Path(onnx_path)
        self.module = module
        self.device = device
        self.plugins = plugins

    def __call__(self) -> bytes:
        """The serialized engine, with its plugins loaded.

        Raises:
            DeployKitError: no engine was built for this graph and backend.
            StaleEngineError: fingerprint missing or different from now, the engine file changed,
                or the plugins given are not the ones it was built with.
        """
        from deploykit.errors import DeployKitError
        from deploykit.export.manifest import sha256_file

        engine, fp_path = engine_paths(self.onnx_path, self.module)
        tag = BACKEND_TAGS[self.module]
        hint = f"rebuild with: deploykit build {self.onnx_path.parent} --backend {tag} --rebuild"
        if not engine.is_file():
            raise DeployKitError(f"no {tag} engine for {self.onnx_path.name}; run: deploykit build {self.onnx_path.parent} --backend {tag}")
        stored, engine_sha, built_with = read_fingerprint(fp_path)
        check_plugins(engine, stored.plugin_sha256, built_with, self.plugins, hint)
        try:
            options = BuildOptions(module=self.module, **stored.build)
        except (TypeError, ValueError) as err:  # a fingerprint from another deploykit version, or edited
            raise StaleEngineError(f"{fp_path} records build settings this deploykit does not know ({err}); {hint}") from err
        current = current_fingerprint(self.onnx_path, graph_metadata(self.onnx_path), stored.shapes, options, self.plugins, self.device)
        check_fingerprint(engine, stored, current, hint)
        if sha256_file(engine) != engine_sha:
            raise StaleEngineError(f"{engine} changed since it was built (sha256 differs from {fp_path.name}); {hint}")
        self.plugins.load(self.module)  # before the runner deserializes: the engine's layers need their creators
        return engine.read_bytes()
