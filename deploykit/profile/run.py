"""``profile()``: every backend × precision × encoding × resolution × batch, measured in rounds
(see the package docstring for the method)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from deploykit.backends.environment import capture_environment
from deploykit.backends.registry import check_backend
from deploykit.errors import ConfigError, DeployKitError, unknown_choice
from deploykit.export.directory import ExportDir
from deploykit.export.onnx_export import check_export_shape
from deploykit.export.precision import check_precision
from deploykit.inputs.resolutions import resolution_tag
from deploykit.nn.factory import Model
from deploykit.profile.choice import (
    References,
    check_target,
    choice_lines,
    chosen_plans,
    mark_fastest,
    not_default_lines,
    slower_lines,
)
from deploykit.profile.flops import model_flops
from deploykit.profile.options import ProfileOptions
from deploykit.profile.report import BASELINE_ENCODING, FP32, TORCH_BACKEND, ProfileRecord, ProfileReport, add_ratios
from deploykit.profile.streams import with_measured_streams
from deploykit.profile.targets import (
    RunnerTarget,
    Subject,
    Unavailable,
    ape_twin,
    backend_names,
    end_to_end_call,
    inputs,
    open_target,
    pe_step,
    real_rows,
)
from deploykit.profile.timing import LatencyStats, denormals_flushed, device_timer, measure


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this PyTorch build sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise ConfigError(unknown_choice("device", device, ("auto", "cpu", "cuda")))
    return torch.device(device)


def _check_inputs(subjects: list[Subject], options: ProfileOptions) -> None:
    resolutions, batches, backends = options.resolutions, options.batches, options.backends
    for subject in subjects:
        for resolution in resolutions:
            check_export_shape(subject.model, resolution)  # ResolutionError with a hint, before any work
    for precision in options.precisions:
        check_precision(precision)
        missing = [resolution_tag(r) for r in resolutions if subjects[0].graphs and not subjects[0].has(r, precision)]
        if missing:
            raise ConfigError(f"no {precision} graph at {', '.join(missing)}; run deploykit export --precision {precision}")
    if not batches or min(batches) < 1:
        raise ConfigError(f"batch sizes must be positive integers, got {list(batches)}")
    if not backends:
        raise ConfigError(f"no backend to profile; choose from: {', '.join(backend_names())}")
    for backend in backends:
        check_backend(backend, backend_names())
    encodings = [s.encoding for s in subjects]
    if len(set(encodings)) != len(encodings):
        raise ConfigError(f"each profiled model needs its own encoding, got {encodings}")


def profile(
    models: Model | Subject | str | os.PathLike | Sequence[Model | Subject],
    options: ProfileOptions = ProfileOptions(),
    *,
    progress: Callable[[str], None] | None = None,
    **fields,
) -> ProfileReport:
    """Profile models (one per encoding, same trunk) at each resolution, batch and backend.

    Profiling an export directory (its path, or ``Subject.from_export_dir``) also writes its
    choice (``ExportDir.choices``: each resolution's fastest validated plan per batch), which
    ``deploykit.load`` and ``deploykit serve`` take on a CPU; ``ProfileReport.choice_file`` says
    where, or None when no plan was validated.

    Args:
        models: an export directory, a model, a ``Subject`` (model + exported graphs), or
            several models or subjects with different encodings. A model given as such (and the
            APE twin, in its plans that need no calibration) is exported by
            ``deploykit.export.export`` into a temporary directory for this run, each plan once.
        options: what is measured and how (``ProfileOptions``).
        progress: called as ``progress(message)`` at each step.
        fields: ``ProfileOptions`` fields given by name instead (``resolutions=[(224, 224)]``),
            replacing those of ``options``.

    Returns:
        The report: one ``ProfileRecord`` per measurement (its JSON form follows ``RECORD_FIELDS``,
        then ``e2e_*``, the positional step and its share, FLOP rates, what the runner reported,
        the verdict, the ratios to APE and to fp32 and ``fastest_validated``); ``advice`` says each
        cell's fastest validated plan and every reduced-precision plan slower than fp32. On an
        engine backend only the engines ``deploykit build`` wrote are timed; what is missing is in
        ``notes``.

    Raises:
        ResolutionError: a resolution the model cannot take.
        ConfigError: unknown backend or device, bad batch or budget, an unknown options field.
        DeployKitError: not an export directory, or nothing could be profiled (the notes say why).
    """
    try:
        options = dataclasses.replace(options, **fields)
    except TypeError as err:
        raise ConfigError(f"profile() got an unknown option: {err}; the options are ProfileOptions' fields") from err
    subjects = _subjects(models, options.precisions)
    first = subjects[0]
    # A model's own shape: (height, width), or (T,) for a sequence model given "-r 256".
    options = options.settled(first.resolutions or [first.model.default_shape], first.precisions, str(first.directory or ""))
    options = dataclasses.replace(options, resolutions=tuple(dict.fromkeys(first.model.check_shape(r) for r in options.resolutions)))
    if options.compare_ape and BASELINE_ENCODING not in [s.encoding for s in subjects]:
        subjects.append(Subject(ape_twin(first.model, max((r[0] for r in options.resolutions), default=0)), baseline=True))
    _check_inputs(subjects, options)
    with tempfile.TemporaryDirectory(prefix="deploykit-profile-") as work:
        if any(b != TORCH_BACKEND for b in options.backends):  # graphs for the models given without an export directory
            subjects = [_exported(s, options, Path(work) / f"{i}-{s.encoding}", progress) for i, s in enumerate(subjects)]
        report = _profile(subjects, options, progress)
    if first.directory is not None:  # the choice, streams decided, written once
        chosen = chosen_plans(report.records, first.encoding, first.graph_hashes())
        if options.measure_streams:
            chosen = with_measured_streams(first.directory, chosen, progress)  # throughput mode: the streams each plan is served with
        report.choice_file = ExportDir(first.directory).write_choices(chosen)
    return report


def _subjects(models, precisions: Sequence[str]) -> list[Subject]:
    """The subjects to profile: an export directory's (its ``precisions``, else every plan it
    holds), the ones given, and a model given as such."""
    if isinstance(models, (str, os.PathLike)):
        return [Subject.from_export_dir(models, precisions or None)]
    return [m if isinstance(m, Subject) else Subject(m) for m in (models if isinstance(models, Sequence) else [models])]


def _exported(subject: Subject, options: ProfileOptions, directory: Path, progress) -> Subject:
    """``subject`` itself when it has its graphs (an export directory's), else exported once."""
    if subject.graphs:
        return subject
    precisions = options.precisions
    if subject.baseline:  # its calibrated plans would cost minutes each, for a ×APE ratio no plan is chosen by
        precisions = [p for p in precisions if not check_precision(p).calibrated]  # int8-mha's flag covers its int8 base
    if progress:
        progress(f"exporting {subject.encoding}{' (APE baseline)' if subject.baseline else ''}")
    return Subject.exported(subject.model, options.resolutions, precisions, directory, subject.baseline)


def _profile(subjects: list[Subject], options: ProfileOptions, progress) -> ProfileReport:
    torch_device = _resolve_device(options.device)
    settings = dict(
        model=options.label,
        resolutions=[resolution_tag(r) for r in options.resolutions],
        batches=list(options.batches),
        backends=list(options.backends),
        precisions=list(options.precisions),
        encodings=[s.encoding for s in subjects],
        device=str(torch_device),
        budget=dataclasses.asdict(options.budget),
        end_to_end=options.end_to_end,
        flush_denormal=True,
        validate_plans=options.validate_plans,
    )
    records: list[ProfileRecord] = []
    notes: list[str] = []
    checks = References() if options.validate_plans else None
    with denormals_flushed():
        environment = capture_environment(torch_device)
        for resolution in options.resolutions:
            records += _profile_resolution(subjects, resolution, options, torch_device, progress, notes, checks)
    if not records:
        raise DeployKitError(f"nothing was profiled: {'; '.join(notes)}")
    environment["load_average_end"] = list(os.getloadavg())
    records = mark_fastest(add_ratios(records))
    return ProfileReport(
        records, settings, environment, notes, advice=choice_lines(records) + slower_lines(records) + not_default_lines(records)
    )


@dataclass(frozen=True)
class Lane:
    """One timed lane of a backend: an encoding's graph under one plan (PyTorch eager: fp32)."""

    encoding: str
    precision: str


@dataclass(frozen=True)
class _Opened:
    """A lane's subject and the target that runs it on one backend."""

    lane: Lane
    subject: Subject
    target: RunnerTarget


@dataclass
class _Samples:
    """One lane's timed calls at one batch, in nanoseconds, gathered over the rounds."""

    kernel: list[int] = field(default_factory=list)
    e2e: list[int] = field(default_factory=list)


def _open_targets(backend: str, subjects: list[Subject], resolution, options: ProfileOptions, device, progress, notes) -> list[_Opened]:
    """A target for every lane of ``backend`` that can run here (PyTorch runs fp32 only); a note
    for each that cannot."""
    lanes = (
        [(s, FP32) for s in subjects]
        if backend == TORCH_BACKEND
        else [(s, p) for p in options.precisions for s in subjects if s.has(resolution, p)]
    )
    opened = []
    for subject, precision in lanes:
        if progress:
            progress(f"{backend} {subject.encoding} {precision} @ {resolution_tag(resolution)}: preparing")
        try:
            target = open_target(backend, subject, resolution, precision, device, options.runner_options)
        except Unavailable as err:
            notes.append(str(err))
            continue
        opened.append(_Opened(Lane(subject.encoding, precision), subject, target))
    return opened


def _pe_steps(subjects: list[Subject], resolution, options: ProfileOptions, device) -> dict[tuple[str, int], LatencyStats]:
    """The positional step alone, in PyTorch eager, per (encoding, batch): its share is reported
    on the torch records only."""
    steps = {}
    for subject in subjects if TORCH_BACKEND in options.backends else []:
        for batch in options.batches:
            step = pe_step(subject.model, resolution, batch, device)
            steps[subject.encoding, batch] = LatencyStats.from_ns(measure(step, options.budget, device_timer(device)))
    return steps


def _profile_resolution(subjects, resolution, options: ProfileOptions, device, progress, notes, checks=None) -> list[ProfileRecord]:
    tag = resolution_tag(resolution)
    pe_steps = _pe_steps(subjects, resolution, options, device)
    rng = np.random.default_rng(0)
    real = real_rows(subjects[0].model, resolution)
    records = []
    for backend in options.backends:
        opened: list[_Opened] = []
        try:
            opened = _open_targets(backend, subjects, resolution, options, device, progress, notes)
            verdicts = {}
            for o in opened if checks is not None and backend != TORCH_BACKEND else []:
                if progress:
                    progress(f"{backend} {o.lane.encoding} {o.lane.precision} @ {tag}: validating")
                graph = o.subject.onnx(resolution, o.lane.precision)
                verdicts[o.lane] = check_target(o.target, o.subject.model, resolution, o.lane.precision, checks, progress, graph=graph)
            for batch in options.batches:
                images, frames = inputs(subjects[0].model, resolution, batch, rng, real)
                samples = _time_lanes(backend, opened, images, frames, resolution, batch, options, progress)
                flops = model_flops(subjects[0].model.cfg, resolution, batch)
                for o in opened:
                    kernel = LatencyStats.from_ns(samples[o.lane].kernel, batch)
                    e2e = LatencyStats.from_ns(samples[o.lane].e2e, batch) if options.end_to_end else None
                    step = pe_steps[o.lane.encoding, batch] if backend == TORCH_BACKEND else None
                    records.append(
                        ProfileRecord(
                            backend,
                            o.lane.precision,
                            o.lane.encoding,
                            tag,
                            batch,
                            kernel,
                            e2e,
                            step,
                            flops,
                            o.target.details(),
                            verdicts.get(o.lane),
                        )
                    )
        finally:
            for o in opened:
                o.target.close()
    return records


def _time_lanes(
    backend, opened: list[_Opened], images, frames, resolution, batch, options: ProfileOptions, progress
) -> dict[Lane, _Samples]:
    """Every lane's timed calls at one batch, the lanes interleaved round by round, so a load
    change on a shared machine hits every lane alike."""
    budget, samples = options.budget, {o.lane: _Samples() for o in opened}
    for _ in range(budget.rounds):
        for o in opened:
            if progress:
                progress(f"{backend} {o.lane.encoding} {o.lane.precision} @ {resolution_tag(resolution)} batch {batch}")
            samples[o.lane].kernel.extend(measure(o.target.kernel(images), budget.per_round(), o.target.timer))
            if options.end_to_end:
                call = end_to_end_call(o.target, frames, resolution, o.subject.model.cfg)
                samples[o.lane].e2e.extend(measure(call, budget.per_round()))
    return samples
