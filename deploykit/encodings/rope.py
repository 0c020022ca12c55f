"""2-D rotary position embedding for ViTs: axial and mixed (Heo et al., ECCV 2024, "Rotary
Position Embedding for Vision Transformer", arXiv:2403.13298).

Real-valued throughout (no complex dtypes, which ONNX and TensorRT lack). Pairs are interleaved
as in the paper's ``view_as_complex`` code: dims ``(2j, 2j+1)`` rotate by angle ``a_j``; the
``halves`` form (timm's ``rotate_half`` convention) pairs ``j`` with ``r/2 + j`` instead, and is
what the exporter emits: the same function with q/k channels reordered (``contiguous_qk_form``).

* axial (paper Eq. 10): ``d/4`` frequencies ``θ^(-4j/d)``; the first ``d/4`` angles are
  ``x * f_j``, the last ``d/4`` are ``y * f_j``; shared by all heads and blocks.
* mixed (paper Eq. 11-12): learned ``f_x, f_y`` per block and head, angle ``x f_x + y f_y``;
  initialised as the paper's code does (magnitudes as axial, per-head random direction).

Coordinates are integer patch indices ``(x, y)``, prefix tokens get identity rotations by
concatenation. Tables ``cos``/``sin`` are ``[H or 1, P + N, d/2]`` per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from deploykit.encodings._registry import register_encoding
from deploykit.encodings.base import (
    EncodingConfig,
    Hook,
    PETables,
    PositionalEncoding,
    QKChannelOrder,
    TrunkDims,
    patch_coordinates,
    prefix_identity_rotation,
)

_MODES = ("axial", "mixed")
PAIRINGS = ("interleaved", "halves")


@dataclass(frozen=True)
class RopeConfig(EncodingConfig):
    """Options of 2-D RoPE.

    Attributes:
        mode: ``axial`` (fixed frequencies) or ``mixed`` (learned per block and head).
        theta: frequency base; the paper uses 100 for axial and 10 for mixed.
        pairs: which channels rotate together: ``interleaved`` ``(2j, 2j+1)`` as the paper's
            code, or ``halves`` ``(j, d/2 + j)`` as timm's ``rotate_half``.
    """

    mode: str = "axial"
    theta: float = 100.0
    pairs: str = "interleaved"

    def __post_init__(self):
        self.check_choices(mode=_MODES, pairs=PAIRINGS)


def rope_magnitudes(head_dim: int, theta: float) -> Tensor:
    """The ``d/4`` frequencies ``θ^(-4j/d)``, float64."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head dim divisible by 4, got {head_dim}")
    return 1.0 / theta ** (torch.arange(0, head_dim, 4, dtype=torch.float64)[: head_dim // 4] / head_dim)


def axial_angles(grid: tuple[int, int], head_dim: int, theta: float) -> Tensor:
    """Axial RoPE angles ``[N, d/2]``: ``[x f_0..x f_{d/4-1}, y f_0..y f_{d/4-1}]``."""
    ys, xs = patch_coordinates(grid)
    mag = rope_magnitudes(head_dim, theta)
    return torch.cat([xs[:, None] * mag, ys[:, None] * mag], dim=-1)


def mixed_angles(grid: tuple[int, int], freqs: Tensor) -> Tensor:
    """Mixed RoPE angles ``[L, H, N, d/2]`` from learned ``freqs`` ``[2, L, H, d/2]`` (x, y)."""
    ys, xs = patch_coordinates(grid, dtype=freqs.dtype)
    # angle[l, h, n, j] = x_n * fx[l, h, j] + y_n * fy[l, h, j]
    return xs[:, None] * freqs[0][:, :, None, :] + ys[:, None] * freqs[1][:, :, None, :]


def init_mixed_freqs(depth: int, num_heads: int, head_dim: int, theta: float, generator=None) -> Tensor:
    """The paper's initialisation: per head, axial magnitudes along a random direction φ and φ+π/2.

    Returns:
        ``[2, depth, num_heads, head_dim/2]`` float32: ``f_x`` then ``f_y``.
    """
    mag = rope_magnitudes(head_dim, theta)
    phi = torch.rand(depth, num_heads, 1, generator=generator, dtype=torch.float64) * 2 * math.pi
    fx = torch.cat([mag * torch.cos(phi), mag * torch.cos(phi + math.pi / 2)], dim=-1)
    fy = torch.cat([mag * torch.sin(phi), mag * torch.sin(phi + math.pi / 2)], dim=-1)
    return torch.stack([fx, fy]).float()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, pairs: str = "interleaved") -> Tensor:
    """Rotate the pairs of the first ``r = 2 * cos.shape[-1]`` dims of ``x``; the rest pass.

    Args:
        x: ``[..., T, d]``.
        cos, sin: broadcastable to ``[..., T, r/2]`` with ``r <= d``.
        pairs: ``interleaved``: pair ``j`` is dims ``(2j, 2j+1)``; ``halves``: ``(j, r/2 + j)``,
            contiguous slices (no strided copies in an exported graph). Same arithmetic either way.
    """
    half = cos.shape[-1]
    if pairs == "halves":
        x1, x2, x_pass = x.split([half, half, x.shape[-1] - 2 * half], dim=-1)
        rotated = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
    elif pairs == "interleaved":
        x_rot, x_pass = x[..., : 2 * half], x[..., 2 * half :]
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        # (x1 + i x2) * (cos + i sin), written out in reals and re-interleaved.
        rotated = [torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)]
    else:
        raise ValueError(f"pairs must be one of {PAIRINGS}, got {pairs!r}")
    parts = rotated + [x_pass] if x_pass.shape[-1] else rotated
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def halves_form(encoding: PositionalEncoding, rotated: int) -> QKChannelOrder | None:
    """``contiguous_qk_form`` of a rotary encoding with a ``pairs`` option whose first ``rotated``
    head dims rotate: channels reordered evens, then odds, then the unrotated tail, and the same
    encoding with ``pairs="halves"``; ``None`` when it already pairs halves."""
    if encoding.config.pairs == "halves":
        return None
    d = encoding.dims.head_dim
    order = torch.cat([torch.arange(0, rotated, 2), torch.arange(1, rotated, 2), torch.arange(rotated, d)])
    return QKChannelOrder(order=order, encoding=encoding.with_config(pairs="halves"))


