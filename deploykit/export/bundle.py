"""``deploykit export``: write an export directory (its layout: ``deploykit.export.directory``).

An export is staged: everything is written into a hidden sibling directory (``.DIR.*.staging``)
and swapped in for ``DIR`` at the end, so an interrupted or failed export leaves ``DIR`` exactly
as it was, and a finished one leaves nothing in ``DIR`` that the new export does not account for.
Re-exporting the same weights keeps the graphs of the previous manifest that are not exported
again (resolutions add up), each checked unchanged; files derived from a graph and named after
it (``model_224.trt.engine`` and its fingerprint ``model_224.trt.json``) are kept only when that
graph is byte-identical in the new export, and so is each entry of ``deploykit profile``'s choice.
Different weights start a new manifest. Nothing else deploykit wrote (``timing.cache``, engines
of graphs not kept) survives a re-export; a file deploykit did not write (a report, notes,
anything ``ExportDir.foreign_files`` names) is never deleted silently: the export is refused naming it, unless ``force``, which deletes it and says
so. A non-empty ``DIR`` without a ``manifest.json`` is refused rather than replaced, always.

One export writes ``DIR`` at a time: it holds ``directory_lock(DIR)`` from its first look at
``DIR`` to the swap, and a second export into ``DIR`` meanwhile is refused in one line. Holding
the lock proves that no other writer is alive, so the staging directories a killed export left
beside ``DIR`` are removed then (``clear_stale_stages``).

Every path read from ``manifest.json`` goes through ``confined_path``: a name leading outside
``DIR`` (``../x``, an absolute path, a symlink pointing elsewhere) is refused before anything is
read, so ``validate``, ``build``, ``profile``, ``serve`` and ``package`` never open, run or copy
a file from outside the export. Each graph's entry is checked against the graph itself
(resolution, range, precision and opset recorded in its metadata) before it is used.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from deploykit._io import clear_stale_stages, directory_lock, staged_directory, write_json_atomic
from deploykit._terminal import counter
from deploykit.encodings import config_to_dict
from deploykit.errors import ConfigError, DeployKitError, ExportError
from deploykit.export.directory import ExportDir
from deploykit.export.int8_static import CalibrationOptions
from deploykit.export.lint import check_graph
from deploykit.export.manifest import (
    MANIFEST_FILE,
    GraphEntry,
    Manifest,
    checked_graph,
    graph_file_name,
    range_tag,
    sha256_file,
)
from deploykit.export.onnx_export import (
    DEFAULT_OPSET,
    check_export_shape,
    check_opset,
    check_resolution_range,
    onnx_from_model,
    rows_per_call,
    save_onnx,
)
from deploykit.export.precision import (
    PLANS,
    PlanInputs,
    apply_precision,
    apply_precision_to_base,
    check_precision,
    is_quantized,
    plan_graph,
)
from deploykit.inputs.builtin import CALIBRATION_SPLIT, HELD_OUT_SPLIT, check_real_count
from deploykit.inputs.resolutions import resolution_tag
from deploykit.nn.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_model, save_model
from deploykit.nn.factory import Model
from deploykit.nn.spec import deploy_spec
from deploykit.runners.onnxrt import run_graph

_log = logging.getLogger(__name__)


# One graph to export: (resolution, None) or (the tuned-for resolution, (min, max) of its range).
Job = tuple[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]] | None]


@dataclass(frozen=True)
class ExportRequest:
    """What one export writes: a graph per job and precision plan, at one opset, INT8 plans
    calibrated as ``calibration`` says."""

    jobs: list[Job]
    precisions: list[str]
    opset: int
    calibration: CalibrationOptions = CalibrationOptions()

    @classmethod
    def checked(
        cls,
        model: Model,
        resolutions,
        precisions,
        opset: int,
        resolution_range=None,
        calibration: CalibrationOptions = CalibrationOptions(),
    ) -> ExportRequest:
        """The request, every part checked before any work (``ResolutionError``, ``ExportError`` or
        ``ConfigError`` in one line): shapes the model takes at a size a graph can hold, a
        valid range, known precision plans, a supported opset, no more calibration and held-out
        inputs than the model's data holds."""
        opset = check_opset(opset)
        jobs: list[Job] = [(r, None) for r in dict.fromkeys(check_export_shape(model, tuple(r)) for r in resolutions)]
        if resolution_range is not None:
            low, opt, high = (tuple(r) for r in resolution_range)
            check_resolution_range(model, low, opt, high)
            jobs.append((opt, (low, high)))
        if not jobs:
            raise ExportError("nothing to export: give at least one resolution or a resolution range")
        # fp32 always: every other plan is written beside it, and validate, build and serve
        # start from the fp32 graph, so a directory without it would be refused by each of them.
        precisions = list(dict.fromkeys(["fp32", *precisions]))
        for precision in precisions:
            if check_precision(precision).imported:
                raise ConfigError(
                    f"export does not write the {precision} plan: bring a Q/DQ graph with deploykit import-plan EXPORT_DIR GRAPH"
                )
        if any(is_quantized(p) for p in precisions):
            if calibration.data is not None:  # the user's inputs, before any work
                calibration.data.check(model, [resolution for resolution, _ in jobs])
            else:
                check_real_count(model, calibration.held_out, HELD_OUT_SPLIT, "--held-out")
                check_real_count(model, calibration.samples, CALIBRATION_SPLIT, "--calibration-samples")
        return cls(jobs, precisions, opset, calibration)


