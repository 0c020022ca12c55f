"""Build serialized TensorRT (or TensorRT-RTX) engines from ONNX, through Polygraphy's loaders.

``EngineFromOnnx`` follows Polygraphy's lazy-loader style: construct it with a model and options,
call it to get the serialized engine. Underneath it is Polygraphy's own chain
(``NetworkFromOnnxPath`` → ``CreateConfig`` → ``EngineBytesFromNetwork``, ``LoadPlugins`` for
plugin libraries), on TensorRT or TensorRT-RTX (``deploykit.backends._polygraphy``). Ours are
only what Polygraphy does not do as we need: the strict, atomically saved timing cache, the
progress monitor feeding ``BuildProgress``, the check that a profile fits the graph, and
TensorRT's messages summarised instead of printed one by one. Neither TensorRT package (nor
Polygraphy) is imported until a build is requested.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from deploykit._io import atomic_path
from deploykit.backends import defaults
from deploykit.backends._polygraphy import TrtMessages, backend, import_trt
from deploykit.backends.plugins import Plugins
from deploykit.backends.profiles import ProfileShapes
from deploykit.errors import ExportError
from deploykit.runners.table import FLAVOURS, Flavour, flavour

_MAX_OPT_LEVEL = 5

# --hardware-compatibility → TensorRT's HardwareCompatibilityLevel member.
HARDWARE_LEVELS = {"none": "NONE", "ampere_plus": "AMPERE_PLUS", "same_compute_capability": "SAME_COMPUTE_CAPABILITY"}

_log = logging.getLogger(__name__)

OnnxSource = str | os.PathLike | bytes | bytearray | memoryview


@dataclass(frozen=True)
class BuildOptions:
    """Engine build settings.

    Attributes:
        module: Which TensorRT flavour builds the engine (``"tensorrt"`` or ``"tensorrt_rtx"``).
        workspace_mib: Workspace memory pool limit in MiB; ``None`` keeps TensorRT's default.
        optimization_level: Builder optimization level 0-5; ``None`` keeps the default (3).
        min_batch: Smallest batch the engine accepts.
        opt_batch: Batch size the engine is tuned for.
        max_batch: Largest batch the engine accepts.
        timing_cache: Timing cache file, loaded if it exists and saved after the build.
            TensorRT only: it is a no-op in TensorRT-RTX and ignored there.
        sample_shapes: For a graph with dynamic height/width (a resolution range), the input's
            per-sample shape (without the batch) at min, opt and max; ``None`` when only the
            batch is dynamic.
        compute_capabilities: TensorRT-RTX only: the GPUs' compute capabilities (``"7.5"``) the
            engine is built for, set on the builder config; empty keeps TensorRT-RTX's default,
            which leaves Turing out (``deploykit.backends.devices.rtx_targets`` picks them).
        profiles: several optimization profiles, each the input's full ``[min, opt, max]``
            shapes (``deploykit.backends.profiles``); empty: the one profile the batches and
            ``sample_shapes`` above give.
        version_compatible: ``VERSION_COMPATIBLE``: the engine runs on later TensorRT versions
            (through the lean runtime, embedded unless ``exclude_lean_runtime``).
        exclude_lean_runtime: ``EXCLUDE_LEAN_RUNTIME``: leave the lean runtime out of a
            version-compatible engine; whoever loads it must load one (``lean_runtime_note``).
        hardware_compatibility: ``none``, ``ampere_plus`` or ``same_compute_capability``
            (TensorRT's hardware compatibility level: one engine for several GPU models).
        refittable: ``REFIT_IDENTICAL``: weights can be refitted with the identical ones (TensorRT
            11.3's release notes advise it over ``REFIT``: the builder may optimise for them).
        strip_weights: ``STRIP_PLAN``: the engine carries no refittable weights; they are refitted
            when it is loaded, from the weight set ``deploykit build`` writes for every
            resolution (``deploykit.backends.shared_weights``; needs ``refittable``).
        require_user_allocation: TensorRT-RTX's ``REQUIRE_USER_ALLOCATION``: the engine never
            allocates at run time, so every execution can be captured into a CUDA graph (its
            build fails on a layer that would need to: data-dependent shapes); what the runner's
            CUDA-graph verdict reads (``cuda_graphs.capture_note``). TensorRT has no such flag.
    """

    module: str = "tensorrt"
    workspace_mib: int | None = None
    optimization_level: int | None = None
    min_batch: int = 1
    opt_batch: int = defaults.ENGINE_BATCH
    max_batch: int = defaults.ENGINE_MAX_BATCH
    timing_cache: str | None = None
    sample_shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None
    compute_capabilities: tuple[str, ...] = ()
    profiles: tuple[ProfileShapes, ...] = ()
    version_compatible: bool = False
    exclude_lean_runtime: bool = False
    hardware_compatibility: str = "none"
    refittable: bool = False
    strip_weights: bool = False
    require_user_allocation: bool = False

    def __post_init__(self) -> None:
        # As tuples, however given (a fingerprint read back from JSON holds lists).
        object.__setattr__(self, "profiles", tuple(tuple(tuple(int(d) for d in s) for s in p) for p in self.profiles))
        object.__setattr__(self, "compute_capabilities", tuple(self.compute_capabilities))
        # Fail on construction, before minutes of building, rather than inside TensorRT.
        made_by = self.flavour
        self._check_engine_kind()
        if not 1 <= self.min_batch <= self.opt_batch <= self.max_batch:
            batches = (self.min_batch, self.opt_batch, self.max_batch)
            raise ValueError(f"batch sizes must satisfy 1 <= min <= opt <= max, got {batches}")
        if self.workspace_mib is not None and self.workspace_mib <= 0:
            raise ValueError(f"workspace_mib must be positive, got {self.workspace_mib}")
        if self.optimization_level is not None and not 0 <= self.optimization_level <= _MAX_OPT_LEVEL:
            raise ValueError(f"optimization_level must be in 0-{_MAX_OPT_LEVEL}, got {self.optimization_level}")
        if self.compute_capabilities and not made_by.portable:
            portable = " and ".join(f"{f.title}'s" for f in FLAVOURS if f.portable)
            raise ValueError(f"compute_capabilities are {portable}; a {made_by.title} engine is built for the GPU it is built on")
        unsupported = [cc for cc in self.compute_capabilities if not made_by.supports(cc)]
        if unsupported:
            raise ValueError(f"{made_by.title} cannot build for compute capability {unsupported[0]} ({made_by.supported_text()})")

    def _check_engine_kind(self) -> None:
        if self.hardware_compatibility not in HARDWARE_LEVELS:
            raise ValueError(f"hardware_compatibility must be one of {', '.join(HARDWARE_LEVELS)}, got {self.hardware_compatibility!r}")
        if self.exclude_lean_runtime and not self.version_compatible:
            raise ValueError(
                "exclude_lean_runtime (--exclude-lean-runtime) applies to version-compatible engines (--version-compatible) only"
            )
        if self.strip_weights and not self.refittable:
            raise ValueError("strip_weights needs refittable (--refittable): a weight-stripped engine is refitted when it is loaded")
        for profile in self.profiles:
            low, opt, high = profile
            if not len(low) == len(opt) == len(high) or not all(a <= b <= c for a, b, c in zip(low, opt, high)):
                raise ValueError(f"a profile's shapes must satisfy min <= opt <= max dim by dim, got {[list(s) for s in profile]}")

    @property
    def engine_flags(self) -> tuple[str, ...]:
        """The ``BuilderFlag`` members these options set."""
        wanted = {
            "VERSION_COMPATIBLE": self.version_compatible,
            "EXCLUDE_LEAN_RUNTIME": self.exclude_lean_runtime,
            "REFIT_IDENTICAL": self.refittable,
            "STRIP_PLAN": self.strip_weights,
            "REQUIRE_USER_ALLOCATION": self.require_user_allocation,
        }
        return tuple(name for name, on in wanted.items() if on)

    @property
    def flavour(self) -> Flavour:
        """The TensorRT flavour ``module`` names (``ValueError`` for any other module)."""
        return flavour(self.module)


class BuildProgress:
    """TensorRT's build phases as they advance; rich renders it (``__rich__``) while a build runs.

    The monitor callbacks come from TensorRT's threads, so they only assign (atomic under the
    GIL, no locks, no I/O: see ``deploykit.backends._polygraphy``); rendering happens in rich's refresh thread.
    """

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.phases: dict[str, list[int]] = {}  # phase -> [steps done, steps], outermost first

    def start(self, phase: str, steps: int) -> None:
        self.phases[phase] = [0, steps]

    def step(self, phase: str, step: int) -> None:
        entry = self.phases.get(phase)
        if entry is not None:
            entry[0] = step + 1

    def finish(self, phase: str) -> None:
        self.phases.pop(phase, None)

    def __rich__(self):
        from rich.text import Text

        phases = list(self.phases.items())  # one C-level copy: safe against concurrent updates
        detail = " › ".join(f"{name} {done}/{steps}" for name, (done, steps) in phases)
        return Text(f"building {self.label}" + (f": {detail}" if detail else ""))


def _make_monitor(trt: ModuleType, progress: BuildProgress) -> Any:
    class _Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            progress.start(phase_name, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            progress.step(phase_name, step)
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            progress.finish(phase_name)

    return _Monitor()


PLUGIN_LAYER_TYPES = ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3")


def with_plugin_nodes(source: OnnxSource, registered: Collection[tuple[str, str]]) -> tuple[OnnxSource, list[str]]:
    """``source`` as TensorRT's parser must see it for the plugins ``registered`` (``(namespace,
    name)``: those the build was given) to be used (``deploykit.graph.plugin_nodes``), and the
    nodes that must become plugin layers; ``source`` itself when no custom op of the graph is
    among them."""
    import onnx

    from deploykit.graph.plugin_nodes import has_companions, mark_plugin_nodes, plugin_ops

    if not registered:
        return source, []
    try:
        model = onnx.load_from_string(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview)) else onnx.load(str(source))
    except Exception:  # not ONNX: let TensorRT's parser say so, in its words
        return source, []
    if not plugin_ops(model, registered):
        return source, []
    if not has_companions(model):  # a file exported before the signature stage was a function of its own
        from deploykit.export.custom_ops import attach_functions

        attach_functions(model)
    nodes = mark_plugin_nodes(model, registered)
    return model.SerializeToString(), nodes


def _plugin_layers(trt: ModuleType, network: Any) -> int:
    kinds = {getattr(trt.LayerType, name) for name in PLUGIN_LAYER_TYPES if hasattr(trt.LayerType, name)}
    return sum(network.get_layer(i).type in kinds for i in range(network.num_layers))


# The kind ``IPluginV3QuickAOTBuild`` reports (``interface_info.kind``, TensorRT's
# ``InterfaceInfo{"PLUGIN_V3QUICKAOT_BUILD", 1, 0}``): read from the plugin's build capability, so
# a C++ plugin wrapped by the bindings is judged as well as a Python one.
AOT_BUILD_KIND = "PLUGIN_V3QUICKAOT_BUILD"


def plugin_v3_layers(trt: ModuleType, network: Any) -> list[Any]:
    """The V3 plugin layers of ``network``, as ``IPluginV3Layer``.

    ``network.get_layer(i)`` returns the base ``ILayer`` whatever the layer is (seen with
    TensorRT-RTX's real builder): no ``plugin`` attribute. As TensorRT's own samples and
    Polygraphy do, the layer is recognised by its ``type`` and its Python class set to the
    concrete one, which exposes ``plugin``."""
    layers = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.PLUGIN_V3:
            layer.__class__ = trt.IPluginV3Layer
            layers.append(layer)
    return layers


def carries_its_kernel(trt: ModuleType, plugin: Any) -> bool:
    """Whether ``plugin`` (an ``IPluginV3``) is the ahead-of-time build of a quickly deployable
    plugin: its class, or the kind its build capability reports, is ``IPluginV3QuickAOTBuild``."""
    aot = getattr(trt, "IPluginV3QuickAOTBuild", None)
    if aot is not None and isinstance(plugin, aot):
        return True
    capability = getattr(trt, "PluginCapabilityType", None)
    build = plugin.get_capability_interface(capability.BUILD) if capability is not None else None
    info = getattr(build, "interface_info", None)
    return getattr(info, "kind", None) == AOT_BUILD_KIND


def embedded_plugin_layers(trt: ModuleType, network: Any) -> int:
    """Plugin layers whose plugin is the ahead-of-time build of a quickly deployable plugin
    (``IPluginV3QuickAOTBuild``, what ``tensorrt.plugin`` makes for an ``@aot_impl``): TensorRT
    embeds their compiled kernel in the engine and runs it itself, so the engine needs neither
    the plugin nor Python to deserialize ("it does not require any Python modules or definitions
    to be present at runtime ... the engine can be executed on the standard TRT runtime, as part
    of any tool that is capable of deserializing and running the engine (like trtexec)":
    NVIDIA/TensorRT samples/python/quickly_deployable_plugins; its ``_TemplateAOTPlugin`` has no
    runtime capability of its own, unlike the JIT one). TensorRT-RTX has no such plugins."""
    return sum(carries_its_kernel(trt, layer.plugin) for layer in plugin_v3_layers(trt, network))


def _parse(pg: ModuleType, trt: ModuleType, source: OnnxSource, messages: TrtMessages) -> tuple:
    """``(builder, network, parser)`` through Polygraphy's ONNX loaders (the parser must outlive
    the build: it owns the weights). Strongly typed where the flag exists (TensorRT 10 needs it;
    TensorRT 11 and TensorRT-RTX accept it; a future release may drop the enum member)."""
    strongly_typed = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
    if isinstance(source, (bytes, bytearray, memoryview)):
        loader = pg.NetworkFromOnnxBytes(bytes(source), strongly_typed=strongly_typed)
    else:
        path = Path(source)
        if not path.is_file():
            raise ExportError(f"ONNX model {path} does not exist")
        # From a path, so weights stored as external data resolve relative to the model file.
        loader = pg.NetworkFromOnnxPath(str(path), strongly_typed=strongly_typed)
    with messages.failing_as("TensorRT could not parse the ONNX model"):
        builder, network, parser = loader()
    # Protobuf happily decodes many junk byte strings as an empty model; say so, not "no outputs".
    if network.num_outputs == 0:
        raise ExportError("TensorRT could not parse the ONNX model: it has no outputs (empty or not an ONNX file?)")
    return builder, network, parser


def _profiles(pg: ModuleType, network: Any, options: BuildOptions) -> list:
    """One optimization profile giving every input with dynamic dims its min/opt/max: the batch
    range, and for a graph exported over a resolution range the per-sample shapes of
    ``options.sample_shapes``; empty for a fully static network.

    Without ``sample_shapes`` only dim 0 may be dynamic: such a model was exported at one
    resolution, so any other dynamic dim means the export went wrong, and guessing its range
    would build a slow or wrong engine. With ``options.profiles``, one profile each, for the
    graph's one dynamic input, each checked to fit it.
    """
    if options.profiles:
        return _several_profiles(pg, network, options.profiles)
    profile = pg.Profile()
    batches = (options.min_batch, options.opt_batch, options.max_batch)
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        dims = tuple(tensor.shape)
        if all(d >= 0 for d in dims):
            continue
        if options.sample_shapes is not None:
            samples = [tuple(s) for s in options.sample_shapes]
            fits = all(len(s) == len(dims) - 1 and all(d < 0 or d == v for d, v in zip(dims[1:], s)) for s in samples)
            if not fits:
                raise ExportError(f"input {tensor.name!r} has shape {list(dims)}; the profile's {samples} do not fit it")
        else:
            bad = [axis for axis, d in enumerate(dims) if d < 0 and axis != 0]
            if bad:
                raise ExportError(
                    f"input {tensor.name!r} has shape {list(dims)} with dynamic non-batch dim(s) {bad}; "
                    "a static shape is expected for every dim but the batch (dim 0) unless the graph covers a resolution range"
                )
            samples = [dims[1:]] * 3
        profile.add(tensor.name, *[(batch, *sample) for batch, sample in zip(batches, samples)])
    return [profile] if len(profile) else []


def _several_profiles(pg: ModuleType, network: Any, profiles: tuple[ProfileShapes, ...]) -> list:
    dynamic = [network.get_input(i) for i in range(network.num_inputs) if any(d < 0 for d in network.get_input(i).shape)]
    if len(dynamic) != 1:
        raise ExportError(f"several optimization profiles need a graph with one dynamic input; it has {len(dynamic)}")
    (tensor,) = dynamic
    dims, built = tuple(tensor.shape), []
    for shapes in profiles:
        if not all(_fits_dims(dims, s) for s in shapes):
            raise ExportError(f"input {tensor.name!r} has shape {list(dims)}; the profile {[list(s) for s in shapes]} does not fit it")
        built.append(pg.Profile().add(tensor.name, *shapes))
    return built


def _fits_dims(dims: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` has the network input's rank and its static dims."""
    return len(shape) == len(dims) and all(d < 0 or d == v for d, v in zip(dims, shape))


