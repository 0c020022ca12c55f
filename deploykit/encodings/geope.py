"""GeoPE: geometric positional embedding by quaternion rotations of 3-D sub-vectors ("GeoPE: A
Unified Geometric Positional Embedding for Structured Tensors", anonymous review copy; arXiv
2512.04963). Implementation digest: ``shared/spec/geope.md``.

Each head vector of q and k (never v) is split into ``G = ⌊d/3⌋`` triplets (paper §3.1, Eq. 1).
Triplet ``g`` of the token at patch ``(p_h, p_w)`` is rotated by the rotation of the Lie-algebra
geometric mean of a height rotation about **j** and a width rotation about **k** (§3.2, Eq. 3),
in the closed form of Eq. 4 / App. C Eq. 35:

    θ_h = p_h ω_g,  θ_w = p_w ω_g,  ρ = sqrt(θ_h² + θ_w²),  Θ = ρ / 2,  n = (0, θ_h, θ_w) / ρ
    R_g = cos Θ · I + sin Θ · [n]× + (1 - cos Θ) · n nᵀ          (the paper's R_i, §3.2)

i.e. angle Θ about axis n, rotation vector ``(0, θ_h/2, θ_w/2)``. Quaternion logs are never taken
numerically: the principal log is wrong once a phase passes π (spec §1.5, A12). ``R = I`` at
ρ = 0 (spec §1.7). The attention logit is ``⟨R_m q, R_n k⟩ = ⟨q, R_mᵀ R_n k⟩`` (Eq. 8).

Applied form (spec §7.3 B): ``x' = C0 ⊙ x + C1 ⊙ x[..., idx1] + C2 ⊙ x[..., idx2]`` where, for
dim ``j`` holding component ``a`` of triplet ``g``, ``idx1[j]`` / ``idx2[j]`` hold components
``(a+1) mod 3`` / ``(a+2) mod 3`` of the same triplet and ``C0, C1, C2 = R_g[a, a], R_g[a, a+1],
R_g[a, a+2]``. Only Mul, Add and constant-index Gather: no Einsum over 3-wide dims, no slice
writes, no complex dtypes. In the ``blocked`` grouping the partners of each third of the head
vector are the other two thirds, so ``apply_geope_blocked`` reads them as slices (with the
tables cut into the same thirds) instead of gathering channel by channel; the exporter
reorders q/k channels into that grouping (``contiguous_qk_form``). Tables ``c0``, ``c1``, ``c2`` are ``[P + N, d]`` (prefix rows first,
then patches row-major), identical for every block and head; prefix rows and the ``d - 3G``
passthrough dims are the identity (``C0 = 1``, ``C1 = C2 = 0``, ``idx = j``).

Paper ambiguities are resolved by ``GeoPEConfig`` fields (spec §6); LinGeoPE (§3.4) and the 3-D
operator (§3.3) are not implemented.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from deploykit.encodings._registry import register_encoding
from deploykit.encodings.base import (
    TAIL_POLICIES,
    EncodingConfig,
    Hook,
    PETables,
    PositionalEncoding,
    QKChannelOrder,
    TrunkDims,
    check_head_dim_tail,
    patch_coordinates,
)

F64 = torch.float64

_SCHEDULES = ("rope_neg", "paper_literal")
_GROUPINGS = ("contiguous", "blocked")
_COORDS = ("corner0", "center")
_PREFIX = ("identity",)

# The paper's ViT settings (spec §3): DeiT-III ViT-S/B at patch 16, trained at 224 (Table 1,
# Figs. 4-6), and the CIFAR variants at 32 px with patch 4 (Table 5, App. K). Head dim 64 gives 21
# triplets + 1 passthrough dim. DeiT-III also uses LayerScale, which deploykit's trunk lacks.
PAPER_MODELS: dict[str, dict] = {
    "vit_small": dict(embed_dim=384, depth=12, num_heads=6, patch_size=16, img_size=224),
    "vit_base": dict(embed_dim=768, depth=12, num_heads=12, patch_size=16, img_size=224),
    "vit_small_cifar": dict(embed_dim=384, depth=12, num_heads=6, patch_size=4, img_size=32),
    "vit_base_cifar": dict(embed_dim=768, depth=12, num_heads=12, patch_size=4, img_size=32),
}


@dataclass(frozen=True)
class GeoPEConfig(EncodingConfig):
    """Options of GeoPE; each records how a paper ambiguity was resolved (spec §6).

    Attributes:
        base: frequency base λ; the paper sets 100 "as usual (Heo et al., 2024)" (§3.1).
        freq_schedule: ``rope_neg``: ``ω_g = λ^(-2g/d)``, ``g = 0..G-1`` (RoPE convention, first
            group ω = 1; spec A1/A2 recommendation), or ``paper_literal``: ``ω_g = λ^(+2g/d)``,
            ``g = 1..G`` as printed in §3.1 (all frequencies ≥ 1 rad/patch, aliasing).
        grouping: which dims form triplet ``g``: ``contiguous`` ``(3g, 3g+1, 3g+2)`` or ``blocked``
            ``(g, G+g, 2G+g)`` (A3).
        coords: ``corner0`` integer patch indices from the top-left, extended (not rescaled) at
            other resolutions, or ``center`` (indices minus the grid centre); GeoPE is not
            translation invariant, so this changes outputs (A5).
        pos_scale: factor on the coordinates (A5); 1 keeps integer indices.
        prefix_rotation: rotation of class/prefix tokens; ``identity`` as RoPE-ViT (A6).
        indivisible_head_dim: ``pass`` leaves the last ``d mod 3`` dims unrotated; ``error``
            requires ``3 | d`` (A4).
    """

    base: float = 100.0
    freq_schedule: str = "rope_neg"
    grouping: str = "contiguous"
    coords: str = "corner0"
    pos_scale: float = 1.0
    prefix_rotation: str = "identity"
    indivisible_head_dim: str = "pass"

    def __post_init__(self):
        self.check_above(1.0, "base")
        self.check_above(0.0, "pos_scale")
        self.check_choices(
            freq_schedule=_SCHEDULES,
            grouping=_GROUPINGS,
            coords=_COORDS,
            prefix_rotation=_PREFIX,
            indivisible_head_dim=TAIL_POLICIES,
        )


def geope_frequencies(head_dim: int, base: float = 100.0, schedule: str = "rope_neg") -> Tensor:
    """Per-triplet frequencies ``ω_g`` in rad/patch, float64 ``[G]``, ``G = ⌊d/3⌋`` (§3.1, spec A1/A2)."""
    groups = head_dim // 3
    if groups == 0:
        raise ValueError(f"GeoPE needs a head dim >= 3, got {head_dim}")
    if schedule == "rope_neg":
        return 1.0 / base ** (2.0 * torch.arange(groups, dtype=F64) / head_dim)
    if schedule == "paper_literal":
        return base ** (2.0 * torch.arange(1, groups + 1, dtype=F64) / head_dim)
    raise ValueError(f"schedule must be one of {_SCHEDULES}, got {schedule!r}")


def geope_quaternion(theta_h: Tensor, theta_w: Tensor) -> Tensor:
    """The unit quaternion of Eq. 4, ``(w, x, y, z)`` ``[..., 4]``; identity where both phases are 0.

    ``r = cos(Θ/2) + sin(Θ/2) (θ_h j + θ_w k) / (2Θ)``, ``Θ = ½ sqrt(θ_h² + θ_w²)``.
    """
    rho = torch.sqrt(theta_h**2 + theta_w**2)
    safe = torch.where(rho > 0, rho, torch.ones_like(rho))
    half_s = torch.sin(rho / 4)
    zero = torch.zeros_like(rho)
    return torch.stack([torch.cos(rho / 4), zero, half_s * theta_h / safe, half_s * theta_w / safe], dim=-1)


def geope_rotation(theta_h: Tensor, theta_w: Tensor) -> Tensor:
    """The paper's 3×3 ``R_i`` (§3.2; Rodrigues with angle Θ about ``(0, θ_h, θ_w)/ρ``), ``[..., 3, 3]``.

    Args:
        theta_h, theta_w: broadcastable phases ``p_h ω``, ``p_w ω`` (float64 for tables).

    Returns:
        Rotation matrices acting on column vectors ``(v_x, v_y, v_z)``; ``I`` where ``ρ = 0``.
    """
    rho = torch.sqrt(theta_h**2 + theta_w**2)
    safe = torch.where(rho > 0, rho, torch.ones_like(rho))
    a = torch.where(rho > 0, theta_h / safe, torch.zeros_like(rho))  # axis (0, a, b), guarded at 0/0
    b = torch.where(rho > 0, theta_w / safe, torch.zeros_like(rho))
    c, s = torch.cos(rho / 2), torch.sin(rho / 2)
    m = 1 - c
    rows = [
        [c, -b * s, a * s],
        [b * s, 1 - b * b * m, a * b * m],
        [-a * s, a * b * m, 1 - a * a * m],
    ]
    return torch.stack([torch.stack(row, dim=-1) for row in rows], dim=-2)


def triplet_dims(head_dim: int, grouping: str = "contiguous") -> Tensor:
    """Head-dim index of component ``a`` of triplet ``g``, int64 ``[G, 3]`` (spec A3)."""
    groups = head_dim // 3
    g, a = torch.arange(groups)[:, None], torch.arange(3)[None, :]
    if grouping == "contiguous":
        return 3 * g + a
    if grouping == "blocked":
        return a * groups + g
    raise ValueError(f"grouping must be one of {_GROUPINGS}, got {grouping!r}")


def partner_indices(head_dim: int, grouping: str = "contiguous") -> tuple[Tensor, Tensor]:
    """Constant gather indices ``idx1``, ``idx2`` (int64 ``[d]``) of the three-term form.

    ``idx_k[dims[g, a]] = dims[g, (a + k) mod 3]``; passthrough dims map to themselves.
    """
    dims = triplet_dims(head_dim, grouping)
    # dims is a bijection onto [0, 3G); argsort inverts it so each dim finds its (g, a).
    order = dims.flatten().argsort()
    tail = torch.arange(dims.numel(), head_dim)
    idx1 = torch.cat([dims.roll(-1, dims=1).flatten()[order], tail])
    idx2 = torch.cat([dims.roll(-2, dims=1).flatten()[order], tail])
    return idx1, idx2


def geope_positions(grid: tuple[int, int], coords: str = "corner0", pos_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Patch positions ``(p_h, p_w)``, each float64 ``[gh·gw]`` in row-major token order (spec A5)."""
    ys, xs = patch_coordinates(grid)
    if coords == "center":
        ys, xs = ys - (grid[0] - 1) / 2, xs - (grid[1] - 1) / 2
    elif coords != "corner0":
        raise ValueError(f"coords must be one of {_COORDS}, got {coords!r}")
    return ys * pos_scale, xs * pos_scale


