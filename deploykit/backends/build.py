"""``deploykit build``: one TensorRT (or TensorRT-RTX) engine per exported graph, beside it.

For every graph in an export directory (each resolution × precision plan) the engine is written
as ``model_224_fp16.trt.engine`` with its fingerprint ``model_224_fp16.trt.json``
(``deploykit.backends.engine_cache``). An engine whose fingerprint matches what would be built
now is reused; one that does not is refused, naming the fields, unless ``rebuild=True``: all
graphs are checked before anything is built, so a refusal leaves the directory as it was.
Weight-stripped engines (``strip_weights``) are then given one weight set for every resolution
(``share_weights``).

Shapes: a graph exported at one resolution has static height/width (tables baked for it) and
a dynamic batch. By default each engine is fully static (batch ``batch``), TensorRT's fastest
form; ``dynamic=True`` builds one optimization profile over the batch (1 / ``batch`` /
``max_batch``). A graph exported over a resolution range (``export --resolution-range``, for
encodings whose tables nest) gets a profile over that range too: min/opt/max height and width
from the manifest, paired with the min/opt/max batch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deploykit.backends import defaults
from deploykit.backends.devices import check_cuda_build, probe_device, rtx_targets
from deploykit.backends.engine_cache import (
    Device,
    Fingerprint,
    check_fingerprint,
    current_fingerprint,
    engine_paths,
    profile_shapes,
    read_fingerprint,
    record_shared_weights,
    write_fingerprint,
)
from deploykit.backends.plugins import Plugins
from deploykit.backends.profiles import ProfileRequest, profiles_from_resolutions
from deploykit.backends.registry import check_backend
from deploykit.backends.shared_weights import WeightSet, write_weight_set
from deploykit.backends.tensorrt import BuildOptions, BuildProgress, EngineFromOnnx, lean_runtime_note, save_engine
from deploykit.errors import ConfigError, StaleEngineError
from deploykit.export.directory import ExportDir
from deploykit.export.manifest import GraphEntry, Manifest, sha256_file
from deploykit.export.metadata import GraphMetadata
from deploykit.export.precision import PLANS, check_precision
from deploykit.runners.table import engine_flavours, flavour

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltEngine:
    """One engine ``build`` produced or found valid."""

    graph: str
    engine: Path
    fingerprint: Path
    cached: bool
    seconds: float


@dataclass(frozen=True)
class BuildSettings:
    """What ``build`` builds and how (the ``deploykit build`` flags, as one record).

    Attributes:
        dynamic: one batch profile (1 / ``batch`` / ``max_batch``) instead of a static batch.
        batch: the static batch, or the batch a dynamic profile is tuned for.
        max_batch: largest batch of a dynamic profile.
        precisions: which precision plans; empty: every exported plan TensorRT can build.
        resolutions: which resolutions; empty: every exported one.
        workspace_mib: workspace memory limit (MiB); None: TensorRT's.
        optimization_level: builder optimization level 0-5; None: TensorRT's (3).
        rebuild: replace engines whose fingerprint no longer matches instead of refusing.
        compute_capabilities: TensorRT-RTX only: the GPUs (``"7.5"``) to build for; empty:
            every supported one but Turing, or on a Turing GPU 7.5 alone
            (``deploykit.backends.devices.rtx_targets``).
        profiles: several optimization profiles per engine, as ``--profile`` names them
            (``"1-8"``, ``"1-8@32-48"``: ``deploykit.backends.profiles.ProfileRequest``), each
            tuned for ``batch``; empty: one profile, as ``dynamic`` says.
        profiles_from_resolutions: for a graph exported over a resolution range, one profile per
            bucket between the exported resolutions inside it (batches 1 to ``max_batch``).
        version_compatible, exclude_lean_runtime, hardware_compatibility, refittable,
            strip_weights, require_user_allocation: the engine kind (``BuildOptions``);
            ``strip_weights`` implies ``refittable``.
    """

    dynamic: bool = False
    batch: int = defaults.ENGINE_BATCH
    max_batch: int = defaults.ENGINE_MAX_BATCH
    precisions: Sequence[str] = ()
    resolutions: Sequence[tuple[int, ...]] = ()
    workspace_mib: int | None = None
    optimization_level: int | None = None
    rebuild: bool = False
    compute_capabilities: Sequence[str] = ()
    profiles: Sequence[str] = ()
    profiles_from_resolutions: bool = False
    version_compatible: bool = False
    exclude_lean_runtime: bool = False
    hardware_compatibility: str = "none"
    refittable: bool = False
    strip_weights: bool = False
    require_user_allocation: bool = False


@dataclass(frozen=True)
class BuildJob:
    """What ``build`` does for one graph, decided (and any stale engine refused) before anything is built."""

    graph: Path
    options: BuildOptions
    fingerprint: Fingerprint
    cached: bool  # a valid engine is there already


def build_options(module: str, export_dir: Path, settings: BuildSettings) -> BuildOptions:
    """Static (``min = opt = max = batch``) or dynamic-batch options; the timing cache beside the graphs."""
    batch, max_batch = settings.batch, settings.max_batch
    if batch < 1 or (settings.dynamic and max_batch < batch):
        raise ConfigError(f"need 1 <= batch <= max batch, got batch {batch}, max batch {max_batch}")
    low, high = (1, max_batch) if settings.dynamic else (batch, batch)
    # TensorRT-RTX tunes at run time: a timing cache does nothing there.
    cache = str(ExportDir(export_dir).timing_cache_file) if flavour(module).timing_cache else None
    if settings.profiles and settings.profiles_from_resolutions:
        raise ConfigError("give --profile or --profiles-from-resolutions, not both")
    if settings.dynamic and (settings.profiles or settings.profiles_from_resolutions):
        raise ConfigError("--dynamic is one batch profile; with --profile or --profiles-from-resolutions each profile names its batches")
    try:
        return BuildOptions(
            module=module,
            workspace_mib=settings.workspace_mib,
            optimization_level=settings.optimization_level,
            min_batch=low,
            opt_batch=batch,
            max_batch=high,
            timing_cache=cache,
            version_compatible=settings.version_compatible,
            exclude_lean_runtime=settings.exclude_lean_runtime,
            hardware_compatibility=settings.hardware_compatibility,
            refittable=settings.refittable or settings.strip_weights,
            strip_weights=settings.strip_weights,
            require_user_allocation=settings.require_user_allocation,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err


def build(
    export_dir: str | os.PathLike,
    backend: str = defaults.ENGINE_BACKENDS[0],
    settings: BuildSettings = BuildSettings(),
    *,
    plugins: Plugins = Plugins(),
    progress: BuildProgress | None = None,
    device: Device | None = None,
    **fields,
) -> list[BuiltEngine]:
    """Build an engine for each graph ``deploykit export`` wrote to ``export_dir``.

    Args:
        export_dir: an export directory.
        backend: ``"trt"`` (TensorRT) or ``"rtx"`` (TensorRT-RTX).
        settings: what is built and how (``BuildSettings``).
        plugins: the plugins to load first, as the user named them (``Plugins.resolve``); none
            by default. TensorRT-RTX has no Python plugins (it inlines the custom ops' ONNX
            function bodies), so for ``rtx`` only plugin libraries are kept.
        progress: receives the builder's phases (the CLI renders it).
        device: what ``probe_device()`` reports; probed when None (tests pass one in).
        fields: ``BuildSettings`` fields given by name instead (``dynamic=True``), replacing
            those of ``settings``.

    Returns:
        One ``BuiltEngine`` per graph, in manifest order.

    Raises:
        ConfigError: unknown backend or settings field, bad batch sizes, or compute
            capabilities TensorRT-RTX does not build for (or asked of TensorRT).
        StaleEngineError: an existing engine does not match and ``rebuild`` is False.
        ExportError: a graph does not parse or build, or a plugin fails to load.
        DeployKitError: the TensorRT wheel is built for a newer CUDA than the driver runs.
    """
    try:
        settings = dataclasses.replace(settings, **fields)
    except TypeError as err:
        raise ConfigError(f"build() got an unknown setting: {err}; the settings are BuildSettings' fields") from err
    engines = engine_flavours()
    made_by, export_dir = engines[check_backend(backend, engines)], Path(export_dir)
    module = made_by.module
    check_cuda_build(module)  # a builder on a driver older than its CUDA fails obscurely, minutes in
    options = build_options(module, export_dir, settings)
    options = dataclasses.replace(options, compute_capabilities=_targets(module, settings.compute_capabilities, device))
    entries = _select(ExportDir(export_dir).manifest(), settings.precisions, settings.resolutions)
    if not made_by.python_plugins and plugins.python:
        names = ", ".join(s.describe() for s in plugins.python)
        _log.warning("%s has no Python plugins: %s not loaded; custom ops run their ONNX function bodies", made_by.title, names)
        plugins = plugins.without_python()
    requests = _profile_requests(settings, entries, ExportDir(export_dir).manifest())
    jobs = [
        _prepare_build(export_dir, entry, options, plugins, settings.rebuild, device, requests) for entry in entries
    ]  # refuse before building
    built = [_build_one(job, plugins, progress) for job in jobs]
    if settings.strip_weights:
        shared = share_weights(export_dir, module)
        if shared is not None:
            _log.info("%s", shared.describe())
    return built


def share_weights(export_dir: str | os.PathLike, module: str) -> WeightSet | None:
    """Write the flavour's one weight set (``deploykit.backends.shared_weights``) over every
    weight-stripped engine in ``export_dir`` built from its graph as it is now (those of earlier
    builds too: their refit graphs then point into the new file), and name it in each one's
    record; None when there is none."""
    directory = ExportDir(export_dir)
    stripped: dict[Path, Path] = {}  # graph -> its engine's record
    for entry in directory.manifest().graphs:
        graph = directory.path / entry.file
        engine, fp_path = engine_paths(graph, module)
        try:
            record = read_fingerprint(fp_path)
        except StaleEngineError:  # refused where it is loaded or built again
            continue
        if engine.is_file() and record.weights_stripped and record.fingerprint.onnx_sha256 == sha256_file(graph):
            stripped[graph] = fp_path
    if not stripped:
        return None
    written = write_weight_set(list(stripped), flavour(module).tag)
    for graph, fp_path in stripped.items():  # last: a record names only files already written
        record_shared_weights(fp_path, written.engines[graph])
    return written


def _build_one(job: BuildJob, plugins: Plugins, progress: BuildProgress | None) -> BuiltEngine:
    """Build ``plan``'s engine and write its fingerprint, unless a valid one is there."""
    engine, fp_path = engine_paths(job.graph, job.options.module)
    start = time.perf_counter()
    if not job.cached:
        if progress is not None:
            progress.label = job.graph.name
        loader = EngineFromOnnx(job.graph, job.options, progress, plugins)
        save_engine(loader(), engine)
        layers = len(loader.plugin_nodes)
        lean = lean_runtime_note(job.options, job.fingerprint.trt_version)
        write_fingerprint(fp_path, job.fingerprint, sha256_file(engine), plugins, layers, loader.embedded_plugin_layers, lean)
    return BuiltEngine(job.graph.name, engine, fp_path, job.cached, time.perf_counter() - start)


