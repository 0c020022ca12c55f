"""Engines beside their graphs, each with a fingerprint that says what it was built from and for.

``model_224_fp16.onnx`` built for TensorRT gives ``model_224_fp16.trt.engine`` and
``model_224_fp16.trt.json`` (the fingerprint; ``.rtx.`` for TensorRT-RTX). An engine is only
valid for the exact graph, shapes, build settings, TensorRT/CUDA/driver versions, GPU and plugin
sources it was built with, so ``EngineFromPath`` recomputes the fingerprint for the current
machine and refuses any difference in one line naming the fields, instead of running an engine
that may be wrong or crash. Nothing here rebuilds or overwrites an engine, and no path a
fingerprint file names is ever imported or loaded: plugins come from the caller, or are the
installed plugin packages the fingerprint names by entry point (code already installed here,
as ``--plugins sape2`` would load it), and either way are checked against the recorded hash
(``deploykit.backends.plugins``). Plugins are loaded only for an engine that needs them to
deserialize: one whose plugin layers all carry their compiled kernel (ahead-of-time quickly
deployable plugins, as SaPE²'s) needs nothing, as NVIDIA documents (``embedded_plugin_layers``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deploykit._io import write_json_atomic
from deploykit.backends._polygraphy import import_trt
from deploykit.backends.devices import Device, check_rtx_targets, probe_device
from deploykit.backends.plugins import Plugins, check_plugins
from deploykit.backends.shared_weights import SharedWeights
from deploykit.backends.tensorrt import BuildOptions
from deploykit.errors import DeployKitError, StaleEngineError
from deploykit.export.directory import engine_files, runtime_cache_file
from deploykit.export.metadata import GraphMetadata
from deploykit.runners.table import flavour

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
        cuda_driver: CUDA version the driver supports (``cuDriverGetVersion``), None without a
            driver. None for TensorRT-RTX, whose engines are built ahead of time (on a CPU too)
            for the compute capabilities in ``build`` (``compute_capabilities``) and compiled for
            the GPU on first load: whether one runs on this system is decided by those targets
            (``devices.check_rtx_targets``) and TensorRT-RTX's own answer from the engine's
            header (``devices.check_rtx_engine``), not by a comparison with the build machine.
        driver: NVIDIA driver version (NVML), None as for ``cuda_driver``.
        gpu: GPU name, None without a GPU, or for TensorRT-RTX.
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
    """``(engine, fingerprint)`` paths beside ``onnx_path`` for TensorRT flavour ``module``
    (``deploykit.export.directory.engine_files``)."""
    return engine_files(onnx_path, flavour(module).tag)


def runtime_cache_path(onnx_path: str | os.PathLike) -> Path:
    """Where TensorRT-RTX's runtime cache of the engine beside ``onnx_path`` is kept
    (``model_224_fp16.rtx.runtime-cache``: the kernels it compiled for this GPU, ``rtx_runtime``)."""
    return runtime_cache_file(onnx_path)


def require_engine(onnx_path: str | os.PathLike, module: str) -> tuple[Path, Path]:
    """``engine_paths``, when the engine exists.

    Raises:
        DeployKitError: no engine was built for this graph and flavour (naming the command).
    """
    onnx_path = Path(onnx_path)
    engine, fp_path = engine_paths(onnx_path, module)
    if not engine.is_file():
        tag = flavour(module).tag
        raise DeployKitError(f"no {tag} engine for {onnx_path.name}; run: deploykit build {onnx_path.parent} --backend {tag}")
    return engine, fp_path


def profile_shapes(input_name: str, sample_shapes: Sequence[Sequence[int]], options: BuildOptions) -> dict[str, list[list[int]]]:
    """The input's profile ``[min, opt, max]``: per-sample shapes (``[C, H, W]`` images, ``[T]``
    tokens; three of them, equal unless the graph covers a resolution range) with the options'
    batches in front."""
    if options.profiles:  # several: the first is the fingerprint's shapes, every one is in its build settings
        return {input_name: [list(s) for s in options.profiles[0]]}
    batches = (options.min_batch, options.opt_batch, options.max_batch)
    return {input_name: [[b, *sample] for b, sample in zip(batches, sample_shapes)]}


def build_settings(options: BuildOptions) -> dict:
    """The ``BuildOptions`` fields that change the engine (not where the timing cache lives;
    a range's sample shapes are in the fingerprint's profile shapes already, plugin libraries in
    its plugin hash, which does not depend on where they are)."""
    skip = ("timing_cache", "module", "sample_shapes")
    settings = {k: v for k, v in dataclasses.asdict(options).items() if k not in skip}
    if not options.compute_capabilities:  # TensorRT's, and TensorRT-RTX fingerprints written before targets were set
        del settings["compute_capabilities"]
    # The engine kind and several profiles, recorded when asked for: an engine of the default kind
    # keeps the fingerprint it had before they could be asked for.
    for name in ENGINE_KIND_FIELDS:
        if settings[name] == _DEFAULTS[name]:
            del settings[name]
    return settings


ENGINE_KIND_FIELDS = (
    "profiles",
    "version_compatible",
    "exclude_lean_runtime",
    "hardware_compatibility",
    "refittable",
    "strip_weights",
    "require_user_allocation",
)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(BuildOptions)}


def current_fingerprint(
    onnx_path: str | os.PathLike,
    graph_meta: GraphMetadata,
    shapes: dict,
    options: BuildOptions,
    plugins: Plugins = Plugins(),
    device: Device | None = None,
) -> Fingerprint:
    """The fingerprint an engine built now, here, from ``onnx_path`` would have.

    Args:
        onnx_path: the graph.
        graph_meta: its metadata (the encoding's config and the precision plan are fingerprinted).
        shapes: the optimization profile, from ``profile_shapes``.
        options: the build settings.
        plugins: the plugins loaded for the build.
        device: what ``probe_device()`` reports (passed in by tests).
    """
    from deploykit.export.manifest import sha256_file

    device = probe_device() if device is None else device
    if options.flavour.portable:  # nothing of the build machine's device
        device = Device()
    return Fingerprint(
        onnx_sha256=sha256_file(onnx_path),
        # As the graph stores it (json.dumps of the config), so older fingerprints still compare.
        encoding="" if graph_meta.encoding_config is None else json.dumps(graph_meta.encoding_config),
        precision=graph_meta.plan,
        # As JSON stores them (tuples become lists), so a fingerprint read back compares equal.
        shapes=json.loads(json.dumps(shapes)),
        build=json.loads(json.dumps(build_settings(options))),
        module=options.module,
        trt_version=import_trt(options.module).__version__,
        cuda_driver=device.cuda_driver,
        driver=device.driver,
        gpu=device.gpu,
        compute_capability=device.compute_capability,
        plugin_sha256=plugins.sha256(),
    )


@dataclass(frozen=True)
class EngineRecord:
    """What ``deploykit build`` wrote beside an engine.

    Attributes:
        fingerprint: what the engine depends on.
        engine_sha256: the engine file's hash.
        plugins: where its plugins came from, as described (named in messages only).
        installed_plugins: entry-point names of the installed plugin packages it was built with,
            which a runner given no plugins loads again (installed code, checked by hash).
        plugin_layers: how many of the graph's nodes became plugin layers (0: the engine needs
            no plugin to run, whatever was loaded when it was built).
        embedded_plugin_layers: how many of those carry their compiled kernel in the engine
            (ahead-of-time quickly deployable plugins), which TensorRT runs with no plugin
            registered (0 in records written before this was recorded: a plugin is loaded).
        lean_runtime: what a version-compatible engine needs where it is loaded
            (``tensorrt.lean_runtime_note``); "" for any other engine.
        shared_weights: a weight-stripped engine's refit graph and the one weights file it
            shares with the flavour's other stripped engines (``shared_weights``); None for an
            engine that carries its weights, or a stripped one refitted from its own graph.
    """

    fingerprint: Fingerprint
    engine_sha256: str
    plugins: list[str]
    installed_plugins: list[str]
    plugin_layers: int
    embedded_plugin_layers: int = 0
    lean_runtime: str = ""
    shared_weights: SharedWeights | None = None

    @property
    def profiles(self) -> list:
        """Every optimization profile of the engine, as the input's ``[min, opt, max]`` shapes
        (``deploykit.backends.profiles``)."""
        from deploykit.backends.profiles import recorded_profiles

        return recorded_profiles(self.fingerprint.build, self.fingerprint.shapes)

    @property
    def weights_stripped(self) -> bool:
        """Built with ``STRIP_PLAN``: refitted from the graph's ONNX when loaded."""
        return bool(self.fingerprint.build.get("strip_weights"))

    @property
    def capture_guaranteed(self) -> bool:
        """Built with ``REQUIRE_USER_ALLOCATION`` (TensorRT-RTX): no execution allocates at run
        time, so each can be captured into a CUDA graph (``cuda_graphs.capture_note``)."""
        return bool(self.fingerprint.build.get("require_user_allocation"))

    @property
    def self_contained(self) -> bool:
        """Whether it has plugin layers and all of them carry their kernel, so it deserializes
        with no plugin loaded (an engine without plugin layers is held to the plugins it was
        built with, as before)."""
        return 0 < self.plugin_layers == self.embedded_plugin_layers