def export(
    model: Model,
    resolutions: Iterable[tuple[int, ...]],
    output_dir: str | os.PathLike,
    *,
    opset: int = DEFAULT_OPSET,
    precisions: Iterable[str] = ("fp32",),
    source: str = "",
    progress: Callable[[str], None] | None = None,
    resolution_range: tuple[tuple[int, int], tuple[int, int], tuple[int, int]] | None = None,
    calibration: CalibrationOptions = CalibrationOptions(),
    force: bool = False,
) -> Manifest:
    """Export ``model`` at each resolution into ``output_dir`` (see the module docstring).

    Everything is checked before any work, and everything is written into a staging directory
    beside ``output_dir`` by the steps below, then swapped in: a failed or interrupted export
    (``KeyboardInterrupt`` included) leaves ``output_dir`` exactly as it was.

    Args:
        model: the model to export (exported in float32).
        resolutions: ``(height, width)`` pairs, multiples of the patch size; for a sequence
            model, lengths (``(T,)``, or ``(T, T)`` as ``parse_resolution`` gives them).
        output_dir: created if missing; an existing one must be a previous export (or empty).
        opset: ONNX opset for the graphs (``SUPPORTED_OPSETS``).
        precisions: precision plans to write per resolution beside the fp32 graph, which is
            always written (``fp16``, ``bf16``, ``int8``, ...; see ``deploykit.export.precision``).
        source: where the model came from (recorded in the manifest).
        progress: called as ``progress(message)`` at each step of a long export.
        resolution_range: ``(min, opt, max)``: also write one graph taking any resolution in
            that range (``onnx_from_model``'s ``resolution_range``), tuned for ``opt``.
        calibration: how INT8 plans are calibrated and checked, and on what inputs (its ``data``;
            by default ``deploykit.inputs.builtin.DefaultCalibration``; a range graph is calibrated at ``opt``). A plan that fails its
            tolerance on held-out inputs is refused, and nothing is written.
        force: delete the files of a previous ``output_dir`` that deploykit did not write
            (``ExportDir.foreign_files``; each is named in a warning) instead of refusing the export.

    Returns:
        The manifest written to ``output_dir``.

    Raises:
        DeployKitError: a bad resolution, opset, precision or destination; another export
            writing ``output_dir``; files deploykit did not write there (without ``force``);
            weights that are not finite; a failed export or lint.
    """
    request = ExportRequest.checked(model, resolutions, precisions, opset, resolution_range, calibration)
    check_finite_weights(model)
    output_dir = _destination(Path(output_dir))
    say = progress or (lambda message: None)
    with directory_lock(output_dir):
        for line in clear_stale_stages(output_dir):
            _log.warning("%s", line)
        _check_foreign_files(_destination(output_dir), force)
        with staged_directory(output_dir) as stage:
            weights_sha256 = _write_reference(model, stage)
            graphs = _write_graphs(model, request, stage, say)
            graphs += _keep_previous(output_dir, stage, weights_sha256, graphs)
            manifest = _write_manifest(stage, model, weights_sha256, source, graphs)
            _keep_choice(output_dir, stage, manifest)
    return manifest


