"""The one interface every runner implements (after Polygraphy's ``BaseRunner``), what a runner
reports about how it ran (``RunInfo``), and running inputs through one in batches.

``activate`` loads the model or engine, ``infer`` runs a feed dict of numpy arrays and returns
a dict of numpy arrays, ``deactivate`` frees it. The base class checks state and input names
once so runners only implement ``_activate``, ``_infer`` and ``_deactivate``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from deploykit.catalog import IMAGES_INPUT
from deploykit.errors import DeployKitError


@dataclass(frozen=True)
class CudaGraphUse:
    """Whether an engine runner replays CUDA graphs.

    Attributes:
        used: requested, and the engine allows it.
        note: why they are not used (``""`` when they are).
    """

    used: bool
    note: str

    def to_dict(self) -> dict:
        return {"cuda_graph": self.used, "cuda_graph_note": self.note}


@dataclass(frozen=True)
class Placement:
    """Where ONNX Runtime ran each node of a session.

    Attributes:
        providers: execution provider -> number of nodes it ran.
        cpu_compute: nodes on the CPU whose outputs are not all int64 (compute, not shape
            arithmetic), as ``name (OpType)``, in execution order.
    """

    providers: dict[str, int]
    cpu_compute: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        return {"providers": dict(self.providers), "cpu_compute": list(self.cpu_compute)}


@dataclass(frozen=True)
class NodePlacement:
    """Where a GPU runner of ONNX Runtime ran its nodes.

    Attributes:
        placement: None until the runner has run once (when it activates).
        note: which compute nodes ran on the CPU, where that was allowed (``""``: none).
    """

    placement: Placement | None
    note: str

    def to_dict(self) -> dict:
        return {"node_placement": None if self.placement is None else self.placement.to_dict(), "placement_note": self.note}


@dataclass(frozen=True)
class CpuPrecision:
    """What a runner that takes a precision hint (OpenVINO) computed float ops in, and on how
    many inference streams.

    Attributes:
        hint: the precision the hint resolved to (``f32``, ``bf16``).
        streams: its inference streams (``NUM_STREAMS``).
        computes_in: the plan it lowers a graph's float remainder to itself (None: as written).
        kept_fp32: nodes marked to stay in f32 under a bf16 hint.
        lowered_despite_mark: layer type -> compiled nodes running an encoding op below f32
            though marked (the run is not faithful).
        lowered_elsewhere: the same for the plan's other fp32 nodes (the logits).
        int8_weights: how int8 weights ran (``as exported``, or narrowed to 7 bits and why).
    """

    hint: str
    streams: int
    computes_in: str | None
    kept_fp32: int
    lowered_despite_mark: dict[str, int]
    lowered_elsewhere: dict[str, int]
    int8_weights: str

    def to_dict(self) -> dict:
        return {
            "precision_hint": self.hint,
            "streams": self.streams,
            "computes_in": self.computes_in,
            "kept_fp32": self.kept_fp32,
            "lowered_despite_mark": dict(self.lowered_despite_mark),
            "lowered_elsewhere": dict(self.lowered_elsewhere),
            "int8_weights": self.int8_weights,
        }


@dataclass(frozen=True)
class RunInfo:
    """What reports record about how a runner ran: what executed it, and the part that applies
    to its kind of runner (None elsewhere).

    Attributes:
        provider: what executes the model (ONNX Runtime's execution provider, the TensorRT
            flavour and version, ...).
        cuda_graphs: engine runners.
        placement: ONNX Runtime on the GPU.
        precision: runners that take a precision hint (OpenVINO).
        kernels: ONNX Runtime on the CPU: what computed deploykit's custom ops, for instance
            ``"deploykit::SaPE2Distance compiled"``, or the function body and why
            (``deploykit.kernels``); empty for a graph without them.
    """

    provider: str
    cuda_graphs: CudaGraphUse | None = None
    placement: NodePlacement | None = None
    precision: CpuPrecision | None = None
    kernels: str = ""

    def to_dict(self) -> dict:
        """``provider`` and each present part's keys, as validate and profile write them."""
        out = {"provider": self.provider} | ({"kernels": self.kernels} if self.kernels else {})
        for part in (self.cuda_graphs, self.placement, self.precision):
            if part is not None:
                out.update(part.to_dict())
        return out


