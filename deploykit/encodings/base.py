"""What every positional encoding provides to the trunk.

An encoding declares one of three hooks (see ``Hook``) and builds its tables for a patch grid
on the host in float64. The trunk asks for the tables once per forward and hands each block its
share, so an exporter can bake the same tables as constants for a fixed resolution.

Table layouts used across encodings (``P`` prefix tokens, ``N = gh * gw`` patches, ``D`` embed
dim, ``H`` heads, ``d`` head dim):

* tokens hook: ``pos_embed`` ``[1, P + N, D]``, added to the token sequence.
* qk hook: ``cos``/``sin`` ``[H or 1, P + N, r/2]`` per block, rotating the first ``r`` dims of q, k.
* logits hook: whatever the encoding needs to form a ``[B, H, P + N, P + N]`` bias.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn


class Hook(str, enum.Enum):
    """Where in the trunk an encoding acts."""

    TOKENS = "tokens"  # added to the token sequence once, before the blocks
    QK = "qk"  # applied to queries and keys in every block
    LOGITS = "logits"  # added to the attention logits in every block


@dataclass(frozen=True)
class EncodingConfig:
    """Base for every encoding's frozen config (saved next to the weights)."""

    def check_choices(self, **choices: tuple) -> None:
        """Raise ``ValueError`` naming the valid values when a field is not one of its choices."""
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {valid}, got {getattr(self, name)!r}")

    def check_above(self, bound: float, *names: str, why: str = "") -> None:
        """Raise ``ValueError`` when a field is not a finite number greater than ``bound`` (frequency
        bases, scales): one check and one message for every encoding's numeric options."""
        for name in names:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > bound):
                reason = f" ({why})" if why else ""
                raise ValueError(f"{name} must be a finite number > {bound:g}{reason}, got {value!r}")


@dataclass(frozen=True)
class TrunkDims:
    """The trunk's sizes an encoding needs to build its parameters and tables."""

    embed_dim: int
    num_heads: int
    depth: int
    num_prefix_tokens: int
    grid: tuple[int, int]  # the patch grid the model is built (and trained) for

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


@dataclass
class PETables:
    """Tables for one patch grid: used once per forward (``model``) and per block (``layers``).

    Per-block dicts may share tensor objects; an exporter stores each distinct tensor once.
    """

    model: dict[str, Tensor] = field(default_factory=dict)
    layers: list[dict[str, Tensor]] = field(default_factory=list)

    def map(self, fn) -> PETables:
        """Apply ``fn`` to every tensor, keeping sharing between layers."""
        seen: dict[int, Tensor] = {}

        def once(t: Tensor) -> Tensor:
            if id(t) not in seen:
                seen[id(t)] = fn(t)
            return seen[id(t)]

        return PETables(
            model={k: once(v) for k, v in self.model.items()},
            layers=[{k: once(v) for k, v in layer.items()} for layer in self.layers],
        )


def on_host(param: Tensor) -> Tensor:
    """A learned parameter as the tables are built from it: float64 on the host, whatever device
    the model is on, so it meets the grids built there (differentiable: gradients reach the
    parameter where it lives)."""
    return param.to(device="cpu", dtype=torch.float64)


class KeepsFloat:
    """Marker for modules whose ops quantized (INT8) plans leave in float: positional encodings
    and content gates (MoPE's EGA), where an 8-bit step moves a position or a gate rather than
    rounding a value. The exporter records their scopes in the graph (``deploykit.float_modules``)."""


