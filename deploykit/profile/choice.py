"""Speed-honest plans: which (backend, plan) passed validation, which was fastest per cell, and
where a reduced-precision plan is slower than the fp32 graph it would replace.

Every ONNX-runner target ``profile`` opens is first checked against the PyTorch float64
reference on ``validate``'s inputs (seeded noise and real images) with its plan's tolerance
(loosened to the runner's own precision where it lowers the graph itself, OpenVINO's bf16 hint),
on the runner that is then timed. After timing, the fastest validated record of each
(encoding, resolution, batch) is marked ``fastest_validated``; ``slower_lines`` says in one line
per cell where a reduced-precision plan lost to fp32 (or to the fused float plan, ``fp32-mha``).
``deploykit export`` says the same right after writing a CPU plan (``plans_slower_than_float``: a
short interleaved timing at batch 1), so nobody is told to use a plan that is slower on their
machine.

``profile`` of an export directory writes the choice beside the graphs (``ExportDir.choices``,
each entry with its graph's sha256), and ``deploykit serve`` on a CPU takes it by default.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from deploykit.checks import Agreement, check_runner
from deploykit.export.directory import Choice, ExportDir
from deploykit.export.precision import PLANS
from deploykit.nn.spec import deploy_spec
from deploykit.profile.report import FP32, TORCH_BACKEND, ProfileRecord, Verdict, add_ratios
from deploykit.profile.timing import Budget, LatencyStats, measure
from deploykit.runners.table import BASELINE
from deploykit.validation.run import References as ValidationReferences

# Plans a CPU user picks for speed on ONNX Runtime (the cast plans fp16/bf16 are for GPUs).
CPU_SPEED_PLANS = ("int8", "int8-dynamic", "int8-mha", "fp32-mha")
# The float plan with attention fused: a reduced-precision plan slower than it is not worth its
# accuracy cost either (int8-mha lost to it on the default model at 384 px, where both beat fp32).
FUSED_FLOAT = "fp32-mha"
# export's check: three interleaved rounds of at least 0.2 s per graph; a plan is called slower
# only beyond this margin, which a short timing on a busy machine does not reach by noise alone.
QUICK_BUDGET = Budget(duration_s=0.6, warmup=2, min_iterations=6, rounds=3)
QUICK_MARGIN = 1.05
# validate's defaults: enough real inputs to judge an int8 plan's top-1 agreement.
NUM_RANDOM, NUM_REAL = 4, 8


class References(ValidationReferences):
    """The float64 PyTorch reference per (model, resolution) on validate's inputs (``NUM_RANDOM``
    noise, ``NUM_REAL`` real), and each calibrated plan's own quality target, computed once."""

    def __init__(self):
        super().__init__(NUM_RANDOM, NUM_REAL)
        self._targets: dict = {}  # (model, resolution, graph) -> its QualityTarget, or None

    def quality_target(self, model, resolution, graph: str | os.PathLike):
        """The calibrated plan ``graph``'s own quality target as its export set it
        (``int8_check.recorded_target``: its thresholds, on its held-out inputs drawn again: a zoo
        model's val split, crops of the bundled images or text, or the user's calibration data),
        with PyTorch fp32 as the reference rows; None when the export set no target. Computed
        once per (model, resolution, graph).

        Raises:
            InputError: the held-out inputs are not the export's any more.
        """
        import onnx

        from deploykit.backends import TorchRunner
        from deploykit.export.int8_check import recorded_target
        from deploykit.export.metadata import GraphMetadata
        from deploykit.export.onnx_export import rows_per_call
        from deploykit.runners.base import run_rows

        key = ("quality", id(model), tuple(resolution), str(graph))
        if key not in self._targets:
            details = GraphMetadata.of(onnx.load(str(graph), load_external_data=False)).quantization
            found = recorded_target(model, tuple(resolution), details)
            if found is None:
                self._targets[key] = None
            else:
                options, inputs = found
                # fp32, as the target is agreement with fp32 (and float64 is much slower)
                batch = rows_per_call(model, tuple(resolution))
                with TorchRunner(model, dtype=torch.float32) as runner:
                    reference = run_rows(runner, inputs, batch)
                self._targets[key] = options.target(inputs, reference, logits=deploy_spec(model).answers_top_k, batch=batch)
        return self._targets[key]


