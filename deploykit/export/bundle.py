"""The export directory: what ``deploykit export`` writes and every later step reads.

Layout of ``DIR``::

    manifest.json        model config, weights hash, one entry per exported resolution
    config.json          the PyTorch reference model's config   } so DIR alone is enough
    model.safetensors    the PyTorch reference model's weights  } to validate
    model_224.onnx       one graph per resolution (tables baked, batch dynamic)

Every file is written atomically; re-exporting the same weights adds resolutions to the
manifest, exporting different weights starts a new manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import deploykit
from deploykit._io import write_json_atomic
from deploykit.encodings import config_to_dict
from deploykit.errors import DeployKitError
from deploykit.export.onnx_export import DEFAULT_OPSET, onnx_from_model, resolution_tag, save_onnx
from deploykit.nn.checkpoint import WEIGHTS_FILE, load_model, save_model
from deploykit.nn.factory import Model

MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class GraphEntry:
    """One exported resolution (``(height, width)``, or ``(length,)`` for a sequence model)."""

    resolution: tuple[int, ...]
    file: str
    sha256: str
    opset: int


@dataclass
class Manifest:
    """Contents of ``manifest.json``."""

    encoding: str
    weights_sha256: str
    source: str
    deploykit_version: str = deploykit.__version__
    graphs: list[GraphEntry] = field(default_factory=list)

    def graph(self, resolution: tuple[int, ...]) -> GraphEntry:
        # Compared by tag: a sequence length parsed from "--resolution 256" is (256, 256).
        for entry in self.graphs:
            if resolution_tag(entry.resolution) == resolution_tag(tuple(resolution)):
                return entry
        have = ", ".join(resolution_tag(g.resolution) for g in self.graphs) or "none"
        raise DeployKitError(f"no graph exported at {resolution_tag(resolution)} (exported: {have}); run deploykit export --resolution ...")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def read(cls, directory: str | os.PathLike) -> Manifest:
        path = Path(directory) / MANIFEST_FILE
        try:
            data = json.loads(path.read_text())
            data["graphs"] = [GraphEntry(**{**g, "resolution": tuple(g["resolution"])}) for g in data["graphs"]]
            return cls(**data)
        except FileNotFoundError:
            raise DeployKitError(f"{directory} is not a deploykit export directory (no {MANIFEST_FILE}); run deploykit export first") from None
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DeployKitError(f"corrupt manifest {path}: {err}") from err


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def export(
    model: Model,
    resolutions: Iterable[tuple[int, ...]],
    output_dir: str | os.PathLike,
    *,
    opset: int = DEFAULT_OPSET,
    source: str = "",
    progress=None,
) -> Manifest:
    """Export ``model`` at each resolution into ``output_dir`` (see the module docstring).

    Every resolution is checked before anything is written, so a bad one leaves the directory
    untouched.

    Args:
        model: the model to export (exported in float32).
        resolutions: ``(height, width)`` pairs, multiples of the patch size; for a sequence
            model, lengths (``(T,)``, or ``(T, T)`` as ``parse_resolution`` gives them).
        output_dir: created if missing.
        opset: ONNX opset for the graphs.
        source: where the model came from (recorded in the manifest).
        progress: optional callable ``progress(message)`` for long exports.

    Returns:
        The manifest written to ``output_dir``.
    """
    # check_shape raises ResolutionError before any file is touched
    resolutions = list(dict.fromkeys(model.check_shape(tuple(r)) for r in resolutions))
    output_dir = Path(output_dir)
    protos = []
    for resolution in resolutions:
        if progress:
            progress(f"exporting {resolution_tag(resolution)}")
        protos.append((resolution, onnx_from_model(model, resolution, opset)))
    save_model(model, output_dir)
    manifest = _fresh_or_existing_manifest(output_dir, model, source)
    for resolution, proto in protos:
        name = f"model_{resolution_tag(resolution)}.onnx"
        save_onnx(proto, output_dir / name)
        manifest.graphs = [g for g in manifest.graphs if tuple(g.resolution) != resolution]
        manifest.graphs.append(GraphEntry(resolution, name, sha256_file(output_dir / name), opset))
    manifest.graphs.sort(key=lambda g: g.resolution)
    write_json_atomic(output_dir / MANIFEST_FILE, manifest.to_dict())
    return manifest


def _fresh_or_existing_manifest(output_dir: Path, model: Model, source: str) -> Manifest:
    weights_sha = sha256_file(output_dir / WEIGHTS_FILE)
    fresh = Manifest(encoding=config_to_dict(model.cfg.encoding)["name"], weights_sha256=weights_sha, source=source)
    try:
        existing = Manifest.read(output_dir)
    except DeployKitError:
        return fresh
    return existing if existing.weights_sha256 == weights_sha else fresh


def load_reference(directory: str | os.PathLike) -> Model:
    """The PyTorch reference model saved in an export directory."""
    return load_model(Path(directory))
