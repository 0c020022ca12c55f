"""Build serialized TensorRT (or TensorRT-RTX) engines from ONNX.

``EngineFromOnnx`` follows Polygraphy's lazy-loader style: construct it with a model and options,
call it to get the serialized engine. Both ``tensorrt`` (10.9+/11) and ``tensorrt_rtx`` share the
Python API used here; differences are handled by introspection, never by guessing versions.
Neither package is imported until a build is requested.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from deploykit._io import atomic_path
from deploykit._lazy import lazy_import
from deploykit.errors import ExportError

TRT_MODULES = ("tensorrt", "tensorrt_rtx")
_MAX_OPT_LEVEL = 5
# Parser/builder messages may span lines; one-line errors need a cap as well as flattening.
_MAX_MESSAGE_CHARS = 600

_log = logging.getLogger(__name__)

OnnxSource = str | os.PathLike | bytes | bytearray | memoryview


def _check_module(module: str) -> None:
    if module not in TRT_MODULES:
        raise ValueError(f"unknown TensorRT module {module!r}; choose one of: {', '.join(TRT_MODULES)}")


def import_trt(module: str = "tensorrt") -> ModuleType:
    """Import a TensorRT flavour on demand.

    Args:
        module: ``"tensorrt"`` or ``"tensorrt_rtx"``.

    Returns:
        The imported module.

    Raises:
        ValueError: ``module`` is not one of ``TRT_MODULES``.
        MissingDependencyError: the module is not installed.
    """
    _check_module(module)
    return lazy_import(module)


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
        plugin_libraries: Shared libraries with plugin creators, loaded before parsing.
        sample_shapes: For a graph with dynamic height/width (a resolution range), the input's
            per-sample shape (without the batch) at min, opt and max; ``None`` when only the
            batch is dynamic.
    """

    module: str = "tensorrt"
    workspace_mib: int | None = None
    optimization_level: int | None = None
    min_batch: int = 1
    opt_batch: int = 1
    max_batch: int = 8
    timing_cache: str | None = None
    plugin_libraries: tuple[str, ...] = ()
    sample_shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        # Fail on construction, before minutes of building, rather than inside TensorRT.
        _check_module(self.module)
        if not 1 <= self.min_batch <= self.opt_batch <= self.max_batch:
            batches = (self.min_batch, self.opt_batch, self.max_batch)
            raise ValueError(f"batch sizes must satisfy 1 <= min <= opt <= max, got {batches}")
        if self.workspace_mib is not None and self.workspace_mib <= 0:
            raise ValueError(f"workspace_mib must be positive, got {self.workspace_mib}")
        if self.optimization_level is not None and not 0 <= self.optimization_level <= _MAX_OPT_LEVEL:
            raise ValueError(f"optimization_level must be in 0-{_MAX_OPT_LEVEL}, got {self.optimization_level}")


def _one_line(text: str) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= _MAX_MESSAGE_CHARS else flat[: _MAX_MESSAGE_CHARS - 3] + "..."


def _make_logger(trt: ModuleType) -> Any:
    """A logger that records TensorRT's messages; ``drain()`` forwards them to ``logging``.

    TensorRT calls ``log`` from its own threads as well as the caller's. Doing I/O there (a
    ``logging`` handler flush) releases the GIL while holding the handler's lock; another
    TensorRT thread can then take the GIL and wait on that lock: a deadlock seen with
    TensorRT-RTX's Builder. So ``log`` only appends (atomic under the GIL, no locks), and the
    calling thread forwards the messages after each TensorRT call.
    """

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages: list[tuple[Any, str]] = []
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            self.messages.append((severity, msg))

        def drain(self) -> None:
            pending, self.messages = self.messages, []
            for severity, msg in pending:
                if severity <= trt.ILogger.ERROR:
                    self.errors.append(_one_line(msg))
                # Errors end up in the ExportError; logging them loudly too would repeat them.
                _log.log(logging.WARNING if severity == trt.ILogger.WARNING else logging.DEBUG, "%s", msg)

    return _Logger()