class Runner:
    """Base runner; use as a context manager: ``with OnnxrtRunner(path) as r: r.infer(feed)``."""

    name = "runner"
    # Whether one active runner may run ``infer`` from several threads at once. A runner that
    # owns per-call state (an execution context, device buffers, a stream) may not: callers
    # that share it across threads (``deploykit.serve.Pipeline``) serialise its calls with a lock.
    thread_safe = False
    # The precision plan a runner computes a graph's float ops in when it lowers them itself
    # (OpenVINO's bf16 hint): ``checks.check_runner`` then judges by the looser of that plan's bars and
    # the graph's own. None: the graph's types are run as written.
    computes_in: str | None = None

    def __init__(self):
        self.is_active = False

    def activate(self) -> None:
        if self.is_active:
            raise DeployKitError(f"{self.name} runner is already active")
        self._activate()
        self.is_active = True

    def deactivate(self) -> None:
        if not self.is_active:
            raise DeployKitError(f"{self.name} runner is not active")
        self._deactivate()
        self.is_active = False

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch.

        Args:
            feed: input name → array (``images``: ``[B, C, H, W]`` float32, or ``tokens``:
                ``[B, T]`` int64 for sequence models).

        Returns:
            Output name → array.
        """
        if not self.is_active:
            raise DeployKitError(f"{self.name} runner must be activated before infer()")
        missing = sorted(set(self.input_names()) - set(feed))
        if missing:
            raise DeployKitError(f"{self.name} runner: missing input(s) {missing}; got {sorted(feed)}")
        return self._infer(feed)

    def input_names(self) -> list[str]:
        return [IMAGES_INPUT]

    @property
    def provider(self) -> str:
        """What executes the model (ONNX Runtime's execution provider, the TensorRT flavour and
        version, ...), for reports; meaningful once active."""
        return self.name

    @property
    def parallel_calls(self) -> int:
        """How many ``infer`` calls this runner runs at once when called from that many threads
        (its inference streams, ``deploykit.runners.streams``); 1 for most runners."""
        return 1

    @property
    def spreads_batches(self) -> bool:
        """Whether one call of several rows runs on all of ``parallel_calls`` at once
        (``deploykit.runners.streams.StreamScheduler``): a server then gives this runner one
        instance and its whole merged batches, rather than one instance per stream."""
        return False

    @property
    def info(self) -> RunInfo:
        """What reports record about how this runner ran (meaningful once active)."""
        return RunInfo(self.provider)

    @property
    def profiled_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The input shapes an engine was built for (its optimization profile's min/opt/max,
        duplicates dropped), which validation must each run; empty for runners that take any
        shape (PyTorch, ONNX Runtime)."""
        return ()

    def layer_names(self) -> list[str]:
        """The names of the layers an active runner executes (an engine's, as its inspector lists
        them), for mapping a divergence back to the graph; empty for runners without layers."""
        return []

    def __enter__(self):
        self.activate()
        return self

    def __exit__(self, *exc):
        self.deactivate()

    def _activate(self) -> None:
        raise NotImplementedError

    def _infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _deactivate(self) -> None:
        raise NotImplementedError


def run_batched(runner: Runner, inputs: np.ndarray, batch_size: int, done: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """Run ``inputs`` through an active runner (one input) in batches; concatenate each output
    (``done(rows)`` after each batch, e.g. a ``deploykit._terminal.counter``)."""
    (name,) = runner.input_names()
    parts = []
    for i in range(0, len(inputs), batch_size):
        parts.append(runner.infer({name: inputs[i : i + batch_size]}))
        if done:
            done(min(i + batch_size, len(inputs)))
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def run_exact_batches(runner: Runner, inputs: np.ndarray, batch: int) -> dict[str, np.ndarray]:
    """Like ``run_batched``, but every call gets exactly ``batch`` rows: the last call is filled up
    by cycling through ``inputs`` again, and the extra rows' outputs are dropped."""
    total = -(-len(inputs) // batch) * batch
    filled = inputs[np.arange(total) % len(inputs)]
    return {name: out[: len(inputs)] for name, out in run_batched(runner, filled, batch).items()}


def output_rows(outputs: np.ndarray) -> np.ndarray:
    """Outputs as checks compare them: ``[rows, last dim]`` float64 (a classifier's logits one row
    per input, a sequence model's or a backbone's every token a row)."""
    return outputs.astype(np.float64).reshape(-1, outputs.shape[-1])


def run_rows(
    runner: Runner, inputs: np.ndarray, batch: int = 32, outputs: Sequence[str] | None = None, done: Callable[[int], None] | None = None
) -> np.ndarray | list[np.ndarray]:
    """An active runner's first output on ``inputs`` as ``[rows, last dim]`` float64
    (``output_rows``: a classifier's logits one row per input, a sequence model's
    every position a row); with ``outputs``, those tensors as a list of ``[N, ...]`` float64
    arrays instead (``done(rows)`` after each batch)."""
    ran = run_batched(runner, inputs, batch, done)
    if outputs is not None:
        return [ran[name].astype(np.float64) for name in outputs]
    return output_rows(next(iter(ran.values())))