def _apply_engine_kind(trt: ModuleType, config: Any, opts: BuildOptions, title: str) -> None:
    """Set the builder flags and hardware compatibility level ``opts`` ask for, reading each back:
    a flavour that does not take one (TensorRT-RTX has no hardware compatibility level: it warns
    and keeps ``NONE``) is refused in one line before the build, not found out where it is loaded."""
    for name in opts.engine_flags:
        flag = getattr(trt.BuilderFlag, name, None)
        if flag is None:
            raise ExportError(f"{title} has no builder flag {name}; build this engine with the other TensorRT flavour")
        config.set_flag(flag)
        if not config.get_flag(flag):
            raise ExportError(f"{title} did not take the builder flag {name}")
    if opts.hardware_compatibility != "none":
        level = getattr(getattr(trt, "HardwareCompatibilityLevel", None), HARDWARE_LEVELS[opts.hardware_compatibility], None)
        if level is not None:
            config.hardware_compatibility_level = level
        if level is None or config.hardware_compatibility_level != level:
            raise ExportError(
                f"{title} does not build hardware-compatible engines (--hardware-compatibility {opts.hardware_compatibility}); "
                + ("name the GPUs with --compute-capability instead" if opts.flavour.portable else "it kept the level NONE")
            )


def lean_runtime_note(options: BuildOptions, trt_version: str) -> str:
    """What a version-compatible engine needs where it is loaded ("" for any other engine)."""
    if not options.version_compatible:
        return ""
    if not options.exclude_lean_runtime:
        return "lean runtime embedded in the engine (the loading runtime must allow it: IRuntime.engine_host_code_allowed)"
    major = trt_version.split(".")[0]
    return (
        f"lean runtime not embedded: load libnvinfer_lean.so.{major} of {options.flavour.title} {major}.x with IRuntime.load_runtime first"
    )


