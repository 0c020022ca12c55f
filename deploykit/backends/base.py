"""The one interface every backend implements (after Polygraphy's ``BaseRunner``).

``activate`` loads the model or engine, ``infer`` runs a feed dict of numpy arrays and returns
a dict of numpy arrays, ``deactivate`` frees it. The base class checks state and input names
once so runners only implement ``_activate``, ``_infer`` and ``_deactivate``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from deploykit.errors import DeployKitError


class Runner:
    """Base runner; use as a context manager: ``with OnnxrtRunner(path) as r: r.infer(feed)``."""

    name = "runner"
    # Whether one active runner may run ``infer`` from several threads at once. A runner that
    # owns per-call state (an execution context, device buffers, a stream) may not: callers
    # that share it across threads (``deploykit.serve.Pipeline``) serialise its calls with a lock.
    thread_safe = False
    # The precision plan a runner computes a graph's float ops in when it lowers them itself
    # (OpenVINO's bf16 hint): ``validate`` then judges by the looser of that plan's tolerance and
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
        return ["images"]

    @property
    def provider(self) -> str:
        """What executes the model (ONNX Runtime's execution provider, the TensorRT flavour and
        version, ...), for reports; meaningful once active."""
        return self.name

    @property
    def details(self) -> dict:
        """What reports record about how this runner ran: ``provider``; engine runners add
        whether CUDA graphs were replayed."""
        return {"provider": self.provider}

    @property
    def profiled_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The input shapes an engine was built for (its optimization profile's min/opt/max,
        duplicates dropped), which validation must each run; empty for runners that take any
        shape (PyTorch, ONNX Runtime)."""
        return ()

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
