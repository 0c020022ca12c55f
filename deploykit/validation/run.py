"""Validate exported artifacts against the PyTorch reference.

The reference is the saved model run in float64. For every backend × resolution the report
holds max/mean absolute error, max relative error, worst per-sample cosine similarity, top-1 and
top-5 agreement on the real inputs (images, or text for a sequence model), NaN/Inf counts and pass/fail against the precision
plan's criteria (``deploykit.checks``, the same judge as the export's and profile's), and which execution provider ran (ONNX Runtime drops CUDA silently). A backbone
without a classifier (``DeploySpec.answers_top_k`` false, e.g. an imported DINOv3) is compared on its
features by the same max abs and cosine; it has no top-k. When a check
fails, block outputs are compared one by one (recorded at export, so only those tensors are
marked as outputs: fusion elsewhere is untouched) to name the first transformer block that
diverges, in the backend that failed: ONNX Runtime with the same providers, or a debug engine
built from the marked graph with the failing engine's settings (``registry.create_bisect_runner``).
Within that block the output of each module is then compared with its float64 output
(``first_divergent_layer``): the record names the first divergent layer (the engine layer where
the runner has layers, its ONNX nodes, the module, the error there) and holds each measured node's
error, which ``--bundle`` writes for Model Explorer (``deploykit.validation.layer_map``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from deploykit._terminal import counter
from deploykit.backends import TorchRunner, registry
from deploykit.backends.defaults import RUNNER
from deploykit.backends.plugins import Plugins
from deploykit.catalog import OUTPUT_NAME
from deploykit.checks import Checked, Reference, Tolerance, bar_of, check_runner, first_divergent
from deploykit.errors import ConfigError, ValidationError
from deploykit.export.bundle import load_reference
from deploykit.export.directory import ExportDir
from deploykit.export.manifest import GraphEntry
from deploykit.export.metadata import GraphMetadata
from deploykit.export.precision import check_precision
from deploykit.export.qk_channels import with_contiguous_qk_channels
from deploykit.inputs.builtin import (
    VALIDATION_NOISE,
    VALIDATION_REAL,
    VALIDATION_SEED,
    VALIDATION_SPLIT,
    check_real_count,
    validation_inputs,
)
from deploykit.inputs.resolutions import resolution_tag
from deploykit.inputs.user import InputData
from deploykit.nn.factory import Model
from deploykit.nn.spec import block_paths, deploy_spec
from deploykit.runners.base import Runner, run_batched
from deploykit.validation.layer_map import DivergentLayer, NodeError, marked_graph, module_nodes, module_outputs, node_errors


@dataclass
class Record:
    """One backend at one resolution and batch size."""

    backend: str
    resolution: list[int]
    batch: int
    precision: str
    num_inputs: int
    num_real: int
    max_abs: float
    mean_abs: float
    max_rel: float
    cosine: float
    mean_cosine: float
    top1_agreement: float | None  # None for features (no classes to rank)
    top5_agreement: float | None
    nan_count: int
    inf_count: int
    tolerance: dict
    passed: bool
    failures: list[str] = field(default_factory=list)
    first_divergent_block: str | None = None
    first_divergent_layer: DivergentLayer | None = None  # within that block (``first_divergent_layer``)
    node_errors: list[NodeError] | None = None  # each module output node measured there, in graph order
    profiled: bool = False  # ``resolution`` × ``batch`` is one of an engine's profile shapes (min/opt/max)
    graph: str = ""  # the graph file checked
    range_graph: bool = False  # the graph covers a resolution range (checked at its min/opt/max)
    provider: str = ""  # what ran it: ONNX Runtime's execution provider, the TensorRT flavour and version
    inputs: dict | None = None  # --inputs: the real inputs' source, count and sha256 (None: bundled or the zoo's test split)
    quantization: dict | None = None  # a quantized plan's record (what stayed float and why), from the manifest
    node_placement: dict | None = None  # ort-cuda: nodes per execution provider, and compute nodes on the CPU
    precision_hint: str = ""  # the precision a runtime computes float ops in, where it takes a hint (OpenVINO: f32, bf16)
    kernels: str = ""  # ONNX Runtime on the CPU: what computed deploykit's custom ops (compiled kernel or function body)

    @classmethod
    def of(
        cls, checked: Checked, run: Run, reference: Reference, resolution: tuple[int, ...], batch: int, divergence: Divergence | None
    ) -> Record:
        """The record of one check (``checked``) of ``run``'s runner on ``reference`` at
        ``resolution`` × ``batch``; ``divergence``: where it diverged, when it failed."""
        tolerance = bar_of(checked.criteria, Tolerance)
        reported = {f.name for f in fields(cls)}  # the tolerance's metrics (another bar of the plan may measure more)
        return cls(
            backend=run.backend,
            resolution=list(resolution),
            batch=batch,
            precision=run.precision,
            num_inputs=len(reference.inputs),
            num_real=reference.num_real,
            **{name: value for name, value in checked.result.metrics.items() if name in reported},
            tolerance=tolerance.to_dict(),
            passed=checked.result.passed,
            failures=list(checked.result.failures),
            first_divergent_block=divergence.block if divergence else None,
            first_divergent_layer=divergence.layer if divergence else None,
            node_errors=divergence.errors if divergence and divergence.errors else None,
            profiled=run.profiled,
            graph=run.entry.file,
            range_graph=run.entry.resolution_range is not None,
            provider=run.provider,
            inputs=run.inputs,
            quantization=run.entry.quantization,
            node_placement=run.node_placement,
            precision_hint=run.precision_hint,
            kernels=run.kernels,
        )

    @property
    def label(self) -> str:
        """``ort@224``; ``trt@224/b8`` for one profile shape of an engine; ``… in model_224-512.onnx``
        for a resolution range's graph."""
        label = f"{self.backend}@{resolution_tag(tuple(self.resolution))}" + (f"/b{self.batch}" if self.profiled else "")
        return label + (f" in {self.graph}" if self.range_graph else "")


