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

Coordinates are integer patch indices ``(x, y)`` by default, prefix tokens get identity
rotations by concatenation. Tables ``cos``/``sin`` are ``[H or 1, P + N, d/2]`` per block.

timm's conventions map onto the options (``deploykit import timm`` records them in the config):

* naver RoPE-ViT (``vit_*_rope_*``, ``RotaryEmbeddingCat`` / ``RotaryEmbeddingMixed`` with
  ``grid_indexing="xy"``): the defaults above; ``_ape`` variants add a learned APE (``ape``)
  to the patches only (``no_embed_class``).
* DINOv3 (``RotaryEmbeddingDinoV3``): ``coords="centered"`` (patch centres ``(i + 0.5) / n``
  mapped to [-1, 1], each axis by its own size: ``normalize_coords="separate"``),
  ``axis_order="yx"`` (timm's ``grid_indexing="ij"``: the first d/4 angles follow the row),
  periods ``θ^(4j/d)`` read in turns (``angle_scale=2π``: angle ``2π c / period``) and
  ``pairs="halves"``. Its tables are normalised to the grid, so they do not nest.
* EVA-02 (``eva02_*``, ``RotaryEmbeddingCat`` with ``ref_feat_shape``): integer coordinates
  rescaled to the pre-training grid at every resolution (``ref_grid``: ``i · ref / n``, so the
  native 224 px grid of 16 keeps integer positions and 448 px spans the same 0..16),
  ``axis_order="yx"``, interleaved pairs, θ = 10000. Rescaled tables do not nest either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from deploykit.encodings._registry import register_encoding
from deploykit.encodings.ape import INTERPOLATIONS, ape_table, pos_embed_parameter
from deploykit.encodings.base import (
    EncodingConfig,
    Hook,
    PETables,
    PositionalEncoding,
    QKChannelOrder,
    TrunkDims,
    on_host,
    patch_coordinates,
    prefix_identity_rotation,
)

_MODES = ("axial", "mixed")
PAIRINGS = ("interleaved", "halves")
COORDINATES = ("index", "centered")
NORMALIZATIONS = ("separate", "min", "max")
AXIS_ORDERS = ("xy", "yx")


@dataclass(frozen=True)
class RopeConfig(EncodingConfig):
    """Options of 2-D RoPE.

    Attributes:
        mode: ``axial`` (fixed frequencies) or ``mixed`` (learned per block and head).
        theta: frequency base; the paper uses 100 for axial and 10 for mixed.
        pairs: which channels rotate together: ``interleaved`` ``(2j, 2j+1)`` as the paper's
            code, or ``halves`` ``(j, d/2 + j)`` as timm's ``rotate_half``.
        coords: ``index``: integer patch indices (the paper, timm's index grid); ``centered``:
            patch centres normalised to [-1, 1] (DINOv3, timm's centered grid).
        normalize_coords: for ``centered``, the size each axis is divided by: its own
            (``separate``), or the grid's ``min``/``max`` side (timm's option of that name).
        axis_order: which coordinate the first d/4 angles (axial) or ``freqs[0]`` (mixed)
            follow: ``xy`` the column (timm ``grid_indexing="xy"``), ``yx`` the row (``"ij"``).
        angle_scale: angles are ``angle_scale · coordinate · θ^(-4j/d)``; 1 for the paper and
            RoPE-ViT, 2π for DINOv3, whose periods ``θ^(4j/d)`` count turns.
        ref_grid: for ``index`` coordinates, the ``(rows, columns)`` patch grid positions are
            measured in at every resolution: patch ``i`` of ``n`` sits at ``i · ref / n`` (EVA-02,
            timm's ``ref_feat_shape``); ``None`` keeps integer indices. ``--set ref_grid=16x16``.
        ape: also a learned absolute embedding on the tokens (RoPE-ViT's ``_ape`` models).
        interpolation, antialias, no_embed_class: that APE's resize and layout, as
            ``deploykit.encodings.ape.ApeConfig``.
    """

    mode: str = "axial"
    theta: float = 100.0
    pairs: str = "interleaved"
    coords: str = "index"
    normalize_coords: str = "separate"
    axis_order: str = "xy"
    angle_scale: float = 1.0
    ref_grid: tuple[int, int] | None = None
    ape: bool = False
    interpolation: str = "bicubic"
    antialias: bool = True
    no_embed_class: bool = False

    def __post_init__(self):
        self.check_choices(
            mode=_MODES,
            pairs=PAIRINGS,
            coords=COORDINATES,
            normalize_coords=NORMALIZATIONS,
            axis_order=AXIS_ORDERS,
            interpolation=INTERPOLATIONS,
        )
        if not self.angle_scale > 0:
            raise ValueError(f"angle_scale must be positive, got {self.angle_scale!r}")
        if self.ref_grid is not None:
            # config.json gives a list; the frozen config keeps a tuple (hashable, equal to the original)
            object.__setattr__(self, "ref_grid", tuple(self.ref_grid))
            if len(self.ref_grid) != 2 or not all(type(n) is int and n > 0 for n in self.ref_grid):
                raise ValueError(f"ref_grid must be two positive integers (rows, columns), e.g. 16x16; got {self.ref_grid!r}")
            if self.coords != "index":
                raise ValueError(f"ref_grid rescales index coordinates; coords {self.coords!r} are already normalised to the grid")


def rope_magnitudes(head_dim: int, theta: float) -> Tensor:
    """The ``d/4`` frequencies ``θ^(-4j/d)``, float64."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head dim divisible by 4, got {head_dim}")
    return 1.0 / theta ** (torch.arange(0, head_dim, 4, dtype=torch.float64)[: head_dim // 4] / head_dim)


def rope_coordinates(grid: tuple[int, int], config: RopeConfig) -> tuple[Tensor, Tensor]:
    """The two coordinates ``(c0, c1)`` of every patch, each ``[gh * gw]`` float64, row-major,
    in the config's axis order and scaled by its ``angle_scale``.

    ``centered`` follows timm's ``_build_grid(grid_type="centered")``: ``(i + 0.5) / n``, then
    ``2 c - 1``; ``ref_grid`` its ``ref_feat_shape`` rescale of an index grid, ``i / n · ref``.
    """
    ys, xs = patch_coordinates(grid)
    if config.ref_grid is not None:
        ys, xs = ys / grid[0] * config.ref_grid[0], xs / grid[1] * config.ref_grid[1]
    if config.coords == "centered":
        sizes = {"separate": grid, "min": (min(grid),) * 2, "max": (max(grid),) * 2}[config.normalize_coords]
        ys, xs = 2 * (ys + 0.5) / sizes[0] - 1, 2 * (xs + 0.5) / sizes[1] - 1
    first, second = (xs, ys) if config.axis_order == "xy" else (ys, xs)
    return config.angle_scale * first, config.angle_scale * second


def axial_angles(grid: tuple[int, int], head_dim: int, theta: float, config: RopeConfig | None = None) -> Tensor:
    """Axial RoPE angles ``[N, d/2]``: ``[c0 f_0..c0 f_{d/4-1}, c1 f_0..c1 f_{d/4-1}]``; by default
    ``(c0, c1) = (x, y)`` integer patch indices."""
    c0, c1 = rope_coordinates(grid, config or RopeConfig(theta=theta))
    mag = rope_magnitudes(head_dim, theta)
    return torch.cat([c0[:, None] * mag, c1[:, None] * mag], dim=-1)


def mixed_angles(grid: tuple[int, int], freqs: Tensor, config: RopeConfig | None = None) -> Tensor:
    """Mixed RoPE angles ``[L, H, N, d/2]`` from learned ``freqs`` ``[2, L, H, d/2]`` (``c0``, ``c1``;
    by default x, y)."""
    c0, c1 = (c.to(freqs.dtype) for c in rope_coordinates(grid, config or RopeConfig(mode="mixed")))
    # angle[l, h, n, j] = c0_n * f0[l, h, j] + c1_n * f1[l, h, j]
    return c0[:, None] * freqs[0][:, :, None, :] + c1[:, None] * freqs[1][:, :, None, :]


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


class RotaryEncoding(PositionalEncoding):
    """Base of the qk-hook encodings that rotate channel pairs by per-block ``cos``/``sin`` tables
    and have a ``pairs`` option (2-D RoPE, GridPE): the rotation of q and k and its reordered
    ``halves`` form are the same for all of them, so they are written once here.

    Subclasses build the ``cos``/``sin`` tables and say how many leading head dims rotate.
    """

    hook = Hook.QK

    @property
    def rotated_dims(self) -> int:
        """Leading head dims that rotate (``2 * cos.shape[-1]``); the rest pass."""
        raise NotImplementedError

    def apply_qk(self, q: Tensor, k: Tensor, tables: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        cos, sin, pairs = tables["cos"], tables["sin"], self.config.pairs
        return apply_rotary(q, cos, sin, pairs), apply_rotary(k, cos, sin, pairs)

    def contiguous_qk_form(self) -> QKChannelOrder | None:
        return halves_form(self, self.rotated_dims)


@register_encoding("rope-axial", RopeConfig, variant={"mode": "axial"}, theta=100.0)
@register_encoding("rope-mixed", RopeConfig, variant={"mode": "mixed"}, theta=10.0)
class Rope2d(RotaryEncoding):
    """2-D RoPE applied to q and k in every block (with ``ape``, also a learned APE on the tokens).

    State dict: ``pos_enc.freqs`` ``[2, L, H, d/2]`` (mixed; timm's ``rope.freqs``) and, with
    ``ape``, timm's top-level ``pos_embed``.
    """

    top_level_keys = ("pos_embed",)

    def __init__(self, config: RopeConfig, dims: TrunkDims):
        super().__init__(config, dims)
        rope_magnitudes(dims.head_dim, config.theta)  # validates the head dim early
        if config.mode == "mixed":
            self.freqs = nn.Parameter(torch.zeros(2, dims.depth, dims.num_heads, dims.head_dim // 2))
        if config.ape:
            self.pos_embed = pos_embed_parameter(dims, config.no_embed_class)
        self.reset_parameters()

    def uses(self, hook: Hook) -> bool:
        return hook is Hook.QK or (hook is Hook.TOKENS and self.config.ape)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.config.mode == "mixed":
                self.freqs.copy_(init_mixed_freqs(self.dims.depth, self.dims.num_heads, self.dims.head_dim, self.config.theta))
            if self.config.ape:
                nn.init.trunc_normal_(self.pos_embed, std=0.02)

    @property
    def tables_nest(self) -> bool:
        # rotations by integer patch coordinates, whatever the grid; centred or rescaled ones and an APE are resized
        return self.config.coords == "index" and self.config.ref_grid is None and not self.config.ape

    def tables(self, grid: tuple[int, int]) -> PETables:
        model = {"pos_embed": ape_table(self.pos_embed, self.dims, grid, self.config)} if self.config.ape else {}
        if self.config.mode == "axial":
            angles = axial_angles(grid, self.dims.head_dim, self.config.theta, self.config)[None]  # [1, N, d/2]
            cos, sin = prefix_identity_rotation(self.dims.num_prefix_tokens, angles.cos(), angles.sin())
            return PETables(model=model, layers=[{"cos": cos, "sin": sin}] * self.dims.depth)
        angles = mixed_angles(grid, on_host(self.freqs), self.config)  # [L, H, N, d/2]
        cos, sin = prefix_identity_rotation(self.dims.num_prefix_tokens, angles.cos(), angles.sin())
        return PETables(model=model, layers=[{"cos": cos[i], "sin": sin[i]} for i in range(self.dims.depth)])

    def apply_tokens(self, x: Tensor, tables: dict[str, Tensor]) -> Tensor:
        return x + tables["pos_embed"]

    @property
    def rotated_dims(self) -> int:
        return self.dims.head_dim
