"""``profile()``: every backend × precision × encoding × resolution × batch, measured in rounds
(see the package docstring for the method)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from deploykit.backends.plugins import Plugins
from deploykit.backends.registry import check_backend
from deploykit.errors import ConfigError, DeployKitError, ResolutionError, unknown_choice
from deploykit.export.onnx_export import check_export_shape
from deploykit.export.precision import check_precision
from deploykit.nn.factory import Model
from deploykit.profile import defaults
from deploykit.profile.choice import References, check_target, choice_lines, mark_fastest, not_default_lines, slower_lines
from deploykit.profile.environment import capture_environment
from deploykit.profile.flops import model_flops
from deploykit.profile.report import BASELINE_ENCODING, FP32, TORCH_BACKEND, ProfileReport, add_ratios, make_record
from deploykit.profile.targets import (
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
from deploykit.profile.timing import Budget, LatencyStats, denormals_flushed, device_timer, measure
from deploykit.resolutions import resolution_tag


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this PyTorch build sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise ConfigError(unknown_choice("device", device, ("auto", "cpu", "cuda")))
    return torch.device(device)


def _check_inputs(subjects: list[Subject], resolutions, batches, backends, precisions) -> None:
    if not resolutions:
        raise ResolutionError("no resolution to profile")
    for subject in subjects:
        for resolution in resolutions:
            check_export_shape(subject.model, resolution)  # ResolutionError with a hint, before any work
    for precision in precisions:
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
    models: Model | Subject | Sequence[Model | Subject],
    *,
    resolutions: Sequence[tuple[int, int]],
    batches: Sequence[int] = defaults.BATCHES,
    backends: Sequence[str] = defaults.BACKENDS,
    precisions: Sequence[str] = (FP32,),
    budget: Budget = Budget(),
    compare_ape: bool = True,
    end_to_end: bool = True,
    device: str = defaults.DEVICE,
    label: str = "",
    progress: Callable[[str], None] | None = None,
    plugins: Plugins | None = None,
    cuda_graphs: bool = True,
    allow_cpu_fallback: bool = False,
    validate_plans: bool = True,
) -> ProfileReport:
    """Profile models (one per encoding, same trunk) at each resolution, batch and backend.

    Args:
        models: a model, a ``Subject`` (model + exported graphs), or several with different encodings.
        resolutions: ``(height, width)`` pairs, multiples of the patch size.
        batches: batch sizes.
        backends: names from the table of backends (``deploykit.backends.table``), ``torch`` included.
        precisions: precision plans the ONNX runners time, interleaved: an export directory's, or,
            for a model given as such (and the APE twin, in its plans that need no calibration),
            the graphs ``deploykit.export.export`` writes into a temporary directory for this run,
            each plan once; PyTorch eager runs fp32 only.
        budget: time per measurement.
        compare_ape: add the same trunk with a learned APE when no APE model is given, and
            report every encoding's latency as a ratio to it.
        end_to_end: also time preprocessing + copies + model + top-5 per batch.
        device: ``auto``, ``cpu`` or ``cuda`` for PyTorch (ONNX runners pick their own providers).
        label: the model's name for the report (e.g. ``vit_small_patch16``).
        plugins: for engine backends, the plugins the engines were built with; None: the
            installed plugin packages each engine's fingerprint names.
        cuda_graphs: engine backends replay CUDA graphs where the engine allows it (each record
            says whether they did: ``cuda_graph``, ``cuda_graph_note``).
        allow_cpu_fallback: ``ort-cuda`` accepts nodes ONNX Runtime runs on the CPU (records name
            them in ``node_placement``); refused by default.
        validate_plans: check every ONNX-runner target against the PyTorch reference before
            timing it (``validated``), and mark each cell's fastest validated plan
            (``fastest_validated``; ``deploykit.profile.choice``).

    Returns:
        The report; ``records`` follow ``RECORD_FIELDS`` (kernel-only latency) and then extra
        fields: ``e2e_*`` (end-to-end), ``pe_step_p50_ms`` and ``pe_share`` (positional step
        alone and its share of the kernel p50), ``ape_p50_ms`` and ``ratio_vs_ape``, ``gflops``
        and ``achieved_gflop_per_s``, ``fp32_p50_ms`` and ``ratio_vs_fp32``, ``provider`` (what
        ran it), ``validated`` and ``fastest_validated``; ``advice`` says each cell's fastest
        validated plan and every reduced-precision plan slower than fp32. On an engine backend only the engines ``deploykit build`` wrote are timed; what
        is missing is in ``notes``.

    Raises:
        ResolutionError: a resolution the model cannot take.
        ConfigError: unknown backend or device, bad batch or budget.
        DeployKitError: nothing could be profiled (the notes say why).
    """
    subjects = [m if isinstance(m, Subject) else Subject(m) for m in (models if isinstance(models, Sequence) else [models])]
    # A model's own shape: (height, width), or (T,) for a sequence model given "-r 256".
    resolutions = list(dict.fromkeys(subjects[0].model.check_shape(tuple(r)) for r in resolutions)) if resolutions else []
    if compare_ape and BASELINE_ENCODING not in [s.encoding for s in subjects]:
        subjects.append(Subject(ape_twin(subjects[0].model, max((r[0] for r in resolutions), default=0)), baseline=True))
    _check_inputs(subjects, resolutions, batches, backends, precisions)
    with tempfile.TemporaryDirectory(prefix="deploykit-profile-") as work:
        if any(b != TORCH_BACKEND for b in backends):  # graphs for the models given without an export directory
            subjects = [_exported(s, resolutions, precisions, Path(work) / f"{i}-{s.encoding}", progress) for i, s in enumerate(subjects)]
        return _profile(
            subjects,
            label,
            resolutions,
            batches,
            backends,
            precisions,
            budget,
            end_to_end,
            device,
            progress,
            dict(plugins=plugins, cuda_graph=cuda_graphs, allow_cpu_fallback=allow_cpu_fallback),
            validate_plans,
        )


def _exported(subject: Subject, resolutions, precisions, directory: Path, progress) -> Subject:
    """``subject`` itself when it has its graphs (an export directory's), else exported once."""
    if subject.graphs:
        return subject
    if subject.baseline:  # its calibrated plans would cost minutes each, for a ×APE ratio no plan is chosen by
        precisions = [p for p in precisions if not check_precision(p).calibrated]  # int8-mha's flag covers its int8 base
    if progress:
        progress(f"exporting {subject.encoding}{' (APE baseline)' if subject.baseline else ''}")
    return Subject.exported(subject.model, resolutions, precisions, directory, subject.baseline)


def _profile(
    subjects, label, resolutions, batches, backends, precisions, budget, end_to_end, device, progress, runner_options, validate_plans
):
    torch_device = _resolve_device(device)
    settings = dict(
        model=label,
        resolutions=[resolution_tag(r) for r in resolutions],
        batches=list(batches),
        backends=list(backends),
        precisions=list(precisions),
        encodings=[s.encoding for s in subjects],
        device=str(torch_device),
        budget=dataclasses.asdict(budget),
        end_to_end=end_to_end,
        flush_denormal=True,
        validate_plans=validate_plans,
    )
    records: list[dict] = []
    notes: list[str] = []
    checks = References() if validate_plans else None
    with denormals_flushed():
        environment = capture_environment(torch_device)
        for resolution in resolutions:
            records += _profile_resolution(
                subjects,
                resolution,
                batches,
                backends,
                precisions,
                budget,
                end_to_end,
                torch_device,
                progress,
                runner_options,
                notes,
                checks,
            )
    if not records:
        raise DeployKitError(f"nothing was profiled: {'; '.join(notes)}")
    environment["load_average_end"] = list(os.getloadavg())
    add_ratios(records)
    mark_fastest(records)
    return ProfileReport(
        records, settings, environment, notes, advice=choice_lines(records) + slower_lines(records) + not_default_lines(records)
    )


def _open_targets(backend, lanes, resolution, device, runner_options, progress, notes) -> list:
    """``((subject, precision), target)`` for every lane that can run on ``backend``; a note for each that cannot."""
    targets = []
    for subject, precision in lanes:
        if progress:
            progress(f"{backend} {subject.encoding} {precision} @ {resolution_tag(resolution)}: preparing")
        try:
            targets.append(((subject, precision), open_target(backend, subject, resolution, precision, device, runner_options)))
        except Unavailable as err:
            notes.append(str(err))
    return targets


def _profile_resolution(
    subjects, resolution, batches, backends, precisions, budget, end_to_end, device, progress, runner_options, notes, checks=None
) -> list[dict]:
    tag = resolution_tag(resolution)
    cfg = subjects[0].model.cfg
    # The positional step alone, in PyTorch eager: its share is reported on the torch records only.
    pe_steps = {}
    for subject in subjects if TORCH_BACKEND in backends else []:
        for batch in batches:
            step = pe_step(subject.model, resolution, batch, device)
            pe_steps[subject.encoding, batch] = LatencyStats.from_ns(measure(step, budget, device_timer(device)))
    rng = np.random.default_rng(0)
    real = real_rows(subjects[0].model, resolution)
    records = []
    for backend in backends:
        # (subject, precision) lanes of this backend, interleaved round by round; PyTorch runs fp32 only.
        lanes = (
            [(s, FP32) for s in subjects]
            if backend == TORCH_BACKEND
            else [(s, p) for p in precisions for s in subjects if s.has(resolution, p)]
        )
        targets = []
        try:
            targets = _open_targets(backend, lanes, resolution, device, runner_options, progress, notes)
            verdicts = {}
            for (subject, precision), target in targets if checks is not None and backend != TORCH_BACKEND else []:
                if progress:
                    progress(f"{backend} {subject.encoding} {precision} @ {tag}: validating")
                verdicts[subject.encoding, precision] = check_target(
                    target, subject.model, resolution, precision, checks, progress, graph=subject.onnx(resolution, precision)
                )
            for batch in batches:
                images, frames = inputs(subjects[0].model, resolution, batch, rng, real)
                samples = {}
                for _ in range(budget.rounds):
                    for (subject, precision), target in targets:
                        if progress:
                            progress(f"{backend} {subject.encoding} {precision} @ {tag} batch {batch}")
                        lane = (subject.encoding, precision)
                        samples.setdefault((lane, "kernel"), []).extend(measure(target.kernel(images), budget.per_round(), target.timer))
                        if end_to_end:
                            samples.setdefault((lane, "e2e"), []).extend(
                                measure(end_to_end_call(target, frames, resolution, subject.model.cfg), budget.per_round())
                            )
                for (subject, precision), target in targets:
                    lane = (subject.encoding, precision)
                    kernel = LatencyStats.from_ns(samples[lane, "kernel"], batch)
                    e2e = LatencyStats.from_ns(samples[lane, "e2e"], batch) if end_to_end else None
                    step = pe_steps[subject.encoding, batch] if backend == TORCH_BACKEND else None
                    flops = model_flops(cfg, resolution, batch)
                    records.append(
                        make_record(backend, precision, subject.encoding, tag, batch, kernel, e2e, step, flops)
                        | target.details()
                        | verdicts.get(lane, {})
                    )
        finally:
            for _, target in targets:
                target.close()
    return records