@dataclass
class ValidationReport:
    """All records; ``bool(report)`` is True when every check passed."""

    records: list[Record]

    def __bool__(self) -> bool:
        return bool(self.records) and all(r.passed for r in self.records)

    def to_json(self) -> list[dict]:
        return [asdict(r) for r in self.records]

    def raise_for_failure(self) -> None:
        failed = [r for r in self.records if not r.passed]
        if failed:
            parts = [f"{r.label}: {', '.join(r.failures)}" for r in failed]
            raise ValidationError(f"{len(failed)} of {len(self.records)} checks failed: {'; '.join(parts)}")


def first_divergent_block(
    onnx_path: Path,
    model: Model,
    inputs: np.ndarray,
    tolerance: Tolerance,
    batch_size: int = 4,
    backend: str = RUNNER,
    plugins: Plugins | None = None,
    num_real: int = 0,
) -> str | None:
    """Name the first ``blocks.<i>`` whose output diverges in ``backend``, or ``"head"`` if every
    block agrees there.

    The block outputs are marked as outputs of that backend's graph (ONNX Runtime) or engine (a
    debug engine built from the marked graph, same precision plan and profile), so a TensorRT or
    reduced-precision divergence is found where it happened, not re-run elsewhere. Block outputs
    are judged by ``checks.first_divergent`` (as the int8 plan check judges them). Returns
    None when the graph has no recorded block outputs or the backend cannot run a marked graph.
    """
    marked, names = marked_graph(onnx_path)
    runner = registry.create_bisect_runner(backend, onnx_path, marked, plugins=plugins) if names else None
    if runner is None:
        return None
    with runner:
        actual = run_batched(runner, inputs, batch_size)
    with TorchRunner(model, return_blocks=True) as reference_runner:
        reference = run_batched(reference_runner, inputs, batch_size)
    paths = block_paths(model)
    block = first_divergent([reference[path] for path in paths], [actual[n] for n in names], tolerance, num_real)
    return "head" if block is None else paths[block]


