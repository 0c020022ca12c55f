"""The package's layers: every import points down (or within its layer), and no modules import
each other in a cycle.

Read from the source (every ``import``, at module level or inside a function: a function-level
import is still a dependency), so the test needs none of the optional packages.
"""

import ast
from pathlib import Path

from tests.package_layout import modules, package_dirs, source_packages

# Lowest first. A module belongs to the longest prefix listed; it may import its own layer and
# the layers below. Where the small shared modules sit, and why:
LAYERS = [
    # Imports nothing above itself: errors, atomic writes, the lazy importer, NVML, CLI rendering
    # helpers, /proc/cpuinfo, the check of config values (the encodings' and the models' configs share it),
    # image decoding (numpy + Pillow), resolution strings,
    # the torch-free catalog of names, and model inputs (numpy: noise, sample images, the zoo's data;
    # a user's own folders, lists and arrays; the rendered datasets the zoo trains on, which
    # model configs name and validation draws from), and the table of backends (names and the
    # TensorRT flavours as data: the export directory names engine files by their flavour's tag).
    (
        "infrastructure",
        (
            "deploykit.errors",
            "deploykit._io",
            "deploykit._lazy",
            "deploykit._nvml",
            "deploykit._cpu",
            "deploykit._terminal",
            "deploykit._fields",
            "deploykit._version",
            "deploykit.answers",
            "deploykit.inputs.imaging",
            "deploykit.inputs.resolutions",
            "deploykit.catalog",
            "deploykit.inputs",
            "deploykit.backends.table",
        ),
    ),
    # GPU kernels and TensorRT plugins, and the CPU runtimes' compiled kernels: imported by the
    # encodings' own ops (SaPE²'s CUDA kernel, its CPU distances) and the runners, importing nothing
    # of deploykit but the lazy importer.
    ("kernels", ("deploykit.plugins", "deploykit.backends.cpu_kernels")),
    ("encodings", ("deploykit.encodings",)),
    ("nn", ("deploykit.nn",)),
    # The table of the papers' importers (``deploykit import gridpe|mope|wepe``): torch-free, so the
    # CLI builds its commands from it; each entry names its converter in nn, which imports nothing from here.
    ("importers", ("deploykit.cli.importers",)),
    # Graph rewrites and edits, torch-free (onnx_ir, onnxscript's rewriter): the canonical rule set
    # the export applies, OpenVINO's that its runner applies when it loads a graph, and the INT8
    # fallback's edits. Below both.
    ("graph", ("deploykit.graph",)),
    # Running graphs, torch-free: the Runner interface and batched runs, ONNX Runtime's runners and
    # their inference streams. In the backends' folder with every other runner, but below export,
    # whose checks (calibration fallback, plan check) run graphs through them.
    ("runners", ("deploykit.backends.base", "deploykit.backends.onnxrt", "deploykit.backends.streams")),
    # One judge of outputs against a reference, torch-free: criteria (numpy) and the check that runs
    # a runner against them. Below export, whose plan check and INT8 fallback judge by it.
    ("checks", ("deploykit.checks",)),
    ("export", ("deploykit.export",)),
    ("backends", ("deploykit.backends",)),
    # What uses exported graphs and runners: checks, engines, timing (with what a timing ran on,
    # which reads the runtimes' thread settings), inspection, and the zoo: its table of trained
    # models, which model a command works on (a zoo model by default), training and cards.
    (
        "tools",
        (
            "deploykit.validation",
            "deploykit.backends.build",
            "deploykit.profile",
            "deploykit.backends.inspection",
            "deploykit.zoo",
        ),
    ),
    ("serve", ("deploykit.serve",)),
    # ``import deploykit``'s workflow: one thin function per step, over every layer below.
    ("api", ("deploykit.api",)),
    # The command, what its commands share (option types and groups, -q/-v, the error line) and
    # what they print.
    ("cli", ("deploykit.cli", "deploykit.__main__")),
]
# The package root only holds ``__version__`` and the facade of ``deploykit.api``'s names (imported
# on first use): anything may import it, and its lazy import of the workflow is the public API.
ROOT = "deploykit"


def _modules() -> dict[str, Path]:
    return modules()  # as installed: plugins/ is deploykit.plugins


def test_every_source_package_is_installed():
    """A directory of modules the build configuration does not list would be missing from a wheel."""
    assert source_packages() == set(package_dirs().values())


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The deploykit modules ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [node.module])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def _layer(name: str) -> int:
    matches = [
        (len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes if name == prefix or name.startswith(prefix + ".")
    ]
    assert matches, f"{name} is in no layer: add it to LAYERS with the reason it sits there"
    return max(matches)[1]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_every_module_has_a_layer():
    for name in _graph():
        if name != ROOT:
            _layer(name)


def test_imports_point_down():
    upward = [
        f"{name} ({LAYERS[_layer(name)][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})"
        for name, deps in _graph().items()
        if name != ROOT
        for dep in sorted(deps)
        if dep != ROOT and _layer(dep) > _layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_nothing_inside_imports_the_root():
    """The root is the front door (``__version__`` lives in ``deploykit._version``): a module that
    imported it would load the whole workflow's facade to read one name."""
    assert sorted(name for name, deps in _graph().items() if ROOT in deps and name != ROOT) == []


def test_no_import_cycle():
    cycles = _cycles({name: deps - {ROOT} for name, deps in _graph().items() if name != ROOT})
    assert not cycles, "\n".join(cycles)


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each import cycle of ``graph`` (node -> what it imports) found by depth-first search, as
    ``a -> b -> a``."""
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def _package(name: str) -> str:
    """The package a module belongs to: ``deploykit.export`` for ``deploykit.export.int8_static``; a
    module directly under ``deploykit`` is a package of its own, and so is a module ``LAYERS`` lists
    by itself below its package's layer (the runners under ``deploykit.backends``)."""
    own = [prefix for _, prefixes in LAYERS for prefix in prefixes if prefix.count(".") > 1 and (name + ".").startswith(prefix + ".")]
    return max(own, key=len) if own else ".".join(name.split(".")[:2])


def test_no_package_cycle():
    """Packages as a whole import one way: no ``nn → zoo → nn``, however many modules apart
    (module cycles are caught above; this catches the loops they hide)."""
    graph: dict[str, set[str]] = {}
    for name, deps in _graph().items():
        if name != ROOT:
            graph.setdefault(_package(name), set()).update(_package(d) for d in deps if d != ROOT and _package(d) != _package(name))
    cycles = _cycles(graph)
    assert not cycles, "\n".join(cycles)