def check_target(target, model, resolution, precision: str, references: References, progress=None, graph=None) -> Verdict:
    """The verdict on one opened runner target.

    The runner is judged as ``validate`` judges it (``checks.check_runner``): its plan's criteria,
    loosened to the plan it computes in when it lowers the graph itself. A calibrated plan on such a runner is also held to
    its own export target again (``quality_check``, which ``not_default_because`` reads; the plan's
    ``graph`` says what the target and its held-out inputs were), unless the runner lowered an
    encoding op, which rules it out as a default anyway. Where its held-out inputs cannot be drawn
    again, ``quality_unchecked`` says why.
    """
    runner = target.runner
    checked = check_runner(runner, references.at(model, resolution), PLANS[precision])
    verdict = Verdict(checked.result.passed, tuple(checked.result.failures))
    lowered = runner.info.precision.lowered_despite_mark if runner.info.precision else None
    if runner.computes_in and PLANS[precision].calibrated and verdict.validated and not lowered:
        # The plan's calibration was checked at export with its float remainder in f32; this runner
        # lowers that remainder itself, so the plan is held to its own target again, as it runs here.
        from deploykit.errors import DeployKitError

        if progress:
            progress(f"checking the {precision} plan's own target on its held-out inputs, float remainder in {runner.computes_in}")
        try:
            quality = references.quality_target(model, resolution, graph)
        except DeployKitError as err:
            quality, verdict = None, replace(verdict, quality_unchecked=str(err))
        if quality is not None:
            measured, met, _ = quality.measure(runner)
            verdict = replace(verdict, quality_check=dict(measured, met=met, **quality.to_dict()))
    return verdict


def not_default_because(record: ProfileRecord) -> str | None:
    """Why a validated record is never ``profile``'s default choice, or None. Measured on the zoo's
    test split (``benchmarks/results/cpu-plan-accuracy.json``, 2000 inputs, 9 models at 1x and 2x),
    against a bar of 99.0% top-1 agreement with fp32:

    * a run that computed an encoding op below f32 (``lowered_despite_mark``: a table's reader, a
      rotation, LayerNorm or Softmax; OpenVINO 2026.4 under its bf16 hint on SaPE²'s bias body).
      With LayerNorm in bf16 as well, three models fell to 98.45-98.95%
      (``cpu-plan-accuracy-string-marks.json``).
    * a calibrated plan (int8) run by a runner that lowers its float remainder itself
      (``computes_in``: OpenVINO's bf16 hint), unless the plan met its own export-time quality
      target again as this runner runs it (``quality_check``, from ``check_target``). The target
      was checked at export with the remainder in f32; in bf16 the test-split agreement fell to
      98.80% (GridPE at 2x) and 98.95% (SaPE² at 1x), where the same runner on the fp32 graph
      kept 99.15% or more and the int8 plan with an f32 remainder 99.25% or more.
    """
    run, verdict = record.run, record.verdict
    if run.get("lowered_despite_mark"):
        kinds = ", ".join(sorted(run["lowered_despite_mark"]))
        return f"the runtime ran encoding ops the plan keeps in f32 (tables, rotations, LayerNorm, Softmax) below it ({kinds})"
    plan = PLANS.get(record.precision)
    if run.get("computes_in") and plan is not None and plan.calibrated:
        check = verdict.quality_check if verdict is not None else None
        if check is None:
            why = f"its calibration was checked with a float32 remainder, which this runner computes in {run['computes_in']}"
            unchecked = verdict.quality_unchecked if verdict is not None else None
            return f"{why}, and its own target could not be checked again: {unchecked}" if unchecked else why
        if not check["met"]:
            from deploykit.export import sensitivity

            goal = Agreement.from_dict(check).describe()
            return (
                f"with its float remainder in {run['computes_in']} it missed the plan's own target ({goal}) on "
                f"{check['held_out']} held-out inputs: {sensitivity.summary(check)}"
            )
    return None