@dataclass(frozen=True)
class Divergence:
    """Where a failing check diverged: the first divergent block, the first divergent layer in it
    and the error at each module output node measured there."""

    block: str | None
    layer: DivergentLayer | None = None
    errors: list[NodeError] = field(default_factory=list)


def first_divergent_layer(
    onnx_path: Path,
    model: Model,
    inputs: np.ndarray,
    tolerance: Tolerance,
    block: str,
    batch_size: int = 4,
    backend: str = RUNNER,
    plugins: Plugins | None = None,
    num_real: int = 0,
) -> tuple[DivergentLayer | None, list[NodeError]]:
    """The first layer of ``block`` (``blocks.<i>``, or ``"head"``: what follows the last block)
    whose output diverges in ``backend``, and the error at each module output node of the block.

    Every module whose output node lies after the previous block's output and up to this block's
    (``layer_map.module_outputs``) has that output marked and compared with the module's float64
    output; the layer is the engine layer holding the first divergent node where the runner names
    its layers, else that node. ``(None, [])`` when the graph recorded no block outputs or the
    backend cannot run a marked graph."""
    import onnx

    from deploykit.runners.onnxrt import with_outputs

    proto = onnx.load(str(onnx_path))
    paths, tensors = block_paths(model), GraphMetadata.of(proto).block_outputs
    if len(tensors) != len(paths):
        return None, []
    produced = {tensor: i for i, node in enumerate(proto.graph.node) for tensor in node.output}
    at = {node.name: i for i, node in enumerate(proto.graph.node)}
    # the nodes after the previous block's output, up to this block's (the head: to the end)
    index = paths.index(block) if block in paths else len(paths)
    low = produced[tensors[index - 1]] if index > 0 else -1
    high = produced[tensors[index]] if index < len(paths) else len(at)
    outputs = module_outputs(proto, [name for name, _ in model.named_modules() if name])
    chosen = {m: o for m, o in outputs.items() if low < at[o.node] <= high and o.outputs}
    if not chosen:
        return None, []
    marked = with_outputs(proto, [o.outputs[0] for o in chosen.values()]).SerializeToString()
    runner = registry.create_bisect_runner(backend, onnx_path, marked, plugins=plugins)
    if runner is None:
        return None, []
    with runner:
        actual = run_batched(runner, inputs, batch_size)
        layers = runner.layer_names()
    # The graph's q/k rows may be reordered at export (``export.qk_channels``, the order recorded):
    # the reference is the model it was exported as, whose qkv outputs are in the graph's order.
    graph_model, order = with_contiguous_qk_channels(model)
    recorded = GraphMetadata.of(proto).qk_channel_order
    if (None if order is None else tuple(int(i) for i in order)) != (None if recorded is None else tuple(recorded)):
        graph_model = model  # a graph recording another order, or none: the trained layout
    with TorchRunner(graph_model, return_modules=list(chosen)) as reference_runner:
        reference = run_batched(reference_runner, inputs, batch_size)
    errors = node_errors(chosen, reference, actual, tolerance, num_real)
    return DivergentLayer.of(errors, layers, [n.name for n in proto.graph.node], module_nodes(proto, chosen)), errors