@register_encoding("rope-axial", RopeConfig, variant={"mode": "axial"}, theta=100.0)
@register_encoding("rope-mixed", RopeConfig, variant={"mode": "mixed"}, theta=10.0)
class Rope2d(PositionalEncoding):
    """2-D RoPE applied to q and k in every block."""

    hook = Hook.QK

    def __init__(self, config: RopeConfig, dims: TrunkDims):
        super().__init__(config, dims)
        rope_magnitudes(dims.head_dim, config.theta)  # validates the head dim early
        if config.mode == "mixed":
            self.freqs = nn.Parameter(torch.zeros(2, dims.depth, dims.num_heads, dims.head_dim // 2))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.config.mode == "mixed":
            with torch.no_grad():
                self.freqs.copy_(init_mixed_freqs(self.dims.depth, self.dims.num_heads, self.dims.head_dim, self.config.theta))

    @property
    def tables_nest(self) -> bool:
        return True  # rotations by integer patch coordinates, whatever the grid

    def tables(self, grid: tuple[int, int]) -> PETables:
        if self.config.mode == "axial":
            angles = axial_angles(grid, self.dims.head_dim, self.config.theta)[None]  # [1, N, d/2]
            cos, sin = prefix_identity_rotation(self.dims.num_prefix_tokens, angles.cos(), angles.sin())
            return PETables(layers=[{"cos": cos, "sin": sin}] * self.dims.depth)
        angles = mixed_angles(grid, self.freqs.double())  # [L, H, N, d/2]
        cos, sin = prefix_identity_rotation(self.dims.num_prefix_tokens, angles.cos(), angles.sin())
        return PETables(layers=[{"cos": cos[i], "sin": sin[i]} for i in range(self.dims.depth)])

    def apply_qk(self, q: Tensor, k: Tensor, tables: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        cos, sin, pairs = tables["cos"], tables["sin"], self.config.pairs
        return apply_rotary(q, cos, sin, pairs), apply_rotary(k, cos, sin, pairs)

    def contiguous_qk_form(self) -> QKChannelOrder | None:
        return halves_form(self, self.dims.head_dim)