def build_geope_table(grid: tuple[int, int], head_dim: int, config: GeoPEConfig, num_prefix: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Three-term tables ``C0, C1, C2`` for a patch grid, float64, each ``[P + N, d]``.

    Row ``P + r·gw + c`` is patch ``(r, c)``; prefix rows and passthrough dims are identity.
    Built by concatenation only, so nothing here becomes a scatter if it is ever traced.
    """
    ys, xs = geope_positions(grid, config.coords, config.pos_scale)
    omega = geope_frequencies(head_dim, config.base, config.freq_schedule)  # [G]
    rot = geope_rotation(ys[:, None] * omega, xs[:, None] * omega)  # [N, G, 3, 3]
    a = torch.arange(3)
    # coef[k][n, g, a] = R[n, g, a, (a + k) mod 3]
    coef = [rot[..., a, (a + k) % 3] for k in range(3)]
    if config.grouping == "blocked":
        coef = [t.transpose(-1, -2) for t in coef]  # [N, 3, G]: column a·G + g
    elif config.grouping != "contiguous":
        raise ValueError(f"grouping must be one of {_GROUPINGS}, got {config.grouping!r}")
    tail = head_dim - 3 * omega.numel()
    tables = []
    for k, t in enumerate(coef):
        fill = 1.0 if k == 0 else 0.0  # identity: C0 = 1, C1 = C2 = 0
        body = torch.cat([t.flatten(-2), torch.full((t.shape[0], tail), fill, dtype=F64)], dim=-1)
        tables.append(torch.cat([torch.full((num_prefix, head_dim), fill, dtype=F64), body], dim=0))
    return tables[0], tables[1], tables[2]


def apply_geope(x: Tensor, c0: Tensor, c1: Tensor, c2: Tensor, idx1: Tensor, idx2: Tensor) -> Tensor:
    """Rotate every triplet of ``x`` by its token's ``R_g`` in the three-term elementwise form.

    Args:
        x: ``[..., T, d]`` queries or keys.
        c0, c1, c2: ``[T, d]`` tables from ``build_geope_table`` (broadcast over batch and heads).
        idx1, idx2: int64 ``[d]`` from ``partner_indices`` (exported as constant Gathers).

    Returns:
        ``[..., T, d]``, the same dtype as ``x``.
    """
    return c0 * x + c1 * torch.index_select(x, -1, idx1) + c2 * torch.index_select(x, -1, idx2)


def split_blocked_tables(c0: Tensor, c1: Tensor, c2: Tensor) -> dict[str, Tensor]:
    """``blocked`` tables as thirds: ``c{k}_{a}`` ``[..., G]`` is columns ``a·G … (a+1)·G`` of
    ``Ck`` (component ``a`` of every triplet). The tail is the identity and needs no table.

    Each third is its own table (so exported, each is a ``pe_tables.*`` fp32 initializer; a
    slice of a table inside the graph would be folded into an anonymous constant).
    """
    groups = c0.shape[-1] // 3
    return {f"c{k}_{a}": t[..., a * groups : (a + 1) * groups].contiguous() for k, t in enumerate((c0, c1, c2)) for a in range(3)}


def apply_geope_blocked(x: Tensor, thirds: dict[str, Tensor]) -> Tensor:
    """``apply_geope`` for the ``blocked`` grouping, by slices: thirds ``A, B, C`` of the first
    ``3G`` dims hold components 0, 1, 2 of every triplet, so ``A' = C0 A + C1 B + C2 C`` and
    cyclically; the tail passes. The same products and sums in the same order as ``apply_geope``.

    Args:
        x: ``[..., T, d]`` queries or keys.
        thirds: from ``split_blocked_tables``.
    """
    groups = x.shape[-1] // 3
    parts = x.split([groups, groups, groups, x.shape[-1] - 3 * groups], dim=-1)
    out = [thirds[f"c0_{a}"] * parts[a] + thirds[f"c1_{a}"] * parts[(a + 1) % 3] + thirds[f"c2_{a}"] * parts[(a + 2) % 3] for a in range(3)]
    return torch.cat(out + [parts[3]] if parts[3].shape[-1] else out, dim=-1)


@register_encoding("geope", GeoPEConfig)
class GeoPE(PositionalEncoding):
    """GeoPE applied to q and k in every block; no learnable parameters (spec A7).

    Buffers (non-persistent, so checkpoints carry no GeoPE keys):
        idx1, idx2: int64 ``[d]`` partner indices of the three-term form.
    """

    hook = Hook.QK

    def __init__(self, config: GeoPEConfig, dims: TrunkDims):
        super().__init__(config, dims)
        tail = dims.head_dim % 3
        geope_frequencies(dims.head_dim, config.base, config.freq_schedule)  # validates the head dim early
        check_head_dim_tail(config.indivisible_head_dim, dims.head_dim, tail, "3")
        idx1, idx2 = partner_indices(dims.head_dim, config.grouping)
        self.register_buffer("idx1", idx1, persistent=False)
        self.register_buffer("idx2", idx2, persistent=False)

    @property
    def tables_nest(self) -> bool:
        return self.config.coords == "corner0"  # indices from the top-left; "center" shifts per grid

    def tables(self, grid: tuple[int, int]) -> PETables:
        """``c0, c1, c2`` ``[P + N, d]``; in the ``blocked`` grouping their thirds ``c{k}_{a}``
        (``split_blocked_tables``), which ``apply_geope_blocked`` reads."""
        # Built on the host in float64; the trunk casts and moves them next to the input.
        c0, c1, c2 = build_geope_table(grid, self.dims.head_dim, self.config, self.dims.num_prefix_tokens)
        layer = split_blocked_tables(c0, c1, c2) if self.config.grouping == "blocked" else {"c0": c0, "c1": c1, "c2": c2}
        # One dict object for every block: the exporter stores each table once (spec §7.1).
        return PETables(layers=[layer] * self.dims.depth)

    def apply_qk(self, q: Tensor, k: Tensor, tables: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        if self.config.grouping == "blocked":
            return apply_geope_blocked(q, tables), apply_geope_blocked(k, tables)
        c0, c1, c2 = tables["c0"], tables["c1"], tables["c2"]
        return apply_geope(q, c0, c1, c2, self.idx1, self.idx2), apply_geope(k, c0, c1, c2, self.idx1, self.idx2)

    def contiguous_qk_form(self) -> QKChannelOrder | None:
        if self.config.grouping == "blocked":
            return None
        d = self.dims.head_dim
        # blocked position a·G + g holds contiguous channel 3g + a; the tail stays last
        order = torch.cat([triplet_dims(d, "contiguous").T.flatten(), torch.arange(3 * (d // 3), d)])
        # GeoPE has no parameters: a new module builds the blocked partner indices itself.
        blocked = type(self)(dataclasses.replace(self.config, grouping="blocked"), self.dims)
        return QKChannelOrder(order=order, encoding=blocked.to(self.idx1.device))