def _create_network(trt: ModuleType, builder: Any) -> Any:
    """Create an explicitly strongly typed network where the flag exists.

    TensorRT 10 needs the flag for strong typing (the only mode TensorRT 11 has); TensorRT 11
    and TensorRT-RTX accept and ignore it, and a future release may drop the enum member.
    """
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    flags = 0 if strongly_typed is None else 1 << int(strongly_typed)
    return builder.create_network(flags)


def load_plugin_modules(plugin_dirs: Iterable[str | os.PathLike]) -> list[str]:
    """Import the Python plugins under each directory, so they register with TensorRT.

    A plugin is a package ``<dir>/<name>/__init__.py`` or a module ``<dir>/<name>.py`` (the
    SaPE² plugin lives in ``plugins/sape2/``); importing it runs its ``@trtp.register``
    decorators, and a module-level ``register()`` (for plugins that import TensorRT only when
    asked, as SaPE²'s does) is called right after. Each is imported once per process
    (registering twice is a TensorRT error).

    Returns:
        The module names imported or already loaded.

    Raises:
        ExportError: a directory does not exist or a plugin fails to import.
    """
    names = []
    for root in map(Path, plugin_dirs):
        if not root.is_dir():
            raise ExportError(f"plugin directory {root} does not exist")
        for path in sorted(root.iterdir()):
            init = path / "__init__.py" if path.is_dir() else path
            if not init.is_file() or init.suffix != ".py" or path.name.startswith(("_", ".")):
                continue
            name = f"deploykit_plugins.{root.resolve().name}.{path.stem}"
            names.append(name)
            if name not in sys.modules:
                _import_plugin(name, init, path)
                _call_register(sys.modules[name], init)
    return names


def _import_plugin(name: str, init: Path, path: Path) -> None:
    search = [str(path)] if path.is_dir() else None
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=search)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec, so the package's relative imports resolve
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # a plugin may raise anything; report it as one line
        del sys.modules[name]
        raise ExportError(_one_line(f"plugin {init} failed to import: {type(err).__name__}: {err}")) from err


def _call_register(module, init: Path) -> None:
    register = getattr(module, "register", None)
    if not callable(register):
        return
    try:
        register()
    except Exception as err:
        raise ExportError(_one_line(f"plugin {init} failed to register: {type(err).__name__}: {err}")) from err