class PositionalEncoding(nn.Module, KeepsFloat):
    """Base class: subclasses set ``hook`` and implement ``tables`` plus that hook's method.

    Args:
        config: the encoding's frozen config.
        dims: the trunk sizes.
    """

    hook: ClassVar[Hook]
    # State-dict keys this encoding keeps at the model's top level (timm names), e.g. ``pos_embed``.
    top_level_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: EncodingConfig, dims: TrunkDims):
        super().__init__()
        self.config = config
        self.dims = dims

    def tables(self, grid: tuple[int, int]) -> PETables:
        """Build the tables for a ``(gh, gw)`` patch grid in float64 (differentiable in learned params)."""
        raise NotImplementedError

    def apply_tokens(self, x: Tensor, tables: dict[str, Tensor]) -> Tensor:
        """Tokens hook: ``x`` ``[B, P + N, D]`` → same shape."""
        raise NotImplementedError(f"{type(self).__name__} has no tokens hook")

    def apply_qk(self, q: Tensor, k: Tensor, tables: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """QK hook: ``q``, ``k`` ``[B, H, P + N, d]`` → same shapes."""
        raise NotImplementedError(f"{type(self).__name__} has no qk hook")

    def logits_bias(self, q: Tensor, k: Tensor, tables: dict[str, Tensor], grid: tuple[int, int]) -> Tensor:
        """Logits hook: bias ``[B or 1, H or 1, P + N, P + N]`` added to the scaled logits.

        ``grid`` is the ``(gh, gw)`` patch grid: a content-dependent bias cannot read it from a table.
        """
        raise NotImplementedError(f"{type(self).__name__} has no logits hook")

    @property
    def tables_nest(self) -> bool:
        """True when a smaller grid's tables are the top-left block of a larger grid's (rotations
        of integer patch coordinates): one graph then serves a range of resolutions by cropping
        the largest grid's tables in-graph (``crop_tables``). False for tables resized or
        normalised to the grid (learned APE, WePE, MoPE, centred coordinates), which must be
        baked per resolution."""
        return False

    def crop_tables(self, tables: PETables, full_grid: tuple[int, int], grid: tuple[int, int]) -> PETables:
        """Tables for ``grid`` cut from those built for the larger ``full_grid`` (only where
        ``tables_nest``). Every table has its tokens on dim -2, prefix tokens first, patches
        row-major; ``grid`` may be symbolic (traced shapes), so this is plain slicing."""
        if not self.tables_nest:
            raise NotImplementedError(f"{type(self).__name__} tables depend on the whole grid; they do not crop")
        prefix = self.dims.num_prefix_tokens

        def crop(table: Tensor) -> Tensor:
            lead, width = table.shape[:-2], table.shape[-1]
            patches = table[..., prefix:, :].reshape(*lead, full_grid[0], full_grid[1], width)
            patches = patches[..., : grid[0], : grid[1], :].reshape(*lead, grid[0] * grid[1], width)
            return torch.cat([table[..., :prefix, :], patches], dim=-2)

        return tables.map(crop)

    def contiguous_qk_form(self) -> QKChannelOrder | None:
        """This encoding for q/k head channels reordered so that the channels it mixes are
        contiguous slices, or ``None`` where they already are (or it has no qk hook).

        Interleaved rotary pairs and GeoPE's contiguous triplets read every other or every third
        channel: a strided slice or a ``Gather`` on the last axis, which ONNX Runtime copies one
        element at a time. The exporter reorders the q and k rows of each block's ``qkv``
        projection by ``order`` and applies the returned form instead (``deploykit.export.qk_channels``).
        """
        return None

    def with_config(self, **changes) -> PositionalEncoding:
        """A copy (parameters and buffers included) whose config has ``changes``."""
        clone = copy.deepcopy(self)
        clone.config = dataclasses.replace(self.config, **changes)
        return clone

    def uses(self, hook: Hook) -> bool:
        """Whether the trunk calls ``hook``'s method: ``self.hook``, unless an encoding adds the
        tokens hook to its own (SaPE² + APE)."""
        return hook is self.hook

    def reset_parameters(self) -> None:
        """Initialise learned parameters (called by the trunk's init)."""


@dataclass(frozen=True)
class QKChannelOrder:
    """An equivalent form of a qk-hook encoding for reordered head channels.

    Attributes:
        order: int64 ``[d]``; position ``i`` of the reordered head vector holds channel
            ``order[i]`` of the original. The same order for q and k leaves every q·k unchanged.
        encoding: the encoding to apply to q and k in that order; with it the model computes
            the same function (each q·k sums its channels in another order, so fp32 results
            differ by rounding only).
    """

    order: Tensor
    encoding: PositionalEncoding


def prefix_identity_rotation(num_prefix: int, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Prepend identity rotations (cos 1, sin 0) for prefix tokens along dim -2, by concatenation.

    Concatenation rather than slice writes keeps the exported graph free of ScatterND.
    """
    if num_prefix == 0:
        return cos, sin
    shape = (*cos.shape[:-2], num_prefix, cos.shape[-1])
    return (
        torch.cat([cos.new_ones(shape), cos], dim=-2),
        torch.cat([sin.new_zeros(shape), sin], dim=-2),
    )


# ``indivisible_head_dim`` of the encodings that rotate fixed-size groups of head dims (GeoPE's
# triplets, GridPE's 2(n+1) channels): ``pass`` leaves the remainder unrotated, ``error`` refuses it.
TAIL_POLICIES = ("pass", "error")


def check_head_dim_tail(policy: str, head_dim: int, tail: int, divisible_by: str) -> None:
    """Refuse a head dim that leaves ``tail`` dims unrotated when ``policy`` is ``error``;
    ``divisible_by`` is the group size as the message names it."""
    if tail and policy == "error":
        raise ValueError(
            f"head dim {head_dim} is not divisible by {divisible_by}; use indivisible_head_dim='pass' to leave the last {tail} dims unrotated"
        )


def patch_coordinates(grid: tuple[int, int], dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Integer patch coordinates ``(y, x)``, each ``[gh * gw]``, in row-major token order."""
    gh, gw = grid
    ys = torch.arange(gh, dtype=dtype)[:, None].expand(gh, gw).reshape(-1)
    xs = torch.arange(gw, dtype=dtype)[None, :].expand(gh, gw).reshape(-1)
    return ys, xs