def _targets(module: str, asked: Sequence[str], device: Device | None) -> tuple[str, ...]:
    """The compute capabilities a portable (TensorRT-RTX) engine is built for (none for TensorRT)."""
    if not flavour(module).portable:
        if asked:
            raise ConfigError(
                "--compute-capability is TensorRT-RTX's (--backend rtx); a TensorRT engine is built for the GPU it is built on"
            )
        return ()
    return rtx_targets(probe_device() if device is None else device, tuple(asked))


def _select(manifest: Manifest, precisions, resolutions) -> list[GraphEntry]:
    """The graphs to build: the ``precisions`` asked for (refusing, in one line, a plan only ONNX
    Runtime runs), else every exported plan TensorRT can build."""
    for precision in precisions or ():
        if check_precision(precision).ort_only:
            raise ConfigError(f"cannot build {precision} engines: {PLANS[precision].ort_only}")
    precisions = precisions or [p for p in dict.fromkeys(g.precision for g in manifest.graphs) if not PLANS[p].ort_only]
    if resolutions:
        return [manifest.graph(tuple(r), p) for r in resolutions for p in precisions]
    return [g for p in precisions for g in manifest.graphs_at(p, ranges=True)]


def _profile_requests(settings: BuildSettings, entries: Sequence[GraphEntry], manifest: Manifest) -> dict[str, list[ProfileRequest]]:
    """The profiles asked for, per graph file (none: one profile, as before)."""
    if settings.profiles:
        requests = [ProfileRequest.parse(spec) for spec in settings.profiles]
        return {entry.file: requests for entry in entries}
    if not settings.profiles_from_resolutions:
        return {}
    exported = [tuple(g.resolution) for g in manifest.graphs if g.resolution_range is None]
    ranged = [e for e in entries if e.resolution_range is not None]
    if not ranged:
        raise ConfigError("--profiles-from-resolutions needs a graph exported over a resolution range (export --resolution-range)")
    return {e.file: profiles_from_resolutions(exported, e.resolution_range, (1, settings.max_batch)) for e in ranged}


