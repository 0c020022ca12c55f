"""TensorRT plugins: only the ones the caller names, checked against what an engine was built with.

A plugin is code, so it comes from exactly two places: what the user names (``--plugins``), and
packages installed in this environment that register under the entry-point group
``deploykit.plugins`` (deploykit's own SaPE² plugin is ``sape2``). Never from a path found in a
file someone handed us (an engine's fingerprint) or from the working directory. An engine's
fingerprint records the hash of the plugins it was built with; loading it with other plugins, or
with none, is refused before anything is imported or loaded (``check_plugins``), unless its
plugin layers all carry their kernel, so that it needs none (``engine_cache.EngineRecord.self_contained``).

Three kinds, one spec each (``Plugins.resolve``):

* a directory of Python plugins: packages ``<dir>/<name>/__init__.py`` or modules
  ``<dir>/<name>.py``, imported so their ``@trtp.register`` decorators run (and a module-level
  ``register()`` is called);
* the name of an installed plugin package (entry point ``deploykit.plugins``), imported the same way;
* a shared library (``.so``), loaded with Polygraphy's ``LoadPlugins`` (``ctypes.CDLL``): its
  plugin creators register themselves on load, as ``trtexec --staticPlugins`` and Triton's
  ``--backend-config=tensorrt,plugins=`` load them, so an engine that needs it deserializes.

A build uses only the plugins it was given: ``Plugins.load`` returns the plugin creators
``(namespace, name)`` its sources registered, and only those ops are built as plugin layers,
whatever else an earlier build or import registered in this process (TensorRT's registry is per
process). What a source registered is what its first load added to the registry (remembered, as a
source registers once per process), plus the ids its ``register()`` returns.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from deploykit.errors import ExportError, StaleEngineError, one_line
from deploykit.plugins import ENTRY_POINT_GROUP

LIBRARY_SUFFIXES = (".so", ".dll", ".dylib")
_MAX_NAMES = 3  # sources named in a one-line refusal
# Compilers whose version changes what a Python plugin builds into an engine (the PTX Triton
# writes: its parameter list and PTX version changed between releases), folded into the hash of
# every Python plugin without importing anything.
TOOLCHAINS = ("triton",)


@dataclass(frozen=True)
class PluginSource:
    """One named plugin source.

    Attributes:
        kind: ``"directory"`` (Python plugins), ``"package"`` (installed, by entry point) or
            ``"library"`` (shared library).
        path: the directory, the package's directory, or the library file.
        module: the importable module of an installed package; None otherwise.
        name: the entry-point name of an installed package (``sape2``); None otherwise.
    """

    kind: str
    path: Path
    module: str | None = None
    name: str | None = None

    def sha256(self) -> str:
        """Hash of the library's bytes, or of every file (relative path and bytes) under the
        directory and the versions of the ``TOOLCHAINS`` that compile Python plugins' kernels."""
        digest = hashlib.sha256(f"{self.kind}:{self.path.name}\n".encode())
        files = (
            [self.path]
            if self.kind == "library"
            else sorted(p for p in self.path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        )
        for path in files:
            digest.update(f"{path.relative_to(self.path.parent).as_posix()}\n".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        if self.kind != "library":
            digest.update(toolchain_versions().encode())
        return digest.hexdigest()

    def describe(self) -> str:
        return f"{self.module} (installed)" if self.module else str(self.path)


@dataclass(frozen=True)
class Plugins:
    """The plugins a build or a runner was given (empty: none)."""

    sources: tuple[PluginSource, ...] = ()

    @classmethod
    def resolve(cls, specs: Iterable[str | os.PathLike]) -> Plugins:
        """Plugins from ``--plugins`` values: a directory, a library file, or an installed name.

        Raises:
            ExportError: a spec is none of these (nothing is imported here).
        """
        return cls(tuple(_resolve_one(str(spec)) for spec in specs))

    def __bool__(self) -> bool:
        return bool(self.sources)

    @property
    def libraries(self) -> tuple[str, ...]:
        return tuple(str(s.path) for s in self.sources if s.kind == "library")

    @property
    def python(self) -> tuple[PluginSource, ...]:
        return tuple(s for s in self.sources if s.kind != "library")

    @property
    def installed(self) -> tuple[str, ...]:
        """Entry-point names of the installed plugin packages (what a fingerprint may name for
        loading again: installed code, checked by hash)."""
        return tuple(s.name for s in self.sources if s.kind == "package")

    def without_python(self) -> Plugins:
        """Only the shared libraries (TensorRT-RTX has no Python plugins)."""
        return Plugins(tuple(s for s in self.sources if s.kind == "library"))

    def sha256(self) -> str | None:
        """One hash over every source, independent of their order; None without plugins."""
        if not self.sources:
            return None
        return hashlib.sha256("\n".join(sorted(s.sha256() for s in self.sources)).encode()).hexdigest()

    def describe(self) -> list[str]:
        """Where each source came from (recorded beside a fingerprint, for messages only)."""
        return [s.describe() for s in self.sources]

    def load(self, module: str) -> frozenset[tuple[str, str]]:
        """Import the Python plugins (each once per process) and load the shared libraries.

        Args:
            module: the TensorRT flavour they are for (``tensorrt``, ``tensorrt_rtx``).

        Returns:
            ``(namespace, name)`` of the plugin creators these sources registered (in this call
            or an earlier one): the ops a build given these plugins may build as plugin layers.

        Raises:
            ExportError: a plugin fails to import or register, or a library is missing or fails to load.
        """
        provided: set[tuple[str, str]] = set()
        for source in self.sources:
            before = registered_creators(module)
            ids = _load_source(source, module)
            key = (source.kind, source.path)
            _PROVIDED[key] = _PROVIDED.get(key, frozenset()) | ids | (registered_creators(module) - before)
            provided |= _PROVIDED[key]
        return frozenset(provided)


# (kind, path) of each source loaded in this process -> the plugin creators its loading
# registered. Process state, as TensorRT's registry is: a source registers on its first load only.
_PROVIDED: dict[tuple[str, Path], frozenset[tuple[str, str]]] = {}


def registered_creators(module: str) -> set[tuple[str, str]]:
    """``(namespace, name)`` of every plugin creator registered with TensorRT flavour ``module`` in
    this process; empty when the flavour is not installed (nothing can be registered with it)."""
    from deploykit._lazy import is_available

    if not is_available(module):
        return set()
    trt = importlib.import_module(module)
    return {(c.plugin_namespace, c.name) for c in trt.get_plugin_registry().all_creators}


def _load_source(source: PluginSource, module: str) -> frozenset[tuple[str, str]]:
    """Load one source; the plugin ids (``namespace::name``) its ``register()`` returned."""
    if source.kind == "package":
        return _plugin_ids(_import_package(source))
    if source.kind == "directory":
        return frozenset().union(*(_plugin_ids(r) for r in _import_directory(source.path).values()))
    if not source.path.is_file():
        raise ExportError(f"plugin library {source.path} does not exist")
    from deploykit.backends._polygraphy import backend

    try:
        backend(module).LoadPlugins(plugins=[str(source.path)])()
    except OSError as err:
        raise ExportError(one_line(f"cannot load plugin library: {err}")) from err
    return frozenset()


def _plugin_ids(returned) -> frozenset[tuple[str, str]]:
    """``register()``'s ``"namespace::name"`` (one, or several), as ``(namespace, name)``."""
    ids = [returned] if isinstance(returned, str) else returned if isinstance(returned, (list, tuple, set, frozenset)) else []
    return frozenset(tuple(i.split("::", 1)) for i in ids if isinstance(i, str) and "::" in i)


def _resolve_one(spec: str) -> PluginSource:
    path = Path(spec)
    if path.is_dir():
        _refuse_installed_directory(path)
        return PluginSource("directory", path.resolve())
    if path.is_file() and path.suffix in LIBRARY_SUFFIXES:
        return PluginSource("library", path.resolve())
    if path.is_file():
        raise ExportError(
            f"plugin {spec} is a file but not a shared library ({', '.join(LIBRARY_SUFFIXES)}); "
            "give a directory of Python plugins, a library, or an installed plugin's name"
        )
    installed = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if spec in installed:
        return PluginSource("package", _package_dir(spec, installed[spec]), installed[spec], spec)
    names = ", ".join(sorted(installed)) or "none"
    raise ExportError(f"plugin {spec} is not a directory, a shared library or an installed plugin (installed: {names})")


def toolchain_versions() -> str:
    """``"triton==3.6.0"``-style versions of ``TOOLCHAINS`` (``absent`` when not installed), read
    from installed metadata without importing them."""
    from importlib.metadata import PackageNotFoundError, version

    def one(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "absent"

    return ";".join(f"{dist}=={one(dist)}" for dist in TOOLCHAINS)


def _package_dir(name: str, module: str) -> Path:
    """Where an installed plugin's package is (finding it imports its parent packages only)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ExportError(f"installed plugin {name} names {module}, which is not an importable package")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def _refuse_installed_directory(path: Path) -> None:
    """A directory that is, or holds, an installed plugin package would import that package a
    second time under another module name (``deploykit_plugins.<dir>.<name>``), registering its
    ops twice; it is named by its entry point instead."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        package = _package_dir(ep.name, ep.value)
        if path.resolve() in (package, package.parent):
            raise ExportError(f"plugin directory {path} holds the installed plugin {ep.name} ({ep.value}); pass --plugins {ep.name}")


def _import_package(source: PluginSource) -> list[str]:
    """Import an installed plugin package and call its ``register()`` (which must be idempotent:
    it runs on every load). Registration does not hang on the import: the package may be
    imported already for other reasons (SaPE²'s encoding imports its kernels on CUDA) without
    its TensorRT plugin being registered."""
    name = source.module
    try:
        module = importlib.import_module(name)
    except Exception as err:  # a plugin may raise anything; report it as one line
        raise ExportError(one_line(f"plugin {name} failed to import: {type(err).__name__}: {err}")) from err
    return _call_register(module, name)


def load_plugin_modules(plugin_dirs: Iterable[str | os.PathLike]) -> list[str]:
    """Import the Python plugins under each directory, so they register with TensorRT.

    A plugin is a package ``<dir>/<name>/__init__.py`` or a module ``<dir>/<name>.py``; importing
    it runs its ``@trtp.register`` decorators, and a module-level ``register()`` (for plugins that
    import TensorRT only when asked, as SaPE²'s does) is called right after. Each is imported once
    per process (registering twice is a TensorRT error). Only call this with directories the user
    named.

    Returns:
        The module names imported or already loaded.

    Raises:
        ExportError: a directory does not exist or a plugin fails to import.
    """
    return [name for root in plugin_dirs for name in _import_directory(Path(root))]


def _import_directory(root: Path) -> dict[str, object]:
    """Import the plugins under ``root`` (``load_plugin_modules``): module name -> what its
    ``register()`` returned when imported now (None when imported before)."""
    if not root.is_dir():
        raise ExportError(f"plugin directory {root} does not exist")
    registered = {}
    for path in sorted(root.iterdir()):
        init = path / "__init__.py" if path.is_dir() else path
        if not init.is_file() or init.suffix != ".py" or path.name.startswith(("_", ".")):
            continue
        name = f"deploykit_plugins.{root.resolve().name}.{path.stem}"
        registered[name] = None
        if name not in sys.modules:
            _import_plugin(name, init, path)
            registered[name] = _call_register(sys.modules[name], str(init))
    return registered


def _import_plugin(name: str, init: Path, path: Path) -> None:
    search = [str(path)] if path.is_dir() else None
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=search)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec, so the package's relative imports resolve
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # a plugin may raise anything; report it as one line
        del sys.modules[name]
        raise ExportError(one_line(f"plugin {init} failed to import: {type(err).__name__}: {err}")) from err


def _call_register(module, what: str):
    """Call the plugin's ``register()`` and return what it returns (None without one); ``what``
    names it in the one-line error (its module, or the file under a directory the user named)."""
    register = getattr(module, "register", None)
    if not callable(register):
        return None
    try:
        return register()
    except Exception as err:
        raise ExportError(one_line(f"plugin {what} failed to register: {type(err).__name__}: {err}")) from err


def check_plugins(engine: Path, built_sha256: str | None, built_from: list[str], given: Plugins, hint: str) -> None:
    """Refuse, in one line and before anything is imported, plugins that are not the ones the
    engine was built with (by hash; ``built_from`` only names them in the message)."""
    if given.sha256() == built_sha256:
        return
    if built_sha256 is None:
        raise StaleEngineError(
            f"{engine} was built without plugins, but plugins were given ({_names(given.describe())}); run it without --plugins"
        )
    where = _names(built_from) or "unrecorded sources"
    if not given:
        raise StaleEngineError(
            f"{engine} needs the plugins it was built with ({where}); pass them with --plugins "
            "(plugins are never loaded from paths recorded in a fingerprint)"
        )
    raise StaleEngineError(
        f"{engine} was built with other plugins than the ones given (built with {where}, "
        f"given {_names(given.describe())}; sources differ); pass the same plugins, or {hint}"
    )


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_NAMES])
    return shown + (f" and {len(items) - _MAX_NAMES} more" if len(items) > _MAX_NAMES else "")
