"""The export directory: what ``deploykit export`` writes and every later step reads.

Layout of ``DIR``::

    manifest.json        model config, weights hash, one entry per exported resolution
    config.json          the PyTorch reference model's config   } so DIR alone is enough
    model.safetensors    the PyTorch reference model's weights  } to validate
    model_224.onnx       one graph per resolution (tables baked, batch dynamic)
    model_224_fp16.onnx  the same graph under a precision plan (``--precision fp16``, ``int8``, ...;
                         ``deploykit.export.precision.PLANS``)
    model_224-512.onnx   one graph for a resolution range (``--resolution-range 224:384:512``;
                         dynamic height/width, for encodings whose tables nest)

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

import onnx

import deploykit
from deploykit._io import write_json_atomic
from deploykit.encodings import config_to_dict
from deploykit.errors import DeployKitError
from deploykit.export.lint import check_graph
from deploykit.export.onnx_export import DEFAULT_OPSET, check_resolution_range, onnx_from_model, resolution_tag, save_onnx
from deploykit.export.precision import PLANS, apply_precision, check_precision
from deploykit.export.quantize import CalibrationOptions, graph_quantization
from deploykit.nn.checkpoint import WEIGHTS_FILE, load_model, save_model
from deploykit.nn.factory import Model

MANIFEST_FILE = "manifest.json"


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


@dataclass
class Manifest:
    """Contents of ``manifest.json``."""

    encoding: str
    weights_sha256: str
    source: str
    deploykit_version: str = deploykit.__version__
    graphs: list[GraphEntry] = field(default_factory=list)

    def graph(self, resolution: tuple[int, ...], precision: str = "fp32") -> GraphEntry:
        # Compared by tag: a sequence length parsed from "--resolution 256" is (256, 256).
        for entry in self.graphs:
            if entry.resolution_range is None and entry.precision == precision and \
                    resolution_tag(entry.resolution) == resolution_tag(tuple(resolution)):
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
        path = Path(directory) / MANIFEST_FILE
        try:
            data = json.loads(path.read_text())
            data["graphs"] = [_graph_entry(g) for g in data["graphs"]]
            return cls(**data)
        except FileNotFoundError:
            raise DeployKitError(f"{directory} is not a deploykit export directory (no {MANIFEST_FILE}); run deploykit export first") from None
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DeployKitError(f"corrupt manifest {path}: {err}") from err


def _graph_entry(data: dict) -> GraphEntry:
    span = data.get("resolution_range")
    return GraphEntry(**{**data, "resolution": tuple(data["resolution"]),
                         "resolution_range": tuple(tuple(r) for r in span) if span else None})  # fmt: skip


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


def check_unchanged(path: Path, sha256: str) -> None:
    """Refuse a file that is missing or differs from what ``manifest.json`` recorded."""
    if not path.is_file():
        raise DeployKitError(f"exported file missing: {path}; re-run deploykit export")
    if sha256_file(path) != sha256:
        raise DeployKitError(f"{path} changed since export (sha256 differs from manifest.json); re-run deploykit export")


def checked_graph(export_dir: str | os.PathLike, entry: GraphEntry) -> Path:
    """The graph's path, refusing a file that changed since export."""
    path = Path(export_dir) / entry.file
    check_unchanged(path, entry.sha256)
    return path


def export(
    model: Model,
    resolutions: Iterable[tuple[int, ...]],
    output_dir: str | os.PathLike,
    *,
    opset: int = DEFAULT_OPSET,
    precisions: Iterable[str] = ("fp32",),
    source: str = "",
    progress=None,
    resolution_range: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None,
    calibration: CalibrationOptions = CalibrationOptions(),
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
        precisions: precision plans to write per resolution (``fp32``, ``fp16``, ``bf16``; see
            ``deploykit.export.precision``).
        source: where the model came from (recorded in the manifest).
        progress: optional callable ``progress(message)`` for long exports.
        resolution_range: ``(min, opt, max)``: also write one graph taking any resolution in
            that range (``onnx_from_model``'s ``resolution_range``), tuned for ``opt``.
        calibration: how INT8 plans are calibrated and checked (``deploykit.data.calibration_inputs``
            picks the data; a range graph is calibrated at ``opt``). A plan that fails its
            tolerance on held-out inputs is refused, and nothing is written.

    Returns:
        The manifest written to ``output_dir``.
    """
    # check_shape raises ResolutionError before any file is touched
    # (resolution, range or None): every fixed resolution, then the range's graph if asked for.
    jobs = [(r, None) for r in dict.fromkeys(model.check_shape(tuple(r)) for r in resolutions)]
    if resolution_range is not None:
        low, opt, high = (tuple(r) for r in resolution_range)
        check_resolution_range(model, low, opt, high)
        jobs.append((opt, (low, high)))
    precisions = list(dict.fromkeys(precisions))
    for precision in precisions:
        check_precision(precision)
    output_dir = Path(output_dir)
    protos = []
    for resolution, span in jobs:
        if progress:
            progress(f"exporting {resolution_tag(resolution) if span is None else range_tag(span)}")
        proto = onnx_from_model(model, resolution, opset, resolution_range=span)
        for precision in precisions:
            planned = planned_graph(proto, model, resolution, precision, calibration, progress)
            if precision != "fp32":
                check_graph(planned)  # the casts must leave a valid, strictly typed graph
            protos.append((resolution, span, precision, planned))
    save_model(model, output_dir)
    manifest = _fresh_or_existing_manifest(output_dir, model, source)
    for resolution, span, precision, proto in protos:
        name = graph_file_name(resolution, precision, span)
        save_onnx(proto, output_dir / name)
        manifest.graphs = [g for g in manifest.graphs if g.file != name]
        manifest.graphs.append(GraphEntry(resolution, name, sha256_file(output_dir / name), opset, precision, span,
                                          graph_quantization(proto)))  # fmt: skip
    manifest.graphs.sort(key=lambda g: (g.resolution_range is not None, g.resolution, list(PLANS).index(g.precision)))
    write_json_atomic(output_dir / MANIFEST_FILE, manifest.to_dict())
    return manifest


def planned_graph(
    proto: onnx.ModelProto, model: Model, resolution, precision: str, options: CalibrationOptions = CalibrationOptions(), progress=None
) -> onnx.ModelProto:
    """``proto`` (the fp32 graph of ``model`` at ``resolution``) under one precision plan; a
    quantized plan is calibrated on the model's own data (``deploykit.data.calibration_inputs``)
    and checked on held-out inputs against the fp32 graph.

    Raises:
        ExportError: the plan fails its tolerance on the held-out inputs, or calibration failed.
    """
    from deploykit.data import calibration_inputs
    from deploykit.export import quantize

    plan = check_precision(precision)
    if not precision.startswith("int8"):
        return apply_precision(proto, precision)
    say = (lambda msg: progress(f"{resolution_tag(resolution)} {precision}: {msg}")) if progress else None
    held_out, _ = calibration_inputs(model, resolution, options.held_out, held_out=True)
    logits = model.output_kind == "logits"  # a headless backbone's features have no answers to agree on
    calibration = target = None
    if plan.calibrated:
        calibration = quantize.Calibration(*calibration_inputs(model, resolution, options.samples), method=options.method)
        if options.min_agreement is not None and logits:
            target = quantize.AgreementTarget(held_out, options.min_agreement)
    planned = apply_precision(proto, precision, calibration=calibration, target=target, progress=say, attention=options.attention)
    quantize.check_plan(proto, planned, held_out, plan.tolerance, f"{precision} plan at {resolution_tag(resolution)}", top_k=logits)
    return planned


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
