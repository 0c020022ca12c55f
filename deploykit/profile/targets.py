"""What is profiled and what runs it: subjects (a model and its exported graphs, or the APE twin
of the same trunk), one target per backend (PyTorch eager, or a runner from
``deploykit.backends.registry``), their inputs, the end-to-end call and the positional step alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from deploykit.answers import top_k
from deploykit.catalog import OUTPUT_NAME
from deploykit.encodings import encoding_name, get_config
from deploykit.errors import ConfigError, DeployKitError
from deploykit.export.bundle import load_reference
from deploykit.export.directory import ExportDir
from deploykit.inputs.resolutions import resolution_tag
from deploykit.nn.factory import Model, build_model
from deploykit.nn.spec import deploy_spec
from deploykit.profile.report import BASELINE_ENCODING, FP32
from deploykit.profile.timing import CpuTimer


@dataclass
class Subject:
    """One model to profile, and the ONNX graphs exported for it: an export directory's, or, for a
    model given as such, the ones ``profile`` exports through the normal export path into a
    temporary directory (``exported``), each precision plan once (an int8 plan calibrated and
    checked as ``deploykit export`` does, not a second way).

    Attributes:
        model: the trunk with its encoding.
        graphs: ``(resolution, precision)`` → ``.onnx`` path.
        baseline: the APE twin ``profile`` adds.
        directory: the export directory the graphs are from, where ``profile`` writes its
            choice; None for a model given as such.
    """

    model: Model
    graphs: dict[tuple[tuple[int, int], str], Path] = field(default_factory=dict)
    baseline: bool = False  # the APE twin profile adds
    directory: ExportDir | None = None

    @property
    def encoding(self) -> str:
        return encoding_name(self.model.cfg.encoding)

    @property
    def resolutions(self) -> list[tuple[int, int]]:
        """The exported resolutions, in manifest order."""
        return list(dict.fromkeys(resolution for resolution, _ in self.graphs))

    @property
    def precisions(self) -> list[str]:
        """The plans of its graphs, fp32 first (the plan every ratio is taken against)."""
        return sorted(dict.fromkeys(precision for _, precision in self.graphs), key=lambda p: p != FP32)

    def has(self, resolution: tuple[int, int], precision: str) -> bool:
        return (tuple(resolution), precision) in self.graphs

    def onnx(self, resolution: tuple[int, int], precision: str = FP32) -> Path:
        key = (tuple(resolution), precision)
        if key not in self.graphs:
            raise ConfigError(f"no {precision} graph at {resolution_tag(resolution)}; run deploykit export --precision {precision}")
        return self.graphs[key]

    def graph_hashes(self) -> dict[tuple[str, str], str]:
        """``(resolution tag, precision)`` → sha256 of each graph."""
        from deploykit.export.manifest import sha256_file

        return {(resolution_tag(r), p): sha256_file(path) for (r, p), path in self.graphs.items()}

    @classmethod
    def from_export_dir(cls, directory: str | os.PathLike, precisions: Sequence[str] | None = (FP32,)) -> Subject:
        """The reference model and the (unchanged) graphs of each precision plan of an export
        directory (``precisions`` None: every plan it holds)."""
        return cls(load_reference(directory), _graphs(directory, precisions), directory=ExportDir(directory))

    @classmethod
    def exported(
        cls,
        model: Model,
        resolutions: Sequence[tuple[int, ...]],
        precisions: Sequence[str],
        directory: Path,
        baseline: bool = False,
        progress: Callable[[str], None] | None = None,
    ) -> Subject:
        """``model`` exported by ``deploykit.export.export`` into ``directory`` (new), and its graphs."""
        from deploykit.export.bundle import export

        export(model, resolutions, directory, precisions=list(dict.fromkeys([FP32, *precisions])), progress=progress)
        return cls(model, _graphs(directory, precisions), baseline)


def _graphs(directory: str | os.PathLike, precisions: Sequence[str] | None) -> dict[tuple[tuple[int, int], str], Path]:
    export = ExportDir(directory)
    manifest = export.manifest()
    if precisions is None:  # none at a fixed resolution: graphs_at says so for fp32
        precisions = list(dict.fromkeys(g.precision for g in manifest.graphs if g.resolution_range is None)) or [FP32]
    return {
        (tuple(g.resolution), g.precision): export.graph(g, manifest.encoding)  # refuses files changed since export
        for p in precisions
        for g in manifest.graphs_at(p)
    }


def ape_twin(model: Model, max_length: int = 0) -> Model:
    """The same trunk (same weights) with a learned APE in place of the model's encoding (for a
    sequence model, a table covering at least ``max_length`` positions)."""
    twin = build_model(deploy_spec(model).with_encoding(get_config(BASELINE_ENCODING), max_length)).eval()
    own = twin.state_dict()
    shared = {k: v for k, v in model.state_dict().items() if k in own and own[k].shape == v.shape and k != "pos_embed"}
    twin.load_state_dict(shared, strict=False)
    return twin


class RunnerTarget:
    """A runner (PyTorch's, or one from ``deploykit.backends.registry``); its ``infer`` returns host
    arrays, so wall-clock time is right on any device (kernel-only then includes that runner's own
    copies, PyTorch's on a GPU included)."""

    timer = CpuTimer()

    def __init__(self, runner):
        self.runner = runner
        runner.activate()
        (self.input_name,) = runner.input_names()  # images, or tokens for a sequence model

    def kernel(self, inputs: np.ndarray) -> Callable[[], object]:
        feed = {self.input_name: np.ascontiguousarray(inputs)}
        return lambda: self.runner.infer(feed)

    def infer_host(self, inputs: np.ndarray) -> np.ndarray:
        return self.runner.infer({self.input_name: inputs})[OUTPUT_NAME]

    def details(self) -> dict:
        """What ran, as the record's fields (after measuring: an engine runner captures its CUDA
        graphs on first use)."""
        return self.runner.info.to_dict()

    def close(self) -> None:
        self.runner.deactivate()


def backend_names() -> list[str]:
    """Backends ``profile`` knows: every backend of the table, PyTorch eager first."""
    from deploykit.runners.table import names

    return names()


class Unavailable(Exception):
    """A subject cannot run on an engine backend here; the report notes why."""


def open_target(backend: str, subject: Subject, resolution: tuple[int, int], precision: str, device: torch.device, runner_options: dict):
    from deploykit.backends.registry import create_runner
    from deploykit.runners.table import ENGINE, GRAPH, find, resolve

    descriptor = find(backend)
    if descriptor.runs not in (GRAPH, ENGINE):  # the model itself: PyTorch eager
        # float32 with the tables baked once for this resolution, as the exported graph holds them
        return RunnerTarget(resolve(descriptor.runner)(subject.model, torch.float32, device=device, shape=resolution))
    if descriptor.runs == GRAPH:
        graph = subject.onnx(resolution, precision)
        try:
            return RunnerTarget(create_runner(backend, graph, **runner_options))
        except DeployKitError as err:  # a missing extra, a CPU without the hinted precision: said, not a traceback
            raise Unavailable(f"{subject.encoding} {precision} on {backend} @ {resolution_tag(resolution)}: not profiled: {err}") from err
    # An engine exists only beside a graph of an export directory (deploykit build wrote it).
    plan = "" if precision == FP32 else f" {precision}"
    where = f"{subject.encoding}{plan} on {backend} @ {resolution_tag(resolution)}"
    if subject.baseline:
        raise Unavailable(
            f"{where}: not profiled: the APE baseline is exported by profile into a temporary directory, so no engine was built for it"
        )
    if (resolution, precision) not in subject.graphs:
        raise Unavailable(f"{where}: not profiled: no exported graph at this resolution, so no engine")
    try:
        return RunnerTarget(create_runner(backend, subject.graphs[resolution, precision], **runner_options))
    except DeployKitError as err:  # no engine built, a stale one, no GPU: said, not a traceback
        raise Unavailable(f"{where}: not profiled: {err}") from err


def real_rows(model: Model, resolution) -> np.ndarray | None:
    """The real inputs kernels are timed on, once per resolution: validate's (a zoo model's test
    split, else the bundled images or text), so a kernel whose speed depends on its values is timed
    on values it will see (noise and images differ in how many float32 denormals they produce,
    which the runner flushes: ``deploykit.runners.cpu``, ``benchmarks/results/denormals.json``). None
    without the ``images`` extra (a model with no dataset)."""
    from deploykit.errors import MissingDependencyError
    from deploykit.inputs.builtin import VALIDATION_REAL, validation_inputs

    try:
        return validation_inputs(model, tuple(resolution), 0, VALIDATION_REAL)
    except MissingDependencyError:
        return None


def inputs(model: Model, resolution, batch: int, rng: np.random.Generator, real: np.ndarray | None) -> tuple[np.ndarray, list]:
    """Kernel inputs, ``real`` (``real_rows``) repeated to fill the batch, else seeded noise; and
    end-to-end inputs (uint8 frames or texts)."""
    spec = deploy_spec(model)
    kernel = spec.random_inputs(batch, resolution, seed=batch) if real is None else np.resize(real, (batch, *real.shape[1:]))
    return kernel, spec.raw_inputs(batch, resolution, rng)


def end_to_end_call(target, raw: list, resolution, cfg) -> Callable[[], object]:
    """Raw inputs → preprocess → model → softmax → top-5, all host work and copies included (for a
    sequence model: texts → character ids → model → the last position's top-5)."""
    spec = deploy_spec(cfg)

    def run():
        batch = np.stack([spec.prepare(r, resolution) for r in raw])
        return top_k(spec.ranked_logits(target.infer_host(batch)), 5)  # what a served answer computes

    return run


def pe_step(model: Model, resolution, batch: int, device: torch.device) -> Callable[[], object]:
    """The positional step alone, over every block where it runs per block, on random activations
    (``DeploySpec.positional_step``)."""
    return deploy_spec(model).positional_step(model, resolution, batch, device)