def _prepare_build(
    export_dir: Path, entry: GraphEntry, options: BuildOptions, plugins: Plugins, rebuild: bool, device, requests: dict | None = None
) -> BuildJob:
    """What to do for one graph; raises if a stale engine is in the way."""
    path = ExportDir(export_dir).graph(entry)
    name, sample = _input_shape(path)
    samples = [sample] * 3
    if entry.resolution_range is not None:  # [C, H, W] at min / opt / max of the range
        low, high = entry.resolution_range
        samples = [[*sample[:-2], *shape] for shape in (low, entry.resolution, high)]
        options = dataclasses.replace(options, sample_shapes=tuple(tuple(s) for s in samples))
    if requests and entry.file in requests:
        wanted = [r.shapes(tuple(sample), options.opt_batch, entry.resolution_range, tuple(entry.resolution)) for r in requests[entry.file]]
        options = dataclasses.replace(options, profiles=tuple(wanted))
    shapes = profile_shapes(name, samples, options)
    fingerprint = current_fingerprint(path, GraphMetadata.of_file(path), shapes, options, plugins, device)
    engine, fp_path = engine_paths(path, options.module)
    if not engine.exists() or rebuild:
        return BuildJob(path, options, fingerprint, cached=False)
    tag = options.flavour.tag
    hint = f"pass --rebuild to replace it (deploykit build {export_dir} --backend {tag} --rebuild)"
    try:
        record = read_fingerprint(fp_path)
    except StaleEngineError as err:
        raise StaleEngineError(f"{err}; or {hint}") from err
    check_fingerprint(engine, record.fingerprint, fingerprint, hint)
    if sha256_file(engine) != record.engine_sha256:
        raise StaleEngineError(f"{engine} changed since it was built; {hint}")
    return BuildJob(path, options, fingerprint, cached=True)


def _input_shape(path: Path) -> tuple[str, list[int]]:
    """Name and per-sample shape of the graph's one input (``images`` ``[C, H, W]``, ``tokens``
    ``[T]``); the batch dim is the profile's (a dynamic height/width reads as 0)."""
    import onnx

    (graph_input,) = onnx.load(str(path), load_external_data=False).graph.input
    return graph_input.name, [d.dim_value for d in graph_input.type.tensor_type.shape.dim[1:]]


def describe(result: BuiltEngine) -> str:
    """One line for the terminal."""
    what = "cached" if result.cached else f"built in {result.seconds:.1f} s"
    return f"{result.engine}  ({what})"
