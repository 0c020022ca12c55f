"""What an export directory holds and how it is read: ``manifest.json``, its graph entries, and the
checks every later step makes before it uses a file (confined to the directory, unchanged since
export, the graph saying what its entry says).

Torch-free (onnx and the standard library), so commands that only read an export directory, such
as ``package triton``, do not load PyTorch; ``deploykit.export.bundle`` writes what this reads, and
``deploykit.export.directory.ExportDir`` names every other file the directory holds.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePath

import onnx
from google.protobuf.message import DecodeError

from deploykit._fields import json_nesting, show
from deploykit._io import read_bounded_text
from deploykit._version import __version__
from deploykit.errors import DeployKitError, one_line
from deploykit.export.metadata import GraphMetadata
from deploykit.inputs.resolutions import resolution_tag

MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"  # the reference model's config, as deploykit.nn.checkpoint writes it


def graph_opset(proto: onnx.ModelProto) -> int:
    """The default-domain opset a graph imports (what it really is, whatever was asked for)."""
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


@dataclass(frozen=True)
class GraphEntry:
    """One exported resolution (``(height, width)``, or ``(length,)`` for a sequence model), or
    a resolution range: then ``resolution`` is the shape it is tuned for and ``resolution_range``
    its ``(min, max)``."""

    resolution: tuple[int, ...]
    file: str
    sha256: str
    opset: int
    precision: str = "fp32"  # manifests written before precision plans hold fp32 graphs only
    resolution_range: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    quantization: dict | None = None  # INT8 plans: calibration, nodes kept float and why, agreement

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The resolutions this graph must be checked at: its one, or min/opt/max of its range."""
        if self.resolution_range is None:
            return [tuple(self.resolution)]
        low, high = self.resolution_range
        return list(dict.fromkeys([tuple(low), tuple(self.resolution), tuple(high)]))

    @classmethod
    def describing(cls, proto: onnx.ModelProto, file: str, sha256: str) -> GraphEntry:
        """The entry for a written graph, every field read from the graph itself (its metadata and
        opset import), so the manifest never says what the graph is not."""
        try:
            meta = GraphMetadata.of(proto)
        except DeployKitError as err:
            raise DeployKitError(f"{file} is not a graph deploykit exported: {err}") from err
        if meta.resolution is None:
            raise DeployKitError(f"{file} is not a graph deploykit exported (no resolution in its metadata)")
        quantization = meta.quantization.to_dict() if meta.quantization else None  # the manifest is JSON: its form
        return cls(meta.resolution, file, sha256, graph_opset(proto), meta.plan, meta.resolution_range, quantization)


@dataclass
class Manifest:
    """Contents of ``manifest.json``."""

    encoding: str
    weights_sha256: str
    source: str
    deploykit_version: str = __version__
    graphs: list[GraphEntry] = field(default_factory=list)
    # config.json's sha256: its mean/std, classes and channels change what is served. None in
    # manifests written before it was recorded; those are refused by checked_config.
    config_sha256: str | None = None
    # How an image becomes an input (``deploykit.inputs.imaging.Preprocessing.to_dict``, from config.json):
    # what calibration, validation and serving apply. None for sequence models and older manifests.
    preprocessing: dict | None = None

    def graph(self, resolution: tuple[int, ...], precision: str = "fp32") -> GraphEntry:
        # Compared by tag: a sequence length parsed from "--resolution 256" is (256, 256).
        for entry in self.graphs:
            if (
                entry.resolution_range is None
                and entry.precision == precision
                and resolution_tag(entry.resolution) == resolution_tag(tuple(resolution))
            ):
                return entry
        have = ", ".join(_graph_label(g) for g in self.graphs) or "none"
        raise DeployKitError(
            f"no graph exported at {_graph_label(GraphEntry(resolution, '', '', 0, precision))} (exported: {have}); "
            "run deploykit export --resolution ... --precision ..."
        )

    def graphs_at(self, precision: str, ranges: bool = False) -> list[GraphEntry]:
        """Every exported graph of one precision plan (fixed resolutions, and resolution ranges
        too when ``ranges``), or an error naming what was exported."""
        found = [g for g in self.graphs if g.precision == precision and (ranges or g.resolution_range is None)]
        if not found:
            have = ", ".join(_graph_label(g) for g in self.graphs) or "none"
            what = f"{precision} graphs" if ranges else f"{precision} graphs at a fixed resolution"
            raise DeployKitError(f"no {what} exported (exported: {have}); run deploykit export -r ... --precision {precision}")
        return found

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def read(cls, directory: str | os.PathLike) -> Manifest:
        """Read ``directory/manifest.json``, refusing any file name in it that leads outside
        ``directory`` (``confined_path``) before anything else is read.

        Raises:
            DeployKitError: not a directory, no or a corrupt manifest, or a confined path escapes.
        """
        path = Path(directory) / MANIFEST_FILE
        if Path(directory).exists() and not Path(directory).is_dir():
            raise DeployKitError(f"{directory} is a file, not a deploykit export directory; give the directory deploykit export wrote")
        try:
            data = json_object(read_bounded_text(path, MAX_MANIFEST_BYTES), path)
            data["graphs"] = [_graph_entry(g) for g in data["graphs"]]
            manifest = cls(**data)
            _check_types(manifest, path)
        except FileNotFoundError:
            raise DeployKitError(
                f"{directory} is not a deploykit export directory (no {MANIFEST_FILE}); run deploykit export first"
            ) from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, RecursionError, AttributeError) as err:
            raise DeployKitError(f"corrupt manifest {path}: {one_line(err, 200)}") from err
        for entry in manifest.graphs:
            confined_path(directory, entry.file)
        _check_contents(manifest, path)
        return manifest