def validate(
    export_dir: str | os.PathLike,
    *,
    resolutions: Iterable[tuple[int, int]] | None = None,
    backends: Sequence[str] = (RUNNER,),
    precision: str = "fp32",
    num_random: int = VALIDATION_NOISE,
    num_real: int = VALIDATION_REAL,
    inputs: InputData | None = None,
    seed: int = VALIDATION_SEED,
    batch_size: int = 4,
    progress: Callable[[str], None] | None = None,
    plugins: Plugins | None = None,
    allow_cpu_fallback: bool = False,
    bundle: str | os.PathLike | None = None,
) -> ValidationReport:
    """Validate what ``deploykit export`` wrote to ``export_dir``.

    Args:
        export_dir: an export directory (``manifest.json``, reference weights, graphs).
        resolutions: which exported resolutions; default all.
        backends: graph or engine backends of the table (``deploykit.runners.table``).
        precision: which precision plan's graphs to check, held to that plan's criteria
            (``deploykit.export.precision.PLANS``).
        num_random, num_real: seeded-noise and real inputs per resolution (bundled images or
            text, the zoo's test split, or the first ``num_real`` of ``inputs``).
        inputs: the user's real inputs (``deploykit.inputs.read_inputs``), preprocessed as the
            model's config says, instead of the bundled ones.
        seed: seed of the noise inputs.
        batch_size: inputs per inference call.
        plugins: for engine backends, the plugins the engines were built with; None: the
            installed plugin packages each engine's fingerprint names.
        allow_cpu_fallback: ``ort-cuda`` accepts nodes ONNX Runtime runs on the CPU (records
            name them in ``node_placement``); refused by default.
        bundle: also write a replay bundle here (``deploykit.validation.bundle``): each graph, its
            inputs and the float64 reference in trtexec's, Polygraphy's and numpy's forms, with
            the command lines that replay the check without deploykit; written whether or not
            the check passed.

    Returns:
        The report (``bool(report)`` tells pass/fail).

    Raises:
        DeployKitError: not an export directory, unknown backend/precision, a graph changed
            since export, a resolution that was not exported, or more real inputs than exist.
    """
    export_dir = Path(export_dir)
    plan = check_precision(precision)
    _check_request(backends, num_random, num_real, inputs)
    if bundle is not None:
        from deploykit.validation.bundle import check_bundle_destination

        check_bundle_destination(bundle)  # before the work, not after it
    directory = ExportDir(export_dir)
    manifest = directory.manifest()
    # --precision picks the graphs (model_224_fp16.onnx, ...) as well as the criteria.
    entries = [manifest.graph(tuple(r), precision) for r in resolutions] if resolutions else manifest.graphs_at(precision, ranges=True)
    directory.check_reference(manifest)  # validate must judge what is served
    model = load_reference(export_dir)
    if inputs is not None:  # bad data is refused before any work, naming the file
        inputs.check(model, [shape for entry in entries for shape in entry.shapes])
    else:
        check_real_count(model, num_real, VALIDATION_SPLIT, "--num-real")  # before any run, not at the first resolution
    references = References(num_random, num_real, inputs, seed, batch_size, progress)
    used = None if inputs is None else inputs.record(range(num_real))
    records, divergent = [], []
    for entry in entries:
        path = directory.graph(entry, manifest.encoding)
        for backend in backends:
            if progress:
                progress(f"{backend} @ {path.name}")
            with registry.create_runner(backend, path, plugins=plugins, allow_cpu_fallback=allow_cpu_fallback) as runner:
                run = Run.of(runner, backend, precision, entry, used)
                # an engine at each of its profile shapes; any other runner at each resolution the graph covers
                checks = [
                    (r, b, check_runner(runner, references.at(model, r), plan, batch=b, exact=True))
                    for r, b in _checks(entry, runner, batch_size)
                ]
            for resolution, batch, checked in checks:
                divergence = None
                if not checked:
                    if progress:
                        progress(f"{backend} @ {path.name}: locating the first divergent block and layer")
                    tolerance = bar_of(checked.criteria, Tolerance)
                    images = references.at(model, resolution).inputs
                    block = first_divergent_block(path, model, images, tolerance, batch, backend, plugins, num_real)
                    divergence = Divergence(block)
                    if block is not None:
                        layer, errors = first_divergent_layer(path, model, images, tolerance, block, batch, backend, plugins, num_real)
                        divergence = Divergence(block, layer, errors)
                records.append(Record.of(checked, run, references.at(model, resolution), resolution, batch, divergence))
                if divergence is not None:
                    divergent.append((records[-1].label, path, divergence))
    report = ValidationReport(records)
    if bundle is not None:
        from deploykit.validation.bundle import Divergent, write_bundle

        graphs = [(directory.graph(e, manifest.encoding), tuple(r), references.at(model, r)) for e in entries for r in e.shapes]
        found = [Divergent(label, path, d.block, d.layer, tuple(d.errors)) for label, path, d in divergent]
        write_bundle(bundle, model, graphs, plan.tolerance, precision=precision, report=report.to_json(), divergent=found)
    return report