def _create_config(pg: ModuleType, opts: BuildOptions) -> Callable[..., Any]:
    """Polygraphy's ``CreateConfig``, or for TensorRT-RTX targets ``CreateConfigRTX`` with them
    (``(major, minor)`` pairs, set through ``IBuilderConfig.set_compute_capability``)."""
    if not opts.compute_capabilities:
        return pg.CreateConfig
    from polygraphy.backend.tensorrt_rtx import CreateConfigRTX

    pairs = [tuple(int(p) for p in cc.split(".")) for cc in opts.compute_capabilities]
    return functools.partial(CreateConfigRTX, compute_capabilities=pairs)


def _check_targets(trt: ModuleType, config: Any, targets: tuple[str, ...]) -> None:
    """Refuse a build whose config does not hold exactly ``targets``: Polygraphy ignores what
    ``set_compute_capability`` returns, and an engine built for other GPUs would be refused only
    where it is loaded."""
    if not targets:
        return
    held = [config.get_compute_capability(i) for i in range(config.num_compute_capabilities)]
    wanted = [getattr(trt.ComputeCapability, "SM" + cc.replace(".", "")) for cc in targets]
    if held != wanted:
        raise ExportError(f"TensorRT-RTX did not take the compute capabilities {', '.join(targets)} (its config holds {held})")