def write_fingerprint(
    path: str | os.PathLike,
    fingerprint: Fingerprint,
    engine_sha256: str,
    plugins: Plugins = Plugins(),
    plugin_layers: int = 0,
    embedded_plugin_layers: int = 0,
    lean_runtime: str = "",
) -> None:
    """Store the fingerprint with the engine's own hash, where its plugins came from (named in
    messages only: nothing is ever loaded from these paths), how many plugin layers it has and
    how many of those carry their kernel (``EngineRecord``)."""
    record = {
        "fingerprint": fingerprint.to_dict(),
        "engine_sha256": engine_sha256,
        "plugins": plugins.describe(),
        "installed_plugins": list(plugins.installed),
        "plugin_layers": plugin_layers,
        "embedded_plugin_layers": embedded_plugin_layers,
    }
    if lean_runtime:
        record["lean_runtime"] = lean_runtime
    write_json_atomic(path, record)


def record_shared_weights(path: str | os.PathLike, shared: SharedWeights) -> None:
    """Add to the record at ``path`` the weight set its weight-stripped engine is refitted
    from (written after the weight set, so a record never names files not yet there)."""
    record = json.loads(Path(path).read_text())
    record["shared_weights"] = shared.to_dict()
    write_json_atomic(path, record)


def read_fingerprint(path: str | os.PathLike) -> EngineRecord:
    """The record ``write_fingerprint`` stored.

    Raises:
        StaleEngineError: the file is missing or unreadable (an engine without one is never used).
    """
    path = Path(path)
    try:
        record = json.loads(path.read_text())
        return EngineRecord(
            Fingerprint.from_dict(record["fingerprint"]),
            record["engine_sha256"],
            [str(p) for p in record["plugins"]],
            [str(p) for p in record["installed_plugins"]],
            int(record["plugin_layers"]),
            int(record.get("embedded_plugin_layers", 0)),
            str(record.get("lean_runtime", "")),
            SharedWeights.from_dict(record["shared_weights"]) if record.get("shared_weights") else None,
        )
    except FileNotFoundError:
        raise StaleEngineError(f"engine fingerprint {path} is missing; rebuild with deploykit build --rebuild") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise StaleEngineError(f"engine fingerprint {path} is unreadable ({err}); rebuild with deploykit build --rebuild") from err


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
            engine was built with (checked by hash before anything is imported or loaded). None:
            the installed plugin packages its fingerprint names (``sape2``), resolved by their
            entry points and checked the same way; a library or a directory is never loaded
            unless given. An engine whose plugin layers all carry their kernel
            (``EngineRecord.self_contained``) loads none; plugins given for it are still checked.
    """

    def __init__(self, onnx_path: str | os.PathLike, module: str, device: Device | None = None, plugins: Plugins | None = None) -> None:
        self.onnx_path = Path(onnx_path)
        self.module = module
        self.device = device
        self.plugins = plugins

    def __call__(self) -> bytes:
        """The serialized engine, with the plugins it needs to deserialize loaded.

        Raises:
            DeployKitError: no engine was built for this graph and backend.
            StaleEngineError: fingerprint missing or different from now, the engine file changed,
                or the plugins given are not the ones it was built with.
        """
        from deploykit.export.manifest import sha256_file

        engine, fp_path = require_engine(self.onnx_path, self.module)
        hint = f"rebuild with: deploykit build {self.onnx_path.parent} --backend {flavour(self.module).tag} --rebuild"
        record = read_fingerprint(fp_path)
        stored = record.fingerprint
        if flavour(self.module).portable:  # before anything is loaded: an engine for other GPUs never runs here
            device = probe_device() if self.device is None else self.device
            check_rtx_targets(device, stored.build.get("compute_capabilities", ()), engine.name, hint)
        plugins = self.plugins
        if plugins is None and not record.self_contained:
            plugins = installed_plugins(record)
        if plugins is not None:
            check_plugins(engine, stored.plugin_sha256, record.plugins, plugins, hint)
        try:
            options = BuildOptions(module=self.module, **stored.build)
        except (TypeError, ValueError) as err:  # a fingerprint from another deploykit version, or edited
            raise StaleEngineError(f"{fp_path} records build settings this deploykit does not know ({err}); {hint}") from err
        meta = GraphMetadata.of_file(self.onnx_path)
        current = current_fingerprint(self.onnx_path, meta, stored.shapes, options, plugins or Plugins(), self.device)
        if plugins is None:  # nothing to load: the sources it was built with are not needed here
            current = dataclasses.replace(current, plugin_sha256=stored.plugin_sha256)
        check_fingerprint(engine, stored, current, hint)
        if sha256_file(engine) != record.engine_sha256:
            raise StaleEngineError(f"{engine} changed since it was built (sha256 differs from {fp_path.name}); {hint}")
        if record.weights_stripped and record.shared_weights is not None:  # before it is loaded and refitted from them
            record.shared_weights.check(engine.parent, hint)
        if not record.self_contained:  # before the runner deserializes: plugin layers need their creators
            plugins.load(self.module)
        return engine.read_bytes()


def installed_plugins(record: EngineRecord) -> Plugins:
    """The installed packages the record names, when those are all it was built with (else none,
    and ``check_plugins`` says which ones to pass)."""
    if not record.installed_plugins or len(record.installed_plugins) != len(record.plugins):
        return Plugins()
    try:
        return Plugins.resolve(record.installed_plugins)
    except DeployKitError:  # not installed here: check_plugins names what to pass
        return Plugins()