# A manifest lists a few graphs, each with its quantization record: kilobytes. Its JSON nests
# objects in lists in objects (graphs → entry → quantization → kept_float → entry): 6 levels.
MAX_MANIFEST_BYTES = 16 << 20
MAX_JSON_NESTING = 12


def json_object(text: str, path: Path) -> dict:
    """``text`` parsed as a JSON object, its nesting bounded before the parser recurses into it."""
    depth, field_name = json_nesting(text)
    if depth > MAX_JSON_NESTING:
        where = f"{field_name} nests" if field_name is not None else "it nests"
        raise ValueError(f"{where} {depth:,} levels deep; deploykit writes {MAX_JSON_NESTING} at most")
    data = json.loads(text)
    if not isinstance(data, dict):
        raise TypeError(f"it holds a JSON {type(data).__name__}, not an object")
    return data


def _check_types(manifest: Manifest, path: Path) -> None:
    """Every field of the manifest and its entries is of the type deploykit writes, before any is used."""
    for name in ("encoding", "weights_sha256", "source", "deploykit_version"):
        if not isinstance(getattr(manifest, name), str):
            raise TypeError(f"{name} is {show(getattr(manifest, name))}, not a string")
    for name in ("config_sha256",):
        if not isinstance(getattr(manifest, name), (str, type(None))):
            raise TypeError(f"{name} is {show(getattr(manifest, name))}, not a string")
    if manifest.preprocessing is not None and not isinstance(manifest.preprocessing, dict):
        raise TypeError(f"preprocessing is {show(manifest.preprocessing)}, not an object")
    for entry in manifest.graphs:
        shapes = [entry.resolution, *(entry.resolution_range or ())]
        if not all(_is_shape(shape) for shape in shapes):
            raise ValueError(f"graph {show(entry.file)} has resolution {show(list(entry.resolution))}: expected 1 or 2 positive integers")
        if not (isinstance(entry.file, str) and isinstance(entry.sha256, str) and isinstance(entry.precision, str)):
            raise TypeError(
                f"a graph entry's file, sha256 and precision are strings, got {show(entry.file)}, {show(entry.sha256)}, {show(entry.precision)}"
            )
        if type(entry.opset) is not int or not (entry.quantization is None or isinstance(entry.quantization, dict)):
            raise TypeError(f"graph {show(entry.file)} has opset {show(entry.opset)}: expected an integer")


def _is_shape(shape) -> bool:
    return isinstance(shape, tuple) and len(shape) in (1, 2) and all(type(n) is int and 0 < n <= 1 << 16 for n in shape)


def _check_contents(manifest: Manifest, path: Path) -> None:
    """What a manifest names must be what deploykit writes: a registered encoding (its name reaches
    reports and the packaged repository's README), and each graph once (else it is checked twice)."""
    from deploykit.catalog import encodings

    if manifest.encoding not in encodings():
        raise DeployKitError(
            f"corrupt manifest {path}: encoding {manifest.encoding[:80]!r} is not one deploykit has ({', '.join(encodings())})"
        )
    seen: dict = {}
    for entry in manifest.graphs:
        for key in (entry.file, (tuple(entry.resolution), entry.precision, entry.resolution_range)):
            if key in seen:
                raise DeployKitError(f"corrupt manifest {path}: it lists {_graph_label(entry)} ({entry.file}) twice")
            seen[key] = entry


