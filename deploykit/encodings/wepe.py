"""WePE: Weierstrass elliptic positional encoding (anonymous ICLR-2026 submission "Weierstrass
Positional Encoding for Vision Transformers"; digest ``../shared/spec/wepe.md``).

Patch ``(i, j)`` of an ``H × W`` grid sits at ``u = (j + ½)/W``, ``v = (i + ½)/H`` (Eq. 1), mapped to
``z = α_u·u·2ω1 + i·α_v·v·2ω3′`` (Eq. 2). Its feature ``f = [Re℘, Im℘, Re℘′, Im℘′](z)`` (Eq. 3) is
squashed, ``f̃ = tanh(α_scale f)`` (Eq. 30), projected and normalised, ``PE_ij = β_pos·LN(W f̃ + b)``
(§2.2), and added to the tokens once, with a learnable class-token row (Eq. 8). Nothing depends on
image content, so ``tables`` folds everything into one float64 ``pos_embed`` ``[1, P + N, D]``; the
exported graph then holds a single Add, like a learned APE.

℘ and ℘′ are exact, not the paper's truncated lattice sum (Eq. 4, ~1e-4 error): the real direction
of the lattice is summed in closed form, ``Σ_n (x − nπ)⁻² = csc²x``, and the rows ``m`` of the
imaginary direction form a q-series converging like ``e^{−2π|m|ω3′/ω1}`` (spec §1.4f). With ``z``
reduced to the fundamental cell and the axes swapped when ``ω3′ < ω1`` (``℘(z; Λ) = −℘(−iz; −iΛ)``),
15 rows reach float64 round-off. ℘ is evaluated only in complex128 NumPy on the host, never in fp16
(near the poles ℘′ exceeds 65504, spec §8.2).

The lattice is parameterised by its half-periods: the paper's "g2 = 1" label does not fit its
``ω1 = Γ²(¼)/(2√(2π)) ≈ 2.622``, which gives ``g2 = ¼``, ``g3 = 0`` (Thm B.9; spec §1.3, §7.1).

LUT mode (App. E, Algorithms C/D) tabulates the raw, pre-tanh features on ``Res × Res`` nodes
``linspace(0, 1, Res)`` of the ``(u, v)`` square and reads them bilinearly (align-corners), then
applies tanh (spec §7.9). The pole at ``(u, v) = (0, 0)`` is clamped, so corner patches are poor.
Max |error| of the post-tanh features at patch centres, default config (α = 0.4, ω3′ = 0.755,
α_scale = 0.15), measured with ``measure_lut_error`` for grids 14/24/32/64::

    Res 256:  1.4e-3 / 1.8e-3 / 2.1e-3 / 5.0e-3
    Res 512:  5.8e-4 / 8.0e-4 / 5.2e-4 / 1.2e-3
    Res 1024: 2.0e-4 / 1.2e-4 / 1.3e-4 / 2.9e-4
    (α = 1, ω3′ = ω1: Res 256: 3.9e-4 / 1.2e-3 / 8.7e-4 / 6.4e-3; Res 512: 3.6e-6 / 3.2e-4 / 2.0e-4 / 1.4e-3)

Errors sit at the corner patches next to the pole; roughly O(Res⁻²) but far from the paper's claimed
1e-5..1e-6 (they agree with spec §8.4). The exact mode is the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deploykit.encodings._registry import register_encoding
from deploykit.encodings.base import EncodingConfig, Hook, PETables, PositionalEncoding, TrunkDims

F64 = torch.float64
LEMNISCATE = 2.62205755429212  # ϖ = Γ²(¼)/(2√(2π)): the paper's ω1 (Eq. 23) and the code's; g2 = ¼
CODE_OMEGA3 = math.log1p(math.exp(0.12))  # softplus(0.12) = 0.7549…, the authors' initial ω3′ (spec §1.3)
_EVALUATIONS = ("exact", "lut")
_SCALE_PARAMS = ("softplus", "exp")
_EXP_CLAMP = (0.002, 0.8)  # the authors' clamp on exp-parameterised α_scale (spec §1.6)
_OMEGA3_CLAMP = (0.02, 8.0)  # the authors' clamp on the learned ω3′ (spec §1.3, W_Ti.py)

# The paper's ViT-Ti (Table 1, ablation §3.4, G.6): embed 192, patch 16, 224² → 14 × 14 patches.
# Depth 12 and 3 heads are the authors' W_Ti.py values (spec §3); the paper states neither.
PAPER_MODEL = dict(embed_dim=192, depth=12, num_heads=3, patch_size=16, img_size=224)


@dataclass(frozen=True)
class WePEConfig(EncodingConfig):
    """Options of WePE; each resolves a paper/code difference (spec §7).

    Attributes:
        omega1: real half-period ω1, fixed (paper L160). Default ϖ, the paper's printed value (§7.1).
        lattice_omega3: imaginary half-period of the lattice when it does not track ω3′ (square, ϖ).
        omega3_init: initial learned ω3′ = softplus(α_learn); default the code's softplus(0.12) (§7.4).
            The paper's "square start" is ``omega3_init = omega1``.
        learn_omega3: ω3′ is trained (paper); its gradient flows through the mapping via ℘′, ℘″.
        clamp_omega3: ω3′ is clamped to [0.02, 8] after the softplus, as the authors' code does
            (their checkpoints need it; off by default, the paper's plain softplus) (§1.3).
        lattice_tracks_omega3: ω3′ also deforms the lattice (paper) instead of only the mapping
            (code, released checkpoints; default) (§7.2). Needs ``learn_omega3=False``.
        alpha_u: horizontal mapping scale α_u; the paper gives none, the code uses 0.4 (§7.3).
        alpha_v: vertical mapping scale α_v (0.4, as α_u).
        alpha_scale_init: initial tanh slope α_scale (code 0.15; the paper gives none) (§7.4).
        alpha_scale_param: ``softplus`` (paper Eq. 30) or ``exp`` clamped to [0.002, 0.8] (code) (§7.5).
        use_derivative: feed [Re℘, Im℘, Re℘′, Im℘′] (Eq. 3) or only [Re℘, Im℘] (ablation §3.4).
        pos_scale_init: initial global scale β_pos (code 0.8; paper: learnable, no value) (§7.4).
        scale_cls: β_pos also scales the class-token encoding (code) (§7.8).
        cls_std: std of the class-token encoding's normal init (code 0.015).
        norm_eps: LayerNorm eps after the projection (PyTorch default, as the code) (§7.7).
        feature_clamp: raw features clamped to ±this (code's final ±1e4 clamp; harmless after tanh) (§7.6).
        evaluation: ``exact`` ℘ at the patch centres (default, spec §8.1) or the paper's ``lut``.
        lut_size: LUT nodes per side (paper App. E: 256).
    """

    omega1: float = LEMNISCATE
    lattice_omega3: float = LEMNISCATE
    omega3_init: float = CODE_OMEGA3
    learn_omega3: bool = True
    clamp_omega3: bool = False
    lattice_tracks_omega3: bool = False
    alpha_u: float = 0.4
    alpha_v: float = 0.4
    alpha_scale_init: float = 0.15
    alpha_scale_param: str = "softplus"
    use_derivative: bool = True
    pos_scale_init: float = 0.8
    scale_cls: bool = True
    cls_std: float = 0.015
    norm_eps: float = 1e-5
    feature_clamp: float = 1e4
    evaluation: str = "exact"
    lut_size: int = 256

    def __post_init__(self):
        self.check_choices(evaluation=_EVALUATIONS, alpha_scale_param=_SCALE_PARAMS)
        self.check_above(0.0, "omega1", "lattice_omega3", "omega3_init", "alpha_u", "alpha_v", "alpha_scale_init")
        if not self.feature_clamp > 0:
            raise ValueError(f"feature_clamp must be > 0, got {self.feature_clamp!r}")
        if self.lut_size < 2:
            raise ValueError(f"lut_size must be >= 2, got {self.lut_size}")
        if self.learn_omega3 and self.lattice_tracks_omega3:
            raise ValueError("lattice_tracks_omega3=True has no gradient through the lattice: set learn_omega3=False")


def _csc2_cot(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``csc²a`` and ``cot a`` for complex ``a``, stable for any ``|Im a|`` (no cosh overflow)."""
    small = np.abs(a.imag) < 1.0
    ad = np.where(small, a, 0.5)  # direct form where it is accurate near the pole a = 0
    sd = np.sin(ad)
    s = np.where(a.imag >= 0, 1.0, -1.0)
    w = np.exp(2j * s * np.where(small, 1j, a))  # |w| = e^{-2|Im a|} < e^{-2}: csc² = −4w/(1−w)²
    csc2 = np.where(small, 1.0 / sd**2, -4.0 * w / (1.0 - w) ** 2)
    cot = np.where(small, np.cos(ad) / sd, -1j * s * (1.0 + w) / (1.0 - w))
    return csc2, cot


def _wp_rect(z: np.ndarray, w1: float, w3: float, eps: float = 1e-18) -> tuple[np.ndarray, np.ndarray]:
    """℘, ℘′ on the lattice ``2ω1ℤ + 2iω3ℤ`` with ``ω3 ≥ ω1``, by row sums (spec §1.4f).

    ``℘ = c²[csc²(cz) − ⅓ + Σ_{m≠0}(csc²a_m − csc²(2icmω3))]``, ``℘′ = −2c³ Σ_m cot a_m csc²a_m``,
    ``c = π/2ω1``, ``a_m = c(z − 2imω3)``. Rows past ``M`` contribute < ``16 e^{−πr(2M+1)}``, ``r = ω3/ω1``.
    """
    x = z.real - 2 * w1 * np.round(z.real / (2 * w1))  # reduce to the cell centred at 0 (℘ is periodic)
    y = z.imag - 2 * w3 * np.round(z.imag / (2 * w3))
    c, r = math.pi / (2 * w1), w3 / w1
    rows = max(1, math.ceil((math.log(16 / eps) / (math.pi * r) - 1) / 2))
    m = np.arange(-rows, rows + 1, dtype=np.float64).reshape(-1, *([1] * z.ndim))
    csc2, cot = _csc2_cot(c * (x + 1j * (y - 2 * m * w3)))  # [2M+1, ...]
    ref, _ = _csc2_cot(2j * c * w3 * np.arange(1, rows + 1, dtype=np.float64))  # −csch²(πmr), m ≥ 1
    wp = c**2 * (csc2.sum(0) - 1.0 / 3.0 - 2 * ref.sum())
    dwp = -2 * c**3 * (cot * csc2).sum(0)
    return wp, dwp


def weierstrass_p(z, omega1: float, omega3: float) -> tuple[np.ndarray, np.ndarray]:
    """Exact ``℘(z)``, ``℘′(z)`` for the lattice ``2ω1ℤ + 2iω3ℤ`` (paper Def. B.6, Eq. 15), complex128.

    Args:
        z: complex points, any shape.
        omega1: real half-period ω1 > 0.
        omega3: imaginary half-period ω3′ > 0 (the half-period is ``iω3′``).

    Returns:
        ``(℘, ℘′)``, complex128 arrays shaped like ``z``; non-finite exactly at lattice points.
    """
    z = np.asarray(z, dtype=np.complex128)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if omega3 < omega1:  # ℘(z; Λ) = −℘(−iz; −iΛ), ℘′(z; Λ) = i℘′(−iz; −iΛ): keep r ≥ 1
            wp, dwp = _wp_rect(-1j * z, omega3, omega1)
            return -wp, 1j * dwp
        return _wp_rect(z, omega1, omega3)


def lattice_roots(omega1: float, omega3: float) -> tuple[float, float, float]:
    """``e1 = ℘(ω1)``, ``e2 = ℘(ω1 + ω3)``, ``e3 = ℘(ω3)`` (real for a rectangular lattice; sum 0)."""
    wp, _ = weierstrass_p([omega1, omega1 + 1j * omega3, 1j * omega3], omega1, omega3)
    return tuple(float(e) for e in wp.real)


def lattice_invariants(omega1: float, omega3: float) -> tuple[float, float]:
    """``g2 = 2Σe_k²``, ``g3 = 4e1e2e3`` of ``(℘′)² = 4℘³ − g2℘ − g3`` (Eq. 17); (¼, 0) by default."""
    e1, e2, e3 = lattice_roots(omega1, omega3)
    return 2 * (e1 * e1 + e2 * e2 + e3 * e3), 4 * e1 * e2 * e3


def patch_centres(grid: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Normalised centres ``u = (2j+1)/2W``, ``v = (2i+1)/2H`` (Eq. 1), ``[H·W]`` row-major, float64.

    Written as one rounded division of exact integers, so a 3×-finer grid's centres ``3i+1`` are
    bit-identical to the coarse ones (spec §8.3 item 9).
    """
    gh, gw = grid
    v = (2 * torch.arange(gh, dtype=F64) + 1) / (2 * gh)
    u = (2 * torch.arange(gw, dtype=F64) + 1) / (2 * gw)
    return u[None, :].expand(gh, gw).reshape(-1), v[:, None].expand(gh, gw).reshape(-1)


def _clamped_features(wp: np.ndarray, dwp: np.ndarray, clamp: float) -> tuple[np.ndarray, np.ndarray]:
    """``[..., 4]`` features ``[Re℘, Im℘, Re℘′, Im℘′]`` clamped to ±clamp, and the unclamped mask."""
    raw = np.stack([wp.real, wp.imag, dwp.real, dwp.imag], axis=-1)
    raw = np.nan_to_num(raw, nan=clamp, posinf=clamp, neginf=-clamp)  # lattice points (LUT nodes only)
    return np.clip(raw, -clamp, clamp), np.abs(raw) < clamp


class _WeierstrassFeatures(torch.autograd.Function):
    """Raw features of ``z = x + iy`` (Eq. 3), float64, with ``∂/∂x`` from ℘′ and ℘″ = 6℘² − g2/2."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, omega1: float, omega3: float, clamp: float) -> Tensor:
        z = x.detach().cpu().numpy() + 1j * y.detach().cpu().numpy()
        wp, dwp = weierstrass_p(z, omega1, omega3)
        feats, free = _clamped_features(wp, dwp, clamp)
        ddwp = 6 * wp**2 - lattice_invariants(omega1, omega3)[0] / 2
        # d℘/dx = ℘′, d℘/dy = i℘′ (holomorphic); likewise for ℘′ with ℘″. Zero where clamped.
        dx = np.stack([dwp.real, dwp.imag, ddwp.real, ddwp.imag], axis=-1) * free
        dy = np.stack([-dwp.imag, dwp.real, -ddwp.imag, ddwp.real], axis=-1) * free
        ctx.save_for_backward(torch.from_numpy(dx).to(x.device), torch.from_numpy(dy).to(x.device))
        return torch.from_numpy(feats).to(x.device)

    @staticmethod
    def backward(ctx, grad: Tensor):
        dx, dy = ctx.saved_tensors
        return (grad * dx).sum(-1), (grad * dy).sum(-1), None, None, None


def wepe_features(u: Tensor, v: Tensor, omega3: Tensor, config: WePEConfig) -> Tensor:
    """Raw features ``[N, 4]`` at ``(u, v)`` via Eq. 2, float64, differentiable in ``omega3`` (ω3′)."""
    x = config.alpha_u * u * (2 * config.omega1)
    y = config.alpha_v * v * (2 * omega3.to(F64))
    lattice3 = float(omega3.detach()) if config.lattice_tracks_omega3 else config.lattice_omega3
    return _WeierstrassFeatures.apply(x, y, config.omega1, lattice3, config.feature_clamp)


def build_wepe_lut(omega3: float, config: WePEConfig, size: int) -> Tensor:
    """Raw (pre-tanh) features on ``(v_b, u_a) = (b, a)/(size − 1)``: float64 ``[size, size, 4]`` (App. E)."""
    nodes = torch.linspace(0, 1, size, dtype=F64)
    u, v = nodes[None, :].expand(size, size).reshape(-1), nodes[:, None].expand(size, size).reshape(-1)
    with torch.no_grad():
        return wepe_features(u, v, torch.tensor(omega3, dtype=F64), config).reshape(size, size, 4)


def lut_features(lut: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """Bilinear read of ``lut`` ``[R, R, C]`` at ``(u, v) ∈ [0, 1]²`` (align-corners), ``[N, C]``."""
    last = lut.shape[0] - 1

    def split(t: Tensor) -> tuple[Tensor, Tensor]:
        pos = t.to(F64) * last
        i0 = pos.floor().clamp(0, last - 1).long()
        return i0, (pos - i0)[:, None]

    a, tu = split(u)
    b, tv = split(v)
    top = lut[b, a] * (1 - tu) + lut[b, a + 1] * tu
    bottom = lut[b + 1, a] * (1 - tu) + lut[b + 1, a + 1] * tu
    return top * (1 - tv) + bottom * tv


def measure_lut_error(config: WePEConfig, lut_size: int, grids=((14, 14), (24, 24), (32, 32), (64, 64))) -> dict:
    """Max |tanh(α_scale·f_LUT) − tanh(α_scale·f_exact)| over the 4 features at patch centres, per grid.

    Uses the config's initial ω3′ and α_scale. Returns ``{grid: error}``.
    """
    omega3 = torch.tensor(config.omega3_init, dtype=F64)
    lut = build_wepe_lut(config.omega3_init, config, lut_size)
    errors = {}
    for grid in grids:
        u, v = patch_centres(grid)
        with torch.no_grad():
            exact = torch.tanh(config.alpha_scale_init * wepe_features(u, v, omega3, config))
        approx = torch.tanh(config.alpha_scale_init * lut_features(lut, u, v))
        errors[tuple(grid)] = float((approx - exact).abs().max())
    return errors


def build_wepe_table(features: Tensor, proj: nn.Linear, norm: nn.LayerNorm, pos_scale: Tensor, cls_pos: Tensor, scale_cls: bool) -> Tensor:
    """``[cls; β_pos·LN(W f̃ + b)]`` ``[1, P + N, D]`` float64 (§2.2, Eq. 8) from squashed ``f̃`` ``[N, F]``."""
    patches = F.linear(features, proj.weight.to(F64), proj.bias.to(F64))
    patches = F.layer_norm(patches, patches.shape[-1:], norm.weight.to(F64), norm.bias.to(F64), norm.eps)
    scale = pos_scale.to(F64)
    cls = cls_pos.to(F64) * scale if scale_cls else cls_pos.to(F64)
    return torch.cat([cls, (patches * scale)[None]], dim=1)


@register_encoding("wepe", WePEConfig)
class WePE(PositionalEncoding):
    """Weierstrass positional encoding added to the tokens once; ``8D + 3`` learned values at P = 1."""

    hook = Hook.TOKENS

    def __init__(self, config: WePEConfig, dims: TrunkDims):
        super().__init__(config, dims)
        in_features = 4 if config.use_derivative else 2
        self.proj = nn.Linear(in_features, dims.embed_dim)
        self.norm = nn.LayerNorm(dims.embed_dim, eps=config.norm_eps)
        self.cls_pos = nn.Parameter(torch.zeros(1, dims.num_prefix_tokens, dims.embed_dim))
        self.pos_scale = nn.Parameter(torch.zeros(()))
        self.alpha_raw = nn.Parameter(torch.zeros(()))  # α_scale = softplus or exp of this
        self.omega3_raw = nn.Parameter(torch.zeros(()), requires_grad=config.learn_omega3)  # ω3′ = softplus
        self._luts: dict[tuple[float, ...], Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        cfg = self.config
        nn.init.trunc_normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)
        self.norm.reset_parameters()
        nn.init.normal_(self.cls_pos, std=cfg.cls_std)
        inv = math.log(cfg.alpha_scale_init) if cfg.alpha_scale_param == "exp" else _softplus_inv(cfg.alpha_scale_init)
        with torch.no_grad():
            self.pos_scale.fill_(cfg.pos_scale_init)
            self.alpha_raw.fill_(inv)
            self.omega3_raw.fill_(_softplus_inv(cfg.omega3_init))

    def alpha_scale(self) -> Tensor:
        """Effective tanh slope α_scale (Eq. 30), float64."""
        raw = self.alpha_raw.to(F64)
        return F.softplus(raw) if self.config.alpha_scale_param == "softplus" else raw.exp().clamp(*_EXP_CLAMP)

    def omega3(self) -> Tensor:
        """Learned imaginary half-period ω3′ = softplus(α_learn) (paper L160), float64; clamped
        as the authors' code with ``clamp_omega3``."""
        omega3 = F.softplus(self.omega3_raw.to(F64))
        return omega3.clamp(*_OMEGA3_CLAMP) if self.config.clamp_omega3 else omega3

    def raw_features(self, grid: tuple[int, int]) -> Tensor:
        """Pre-tanh features ``[H·W, 4]`` float64, exact or from the cached LUT (LUT: ω3′ detached)."""
        u, v = patch_centres(grid)
        u, v = u.to(self.proj.weight.device), v.to(self.proj.weight.device)
        if self.config.evaluation == "exact":
            return wepe_features(u, v, self.omega3(), self.config)
        key = (float(self.omega3().detach()), self.config.lut_size)
        if key not in self._luts:
            self._luts = {key: build_wepe_lut(key[0], self.config, key[1]).to(u.device)}
        return lut_features(self._luts[key], u, v)

    def tables(self, grid: tuple[int, int]) -> PETables:
        feats = self.raw_features(grid)
        if not self.config.use_derivative:
            feats = feats[:, :2]
        squashed = torch.tanh(self.alpha_scale() * feats)  # Eq. 30
        table = build_wepe_table(squashed, self.proj, self.norm, self.pos_scale, self.cls_pos, self.config.scale_cls)
        return PETables(model={"pos_embed": table})

    def apply_tokens(self, x: Tensor, tables: dict[str, Tensor]) -> Tensor:
        return x + tables["pos_embed"]


def _softplus_inv(y: float) -> float:
    """``x`` with ``softplus(x) = y``."""
    return y + math.log(-math.expm1(-y))
