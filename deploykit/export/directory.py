"""The export directory: one class, ``ExportDir``, that knows every file deploykit keeps there.

Layout of ``DIR``::

    manifest.json        model config, weights hash, one entry per exported graph (``Manifest``)
    config.json          the PyTorch reference model's config   } so DIR alone is enough
    model.safetensors    the PyTorch reference model's weights  } to validate
    model_224.onnx       one graph per resolution (tables baked, batch dynamic)
    model_224_fp16.onnx  the same graph under a precision plan (``deploykit.export.precision.PLANS``)
    model_224-512.onnx   one graph for a resolution range (dynamic height/width)
    model_224.trt.engine an engine ``deploykit build`` wrote beside its graph (``.rtx.`` for
    model_224.trt.json   TensorRT-RTX) and its fingerprint; TensorRT-RTX's runtime cache
                         (``model_224.rtx.runtime-cache``) beside its engine
    model_224.trt.refit.onnx  a weight-stripped engine's refit graph: its graph with the
    model.trt.weights    initializers in the one weights file every resolution's stripped
                         engine of the flavour is refitted from (``backends.shared_weights``)
    timing.cache         TensorRT's timing cache, shared by the builds of every graph
    profile_choice.json  ``deploykit profile``'s fastest validated plan per resolution and batch,
                         each with the sha256 of the graph it runs (``Choice``)

``deploykit export`` writes the first five (``deploykit.export.bundle``), ``build`` the engines
and the timing cache, ``profile`` the choice; ``validate``, ``serve`` and ``package`` read them.
Every one finds its files here, so the list of what deploykit owns (``own_names``) is the list
a re-export checks against before it replaces the directory (``foreign_files``).

Torch-free (onnx, the standard library and the table of backends, whose TensorRT flavours name
the engine files), like ``deploykit.export.manifest``, so commands that only read an export
directory do not load PyTorch.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path, PurePath

from deploykit._fields import show
from deploykit._io import read_bounded_text, write_json_atomic
from deploykit.errors import DeployKitError, one_line
from deploykit.export.manifest import (
    CONFIG_FILE,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    GraphEntry,
    Manifest,
    checked_config,
    checked_file,
    checked_graph,
    confined_path,
    json_object,
)
from deploykit.inputs.resolutions import resolution_tag
from deploykit.runners.table import FLAVOURS

WEIGHTS_FILE = "model.safetensors"  # as deploykit.nn.checkpoint.save_model writes it
TIMING_CACHE_FILE = "timing.cache"
CHOICE_FILE = "profile_choice.json"
# Engine flavours ``deploykit build --backend`` writes, by the tag their files carry.
ENGINE_TAGS = tuple(f.tag for f in FLAVOURS)
# The flavour that compiles its kernels when it loads an engine (TensorRT-RTX) keeps them beside it.
(RUNTIME_CACHE_TAG,) = (f.tag for f in FLAVOURS if f.portable)
ENGINE_SUFFIXES = (
    *(f".{tag}.{kind}" for tag in ENGINE_TAGS for kind in ("engine", "json", "refit.onnx")),
    f".{RUNTIME_CACHE_TAG}.runtime-cache",
)
# One weights file per flavour, shared by its weight-stripped engines (``shared_weights_file``).
BUILD_FILES = (TIMING_CACHE_FILE, *(f"model.{tag}.weights" for tag in ENGINE_TAGS))
# ``_io.atomic_path``'s temporary file, left by a write that was killed.
_TEMPORARY = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


def engine_files(graph: str | os.PathLike, tag: str) -> tuple[Path, Path]:
    """``(engine, fingerprint)`` beside ``graph`` for the engine flavour ``tag``
    (``model_224.trt.engine``, ``model_224.trt.json`` for ``model_224.onnx``)."""
    stem = Path(graph).with_suffix("")
    return stem.with_name(f"{stem.name}.{tag}.engine"), stem.with_name(f"{stem.name}.{tag}.json")


def refit_graph_file(graph: str | os.PathLike, tag: str) -> Path:
    """The refit graph of the weight-stripped engine of flavour ``tag`` beside ``graph``
    (``model_224.rtx.refit.onnx``): ``graph`` with its initializers in ``shared_weights_file``."""
    stem = Path(graph).with_suffix("")
    return stem.with_name(f"{stem.name}.{tag}.refit.onnx")


def shared_weights_file(directory: str | os.PathLike, tag: str) -> Path:
    """The one weights file the weight-stripped engines of flavour ``tag`` in ``directory`` are
    refitted from (``model.rtx.weights``), whatever their resolution."""
    return Path(directory) / f"model.{tag}.weights"


def runtime_cache_file(graph: str | os.PathLike) -> Path:
    """Where TensorRT-RTX keeps the kernels it compiled for the engine beside ``graph``."""
    stem = Path(graph).with_suffix("")
    return stem.with_name(f"{stem.name}.{RUNTIME_CACHE_TAG}.runtime-cache")


@dataclass(frozen=True)
class Choice:
    """The plan ``profile`` measured fastest among the validated ones, for one resolution and batch,
    and the inference streams it is served with: more than 1 only where ``deploykit.profile.streams``
    measured them raising its throughput under concurrent calls by ``streams_gain``."""

    backend: str
    precision: str
    batch: int
    p50_ms: float
    graph_sha256: str
    streams: int = 1
    streams_gain: float = 1.0


def _checked_choice(choice: Choice) -> Choice:
    """``choice`` if every field is of the type ``profile`` writes, its streams at most one per usable core."""
    from deploykit.runners.streams import usable_cores

    if not all(isinstance(getattr(choice, name), str) for name in ("backend", "precision", "graph_sha256")):
        raise TypeError("backend, precision and graph_sha256 are strings")
    if type(choice.batch) is not int or choice.batch < 1 or not isinstance(choice.p50_ms, (int, float)):
        raise TypeError(f"batch {show(choice.batch)} and p50_ms {show(choice.p50_ms)}: expected a positive integer and a number")
    cores = usable_cores()
    if type(choice.streams) is not int or not 1 <= choice.streams <= cores:
        raise ValueError(f"streams {show(choice.streams)}: expected an integer from 1 to the {cores} usable cores")
    return choice


@dataclass(frozen=True)
class ExportDir:
    """One export directory (see the module docstring for its layout)."""

    path: Path

    def __init__(self, path: str | os.PathLike):
        object.__setattr__(self, "path", Path(path))

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def manifest_file(self) -> Path:
        return self.path / MANIFEST_FILE

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE

    @property
    def timing_cache_file(self) -> Path:
        return self.path / TIMING_CACHE_FILE

    @property
    def choice_file(self) -> Path:
        return self.path / CHOICE_FILE

    def manifest(self) -> Manifest:
        """``manifest.json``, read and checked (``Manifest.read``)."""
        return Manifest.read(self.path)

    def graph(self, entry: GraphEntry, encoding: str | None = None) -> Path:
        """A graph's path, checked against its entry and the manifest's ``encoding`` (``checked_graph``)."""
        return checked_graph(self.path, entry, encoding)

    def config(self, manifest: Manifest) -> Path:
        """``config.json``'s path, checked unchanged since export (``checked_config``)."""
        return checked_config(self.path, manifest)

    def check_reference(self, manifest: Manifest) -> None:
        """Refuse a reference model whose weights or ``config.json`` changed since export (mean,
        std and the model's shape in the config change what is served)."""
        checked_file(self.path, WEIGHTS_FILE, manifest.weights_sha256)
        checked_config(self.path, manifest)

    def reference_files(self) -> tuple[Path, Path]:
        """The reference model's ``config.json`` and weights, each confined to the directory."""
        return confined_path(self.path, CONFIG_FILE), confined_path(self.path, WEIGHTS_FILE)

    def derived_files(self, graph_file: str) -> list[Path]:
        """The regular files ``deploykit build`` (and TensorRT-RTX's runners) wrote beside a graph
        (``ENGINE_SUFFIXES``), symlinks excluded."""
        stem = self.path / PurePath(graph_file).stem
        found = (stem.with_name(stem.name + suffix) for suffix in ENGINE_SUFFIXES)
        return sorted(p for p in found if p.is_file() and not p.is_symlink())

    def own_names(self, manifest: Manifest | None) -> set[str]:
        """Every name deploykit may keep here: the manifest, the reference model, the graphs
        ``manifest`` names and the engine files beside each, the timing cache and the choice."""
        graphs = [g.file for g in manifest.graphs] if manifest is not None else []
        derived = {f"{PurePath(g).stem}{suffix}" for g in graphs for suffix in ENGINE_SUFFIXES}
        return {MANIFEST_FILE, CONFIG_FILE, WEIGHTS_FILE, CHOICE_FILE, *BUILD_FILES, *graphs, *derived}

    def files(self) -> list[str]:
        """The names of deploykit's files the directory holds now, sorted (an unreadable
        manifest names no graph)."""
        ours = self.own_names(self._readable_manifest())
        return sorted(p.name for p in self.path.iterdir() if p.name in ours and p.is_file())

    def foreign_files(self) -> list[str]:
        """The entries deploykit did not write (directories with a trailing ``/``): anything but
        ``own_names`` and the temporary files of an interrupted atomic write."""
        ours = self.own_names(self._readable_manifest())
        return sorted(
            p.name + "/" * (p.is_dir() and not p.is_symlink())
            for p in self.path.iterdir()
            if p.name not in ours and not (_TEMPORARY.fullmatch(p.name) and p.is_file())
        )

    def _readable_manifest(self) -> Manifest | None:
        try:
            return self.manifest()
        except DeployKitError:
            return None

    def choices(self) -> dict[str, list[Choice]]:
        """``deploykit profile``'s choice: resolution tag → one ``Choice`` per profiled batch
        (empty when the directory has none).

        Raises:
            DeployKitError: the file is unreadable, in one line naming it.
        """
        path = self.choice_file
        try:
            data = json_object(read_bounded_text(path, MAX_MANIFEST_BYTES), path).get("choices", {})
            return {tag: [_checked_choice(Choice(**entry)) for entry in entries] for tag, entries in data.items()}
        except FileNotFoundError:
            return {}
        except (OSError, DeployKitError, ValueError, AttributeError, KeyError, TypeError, RecursionError) as err:
            raise DeployKitError(f"{path} is unreadable ({one_line(err, 120)}); run deploykit profile again, or delete it") from err

    def write_choices(self, choices: dict[str, list[Choice]]) -> Path | None:
        """Write ``CHOICE_FILE`` (atomically); None, and nothing written, when ``choices`` is empty."""
        if not any(choices.values()):
            return None
        return write_json_atomic(self.choice_file, {"choices": {tag: [asdict(c) for c in entries] for tag, entries in choices.items()}})

    def choices_still_true(self, manifest: Manifest) -> dict[str, list[Choice]]:
        """The choices whose graph ``manifest`` holds unchanged (same resolution, plan and
        sha256): what a re-export keeps of a profile; an unreadable choice keeps nothing."""
        graphs = {(resolution_tag(tuple(g.resolution)), g.precision): g.sha256 for g in manifest.graphs if g.resolution_range is None}
        try:
            found = self.choices()
        except DeployKitError:
            return {}
        kept = {tag: [c for c in entries if graphs.get((tag, c.precision)) == c.graph_sha256] for tag, entries in found.items()}
        return {tag: entries for tag, entries in kept.items() if entries}
