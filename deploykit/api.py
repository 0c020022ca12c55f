"""The whole workflow as ``deploykit.*``: model → export → validate → build → profile → load.

Each step after ``export`` takes the export directory (``profile`` also takes a model), applies
the same defaults as its ``deploykit`` command, and returns a typed result: ``bool(result)``
says whether it succeeded, ``result.to_json()`` gives what the command's ``--report``/``--json``
writes, and ``result.raise_for_failure()`` raises a ``DeployKitError`` when it did not::

    import deploykit

    exported = deploykit.export(None, "out/default")       # the zoo's trained default model
    deploykit.validate(exported.directory).raise_for_failure()
    deploykit.profile(exported.directory, batches=[1])     # writes the plan `load` serves
    classify = deploykit.load(exported.directory)
    print(classify("photo.jpg"))

Bad input raises a ``DeployKitError`` with a one-line message, as the commands print it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploykit import catalog
from deploykit.errors import DeployKitError, ValidationError

if TYPE_CHECKING:  # the names below import PyTorch; the functions import them when called
    from deploykit.backends.build import BuiltEngine
    from deploykit.export.int8_static import CalibrationOptions
    from deploykit.export.manifest import Manifest
    from deploykit.nn.factory import Model
    from deploykit.profile.report import ProfileReport
    from deploykit.serve.pipeline import Pipeline
    from deploykit.validation.run import ValidationReport

Resolution = tuple[int, ...]


def list_encodings() -> list[str]:
    """Every registered positional encoding, sorted (what ``--encoding`` takes); imports no PyTorch."""
    return catalog.encodings()


def list_models() -> list[str]:
    """Every named model size, sorted (what ``--model`` takes); imports no PyTorch."""
    return catalog.models()


def create_model(name: str, *, encoding: str | None = None, **overrides: Any) -> Model:
    """A seeded, untrained model of a named size (``list_models()``) with an encoding (``list_encodings()``).

    Args:
        name: a model size, e.g. ``"vit_tiny_patch16"`` or ``"char_gpt_ega"``.
        encoding: the positional encoding; default the architecture's own (ViT: ``ape``, sequence: ``mope``).
        **overrides: config fields to change (``img_size=96``, ``depth=2``, ...).

    Raises:
        ConfigError: an unknown name, encoding or field.
    """
    from deploykit.nn.factory import create_model as create

    return create(name, encoding=encoding, **overrides)


@dataclass(frozen=True)
class ExportResult:
    """What ``export`` wrote: the directory and its manifest (one entry per graph)."""

    directory: Path
    manifest: Manifest

    def __bool__(self) -> bool:
        return bool(self.manifest.graphs)

    def to_json(self) -> dict:
        return {"directory": str(self.directory), **self.manifest.to_dict()}

    def raise_for_failure(self) -> None:
        if not self:
            raise DeployKitError(f"{self.directory}: the export wrote no graph")


def export(
    model: Model | str | os.PathLike | None,
    output_dir: str | os.PathLike,
    *,
    resolutions: Iterable[Resolution] | None = None,
    precisions: Iterable[str] = (),
    resolution_range: tuple[Resolution, Resolution, Resolution] | None = None,
    opset: int | None = None,
    calibration: CalibrationOptions | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
    source: str | None = None,
) -> ExportResult:
    """Export a model to one ONNX graph per resolution and precision plan (``deploykit export``).

    Args:
        model: a model (``create_model``, ``deploykit import``'s output loaded), a checkpoint
            directory (``config.json`` + ``model.safetensors``), or None for the zoo's trained
            default (``models/shapes-ape``, as ``deploykit export`` with no model option).
        output_dir: the export directory; created, or a previous export's (refreshed).
        resolutions: ``(height, width)`` pairs (a sequence model: ``(length,)``); default the
            model's own ``img_size``, or none when ``resolution_range`` is given.
        precisions: plans written beside fp32 (``fp16``, ``bf16``, ``int8``, ``int8-dynamic``, ...).
        resolution_range: ``(min, opt, max)``: also one graph for any resolution in that range.
        opset: ONNX opset; default ``deploykit.export.defaults.DEFAULT_OPSET``.
        calibration: INT8 calibration (``CalibrationOptions``: data, samples, method, targets).
        force: delete files in ``output_dir`` that deploykit did not write instead of refusing.
        progress: called with one line per step.
        source: where the model came from, for the manifest; default the checkpoint or zoo
            entry it was read from, or ``"python"`` for a model given as such.

    Raises:
        DeployKitError: a bad model, resolution, precision, opset or destination; a failed export.
    """
    from deploykit.export import export as export_model
    from deploykit.export.defaults import DEFAULT_OPSET
    from deploykit.export.int8_static import CalibrationOptions
    from deploykit.zoo.resolve import resolve_model

    if model is None or isinstance(model, str | os.PathLike):
        model, read_from = resolve_model(checkpoint=None if model is None else Path(model))
        source = source or read_from
    shapes = list(resolutions) if resolutions is not None else ([] if resolution_range else [model.default_shape])
    manifest = export_model(
        model,
        shapes,
        output_dir,
        opset=DEFAULT_OPSET if opset is None else opset,
        precisions=tuple(precisions),
        source=source or "python",
        progress=progress,
        resolution_range=resolution_range,
        calibration=calibration or CalibrationOptions(),
        force=force,
    )
    return ExportResult(Path(output_dir), manifest)


def validate(
    export_dir: str | os.PathLike,
    *,
    backends: Sequence[str] | None = None,
    precision: str = "fp32",
    resolutions: Iterable[Resolution] | None = None,
    inputs: str | os.PathLike | None = None,
    num_real: int | None = None,
    **options: Any,
) -> ValidationReport:
    """Compare an export's graphs with the float64 PyTorch reference (``deploykit validate``).

    Args:
        export_dir: what ``export`` wrote.
        backends: runners to check (``ort``, ``ort-cuda``, ``openvino``, ``trt``, ``rtx``); default ``ort``.
        precision: which exported plan, judged by its own tolerance.
        resolutions: which exported resolutions; default every one.
        inputs: your real inputs: a folder of images, a text file listing images, or a ``.npy``/``.npz``.
        num_real: real inputs per resolution; default all of ``inputs``, else the bundled set
            (a zoo model's test split, or the bundled images).
        **options: the rest of ``deploykit.validation.run.validate``'s keywords (``num_random``, ``seed``, ...).

    Returns:
        The report: ``bool(report)`` is True when every check passed.
    """
    from deploykit.inputs.user import read_inputs
    from deploykit.validation.run import validate as run_validation

    data = read_inputs(inputs) if inputs is not None else None
    if backends:
        options["backends"] = tuple(backends)
    if num_real is not None or data:  # else validate's own default: the bundled set
        options["num_real"] = num_real if num_real is not None else len(data)
    return run_validation(export_dir, resolutions=resolutions, precision=precision, inputs=data, **options)


@dataclass(frozen=True)
class BuildResult:
    """The engines ``build`` wrote or found still valid, one per graph."""

    engines: tuple[BuiltEngine, ...]

    def __bool__(self) -> bool:
        return bool(self.engines)

    def to_json(self) -> list[dict]:
        return [{key: str(value) if isinstance(value, Path) else value for key, value in asdict(e).items()} for e in self.engines]

    def raise_for_failure(self) -> None:
        if not self:
            raise DeployKitError("no engine built: the export directory holds no graph of the plans asked for")


def build(export_dir: str | os.PathLike, backend: str | None = None, **options: Any) -> BuildResult:
    """Build one TensorRT (``trt``) or TensorRT-RTX (``rtx``) engine per exported graph (``deploykit build``).

    Args:
        export_dir: what ``export`` wrote; each engine and its fingerprint go beside its graph.
        backend: ``trt`` or ``rtx``; default ``deploykit.backends.build.build``'s (TensorRT).
        **options: ``deploykit.backends.build.build``'s keywords (``dynamic``, ``batch``, ``precisions``,
            ``plugins``, ``rebuild``, ...).

    Raises:
        MissingDependencyError: TensorRT (``deploykit[trt]``) or TensorRT-RTX (``deploykit[rtx]``) is absent.
        StaleEngineError: an engine no longer matches its graph (``rebuild=True`` replaces it).
    """
    from deploykit.backends.build import build as build_engines

    if backend is not None:  # else build's own default
        options["backend"] = backend
    return BuildResult(tuple(build_engines(export_dir, **options)))


@dataclass(frozen=True)
class ProfileResult:
    """A profile's report and the plan choice it wrote into the export directory (None: a model's
    profile, or no validated plan)."""

    report: ProfileReport

    @property
    def choice(self) -> Path | None:
        return self.report.choice_file

    @property
    def records(self) -> list:
        """One ``deploykit.profile.ProfileRecord`` per measurement."""
        return self.report.records

    @property
    def failed(self) -> list:
        """Records whose plan did not pass its check against the PyTorch reference before timing."""
        return [r for r in self.report.records if r.verdict is not None and not r.verdict.validated]

    def __bool__(self) -> bool:
        return bool(self.report.records) and not self.failed

    def to_json(self) -> dict:
        return self.report.to_json()

    def raise_for_failure(self) -> None:
        if not self.report.records:
            raise DeployKitError(f"nothing was profiled: {'; '.join(self.report.notes) or 'no record'}")
        if self.failed:
            cells = [f"{r.backend} {r.precision} @ {r.resolution}" for r in self.failed]
            raise ValidationError(f"{len(cells)} profiled plan(s) failed their check against PyTorch: {', '.join(cells)}")


def profile(
    subject: str | os.PathLike | Model,
    *,
    resolutions: Iterable[Resolution] | None = None,
    precisions: Sequence[str] | None = None,
    duration_s: float | None = None,
    iterations: int | None = None,
    warmup: int | None = None,
    rounds: int | None = None,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> ProfileResult:
    """Time each backend × plan × resolution × batch against the same trunk with an APE (``deploykit profile``).

    Args:
        subject: an export directory (its graphs are timed, and the fastest validated plan per
            resolution and batch is written into it for ``load``), or a model (exported into a
            temporary directory for the run).
        resolutions: default the export's resolutions, or the model's own ``img_size``.
        precisions: plans to time side by side; default every plan in the export directory, else fp32.
        duration_s: seconds of timed calls per measurement; default ``deploykit.profile.Budget``'s.
        iterations: exactly this many timed calls per measurement instead (overrides ``duration_s``).
        warmup: untimed calls before each measurement.
        rounds: interleave the encodings in this many rounds (shared machines).
        progress: called with one line per step.
        **options: other ``deploykit.profile.ProfileOptions`` fields (``batches``, ``backends``,
            ``device``, ``compare_ape``, ``end_to_end``, ``measure_streams``, ...).
    """
    from deploykit.profile import Budget
    from deploykit.profile import profile as run_profile

    asked = {"duration_s": duration_s, "iterations": iterations, "warmup": warmup, "rounds": rounds}
    if any(value is not None for value in asked.values()):
        options["budget"] = Budget(**{key: value for key, value in asked.items() if value is not None})
    if resolutions:
        options["resolutions"] = tuple(resolutions)
    if precisions:
        options["precisions"] = tuple(precisions)
    return ProfileResult(run_profile(subject, progress=progress, **options))


def load(export_dir: str | os.PathLike, **options: Any) -> Pipeline:
    """Open an export directory as a classifier: ``load(d)(image)`` → top-k classes (``deploykit serve``'s core).

    Args:
        export_dir: what ``export`` wrote (and ``profile`` chose a plan for, if it ran).
        **options: ``deploykit.serve.pipeline.Pipeline``'s keywords (``backend``, ``top_k``, ...).
    """
    from deploykit.serve.pipeline import load as open_pipeline

    return open_pipeline(export_dir, **options)