def mark_fastest(records: list[ProfileRecord]) -> list[ProfileRecord]:
    """``records`` with ``fastest_validated`` set: True on the lowest p50 among the validated
    records of its cell (encoding, resolution, batch), False elsewhere. Never chosen: PyTorch
    eager (the reference, not a deployed plan) and a record ``not_default_because`` names."""
    best: dict[tuple, ProfileRecord] = {}
    for r in records:
        if r.backend != TORCH_BACKEND and r.validated and not_default_because(r) is None:
            if r.cell not in best or r.p50_ms < best[r.cell].p50_ms:
                best[r.cell] = r
    chosen = {id(r) for r in best.values()}
    return [replace(r, fastest_validated=id(r) in chosen) for r in records]


def choice_lines(records: list[ProfileRecord]) -> list[str]:
    """One line per cell: its fastest validated (backend, plan), and its ratio to the baseline
    backend's fp32 there (ONNX Runtime's: the runner every machine has)."""
    ort = {r.cell: r.p50_ms for r in records if r.backend == BASELINE and r.precision == FP32}
    lines = []
    for r in records:
        if r.fastest_validated:
            base = ort.get(r.cell)
            vs = f" ({r.p50_ms / base:.2f}x ORT fp32)" if base else ""
            lines.append(f"fastest validated for {r.encoding} @ {r.resolution} batch {r.batch}: {r.backend} {r.precision}{vs}")
    return lines


def not_default_lines(records: list[ProfileRecord]) -> list[str]:
    """One line per (backend, plan, reason) that is never the default choice
    (``not_default_because``), naming the resolutions where it applies."""
    where: dict[tuple, list[str]] = {}
    for r in records:
        reason = not_default_because(r) if r.backend != TORCH_BACKEND else None
        if reason:
            cells = where.setdefault((r.precision, r.backend, reason), [])
            cells += [] if r.resolution in cells else [r.resolution]
    return [
        f"{precision} on {backend} at {', '.join(cells)} is not chosen by default: {reason}; ask for it by name to use it"
        for (precision, backend, reason), cells in where.items()
    ]


def slower_lines(records: list[ProfileRecord], margin: float = 1.0) -> list[str]:
    """One line per (backend, plan, cell) where a reduced-precision plan's p50 is above ``margin``
    times the same backend's fp32 graph there, or else above its fused float plan (``fp32-mha``,
    when that was timed and not refused by validation): nobody should be told to use it."""
    cell = lambda r: (r.backend, *r.cell)
    fused = {cell(r): r.p50_ms for r in records if r.precision == FUSED_FLOAT and r.validated is not False}
    lines = []
    for r in records:
        if r.precision == FP32:
            continue
        where = f"for {r.encoding} @ {r.resolution} batch {r.batch}"
        if r.ratio_vs_fp32 is not None and r.ratio_vs_fp32 > margin:
            # a tie (1.00x as printed) costs accuracy for no speed: no faster, rather than slower
            verdict = "slower than" if f"{r.ratio_vs_fp32:.2f}" != "1.00" else "no faster than"
            lines.append(
                f"{r.precision} on {r.backend} is {r.ratio_vs_fp32:.2f}x its fp32 graph {where}: {verdict} fp32 there, do not use it"
            )
        elif r.precision != FUSED_FLOAT and cell(r) in fused and r.p50_ms > margin * fused[cell(r)]:
            ratio = r.p50_ms / fused[cell(r)]
            lines.append(f"{r.precision} on {r.backend} is {ratio:.2f}x {FUSED_FLOAT} {where}: {FUSED_FLOAT} is faster there, use it")
    return lines


