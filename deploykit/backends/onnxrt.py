"""ONNX Runtime runner (CPU; CUDA when onnxruntime-gpu is installed and sees a GPU)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from deploykit.backends.base import Runner
from deploykit.errors import DeployKitError


def default_providers() -> list[str]:
    """CUDA first when this onnxruntime build has it, then CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def session_options(intra_op_threads: int = 0):
    """Session options tuned for ViTs: sequential execution (parallel mode is ~2x slower for a
    chain of GEMMs on small machines), full graph optimisation."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = intra_op_threads
    opts.log_severity_level = 3  # errors only: keep the terminal for our report
    return opts


class OnnxrtRunner(Runner):
    """Runs an ONNX model (path or serialized bytes) with ONNX Runtime.

    Args:
        model: path to a ``.onnx`` file, or its bytes.
        providers: execution providers in priority order; default ``default_providers()``.
        intra_op_threads: 0 lets ONNX Runtime choose (one per physical core).
    """

    name = "ort"
    # ONNX Runtime guarantees InferenceSession::Run() is thread-safe (microsoft/onnxruntime#19301);
    # callers need no lock (benchmarks/ort_lock.py measures what one would cost).
    thread_safe = True

    def __init__(self, model: str | os.PathLike | bytes, providers: Sequence[str] | None = None, intra_op_threads: int = 0):
        super().__init__()
        self.model = model
        self.providers = list(providers) if providers else None
        self.intra_op_threads = intra_op_threads
        self._session = None

    def _activate(self) -> None:
        import onnxruntime as ort

        source = self.model if isinstance(self.model, bytes) else str(self.model)
        try:
            self._session = ort.InferenceSession(
                source, sess_options=session_options(self.intra_op_threads), providers=self.providers or default_providers()
            )
        except Exception as err:  # ORT raises its own Fail/InvalidGraph/NoSuchFile types
            raise DeployKitError(f"onnxruntime cannot load {self._label()}: {str(err).splitlines()[0]}") from err

    def _label(self) -> str:
        return "model bytes" if isinstance(self.model, bytes) else str(self.model)

    def input_names(self) -> list[str]:
        return [i.name for i in self._session.get_inputs()] if self._session else super().input_names()

    @property
    def provider(self) -> str:
        """The execution provider ONNX Runtime put first for this session (it drops CUDA
        silently when no GPU is usable: reports say which one ran)."""
        return self._session.get_providers()[0] if self._session else "not active"

    def output_names(self) -> list[str]:
        return [o.name for o in self._session.get_outputs()]

    def _infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self.output_names()
        outputs = self._session.run(names, {k: np.ascontiguousarray(v) for k, v in feed.items()})
        return dict(zip(names, outputs))

    def _deactivate(self) -> None:
        self._session = None


class OnnxrtCudaRunner(OnnxrtRunner):
    """ONNX Runtime on the GPU only (``onnxruntime-gpu``): refuses to fall back to the CPU silently."""

    name = "ort-cuda"

    def __init__(self, model: str | os.PathLike | bytes, intra_op_threads: int = 0):
        super().__init__(model, providers=["CUDAExecutionProvider"], intra_op_threads=intra_op_threads)

    def _activate(self) -> None:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise DeployKitError("ort-cuda needs onnxruntime-gpu (this onnxruntime has no CUDA provider); pip install 'deploykit[gpu]'")
        super()._activate()
        if self._session.get_providers()[0] != "CUDAExecutionProvider":  # ORT drops CUDA when no GPU is usable
            self._session = None
            raise DeployKitError("ort-cuda: onnxruntime could not use the CUDA provider (no GPU, or a CUDA/cuDNN mismatch)")
