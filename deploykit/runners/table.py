"""The table of backends: one descriptor per name ``--backend`` takes, and one record per TensorRT
flavour holding every fact that differs between TensorRT and TensorRT-RTX.

Everything else is derived from here: the registry's lookups and availability checks
(``deploykit.backends.registry``), ``auto``'s order and the GPU backends a server prefers
(``deploykit.serve.pipeline``), the engine backends ``deploykit build`` takes, the runner every
machine has (validate's default and profile's ratio baseline) and PyTorch eager as the reference
that runs the model itself. A test fails where a backend name is compared outside this table
(``tests/runners/test_table.py``).

Imports nothing but the errors (the CLI reads it at start-up, before onnxruntime or TensorRT; the
export directory, below the runners, names engine files by its flavours' tags): a descriptor names
its runner factory and its availability check as ``"module:attribute"``, imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deploykit.errors import unknown_choice

# What a backend runs: the PyTorch model itself, an exported ONNX graph, or the engine
# ``deploykit build`` wrote beside a graph.
MODEL, GRAPH, ENGINE = "model", "graph", "engine"
# Where it runs: the CPU, a CUDA GPU, or wherever the caller puts it (PyTorch eager: profile's --device).
CPU, GPU, ANY = "cpu", "gpu", "any"


@dataclass(frozen=True)
class Flavour:
    """One TensorRT flavour.

    Attributes:
        module: its Python module, also its key in build options and engine fingerprints.
        tag: its backend name, the tag in engine file names (``model_224.trt.engine``) and its pip
            extra (``deploykit[trt]``, ``deploykit[trt-cu12]``).
        title: its name in messages.
        min_compute: the oldest compute capability it runs on, where it runs on every newer one.
        compute: the compute capabilities it runs on, where it runs on those only.
        instead: the backend a refused GPU is pointed to.
        portable: engines are built ahead of time for recorded compute capabilities (on a CPU too)
            and compiled for the GPU when loaded: the fingerprint holds nothing of the build
            machine's device, the runtime judges an engine from its header, and the kernels it
            compiles are kept in a runtime cache beside the engine.
        portable_targets: what a portable engine is built for unless asked otherwise.
        default_targets: what the runtime builds for when no target is set (an engine whose
            fingerprint records none).
        timing_cache: builds keep a timing cache in the export directory.
        python_plugins: it loads Python (quickly deployable) plugins.
        captures_cuda_graphs: the runtime captures CUDA graphs itself when its context is created
            for it (else deploykit's executor captures them, in torch's buffers).
        polygraphy_rtx: the value of Polygraphy's ``config.USE_TENSORRT_RTX`` that drives it.
    """

    module: str
    tag: str
    title: str
    instead: str
    min_compute: tuple[int, int] | None = None
    compute: frozenset[tuple[int, int]] = frozenset()
    portable: bool = False
    portable_targets: tuple[str, ...] = ()
    default_targets: tuple[str, ...] = ()
    timing_cache: bool = False
    python_plugins: bool = False
    captures_cuda_graphs: bool = False
    polygraphy_rtx: bool = False

    def supports(self, compute_capability: str) -> bool:
        """Whether it runs on a GPU of ``compute_capability`` (``"8.9"``)."""
        cc = tuple(int(p) for p in compute_capability.split("."))
        return cc >= self.min_compute if self.min_compute is not None else cc in self.compute

    def supported_text(self) -> str:
        if self.min_compute is not None:
            return f"compute capability {'.'.join(map(str, self.min_compute))} and newer"
        return "compute capabilities " + ", ".join(".".join(map(str, cc)) for cc in sorted(self.compute))


# Support from NVIDIA's support matrices (``deploykit.backends.devices`` says which GPUs that is).
TENSORRT = Flavour(
    module="tensorrt",
    tag="trt",
    title="TensorRT",
    instead="ort-cuda",
    min_compute=(7, 5),
    timing_cache=True,
    python_plugins=True,
)
TENSORRT_RTX = Flavour(
    module="tensorrt_rtx",
    tag="rtx",
    title="TensorRT-RTX",
    instead="trt",
    # TensorRT-RTX support matrix 1.0-1.5: 7.5, 8.6, 8.9, 12.0; 12.1 (GB10) from 1.5.
    compute=frozenset({(7, 5), (8, 6), (8, 9), (12, 0), (12, 1)}),
    portable=True,
    # Every supported GPU but Turing, which NVIDIA advises device-specific engines for.
    portable_targets=("8.6", "8.9", "12.0", "12.1"),
    default_targets=("8.0", "8.6", "8.9", "12.0", "12.1"),
    captures_cuda_graphs=True,
    polygraphy_rtx=True,
)
FLAVOURS = (TENSORRT, TENSORRT_RTX)


@dataclass(frozen=True)
class Backend:
    """One backend.

    Attributes:
        name: what ``--backend`` takes.
        runs: ``MODEL``, ``GRAPH`` or ``ENGINE``.
        device: ``CPU``, ``GPU`` or ``ANY``.
        runner: what creates its runner (a callable, or ``"module:attribute"``): for a graph or
            engine backend ``factory(backend, onnx_path, RunnerOptions)`` (``backend``: this
            descriptor); for the model backend the runner class, given the model.
        bisect: ``factory(backend, onnx_path, marked graph bytes, RunnerOptions)``: the same
            backend on the graph with its block outputs marked (``validate``'s bisection); None: none.
        unavailable: ``check(backend) -> str | None``: why it cannot run here, None when it can;
            None: it runs wherever deploykit's base install does.
        flavour: the TensorRT flavour of an engine backend.
        auto_rank: its place in ``auto``'s order (lowest first); None: ``auto`` never takes it.
        everywhere: the runner every machine has: ``validate``'s default and the baseline
            ``profile``'s ratios are taken against.
        streams: its runner runs several calls at once on inference streams when asked
            (``deploykit.runners.streams``), which ``profile`` measures and ``serve`` takes.
    """

    name: str
    runs: str
    device: str
    runner: Callable[..., Any] | str
    bisect: Callable[..., Any] | str | None = None
    unavailable: Callable[[Backend], str | None] | str | None = None
    flavour: Flavour | None = None
    auto_rank: int | None = None
    everywhere: bool = False
    streams: bool = False

    def why_unavailable(self) -> str | None:
        """Why this backend cannot run here (a missing package, no GPU, a GPU it does not
        support), or None when it can."""
        return None if self.unavailable is None else resolve(self.unavailable)(self)


_REGISTRY = "deploykit.backends.registry"  # the factories and availability checks, imported on first use


def _runs_graphs(name: str, device: str, factories: str, unavailable: str | None = None, **fields) -> Backend:
    """A graph backend whose factories are the registry's ``<factories>_runner`` and ``<factories>_bisect_runner``."""
    return Backend(
        name,
        runs=GRAPH,
        device=device,
        runner=f"{_REGISTRY}:{factories}_runner",
        bisect=f"{_REGISTRY}:{factories}_bisect_runner",
        unavailable=None if unavailable is None else f"{_REGISTRY}:{unavailable}",
        **fields,
    )


def _runs_engines(flavour: Flavour, auto_rank: int) -> Backend:
    return Backend(
        flavour.tag,
        runs=ENGINE,
        device=GPU,
        runner=f"{_REGISTRY}:engine_runner",
        bisect=f"{_REGISTRY}:engine_bisect_runner",
        unavailable=f"{_REGISTRY}:engine_unusable",
        flavour=flavour,
        auto_rank=auto_rank,
    )


BACKENDS: tuple[Backend, ...] = (
    Backend("torch", runs=MODEL, device=ANY, runner="deploykit.backends.torch_runner:TorchRunner"),
    _runs_graphs("ort", CPU, "onnxrt", auto_rank=2, everywhere=True, streams=True),
    _runs_graphs("ort-cuda", GPU, "onnxrt_cuda", unavailable="no_cuda_provider"),
    _runs_graphs("openvino", CPU, "openvino", unavailable="no_openvino", streams=True),
    _runs_graphs("openvino-bf16", CPU, "openvino_bf16", unavailable="no_bf16", streams=True),
    # auto: TensorRT, then TensorRT-RTX, then ONNX Runtime on the CPU
    _runs_engines(TENSORRT, auto_rank=0),
    _runs_engines(TENSORRT_RTX, auto_rank=1),
)


def resolve(ref: Callable[..., Any] | str) -> Callable[..., Any]:
    """A descriptor's callable: itself, or the attribute ``"module:attribute"`` names (imported now)."""
    if callable(ref):
        return ref
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def backends(runs: tuple[str, ...] = (MODEL, GRAPH, ENGINE)) -> list[Backend]:
    """The table's backends that run one of ``runs``, in table order."""
    return [b for b in BACKENDS if b.runs in runs]


def names(runs: tuple[str, ...] = (MODEL, GRAPH, ENGINE)) -> list[str]:
    """Their names, as ``--backend`` lists them."""
    return [b.name for b in backends(runs)]


def find(name: str) -> Backend | None:
    """The descriptor called ``name``, or None."""
    return next((b for b in BACKENDS if b.name == name), None)


def auto_order() -> list[str]:
    """What ``auto`` tries, first to last."""
    return [b.name for b in sorted((b for b in BACKENDS if b.auto_rank is not None), key=lambda b: b.auto_rank)]


def stream_names() -> list[str]:
    """The backends whose runners take inference streams."""
    return [b.name for b in BACKENDS if b.streams]


def gpu_names() -> list[str]:
    """The backends that run on a CUDA GPU."""
    return [b.name for b in BACKENDS if b.device == GPU]


def flavour(module: str) -> Flavour:
    """The TensorRT flavour whose module is ``module``.

    Raises:
        ValueError: no flavour has that module, listing the valid ones.
    """
    found = next((f for f in FLAVOURS if f.module == module), None)
    if found is None:
        raise ValueError(unknown_choice("TensorRT module", module, [f.module for f in FLAVOURS]))
    return found


def engine_flavours() -> dict[str, Flavour]:
    """Engine backend name → its flavour."""
    return {b.name: b.flavour for b in BACKENDS if b.flavour is not None}


# The backend every machine has (ONNX Runtime on the CPU), and the one that runs the model itself
# (PyTorch eager: validate's reference, profile's first lane).
BASELINE = next(b.name for b in BACKENDS if b.everywhere)
REFERENCE = next(b.name for b in BACKENDS if b.runs == MODEL)
