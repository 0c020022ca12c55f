"""The package's layers, one per folder: every import points down (or within its folder), no
modules import each other in a cycle, and no folders do.

Read from the source (every ``import``, at module level or inside a function: a function-level
import is still a dependency), so the test needs none of the optional packages.
"""

import ast
from pathlib import Path

from tests.package_layout import modules, package_dirs, source_packages

# One row per folder, lowest first: a module may import its own folder and the folders below.
LAYERS = [
    # The root's own modules, which import no folder: errors, atomic writes, the lazy importer, NVML,
    # the CLI's progress lines, the check of config values, the version, a classifier's answer and
    # the torch-free catalog of names (and ``deploykit.api`` and ``deploykit.__main__``: ``FRONT``).
    ("root", "deploykit"),
    # Model inputs, numpy only: image decoding and resolution strings, bundled and user inputs, the
    # rendered datasets the zoo trains on (model configs name them; validation draws from them).
    ("inputs", "deploykit.inputs"),
    # TensorRT plugins and the GPU kernels behind them (SaPE²'s op on CUDA uses them).
    ("plugins", "deploykit.plugins"),
    # The CPU runtimes' compiled kernels: SaPE²'s CPU distances, ONNX Runtime's and OpenVINO's custom ops.
    ("kernels", "deploykit.kernels"),
    ("encodings", "deploykit.encodings"),
    ("nn", "deploykit.nn"),
    # Graph rewrites and edits, torch-free (onnx_ir, onnxscript's rewriter).
    ("graph", "deploykit.graph"),
    # Running graphs, torch-free: the Runner interface, the table of backends, ONNX Runtime's runners
    # and inference streams, what this CPU is. Below export, whose plan checks and calibration run graphs.
    ("runners", "deploykit.runners"),
    # One judge of outputs against a reference: criteria (numpy) and the check that runs a runner.
    ("checks", "deploykit.checks"),
    # PyTorch → ONNX, precision plans and the export directory.
    ("export", "deploykit.export"),
    # The other runners (PyTorch eager, TensorRT, OpenVINO), their registry, engines and inspection.
    ("backends", "deploykit.backends"),
    # The zoo's table of trained models, which model a command works on, training and cards.
    ("zoo", "deploykit.zoo"),
    ("validation", "deploykit.validation"),
    ("profile", "deploykit.profile"),
    ("serve", "deploykit.serve"),
    # The command: what its commands share (option types and groups, -q/-v, the error line), what
    # they print, the importers' table it builds ``deploykit import`` from.
    ("cli", "deploykit.cli"),
]
# The root's modules that are not infrastructure, by the row they sit in: ``import deploykit``'s
# workflow (one thin function per step, which the command calls too) and ``python -m deploykit``.
FRONT = {"deploykit.api": "serve", "deploykit.__main__": "cli"}
# The package root holds ``__version__`` (from ``deploykit._version``) and ``deploykit.api``'s
# names: it imports anything, and nothing inside the package imports it.
ROOT = "deploykit"
MAX_ROOT_MODULES = 12


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


def _folder(name: str) -> str:
    """The folder ``name`` lives in, as a package name: ``deploykit.export`` for
    ``deploykit.export.int8_static``, ``deploykit`` for a module of the root."""
    parts = name.split(".")
    if len(parts) > 2:
        return ".".join(parts[:2])
    return name if name in _folders() else ROOT


def _folders() -> set[str]:
    """The package's folders: ``deploykit.X`` for every package directly under the root."""
    return {name for name in package_dirs() if name.count(".") == 1}


def _layer(name: str) -> int:
    rows = [folder for _, folder in LAYERS]
    if name in FRONT:
        return [row for row, _ in LAYERS].index(FRONT[name])
    assert _folder(name) in rows, f"{name}: its folder {_folder(name)} has no row: add it to LAYERS with the reason it sits there"
    return rows.index(_folder(name))


def test_one_row_per_folder():
    rows = [folder for _, folder in LAYERS]
    assert len(rows) == len(set(rows)) and set(rows) == _folders() | {ROOT}


def test_the_root_holds_few_modules():
    """What has a folder lives in it: the root keeps its infrastructure leaves and the front door."""
    at_root = [name for name in _modules() if name != ROOT and _folder(name) == ROOT]
    assert len(at_root) + 1 <= MAX_ROOT_MODULES, sorted(at_root)


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
    """The folder a module belongs to (``deploykit.export`` for ``deploykit.export.int8_static``);
    the root's front-door modules count as their own."""
    return name if name in FRONT else _folder(name)


def test_no_package_cycle():
    """Folders as a whole import one way: no ``nn → zoo → nn``, however many modules apart
    (module cycles are caught above; this catches the loops they hide)."""
    graph: dict[str, set[str]] = {}
    for name, deps in _graph().items():
        if name != ROOT:
            graph.setdefault(_package(name), set()).update(_package(d) for d in deps if d != ROOT and _package(d) != _package(name))
    cycles = _cycles(graph)
    assert not cycles, "\n".join(cycles)
