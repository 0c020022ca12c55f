"""PyTorch eager runner: the reference (float64 by default) and a baseline for profiling."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from deploykit.nn.factory import Model
from deploykit.runtime.base import Runner


class TorchRunner(Runner):
    """Runs a ``VisionTransformer`` or ``SequenceTransformer`` in eager mode.

    Args:
        model: the model (copied to ``dtype``; the caller's model is not modified).
        dtype: ``torch.float64`` for reference checks, ``torch.float32`` for timing.
        return_blocks: also return every block's output as ``blocks.<i>`` (for bisection).
    """

    name = "torch"

    def __init__(self, model: Model, dtype: torch.dtype = torch.float64, return_blocks: bool = False):
        super().__init__()
        self.model = model
        self.dtype = dtype
        self.return_blocks = return_blocks
        self._model = None

    def _activate(self) -> None:
        import copy

        self._model = copy.deepcopy(self.model).to(self.dtype).eval()

    def _infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = torch.from_numpy(np.ascontiguousarray(feed[self.model.input_name]))
        if x.is_floating_point():  # images; token ids stay integers
            x = x.to(self.dtype)
        with torch.inference_mode():
            tables = self._model.shape_tables(self._model.shape_of(x)).map(lambda t: t.to(self.dtype))
            features = self._model.forward_features(x, tables)
            out = {"logits": self._model.forward_head(features[-1]).numpy()}
            if self.return_blocks:
                out.update({f"blocks.{i}": f.numpy() for i, f in enumerate(features[1:])})
        return out

    def input_names(self) -> list[str]:
        return [self.model.input_name]

    @property
    def provider(self) -> str:
        return f"torch {torch.__version__} cpu {str(self.dtype).removeprefix('torch.')}"

    def _deactivate(self) -> None:
        self._model = None