@dataclass(frozen=True)
class Run:
    """One backend running one graph: what every record of it says besides its check."""

    backend: str
    precision: str
    entry: GraphEntry
    inputs: dict | None  # --inputs: the real inputs' source, count and sha256
    profiled: bool
    provider: str
    node_placement: dict | None
    precision_hint: str
    kernels: str

    @classmethod
    def of(cls, runner: Runner, backend: str, precision: str, entry: GraphEntry, inputs: dict | None) -> Run:
        info = runner.info
        placement = info.placement.to_dict()["node_placement"] if info.placement else None
        hint = info.precision.hint if info.precision else ""
        return cls(backend, precision, entry, inputs, bool(runner.profiled_shapes), info.provider, placement, hint, info.kernels)


@dataclass
class References:
    """Validation inputs at each (model, resolution) and the PyTorch float64 outputs on them,
    computed once: the reference ``validate`` and ``profile``'s check before timing judge by.

    Attributes:
        num_random, num_real: seeded-noise and real inputs per resolution.
        inputs: the user's real inputs (``InputData``) instead of the bundled ones.
        seed: seed of the noise inputs.
        batch_size: inputs per PyTorch call.
        progress: optional callable taking a status line.
    """

    num_random: int
    num_real: int
    inputs: InputData | None = None
    seed: int = VALIDATION_SEED
    batch_size: int = 4
    progress: Callable[[str], None] | None = None
    _cache: dict[tuple, Reference] = field(default_factory=dict, init=False, repr=False)

    def at(self, model: Model, resolution: tuple[int, ...]) -> Reference:
        key = (id(model), tuple(resolution))
        if key not in self._cache:
            real = None if self.inputs is None else self.inputs.inputs(model, resolution, range(self.num_real))
            batch = validation_inputs(model, resolution, self.num_random, self.num_real, self.seed, real=real)
            tick = counter(self.progress, f"PyTorch reference at {resolution_tag(resolution)}", len(batch), "inputs")
            with TorchRunner(model) as runner:
                outputs = run_batched(runner, batch, self.batch_size, tick)[OUTPUT_NAME]
            self._cache[key] = Reference(batch, outputs, self.num_real, top_k=deploy_spec(model).answers_top_k)
        return self._cache[key]


def _check_request(backends: Sequence[str], num_random: int, num_real: int, inputs: InputData | None) -> None:
    """Refuse unknown backends and impossible input counts before any work."""
    for backend in backends:
        registry.check_backend(backend)
    _check_input_counts(num_random, num_real)
    if inputs is not None and num_real > len(inputs):  # refused, not silently fewer
        raise ConfigError(
            f"--num-real {num_real} asks for more real inputs than there are ({len(inputs)} in {inputs.path}); give at most {len(inputs)}"
        )


def _check_input_counts(num_random: int, num_real: int) -> None:
    if num_random < 0 or num_real < 0:
        raise ConfigError(f"input counts cannot be negative: --num-random {num_random}, --num-real {num_real}")
    if num_random + num_real == 0:
        raise ConfigError("nothing to compare: --num-random and --num-real are both 0; give at least one input")


def _checks(entry, runner: Runner, batch_size: int) -> list[tuple[tuple[int, ...], int]]:
    """``(resolution, batch)`` pairs to run one graph at. An engine: every shape of its
    optimization profile (min/opt/max), each call exactly that batch. Any other runner: every
    resolution the graph covers (one, or min/opt/max of a range) in ``batch_size`` calls."""
    if not runner.profiled_shapes:
        return [(shape, batch_size) for shape in entry.shapes]
    # [B, C, H, W] images → (H, W); [B, T] tokens → (T,), as the manifest writes resolutions.
    return [(tuple(shape[2:]) if len(shape) == 4 else tuple(shape[1:]), shape[0]) for shape in runner.profiled_shapes]