def _load_timing_cache(config: Any, path: Path) -> Any:
    """Replace the empty cache Polygraphy's ``CreateConfig`` sets with the one at ``path``.

    Our own, not ``CreateConfig(load_timing_cache=...)``: Polygraphy ignores the result of
    ``set_timing_cache``, so a cache from another GPU or TensorRT version would be dropped
    silently; here it is refused.
    """
    data = path.read_bytes() if path.is_file() else b""
    cache = config.create_timing_cache(data)
    if not config.set_timing_cache(cache, False):
        raise ExportError(f"timing cache {path} does not match this GPU/TensorRT; delete it to rebuild")
    return cache


def _save_timing_cache(config: Any, path: Path) -> None:
    """Atomically (Polygraphy's ``save_timing_cache`` writes the file in place): an interrupted
    build leaves the previous cache as it was."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(bytes(config.get_timing_cache().serialize()))


class EngineFromOnnx:
    """Lazily build a serialized engine from an ONNX model, through Polygraphy's loaders
    (``NetworkFromOnnxPath`` → ``CreateConfig`` → ``EngineBytesFromNetwork``).

    Args:
        onnx_path_or_bytes: Path to an ``.onnx`` file, the serialized model, or a callable
            returning either (evaluated when the engine is built).
        options: Build settings; defaults to ``BuildOptions()``.
        progress: Receives the builder's phases as they advance (shown by ``deploykit build``).
        plugins: The plugins this build may use, loaded before parsing; none by default.

    After a call, ``plugin_nodes`` names the graph's nodes built as plugin layers: the custom
    nodes whose op has a creator among the plugins given (never one an earlier build or import
    registered), handed to the parser marked for it (``with_plugin_nodes``). A marked node the
    parser does not turn into a plugin layer fails the build. ``embedded_plugin_layers`` counts
    the plugin layers whose kernel the engine carries (``embedded_plugin_layers``).

    Example:
        >>> engine = EngineFromOnnx("vit.onnx", BuildOptions(module="tensorrt_rtx"))()
    """

    def __init__(
        self,
        onnx_path_or_bytes: OnnxSource | Callable[[], OnnxSource],
        options: BuildOptions | None = None,
        progress: BuildProgress | None = None,
        plugins: Plugins = Plugins(),
    ) -> None:
        self.onnx_path_or_bytes = onnx_path_or_bytes
        self.options = options if options is not None else BuildOptions()
        self.progress = progress
        self.plugins = plugins
        self.plugin_nodes: list[str] = []
        self.embedded_plugin_layers = 0

    def __call__(self) -> bytes:
        """Build the engine.

        Returns:
            The serialized engine.

        Raises:
            ExportError: the model cannot be parsed, has a dynamic non-batch dim, or the build fails.
            MissingDependencyError: the selected TensorRT module is not installed.
        """
        opts = self.options
        source = self.onnx_path_or_bytes() if callable(self.onnx_path_or_bytes) else self.onnx_path_or_bytes
        pg = backend(opts.module)
        what = f"{opts.flavour.title} build" + (f" of {Path(source).name}" if isinstance(source, (str, os.PathLike)) else "")
        with TrtMessages(what, _log) as messages:
            return self._build(pg, import_trt(opts.module), source, messages)

    def _build(self, pg: ModuleType, trt: ModuleType, source: OnnxSource, messages: TrtMessages) -> bytes:
        opts = self.options
        provided = self.plugins.load(opts.module)  # before parsing: the parser maps nodes to their creators
        source, self.plugin_nodes = with_plugin_nodes(source, provided)
        builder, network, parser = _parse(pg, trt, source, messages)
        self.embedded_plugin_layers = embedded_plugin_layers(trt, network)
        layers = _plugin_layers(trt, network)
        if layers < len(self.plugin_nodes):
            raise ExportError(
                f"TensorRT's parser made {layers} plugin layer(s) for the {len(self.plugin_nodes)} node(s) marked for a registered plugin "
                f"({', '.join(self.plugin_nodes[:3])}{', ...' if len(self.plugin_nodes) > 3 else ''}); the engine would not run the plugin"
            )
        monitor = _make_monitor(trt, self.progress) if self.progress is not None and hasattr(trt, "IProgressMonitor") else None
        pools = {trt.MemoryPoolType.WORKSPACE: opts.workspace_mib << 20} if opts.workspace_mib is not None else None
        with messages.failing_as("TensorRT builder configuration failed"):
            config = _create_config(pg, opts)(
                profiles=_profiles(pg, network, opts),
                memory_pool_limits=pools,
                builder_optimization_level=opts.optimization_level,
                progress_monitor=monitor,
            )(builder, network)
        _check_targets(trt, config, opts.compute_capabilities)
        _apply_engine_kind(trt, config, opts, opts.flavour.title)
        cache_path = cache = None
        if opts.timing_cache is not None:
            if opts.flavour.timing_cache and hasattr(config, "create_timing_cache"):
                cache_path = Path(opts.timing_cache)
                cache = _load_timing_cache(config, cache_path)  # must stay alive through the build
            else:
                _log.warning("timing cache ignored: %s has no usable timing cache", opts.module)
        flags = f" with {', '.join(opts.engine_flags)}" if opts.engine_flags else ""
        try:
            with messages.failing_as(
                f"{opts.flavour.title} refused to build the engine{flags}" if flags else "TensorRT engine build failed"
            ):
                serialized = pg.EngineBytesFromNetwork((builder, network, parser), config)()
        except ExportError as err:
            if opts.version_compatible and not opts.exclude_lean_runtime and "lean" in str(err):
                raise ExportError(f"{err}; it embeds a lean runtime it could not load: build with --exclude-lean-runtime") from err
            raise
        del parser, cache, monitor  # only now: the network used weights the parser owned
        if cache_path is not None:  # the config's cache now also holds this build's timings
            _save_timing_cache(config, cache_path)
        return bytes(serialized)


def save_engine(engine: bytes, dest: str | os.PathLike) -> Path:
    """Write a serialized engine atomically; on failure ``dest`` is left as it was.

    Args:
        engine: Serialized engine, e.g. from ``EngineFromOnnx``.
        dest: Destination file; parent directories are created.

    Returns:
        The destination path.
    """
    with atomic_path(dest) as tmp:
        tmp.write_bytes(engine)
    return Path(dest)