class BuildProgress:
    """TensorRT's build phases as they advance; rich renders it (``__rich__``) while a build runs.

    The monitor callbacks come from TensorRT's threads, so they only assign (atomic under the
    GIL, no locks, no I/O: see ``_make_logger``); rendering happens in rich's refresh thread.
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


def _load_plugins(builder: Any, libraries: tuple[str, ...]) -> None:
    registry = builder.get_plugin_registry()
    for lib in libraries:
        if not Path(lib).is_file():
            raise ExportError(f"plugin library {lib} does not exist")
        if registry.load_library(str(lib)) is None:
            raise ExportError(f"TensorRT could not load plugin library {lib}")


def _parse(trt: ModuleType, network: Any, logger: Any, source: OnnxSource) -> Any:
    """Parse ONNX into ``network``; returns the parser, which must outlive the build (it owns weights)."""
    parser = trt.OnnxParser(network, logger)
    if isinstance(source, (bytes, bytearray, memoryview)):
        ok = parser.parse(bytes(source))
    else:
        path = Path(source)
        if not path.is_file():
            raise ExportError(f"ONNX model {path} does not exist")
        # From a path, so weights stored as external data resolve relative to the model file.
        ok = parser.parse_from_file(str(path))
    if not ok:
        errors = []
        for i in range(parser.num_errors):
            err = parser.get_error(i)
            where = f"node {err.node()} ({err.node_name() or '?'}: {err.node_operator() or '?'})"
            errors.append(f"{err.desc()} [{where}]" if err.node() >= 0 else err.desc())
        logger.drain()
        detail = "; ".join(errors) or "; ".join(logger.errors) or "no parser error reported"
        raise ExportError(_one_line(f"TensorRT could not parse the ONNX model: {detail}"))
    # Protobuf happily decodes many junk byte strings as an empty model; say so, not "no outputs".
    if network.num_outputs == 0:
        raise ExportError("TensorRT could not parse the ONNX model: it has no outputs (empty or not an ONNX file?)")
    return parser


def _add_profile(builder: Any, network: Any, config: Any, options: BuildOptions) -> None:
    """Give every input with dynamic dims its min/opt/max: the batch range, and for a graph
    exported over a resolution range the per-sample shapes of ``options.sample_shapes``.

    Without ``sample_shapes`` only dim 0 may be dynamic: such a model was exported at one
    resolution, so any other dynamic dim means the export went wrong, and guessing its range
    would build a slow or wrong engine.
    """
    profile = builder.create_optimization_profile()
    dynamic = False
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
        profile.set_shape(tensor.name, *[(batch, *sample) for batch, sample in zip(batches, samples)])
        dynamic = True
    if dynamic:
        config.add_optimization_profile(profile)


def _load_timing_cache(config: Any, path: Path) -> Any:
    data = path.read_bytes() if path.is_file() else b""
    cache = config.create_timing_cache(data)
    # Strict: a cache from another GPU or version would mislead tactic selection.
    if not config.set_timing_cache(cache, False):
        raise ExportError(f"timing cache {path} does not match this GPU/TensorRT; delete it to rebuild")
    return cache


class EngineFromOnnx:
    """Lazily build a serialized engine from an ONNX model.

    Args:
        onnx_path_or_bytes: Path to an ``.onnx`` file, the serialized model, or a callable
            returning either (evaluated when the engine is built).
        options: Build settings; defaults to ``BuildOptions()``.
        progress: Receives the builder's phases as they advance (shown by ``deploykit build``).

    Example:
        >>> engine = EngineFromOnnx("vit.onnx", BuildOptions(module="tensorrt_rtx"))()
    """

    def __init__(
        self,
        onnx_path_or_bytes: OnnxSource | Callable[[], OnnxSource],
        options: BuildOptions | None = None,
        progress: BuildProgress | None = None,
    ) -> None:
        self.onnx_path_or_bytes = onnx_path_or_bytes
        self.options = options if options is not None else BuildOptions()
        self.progress = progress

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
        trt = import_trt(opts.module)
        logger = _make_logger(trt)
        try:
            return self._build(trt, logger, source)
        finally:
            logger.drain()

    def _build(self, trt: ModuleType, logger: Any, source: OnnxSource) -> bytes:
        opts = self.options
        builder = trt.Builder(logger)
        _load_plugins(builder, opts.plugin_libraries)
        network = _create_network(trt, builder)
        parser = _parse(trt, network, logger, source)

        config = builder.create_builder_config()
        _add_profile(builder, network, config, opts)
        if opts.workspace_mib is not None:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, opts.workspace_mib << 20)
        if opts.optimization_level is not None:
            config.builder_optimization_level = opts.optimization_level
        monitor = None
        if self.progress is not None and hasattr(config, "progress_monitor"):
            config.progress_monitor = monitor = _make_monitor(trt, self.progress)  # kept alive through the build
        cache_path = cache = None
        if opts.timing_cache is not None:
            if opts.module == "tensorrt" and hasattr(config, "create_timing_cache"):
                cache_path = Path(opts.timing_cache)
                cache = _load_timing_cache(config, cache_path)  # must stay alive through the build
            else:
                _log.warning("timing cache ignored: %s has no usable timing cache", opts.module)

        serialized = builder.build_serialized_network(network, config)
        del parser, cache, monitor  # only now: the network used weights the parser owned
        logger.drain()
        if serialized is None:
            detail = "; ".join(logger.errors) or "no builder error reported"
            raise ExportError(_one_line(f"TensorRT engine build failed: {detail}"))
        if cache_path is not None:  # the config's cache now also holds this build's timings
            with atomic_path(cache_path) as tmp:
                tmp.write_bytes(bytes(config.get_timing_cache().serialize()))
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