def chosen_plans(records: list[ProfileRecord], encoding: str, graphs: dict) -> dict[str, list[Choice]]:
    """The export directory's choice (``ExportDir.choices``): per resolution tag, the chosen plan
    at each profiled batch, with the sha256 of the graph it runs (so a re-export makes it stale).

    Args:
        records: the profile's records, after ``mark_fastest``.
        encoding: the export's encoding (the APE twin's records are not choices for it).
        graphs: ``(resolution tag, precision)`` → sha256 of that exported graph.

    Returns:
        Resolution tag → one ``Choice`` per batch; empty when no cell had a validated plan.
    """
    chosen: dict[str, list[Choice]] = {}
    for r in records:
        if r.fastest_validated and r.encoding == encoding and (r.resolution, r.precision) in graphs:
            sha = graphs[r.resolution, r.precision]
            chosen.setdefault(r.resolution, []).append(Choice(r.backend, r.precision, r.batch, r.p50_ms, sha))
    return chosen


def read_choice(export_dir: str | os.PathLike, resolution_tag: str, batch: int) -> Choice | None:
    """The choice for one resolution at the profiled batch nearest ``batch`` (ties: the smaller),
    or None when the directory has no choice for it."""
    entries = ExportDir(export_dir).choices().get(resolution_tag, [])
    return min(entries, key=lambda c: (abs(c.batch - batch), c.batch), default=None)


def plans_slower_than_float(export_dir: str | os.PathLike, budget: Budget = QUICK_BUDGET, timer=None, model=None) -> list[str]:
    """After an export: the fp32 graph and every CPU plan (``CPU_SPEED_PLANS``) of each resolution
    of ``export_dir``, batch 1 on ONNX Runtime's CPU provider, timed in interleaved rounds;
    ``slower_lines`` (beyond ``QUICK_MARGIN``) for the plans slower than fp32 or than ``fp32-mha``.

    Given the exported ``model``, the graphs are timed on one of the real inputs ``profile`` times
    on (``targets.real_rows``, which says why), else on zeros: export and profile should not
    disagree because their inputs differ."""
    from deploykit.export.manifest import Manifest, checked_graph
    from deploykit.inputs.resolutions import resolution_tag
    from deploykit.runners.onnxrt import CPU, OnnxrtRunner

    directory = Path(export_dir)
    manifest = Manifest.read(directory)
    cells: dict[tuple, list] = {}
    for graph in manifest.graphs:
        if graph.precision == FP32 or graph.precision in CPU_SPEED_PLANS:
            cells.setdefault((tuple(graph.resolution), graph.resolution_range), []).append(graph)
    records = []
    for graphs in cells.values():
        graphs.sort(key=lambda g: g.precision != FP32)  # fp32 first: the reference
        if len(graphs) < 2 or graphs[0].precision != FP32:
            continue
        real = None
        if model is not None:
            from deploykit.profile.targets import real_rows

            real = real_rows(model, graphs[0].resolution)
        with contextlib.ExitStack() as stack:
            runners = [stack.enter_context(OnnxrtRunner(checked_graph(directory, g, manifest.encoding), providers=[CPU])) for g in graphs]
            runs = [(runner, _timing_feed(runner, real), []) for runner in runners]
            for _ in range(budget.rounds):  # interleaved: a load change hits every graph alike
                for runner, feed, samples in runs:
                    samples += measure(lambda r=runner, f=feed: r.infer(f), budget.per_round(), timer)
        tag = resolution_tag(graphs[0].resolution)
        timed = [
            ProfileRecord(BASELINE, g.precision, manifest.encoding, tag, 1, LatencyStats.from_ns(samples))  # ONNX Runtime's CPU provider
            for g, (_, _, samples) in zip(graphs, runs, strict=True)
        ]
        records += add_ratios(timed)  # per cell: a range graph's tag can be a fixed graph's too
    return slower_lines(records, QUICK_MARGIN)


def _timing_feed(runner, real: np.ndarray | None) -> dict[str, np.ndarray]:
    """Batch 1 for a graph of one input: the first of ``real`` where it fits the input, else zeros."""
    feed = runner.zero_feed()
    if real is not None and len(feed) == 1:
        (name, zeros), row = next(iter(feed.items())), real[:1]
        if row.shape == zeros.shape:
            feed = {name: row.astype(zeros.dtype)}
    return feed
