"""PyTorch eager runner: validate's reference (float64 by default) and profile's torch baseline."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from deploykit.catalog import OUTPUT_NAME
from deploykit.errors import DeployKitError
from deploykit.nn.factory import Model
from deploykit.nn.spec import block_paths
from deploykit.runners.base import Runner


class TorchRunner(Runner):
    """Runs a ``VisionTransformer`` or ``SequenceTransformer`` in eager mode.

    Args:
        model: the model (copied to ``dtype`` and ``device``; the caller's model is not modified).
        dtype: ``torch.float64`` for reference checks, ``torch.float32`` for timing.
        return_blocks: also return every block's output under its module path (``nn.spec.block_paths``:
            ``blocks.<i>``), for bisection.
        return_modules: also return these modules' outputs under their names (``named_modules``;
            a module called more than once: its last call), to compare with the nodes computing them.
        device: where the copy runs; inputs go there and outputs come back as host arrays, so
            timing ``infer`` includes the copies, as it does for every other runner.
        shape: bake the positional tables once for this input shape (``(height, width)`` or
            ``(length,)``), as an exported graph holds them, so timing leaves their construction
            out; inputs of another shape are refused. None: tables built for each call's shape.
    """

    name = "torch"

    def __init__(
        self,
        model: Model,
        dtype: torch.dtype = torch.float64,
        return_blocks: bool = False,
        return_modules: Sequence[str] = (),
        device: torch.device | str = "cpu",
        shape: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.model = model
        self.dtype = dtype
        self.return_blocks = return_blocks
        self.return_modules = tuple(return_modules)
        self.device = torch.device(device)
        self.shape = tuple(shape) if shape is not None else None
        self._model = None
        self._tables = None

    def _activate(self) -> None:
        self._model = copy.deepcopy(self.model).to(device=self.device, dtype=self.dtype).eval()
        if self.shape is not None:
            self._tables = self._tables_for(self.shape)

    def _tables_for(self, shape: tuple[int, ...]):
        # Built in float64 on the host, then cast (as export stores them).
        with torch.inference_mode():
            return self._model.shape_tables(shape).map(lambda t: t.to(device=self.device, dtype=self.dtype))

    def _infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = torch.from_numpy(np.ascontiguousarray(feed[self.model.input_name]))
        if x.is_floating_point():  # images; token ids stay integers
            x = x.to(self.dtype)
        x = x.to(self.device)
        with torch.inference_mode():
            shape = self._model.shape_of(x)
            if self.shape is not None and tuple(shape) != self.shape:
                raise DeployKitError(f"torch runner baked for input shape {self.shape}, got {tuple(shape)}")
            tables = self._tables if self.shape is not None else self._tables_for(shape)
            captured: dict[str, torch.Tensor] = {}
            modules = dict(self._model.named_modules())
            hooks = [modules[name].register_forward_hook(_capture(captured, name)) for name in self.return_modules if name in modules]
            try:
                states = self._model.hidden_states(x, tables)
                out = {OUTPUT_NAME: self._model.forward_head(self._model.norm(states[-1])).cpu().numpy()}
            finally:
                for hook in hooks:
                    hook.remove()
            out.update({name: t.cpu().numpy() for name, t in captured.items()})
            if self.return_blocks:
                out.update({path: f.cpu().numpy() for path, f in zip(block_paths(self._model), states[1:])})
        return out

    def input_names(self) -> list[str]:
        return [self.model.input_name]

    @property
    def provider(self) -> str:
        return f"torch {torch.__version__} {self.device.type} {str(self.dtype).removeprefix('torch.')}"

    def _deactivate(self) -> None:
        self._model = None
        self._tables = None


def _capture(captured: dict, name: str):
    """A forward hook keeping a module's tensor output under ``name`` (other outputs are not kept)."""

    def hook(module, args, output):
        if isinstance(output, torch.Tensor):
            captured[name] = output.detach()

    return hook