def _graph_entry(data: dict) -> GraphEntry:
    if not isinstance(data, dict):
        raise TypeError(f"a graph entry is {show(data)}, not an object")
    span = data.get("resolution_range")
    return GraphEntry(
        **{**data, "resolution": tuple(data["resolution"]), "resolution_range": tuple(tuple(r) for r in span) if span else None}
    )


def range_tag(resolution_range) -> str:
    """``((224, 224), (512, 512))`` → ``"224-512"``."""
    return "-".join(resolution_tag(tuple(r)) for r in resolution_range)


def _graph_label(entry: GraphEntry) -> str:
    tag = resolution_tag(tuple(entry.resolution)) if entry.resolution_range is None else range_tag(entry.resolution_range)
    return tag if entry.precision == "fp32" else f"{tag} {entry.precision}"


def graph_file_name(resolution: tuple[int, int], precision: str = "fp32", resolution_range=None) -> str:
    """``model_224.onnx`` for fp32 (the name before precision plans), ``model_224_fp16.onnx``
    else; ``model_224-512.onnx`` for a resolution range."""
    suffix = "" if precision == "fp32" else f"_{precision}"
    tag = resolution_tag(resolution) if resolution_range is None else range_tag(resolution_range)
    return f"model_{tag}{suffix}.onnx"


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def confined_path(export_dir: str | os.PathLike, name: str) -> Path:
    """``export_dir / name``, refusing a name that leads outside ``export_dir``.

    The one check every path named by an export directory goes through: an absolute path, a
    ``..`` component, or a symlink (the file itself or a directory on the way) resolving outside
    the directory is refused, so nothing outside the export is read, copied or run.

    Raises:
        DeployKitError: the name escapes the export directory.
    """
    if not isinstance(name, str) or not name or PurePath(name).is_absolute() or ".." in PurePath(name).parts:
        raise DeployKitError(f"{Path(export_dir) / MANIFEST_FILE} names {name!r}, a path outside the export directory; refusing to read it")
    path = Path(export_dir) / name
    if not path.resolve().is_relative_to(Path(export_dir).resolve()):
        raise DeployKitError(f"{path} is a symlink leading outside the export directory (to {path.resolve()}); refusing to read it")
    return path


def checked_file(export_dir: str | os.PathLike, name: str, sha256: str) -> Path:
    """The path of file ``name`` of an export directory, confined to it (``confined_path``) and
    refused when missing or different from what ``manifest.json`` recorded."""
    path = confined_path(export_dir, name)
    if not path.is_file():
        raise DeployKitError(f"exported file missing: {path}; re-run deploykit export")
    if sha256_file(path) != sha256:
        raise DeployKitError(f"{path} changed since export (sha256 differs from manifest.json); re-run deploykit export")
    return path


def checked_config(export_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """The path of the export's ``config.json``, refused when it differs from the sha256
    ``manifest.json`` recorded, or when the manifest is older than that record.

    Raises:
        DeployKitError: the config is missing, changed since export, or not covered by the manifest.
    """
    if manifest.config_sha256 is None:
        raise DeployKitError(
            f"{Path(export_dir) / MANIFEST_FILE} does not record {CONFIG_FILE}'s sha256 (written by an older deploykit); "
            "re-run deploykit export"
        )
    return checked_file(export_dir, CONFIG_FILE, manifest.config_sha256)


def checked_graph(export_dir: str | os.PathLike, entry: GraphEntry, encoding: str | None = None) -> Path:
    """The graph's path, refusing a file outside the export, changed since export, or whose
    entry in ``manifest.json`` says something the graph does not (resolution, range,
    precision, opset, and the manifest's ``encoding`` when given)."""
    path = checked_file(export_dir, entry.file, entry.sha256)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError) as err:
        raise DeployKitError(f"{path} is not a readable ONNX graph ({err}); re-run deploykit export") from err
    actual, recorded = GraphEntry.describing(proto, entry.file, entry.sha256), _graph_entry(asdict(entry))
    fields = [
        f"{name} {getattr(recorded, name)} in the manifest, {getattr(actual, name)} in the graph"
        for name in ("resolution", "resolution_range", "precision", "opset")
        if getattr(recorded, name) != getattr(actual, name)
    ]
    graph_encoding = GraphMetadata.of(proto).encoding
    if encoding is not None and graph_encoding != encoding:
        fields.append(f"encoding {encoding} in the manifest, {graph_encoding} in the graph")
    if fields:
        raise DeployKitError(f"{MANIFEST_FILE} disagrees with {path}: {'; '.join(fields)}; re-run deploykit export")
    return path