def check_finite_weights(model: Model) -> None:
    """Refuse weights holding NaN or Inf, naming the tensors: the graph would only propagate them.

    Raises:
        ExportError: a floating-point tensor of the state dict is not finite.
    """
    bad = [
        (name, int(t.isnan().sum()), int(t.isinf().sum()))
        for name, t in model.state_dict().items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if bad:
        named = ", ".join(f"{name} has {nan} NaN / {inf} Inf" for name, nan, inf in bad[:3])
        more = f" (+{len(bad) - 3} more tensors)" if len(bad) > 3 else ""
        raise ExportError(f"the model's weights are not finite: {named}{more}; fix the checkpoint")


def _destination(output_dir: Path) -> Path:
    """Where the export goes (a symlink's target), refusing a file, and a non-empty directory that
    is not a previous export: an export replaces its whole directory."""
    output_dir = output_dir.resolve() if output_dir.is_symlink() else output_dir
    if output_dir.exists() and not output_dir.is_dir():
        raise DeployKitError(f"cannot write {output_dir}: it exists and is not a directory")
    if output_dir.is_dir() and not (output_dir / MANIFEST_FILE).is_file() and any(output_dir.iterdir()):
        raise DeployKitError(
            f"{output_dir} is not empty and not a deploykit export directory (no {MANIFEST_FILE}); an export replaces "
            "its output directory, so choose another --output or empty it"
        )
    return output_dir


def _check_foreign_files(output_dir: Path, force: bool) -> None:
    """Refuse to replace a directory holding files deploykit did not write, or with ``force`` say
    which are deleted (``ExportDir.foreign_files``)."""
    found = ExportDir(output_dir).foreign_files() if output_dir.is_dir() else []
    if not found:
        return
    named = ", ".join(found[:5]) + (f" (+{len(found) - 5} more)" if len(found) > 5 else "")
    if not force:
        raise DeployKitError(
            f"{output_dir} holds {len(found)} file(s) deploykit did not write: {named}; an export replaces the whole directory, "
            "so move them out first, or pass --force to delete them"
        )
    _log.warning("deleting %d file(s) deploykit did not write from %s (--force): %s", len(found), output_dir, named)


def _write_reference(model: Model, stage: Path) -> str:
    """Step: the PyTorch reference (``config.json`` + ``model.safetensors``); returns the weights' sha256."""
    save_model(model, stage)
    return sha256_file(stage / WEIGHTS_FILE)


def _write_graphs(model: Model, request: ExportRequest, stage: Path, say: Callable[[str], None]) -> list[GraphEntry]:
    """Step: one graph per job and precision plan, each entry read back from the graph written."""
    entries = []
    for resolution, span in request.jobs:
        say(f"exporting {resolution_tag(resolution) if span is None else range_tag(span)}")
        proto = onnx_from_model(model, resolution, request.opset, resolution_range=span)
        for precision, planned in planned_graphs(proto, model, resolution, request.precisions, request.calibration, say):
            if precision != "fp32":
                check_graph(planned)  # the casts must leave a valid, strictly typed graph
            name = graph_file_name(resolution, precision, span)
            path = save_onnx(planned, stage / name)
            entries.append(GraphEntry.describing(planned, name, sha256_file(path)))
    return entries


def planned_graph(
    proto: onnx.ModelProto, model: Model, resolution, precision: str, options: CalibrationOptions = CalibrationOptions(), progress=None
) -> onnx.ModelProto:
    """``proto`` (the fp32 graph of ``model`` at ``resolution``) under one precision plan; a
    quantized plan is calibrated on ``options.data`` (default ``deploykit.inputs.builtin.DefaultCalibration``)
    and checked on held-out inputs from it against the fp32 graph.

    Raises:
        ExportError: the plan fails its tolerance on the held-out inputs, or calibration failed.
    """
    return dict(planned_graphs(proto, model, resolution, [precision], options, progress))[precision]


def planned_graphs(
    proto: onnx.ModelProto,
    model: Model,
    resolution,
    precisions: Iterable[str],
    options: CalibrationOptions = CalibrationOptions(),
    progress=None,
) -> Iterator[tuple[str, onnx.ModelProto]]:
    """``(precision, planned_graph(...))`` for each plan in turn, the quantized plans sharing their
    work: the inputs are read, and the fp32 graph run on the held-out ones, once; a plan built on
    another that is also asked for (``int8-mha`` on ``int8``) is written from that plan's graph,
    not calibrated and searched again, and then checked on the same held-out inputs.

    Raises:
        ExportError: a plan fails its tolerance on the held-out inputs, or calibration failed.
    """
    precisions = list(dict.fromkeys(precisions))
    plans = _QuantizedPlans(proto, model, resolution, options, progress)
    made: dict[str, onnx.ModelProto] = {}

    def make(precision: str) -> onnx.ModelProto:
        if precision not in made:
            base = check_precision(precision).base
            if not is_quantized(precision):  # --keep-float pins products of the cast plans to fp32 too
                made[precision] = apply_precision(proto, precision, keep_float=tuple(options.keep_float))
            elif base in precisions:
                made[precision] = plans.checked(apply_precision_to_base(make(base), precision), precision)
            else:
                made[precision] = plans.planned(precision)
        return made[precision]

    for precision in precisions:
        yield precision, make(precision)


class _QuantizedPlans:
    """The quantized plans of one fp32 graph: its inputs read and its fp32 reference on the
    held-out ones computed at the first plan that needs them, then shared."""

    def __init__(self, proto: onnx.ModelProto, model: Model, resolution, options: CalibrationOptions, progress):
        self.proto, self.model, self.resolution, self.options, self.progress = proto, model, resolution, options, progress
        self.logits = deploy_spec(model).answers_top_k
        self.batch = rows_per_call(model, resolution)
        self._data: tuple | None = None

    def _say(self, precision: str):
        return (lambda msg: self.progress(f"{resolution_tag(self.resolution)} {precision}: {msg}")) if self.progress else None

    def _read(self, precision: str) -> tuple:
        """The calibration inputs, the held-out inputs, the data's record and the fp32 outputs on
        the held-out inputs (the fallback's target and every plan's check share them)."""
        from deploykit.inputs.builtin import DefaultCalibration

        if self._data is None:
            options, say = self.options, self._say(precision)
            if say:  # user data: what the calibration leaves
                say(f"reading {options.samples} calibration and up to {options.held_out} held-out inputs")
            data = options.data or DefaultCalibration()
            inputs, held_out, record = data.inputs(self.model, self.resolution, options.samples, options.held_out)
            tick = counter(say, f"fp32 reference on {len(held_out)} held-out inputs", len(held_out), "inputs")
            self._data = inputs, held_out, record, run_graph(self.proto, held_out, self.batch, done=tick)
        return self._data

    def planned(self, precision: str) -> onnx.ModelProto:
        """The quantized plan ``precision``, calibrated (when the plan is) and checked."""
        from deploykit.export import int8_selection, int8_static

        options = self.options
        if options.keep_float:  # a pattern matching no layer is refused before any input is read
            int8_selection.select_nodes(self.proto, int8_selection.attention_int8(self.proto, options.attention), options.keep_float)
        inputs, held_out, record, reference = self._read(precision)
        calibration = target = None
        if check_precision(precision).calibrated:
            calibration = int8_static.Calibration(inputs, record["calibration"]["description"], options.method, record, batch=self.batch)
            target = options.target(held_out, reference, self.logits, self.batch)
        given = PlanInputs(calibration, target, self._say(precision), options.attention, tuple(options.keep_float))
        planned = plan_graph(self.proto, precision, given)
        # the fallback ran the plan it chose on these held-out inputs: its outputs, judged as they are
        return self.checked(planned.graph, precision, planned.held_out_outputs)

    def checked(self, planned: onnx.ModelProto, precision: str, actual=None) -> onnx.ModelProto:
        """``planned``, once it passes its plan's criteria against the fp32 graph on the held-out
        inputs (``actual``: its outputs on them, when already computed)."""
        from deploykit.export import int8_check

        _, held_out, _, reference = self._read(precision)
        say = self._say(precision)
        label = f"{precision} plan at {resolution_tag(self.resolution)}"
        tick = counter(say, f"checking the plan on the {len(held_out)} held-out inputs", len(held_out), "inputs")
        int8_check.check_plan(
            self.proto,
            planned,
            held_out,
            check_precision(precision),
            label,
            top_k=self.logits,
            reference=reference,
            done=tick,
            actual=actual,
            batch=self.batch,
        )
        return planned


def _keep_previous(output_dir: Path, stage: Path, weights_sha256: str, written: list[GraphEntry]) -> list[GraphEntry]:
    """Step: from a previous export of the same weights, the graphs not written again (each
    checked unchanged), and the files derived from every graph that is byte-identical in both.

    Returns:
        The entries of the graphs kept.
    """
    previous = _previous_manifest(output_dir, weights_sha256)
    if previous is None:
        return []
    rewritten = {g.file for g in written}
    kept = []
    for entry in previous.graphs:
        if entry.file in rewritten:
            continue
        try:
            _carry(checked_graph(output_dir, entry), output_dir, stage)
        except DeployKitError as err:
            _log.warning("not keeping %s of the previous export: %s", entry.file, err)
            continue
        _log.info("keeping %s of the previous export (same weights)", entry.file)
        kept.append(entry)
    before = {g.file: g.sha256 for g in previous.graphs}
    for entry in [*written, *kept]:
        if before.get(entry.file) == entry.sha256:
            for derived in ExportDir(output_dir).derived_files(entry.file):
                _carry(derived, output_dir, stage)
    return kept


def _previous_manifest(output_dir: Path, weights_sha256: str) -> Manifest | None:
    if not (output_dir / MANIFEST_FILE).is_file():
        return None
    try:
        previous = Manifest.read(output_dir)
    except DeployKitError as err:
        _log.warning("starting a new manifest: %s", err)
        return None
    return previous if previous.weights_sha256 == weights_sha256 else None


def _keep_choice(output_dir: Path, stage: Path, manifest: Manifest) -> None:
    """Step, after the manifest: of ``deploykit profile``'s previous choice, the entries whose
    graph the new export holds byte-identical; a choice is a measurement of those bytes."""
    previous = ExportDir(output_dir)
    kept = previous.choices_still_true(manifest)
    if previous.choice_file.is_file() and not kept:
        _log.info("dropping %s: none of the graphs it chose between is unchanged", previous.choice_file.name)
    ExportDir(stage).write_choices(kept)


def _carry(path: Path, output_dir: Path, stage: Path) -> None:
    """Put ``path`` (a file of ``output_dir``) at the same place in ``stage``: a hard link, as
    files here are only ever replaced, never changed in place; a copy where links fail."""
    dest = stage / path.relative_to(output_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(path, dest)
    except OSError:
        shutil.copy2(path, dest)


def _write_manifest(stage: Path, model: Model, weights_sha256: str, source: str, graphs: list[GraphEntry]) -> Manifest:
    """Step, last: the manifest naming everything the steps before wrote or kept."""
    graphs = sorted(graphs, key=lambda g: (g.resolution_range is not None, g.resolution, list(PLANS).index(g.precision)))
    manifest = Manifest(
        encoding=config_to_dict(model.cfg.encoding)["name"],
        weights_sha256=weights_sha256,
        source=source,
        graphs=graphs,
        config_sha256=sha256_file(stage / CONFIG_FILE),
        preprocessing=None if (preprocessing := deploy_spec(model).preprocessing) is None else preprocessing.to_dict(),
    )
    write_json_atomic(stage / MANIFEST_FILE, manifest.to_dict())
    return manifest


def load_reference(directory: str | os.PathLike) -> Model:
    """The PyTorch reference model saved in an export directory (its files confined to it)."""
    ExportDir(directory).reference_files()
    return load_model(Path(directory))
