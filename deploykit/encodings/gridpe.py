"""GridPE: grid-cell-inspired rotary position embedding (Li, Wu, Huang, Zhang, "GridPE: A Grid
Cell-Inspired Unified Position Embedding for Arbitrary-Dimensional Spaces", arXiv:2406.07049v3).

q and k (never v) are rotated RoPE-style: complex channel ``p`` of a head is multiplied by
``exp(j φ_pᵀ x)`` (paper Eqs. 11-13, 25) for a token at position ``x ∈ ℝⁿ``. Each frequency vector
is ``φ_p = mag_s · ω̂_i``:

* directions ``ω̂_i``: the ``M = n + 1`` centroid-to-vertex vectors of a regular simplex
  (§4.2, App. B Eqs. 26-34; ``M = 1``, ``ω = 1`` for ``n = 1``, which is exactly 1-D RoPE),
  unit norm, turned by a random orthogonal matrix per (layer, head) (§5.4, App. D.3, Table 3);
* magnitudes ``mag_s = base^(-2 M s / D_h)``, ``s = 0..S-1`` (App. C Eqs. 38-39), with
  ``S = ⌊D_h / 2M⌋`` scales per head.

The directions live in the persistent buffer ``omegas`` ``[L, H, M, n]`` (state-dict key
``pos_enc.omegas``); tables are always computed from it, so a checkpoint's orientation is what
gets exported. Coordinates are raw integer patch indices ``(row, col)``; prefix tokens get identity
rows; head dims past ``2MS`` pass unrotated. Per block, ``cos``/``sin`` are ``[H, P + N, M·S]``,
rotating interleaved pairs ``(2p, 2p+1)`` with ``rope.apply_rotary``.
Paper ambiguities (spec ``gridpe.md`` §6, A1-A18) are resolved by ``GridPEConfig`` fields.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from deploykit.encodings._registry import register_encoding
from deploykit.encodings.base import (
    TAIL_POLICIES,
    EncodingConfig,
    PETables,
    TrunkDims,
    check_head_dim_tail,
    on_host,
    patch_coordinates,
    prefix_identity_rotation,
)
from deploykit.encodings.rope import PAIRINGS, RotaryEncoding

F64 = torch.float64
SPATIAL_DIM = 2  # images: positions are (row, col)
DEFAULT_BASE = 10000.0  # deploykit's choice: the authors' ViT code (spec A1); the paper states none

_ORIENTATIONS = ("random", "fixed")
_LAYOUTS = ("direction_major", "scale_major")
_COORDS = ("raw", "normalized")
_NORMS = ("unit", "simplex")

# The paper's ViT-S (spec §4.1, A7): embed 384 with 4 heads (head dim 96 = 16 scales × 3
# directions × 2), not timm's 6-head ViT-S. The authors' model also uses LayerScale (init 1e-4).
PAPER_MODEL = dict(embed_dim=384, depth=12, num_heads=4, patch_size=16, img_size=224)


@dataclass(frozen=True)
class GridPEConfig(EncodingConfig):
    """Options of GridPE; each resolves a paper ambiguity (spec §6).

    Attributes:
        base: frequency base, ``mag_s = base^(-2Ms/D_h)``. Required: the paper never states it
            (A1). The registry default 10000 is deploykit's choice, taken from the authors' ViT
            code; it exceeds the paper's bound ``base ≤ e^(D_h/2Mn)`` (App. C Eq. 39, A2), which
            ``optimal_base`` meets with equality.
        orientation: ``random`` (a random orthogonal turn of the simplex per layer and head, as
            the authors' code; A6) or ``fixed`` (the canonical Helmert orientation everywhere; A4).
        layout: complex-channel order, ``direction_major`` (``p = i·S + s``, authors' code,
            checkpoint compatible) or ``scale_major`` (``p = s·M + i``, paper Eq. 11/25) (A12).
        coords: ``raw`` integer patch indices (extrapolation, the paper's Table 1 setting) or
            ``normalized`` (scaled by native grid / grid, interpolation; not the paper's) (A11).
        direction_norm: ``unit`` (authors' code; n = 1 is then exactly RoPE) or ``simplex``
            (App. B's unnormalised length ``√(n/(n+1))``) (A5).
        indivisible_head_dim: ``pass`` leaves the ``D_h mod 2M`` last dims unrotated; ``error``
            requires ``2M | D_h`` as the authors' code does (A10).
        pairs: channels of complex channel ``p``: ``interleaved`` ``(2p, 2p+1)`` as the authors'
            code, or ``halves`` ``(p, R + p)`` for ``R`` rotated pairs (timm's ``rotate_half``).
    """

    base: float
    orientation: str = "random"
    layout: str = "direction_major"
    coords: str = "raw"
    direction_norm: str = "unit"
    indivisible_head_dim: str = "pass"
    pairs: str = "interleaved"

    def __post_init__(self):
        self.check_above(1.0, "base", why="scales must shrink")
        self.check_choices(
            orientation=_ORIENTATIONS,
            layout=_LAYOUTS,
            coords=_COORDS,
            direction_norm=_NORMS,
            indivisible_head_dim=TAIL_POLICIES,
            pairs=PAIRINGS,
        )


def num_directions(n: int) -> int:
    """Wave vectors per scale: ``M = n + 1`` for ``n ≥ 2``, ``1`` for ``n = 1`` (§4.2, A17)."""
    if n < 1:
        raise ValueError(f"spatial dimension must be >= 1, got {n}")
    return 1 if n == 1 else n + 1


def simplex_directions(n: int, norm: str = "unit") -> Tensor:
    """Canonical simplex wave vectors, float64 ``[M, n]`` (rows).

    App. B: ``ω_i = e_i - L/(n+1)`` in ``ℝ^(n+1)`` (Eq. 30), projected onto the hyperplane
    ``Σx = 0`` (Eqs. 31-34). The projection uses the Helmert basis instead of an SVD, whose
    basis is not unique (spec A4), so the orientation is library-independent.

    Args:
        n: spatial dimension.
        norm: ``unit`` rows, or ``simplex`` rows of App. B length ``√(n/(n+1))``.
    """
    if n == 1:
        rows = torch.ones(1, 1, dtype=F64)  # positive frequency only (Eq. 4 text, A17)
    else:
        centred = torch.eye(n + 1, dtype=F64) - 1.0 / (n + 1)  # [n+1, n+1], Ω^(n+1)
        k = torch.arange(1, n + 1, dtype=F64)[:, None]  # Helmert row k: (1,..,1, -k, 0,..)/√(k(k+1))
        j = torch.arange(n + 1, dtype=F64)[None, :]
        helmert = torch.where(j < k, 1.0, torch.where(j == k, -k, 0.0)) / (k * (k + 1)).sqrt()
        rows = centred @ helmert.T  # [n+1, n]
        rows = rows / rows.norm(dim=-1, keepdim=True)
    return rows * math.sqrt(n / (n + 1)) if norm == "simplex" else rows


def random_orthogonal(count: int, n: int) -> Tensor:
    """``count`` Haar-random orthogonal ``[n, n]`` matrices from torch's global RNG, float64.

    QR of a Gaussian matrix, as the authors' code, with the sign fix that makes it Haar. For
    ``n = 1`` the identity: only the positive frequency is kept (A17).
    """
    if n == 1:
        return torch.ones(count, 1, 1, dtype=F64)
    q, r = torch.linalg.qr(torch.randn(count, n, n, dtype=F64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]


def gridpe_magnitudes(head_dim: int, n: int, base: float) -> Tensor:
    """Scale magnitudes ``mag_s = base^(-2Ms/D_h)``, ``s < ⌊D_h/2M⌋``, float64 ``[S]``.

    App. C Eq. 38; for ``n = 1`` these are exactly 1-D RoPE's ``base^(-2s/D_h)``.
    """
    m = num_directions(n)
    scales = head_dim // (2 * m)
    if scales == 0:
        raise ValueError(f"GridPE with n={n} needs a head dim >= {2 * m}, got {head_dim}")
    # Written as RoPE's `1 / base ** (arange(0, d, 2) / d)` so that n = 1 matches it bit for bit.
    return 1.0 / base ** (torch.arange(scales, dtype=F64) * (2 * m) / head_dim)


def optimal_base(head_dim: int, n: int) -> float:
    """The base whose scale ratio is the paper's optimum ``e^(1/n)``: ``e^(D_h/2Mn)`` (App. C Eq. 39)."""
    return math.exp(head_dim / (2 * num_directions(n) * n))


def gridpe_frequencies(omegas: Tensor, magnitudes: Tensor, layout: str) -> Tensor:
    """Frequency vectors ``φ_p = mag_s ω_i``: ``omegas`` ``[..., M, n]``, ``[S]`` → ``[..., M·S, n]``."""
    freqs = magnitudes[:, None] * omegas[..., :, None, :]  # [..., M, S, n]
    if layout == "scale_major":
        freqs = freqs.transpose(-3, -2)  # [..., S, M, n]: p = s·M + i (paper Eq. 11/25)
    return freqs.flatten(-3, -2)  # direction-major: p = i·S + s (authors' code)


def gridpe_angles(positions: Tensor, freqs: Tensor) -> Tensor:
    """Phases ``θ_p(x) = φ_pᵀ x`` (paper Eq. 12): ``[T, n]`` × ``[..., R, n]`` → ``[..., T, R]``, float64."""
    positions, freqs = positions.to(F64), freqs.to(F64)
    # Summed over the n axes in a fixed order, so each entry is the same float ops whatever the
    # grid: a smaller grid's table is exactly a sub-grid of a larger one's.
    angles = positions[:, None, 0] * freqs[..., None, :, 0]
    for j in range(1, positions.shape[-1]):
        angles = angles + positions[:, None, j] * freqs[..., None, :, j]
    return angles


def build_gridpe_table(positions: Tensor, freqs: Tensor, num_prefix: int = 0) -> tuple[Tensor, Tensor]:
    """Rotation tables ``cos θ``, ``sin θ`` for interleaved pairs, float64.

    Args:
        positions: ``[T, n]`` token positions.
        freqs: ``[..., R, n]`` frequency vectors (``R = M·S`` rotated pairs).
        num_prefix: identity rows (cos 1, sin 0) prepended for prefix tokens (spec A13).

    Returns:
        ``cos``, ``sin`` each ``[..., num_prefix + T, R]``.
    """
    angles = gridpe_angles(positions, freqs)
    return prefix_identity_rotation(num_prefix, angles.cos(), angles.sin())


def grid_positions(grid: tuple[int, int], native: tuple[int, int], coords: str) -> Tensor:
    """Patch positions ``[gh·gw, 2]`` as ``(row, col)`` in row-major token order, float64.

    ``raw``: integer indices (authors' code). ``normalized``: scaled by ``native / grid`` per axis.
    """
    ys, xs = patch_coordinates(grid)
    if coords == "normalized":
        ys, xs = ys * (native[0] / grid[0]), xs * (native[1] / grid[1])
    return torch.stack([ys, xs], dim=-1)


@register_encoding("gridpe", GridPEConfig, base=DEFAULT_BASE)
class GridPE(RotaryEncoding):
    """GridPE applied to q and k in every block; no learnable parameters (spec §2.9).

    Buffers:
        omegas: ``[depth, heads, M, n]`` unit simplex directions per (layer, head), persistent
            (saved to and loaded from checkpoints; never regenerated when building tables).
    """

    def __init__(self, config: GridPEConfig, dims: TrunkDims):
        super().__init__(config, dims)
        n, m = SPATIAL_DIM, num_directions(SPATIAL_DIM)
        self.num_scales = gridpe_magnitudes(dims.head_dim, n, config.base).numel()
        tail = dims.head_dim - 2 * m * self.num_scales
        check_head_dim_tail(config.indivisible_head_dim, dims.head_dim, tail, f"2(n+1) = {2 * m}")
        self._warn_above_bound()
        self.register_buffer("omegas", torch.zeros(dims.depth, dims.num_heads, m, n, dtype=F64))
        self.reset_parameters()

    def _warn_above_bound(self) -> None:
        # App. C Eq. 39: the scale ratio base^(2M/D_h) should be <= e^(1/n); spec A2: warn, don't fail.
        m, n = num_directions(SPATIAL_DIM), SPATIAL_DIM
        ratio, bound = self.config.base ** (2 * m / self.dims.head_dim), math.exp(1 / n)
        if ratio > bound * (1 + 1e-12):
            warnings.warn(
                f"GridPE scale ratio {ratio:.4f} exceeds the paper's bound e^(1/n) = {bound:.4f} (App. C "
                f"Eq. 39); base <= {optimal_base(self.dims.head_dim, n):.1f} stays within it",
                stacklevel=2,
            )

    def reset_parameters(self) -> None:
        """Draw the (layer, head) orientations from torch's global RNG (``random``) or use the canonical one."""
        depth, heads, m, n = self.omegas.shape
        rows = simplex_directions(n, self.config.direction_norm)  # [M, n]
        if self.config.orientation == "random":
            turns = random_orthogonal(depth * heads, n).reshape(depth, heads, n, n)
            rows = rows @ turns.transpose(-1, -2)  # row i of head (l, h): Q_lh ω_i
        with torch.no_grad():
            self.omegas.copy_(rows.expand(depth, heads, m, n))

    def magnitudes(self) -> Tensor:
        """``[S]`` float64 scale magnitudes for this head dim and base."""
        return gridpe_magnitudes(self.dims.head_dim, SPATIAL_DIM, self.config.base)

    @property
    def tables_nest(self) -> bool:
        return self.config.coords == "raw"  # integer patch indices; "normalized" rescales per grid

    def tables(self, grid: tuple[int, int]) -> PETables:
        positions = grid_positions(grid, self.dims.grid, self.config.coords)  # [N, 2]
        freqs = gridpe_frequencies(on_host(self.omegas), self.magnitudes(), self.config.layout)  # [L, H, M·S, 2]
        cos, sin = build_gridpe_table(positions, freqs, self.dims.num_prefix_tokens)  # [L, H, P+N, M·S]
        return PETables(layers=[{"cos": cos[i], "sin": sin[i]} for i in range(self.dims.depth)])

    @property
    def rotated_dims(self) -> int:
        return 2 * num_directions(SPATIAL_DIM) * self.num_scales
