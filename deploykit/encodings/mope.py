"""MoPE: Morlet wavelet positional encoding, plus Energy-Gated Attention (EGA-1).

A. Zeris, "Beyond Sinusoids: A Morlet Wavelet Framework for Transformer Positional Encoding",
arXiv:2606.01258v1; implementation digest ``shared/spec/mope.md`` (``A<n>`` = its §7 items).

MoPE is an absolute table added to the tokens. Pair ``i`` is a Gaussian-windowed oscillator
(Eqs. 7-9, Alg. 1): ``PE[b, 2i] = cos(ω_i b) G_i(b)``, ``PE[b, 2i+1] = sin(ω_i b) G_i(b)``,
``G_i(b) = exp(-(b - b0)² / 2σ_i²)`` (``b0 = 0`` in the paper, Eq. 29 for ``b0 ≠ 0``), with
learned ``log ω``, ``log σ`` and the admissibility projection ``ω ← max(ω, 5/σ)`` (§6.3).

For the ViT the table is axial (digest §8.3): channels ``[0, D/2)`` are a 1-D MoPE of the patch
row ``y``, ``[D/2, D)`` of the column ``x``, each axis with its own ``D/4`` pairs. Positions are
integer patch indices (σ in patches). ``pos_embed`` is ``[1, P + N, D]`` float64, prefix rows
prepended by concatenation; at export it is one fp32 constant per resolution (one Add).

EGA-1 is defined only in the authors' code (digest §3): per head a scalar ``r_j = w·x_j + b``,
z-scored over the sequence, gates the keys, ``g_j = sigmoid(α(e_j - τ))``, and the attention rows
are renormalised. In eval this is exactly ``softmax(s + log g)``. It is not wired into the ViT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deploykit.encodings._registry import register_encoding
from deploykit.encodings.base import EncodingConfig, Hook, KeepsFloat, PETables, PositionalEncoding, TrunkDims, on_host, patch_coordinates

F64 = torch.float64
_INITS = ("code", "paper")
_CLAMP_GRADS = ("hard", "straight_through")
_ORIGINS = ("center", "corner")
_PREFIXES = ("zero", "unit")

# The paper's char-level model (§6.1, digest §4.2; [C] details from the authors' training script).
# It is a causal 1-D GPT, not a ViT: the sequence model that carries MoPE + EGA reads these.
PAPER_MODEL = dict(
    vocab_size=65,  # TinyShakespeare characters
    context=256,  # T; positions b = 0..T-1
    embed_dim=256,  # d: 128 (ω, σ) pairs
    depth=6,
    num_heads=8,  # head size 32
    mlp_ratio=4.0,  # GELU MLP, pre-LN blocks, final LayerNorm
    qkv_bias=False,
    dropout=0.1,  # embedding, attention probabilities, projections
    tie_embeddings=True,  # LM head tied to the token embedding
    causal=True,
    attention="ega",  # EGA-MORLET; "dot" for PE-MORLET
    ega_alpha_init=2.0,
    ega_tau_init=0.0,
    encoding="mope",  # MoPEConfig() defaults with origin="corner" (b0 = 0, the paper's)
)


@dataclass(frozen=True)
class MoPEConfig(EncodingConfig):
    """Options of MoPE; each resolves a paper/code ambiguity (digest §7).

    Attributes:
        init: ``code`` (ω geometric in ``[1, 0.99π]``, the authors' code, the only init that
            reproduces Table 5; A3) or ``paper`` (``ω_i = 10000^(-2i/d)``, §6.3 text; the σ → ∞
            limit is then the Vaswani table). Both set ``σ = admissibility / ω``.
        admissibility: the constant ``c`` of ``ωσ ≥ c`` (5, §6.3, App. A.2).
        omega_cap: cap on ``exp(log ω)`` before the projection (``0.95π``, code only; ``inf``
            for the paper's Alg. 1). The projection may still exceed it (A9).
        sigma_floor: lower bound on σ (1e-3, code only; 0 for the paper).
        envelope_eps: added to ``2σ²`` in the envelope (1e-8, code only; 0 for the paper).
        clamp_grad: ``hard`` (``torch.where``, code; no ``log ω`` gradient when clamped) or
            ``straight_through`` (App. A.3: "not during gradient computation") (A2).
        origin: envelope centre ``b0`` of Eq. 29 per axis: ``center`` of the patch grid
            (digest §8.3 recommends it for images) or ``corner`` (``b0 = 0``, the paper's).
            The phase is always ``ω b`` from the corner.
        prefix: prefix (class) token rows: ``zero`` (no position) or ``unit``
            (``[1, 0, 1, 0, …]``, MoPE at its origin) (digest §8.3 item 4).
    """

    init: str = "code"
    admissibility: float = 5.0
    omega_cap: float = 0.95 * math.pi
    sigma_floor: float = 1e-3
    envelope_eps: float = 1e-8
    clamp_grad: str = "hard"
    origin: str = "center"
    prefix: str = "zero"

    def __post_init__(self):
        self.check_choices(init=_INITS, clamp_grad=_CLAMP_GRADS, origin=_ORIGINS, prefix=_PREFIXES)
        if not self.admissibility > 0 or not self.omega_cap > 0:
            raise ValueError(f"admissibility and omega_cap must be > 0, got {self.admissibility}, {self.omega_cap}")
        if self.sigma_floor < 0 or self.envelope_eps < 0:
            raise ValueError(f"sigma_floor and envelope_eps must be >= 0, got {self.sigma_floor}, {self.envelope_eps}")


def init_mope_params(num_pairs: int, init: str = "code", admissibility: float = 5.0) -> tuple[Tensor, Tensor]:
    """Initial ``log ω``, ``log σ`` ``[num_pairs]`` float64 with ``ωσ = admissibility`` (A3).

    ``code``: ``ω = exp(linspace(0, log 0.99π, n))``; ``paper``: ``ω_i = 10000^(-2i/2n)``.
    """
    if init == "code":
        omega = torch.exp(torch.linspace(0.0, math.log(0.99 * math.pi), num_pairs, dtype=F64))
    else:
        omega = 10000.0 ** (-2.0 * torch.arange(num_pairs, dtype=F64) / (2 * num_pairs))
    return omega.log(), (admissibility / omega).log()


def mope_effective_params(
    log_omega: Tensor,
    log_sigma: Tensor,
    admissibility: float = 5.0,
    omega_cap: float = math.inf,
    sigma_floor: float = 0.0,
    straight_through: bool = False,
) -> tuple[Tensor, Tensor]:
    """Effective ``(ω, σ)`` from log parameters (Alg. 1 steps 1-2; code forward, digest §1.6).

    ``ω ← max(ω, c/σ)`` as a hard ``where`` (code); with ``straight_through`` the forward value is
    the same but ``log ω`` gets the unclamped gradient (App. A.3 reading, A2). ``σ = inf`` is
    allowed (``c/σ = 0``: no clamp), giving the sinusoidal limit (Prop. 1).

    Returns:
        ``ω`` (rad per position) and ``σ`` (positions), shapes of the inputs.
    """
    omega = log_omega.exp().clamp(max=omega_cap)
    sigma = log_sigma.exp().clamp(min=sigma_floor)
    admissible = torch.where(omega * sigma < admissibility, admissibility / sigma.clamp(min=1e-6), omega)
    if straight_through:
        return omega + (admissible - omega).detach(), sigma
    return admissible, sigma


def _effective(config: MoPEConfig, log_omega: Tensor, log_sigma: Tensor) -> tuple[Tensor, Tensor]:
    """``mope_effective_params`` with the config's constants, in float64 (differentiable)."""
    return mope_effective_params(
        on_host(log_omega),
        on_host(log_sigma),
        config.admissibility,
        config.omega_cap,
        config.sigma_floor,
        config.clamp_grad == "straight_through",
    )


def build_mope_table(positions: Tensor, omega: Tensor, sigma: Tensor, origin: float = 0.0, eps: float = 0.0) -> Tensor:
    """The 1-D MoPE table (Eqs. 7-8, Alg. 1 steps 3-5; Eq. 29 envelope centre ``origin``).

    Args:
        positions: ``[T]`` positions ``b`` (integers as float), any float dtype (cast to float64).
        omega, sigma: ``[n]`` effective parameters (from ``mope_effective_params``).
        origin: envelope centre ``b0``; the phase is ``ω b`` regardless.
        eps: added to ``2σ²`` (the code's 1e-8).

    Returns:
        ``[T, 2n]`` float64, interleaved: ``[:, 2i] = cos(ω_i b) G_i(b)``, ``[:, 2i+1] = sin(ω_i b) G_i(b)``.
    """
    b, omega, sigma = positions.to(F64)[:, None], omega.to(F64), sigma.to(F64)
    envelope = torch.exp(-((b - origin) ** 2) / (2.0 * sigma**2 + eps))  # [T, n]
    phase = b * omega  # [T, n]
    # stack + reshape, never strided slice writes (ONNX-friendly, digest §1.6): [T, n, 2] -> [T, 2n]
    return torch.stack([phase.cos() * envelope, phase.sin() * envelope], dim=-1).flatten(-2)


def build_mope2d_table(
    grid: tuple[int, int],
    omega: Tensor,
    sigma: Tensor,
    origin: str = "center",
    eps: float = 0.0,
    num_prefix: int = 0,
    prefix: str = "zero",
) -> Tensor:
    """Axial 2-D MoPE (digest §8.3 item 1): ``PE(y, x) = [MoPE(y) ‖ MoPE(x)]``.

    Args:
        grid: ``(gh, gw)`` patch grid; tokens in row-major order.
        omega, sigma: ``[2, n]`` effective parameters, row axis first.
        origin: ``center`` (``b0 = (g - 1)/2`` per axis) or ``corner`` (``b0 = 0``).
        eps: envelope denominator offset.
        num_prefix: prefix rows prepended (``zero`` rows or ``unit`` rows ``[1, 0, 1, 0, …]``).
        prefix: see ``MoPEConfig.prefix``.

    Returns:
        ``[1, num_prefix + gh·gw, 4n]`` float64.
    """
    ys, xs = patch_coordinates(grid)
    centre = [(g - 1) / 2 if origin == "center" else 0.0 for g in grid]
    rows = build_mope_table(ys, omega[0], sigma[0], centre[0], eps)  # [N, 2n]
    cols = build_mope_table(xs, omega[1], sigma[1], centre[1], eps)  # [N, 2n]
    table = torch.cat([rows, cols], dim=-1)
    if num_prefix:
        if prefix == "zero":
            head = table.new_zeros(num_prefix, table.shape[-1])
        else:  # cos 0 · G(b0) = 1, sin 0 = 0 in every pair
            head = torch.tensor([1.0, 0.0], dtype=F64).repeat(num_prefix, table.shape[-1] // 2)
        table = torch.cat([head, table], dim=0)
    return table[None]


@register_encoding("mope", MoPEConfig)
class MoPE2d(PositionalEncoding):
    """Axial 2-D MoPE added to the tokens.

    Parameters:
        log_omega, log_sigma: ``[2, D/4]`` (axis row/col, pair), learned in log space (App. A.3).
    """

    hook = Hook.TOKENS

    def __init__(self, config: MoPEConfig, dims: TrunkDims):
        super().__init__(config, dims)
        if dims.embed_dim % 4:
            raise ValueError(f"axial MoPE needs embed_dim divisible by 4 (pairs per axis), got {dims.embed_dim}")
        self.log_omega = nn.Parameter(torch.zeros(2, dims.embed_dim // 4))
        self.log_sigma = nn.Parameter(torch.zeros(2, dims.embed_dim // 4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        log_omega, log_sigma = init_mope_params(self.log_omega.shape[-1], self.config.init, self.config.admissibility)
        with torch.no_grad():
            self.log_omega.copy_(log_omega.expand_as(self.log_omega))
            self.log_sigma.copy_(log_sigma.expand_as(self.log_sigma))

    def effective_params(self) -> tuple[Tensor, Tensor]:
        """Effective ``(ω, σ)`` ``[2, D/4]`` float64 (compare/export these, never ``exp(log ω)``; A10)."""
        return _effective(self.config, self.log_omega, self.log_sigma)

    def tables(self, grid: tuple[int, int]) -> PETables:
        omega, sigma = self.effective_params()
        cfg = self.config
        prefix = self.dims.num_prefix_tokens
        table = build_mope2d_table(grid, omega, sigma, cfg.origin, cfg.envelope_eps, prefix, cfg.prefix)  # [1, P+N, D]
        return PETables(model={"pos_embed": table})

    def apply_tokens(self, x: Tensor, tables: dict[str, Tensor]) -> Tensor:
        return x + tables["pos_embed"]


class MoPE1d(nn.Module):
    """1-D MoPE for a sequence model: always the paper's ``b0 = 0`` (``origin``, ``prefix`` unused).

    Args:
        embed_dim: ``d`` (even); ``d/2`` learned pairs.
        config: MoPE options (init, clamp and code constants).
    """

    def __init__(self, embed_dim: int, config: MoPEConfig = MoPEConfig()):
        super().__init__()
        if embed_dim % 2:
            raise ValueError(f"MoPE needs an even embed_dim, got {embed_dim}")
        self.config = config
        log_omega, log_sigma = init_mope_params(embed_dim // 2, config.init, config.admissibility)
        self.log_omega, self.log_sigma = nn.Parameter(log_omega.float()), nn.Parameter(log_sigma.float())

    def forward(self, length: int, offset: int = 0) -> Tensor:
        """``[length, d]`` float64 table for positions ``offset … offset + length - 1`` (digest §8.2)."""
        omega, sigma = _effective(self.config, self.log_omega, self.log_sigma)
        positions = torch.arange(offset, offset + length, dtype=F64)
        return build_mope_table(positions, omega, sigma, 0.0, self.config.envelope_eps)


# ----------------------------------------------------------------------------------------------
# Energy-Gated Attention (EGA-1), digest §3 ([C] EGA1Attention). Gate math in at least fp32.


def ega_gate_logits(energy: Tensor, alpha: Tensor, tau: Tensor, std_eps: float = 1e-8) -> Tensor:
    """``z_j = α (e_j - τ)`` with ``e`` the z-score of ``energy`` over the sequence (last axis).

    Population std (``correction=0``) clamped at ``std_eps``; ``T = 1`` or a constant ``r`` gives
    ``e = 0``. The statistics span the whole window, future tokens included (digest §3).

    Args:
        energy: ``[..., H, T]`` per-head scalars ``r_j = w_E·x_j + b_E``.
        alpha, tau: ``[H]`` per-head slope and threshold.

    Returns:
        ``[..., H, T]`` in the promotion of ``energy``'s dtype with float32 (never fp16).
    """
    energy = energy.to(torch.promote_types(energy.dtype, torch.float32))
    mean = energy.mean(dim=-1, keepdim=True)
    std = energy.std(dim=-1, keepdim=True, correction=0).clamp(min=std_eps)
    return alpha[:, None] * ((energy - mean) / std - tau[:, None])


def ega_log_gate(gate_logits: Tensor) -> Tensor:
    """``log g = log sigmoid(z) = -softplus(-z)``, finite for any finite ``z`` (digest §8.4)."""
    return -F.softplus(-gate_logits)


def ega_weights_train(scores: Tensor, gate: Tensor, renorm_eps: float = 1e-8, dropout: nn.Module | None = None) -> Tensor:
    """Training form: ``Ã_ij = A_ij g_j / max(Σ_j' A_ij' g_j', eps)``, ``A = softmax(s)`` (then dropout).

    Args:
        scores: ``[..., T_q, T_k]`` scaled logits, ``-inf`` where masked.
        gate: ``[..., T_k]`` key gates ``g = sigmoid(z)``.
        dropout: applied to ``A`` before gating, as the authors' code.
    """
    attn = scores.softmax(dim=-1)
    if dropout is not None:
        attn = dropout(attn)
    gated = attn * gate[..., None, :]
    return gated / gated.sum(dim=-1, keepdim=True).clamp(min=renorm_eps)


def ega_weights_eval(scores: Tensor, log_gate: Tensor) -> Tensor:
    """Eval form ``softmax(s + log g)``: equals ``ega_weights_train`` without dropout (digest §3)."""
    return (scores + log_gate[..., None, :]).softmax(dim=-1)


def ega_attention(q: Tensor, k: Tensor, v: Tensor, log_gate: Tensor, mask: Tensor | None = None) -> Tensor:
    """Eval-form EGA: ``softmax(q kᵀ/√d + log g + mask) v``, one additive bias per key.

    Written as explicit matmul/softmax rather than fused SDPA: torch.export records SDPA's CPU
    output layout and its ONNX decomposition then fails to reshape the heads back ("cannot view").
    TensorRT fuses this MatMul-Add-Softmax-MatMul pattern into its attention kernels anyway.

    Args:
        q, k, v: ``[B, H, T, d]``.
        log_gate: ``[B, H, T]`` from ``ega_log_gate`` (added in the logits' dtype).
        mask: additive ``[T, T]`` (``causal_mask``: ``-inf`` above the diagonal), or None.
    """
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5) + log_gate[..., None, :].to(q.dtype)
    if mask is not None:
        scores = scores + mask
    return scores.softmax(dim=-1) @ v


def causal_mask(length: int, dtype: torch.dtype = F64) -> Tensor:
    """Additive ``[T, T]`` mask: 0 on and below the diagonal, ``-inf`` above (future keys).

    A per-length constant, so the exporter bakes it like a position table (an in-graph Trilu on
    constants is left unfolded by the ONNX optimiser)."""
    return torch.full((length, length), float("-inf"), dtype=dtype).triu(1)


class EnergyGate(nn.Module, KeepsFloat):
    """EGA-1 key gates for all heads: ``H`` stacked ``Linear(d, 1)`` plus ``α``, ``τ`` per head.

    Args:
        dim: input width ``d`` (the block's LayerNorm output).
        num_heads: ``H``.
        alpha_init, tau_init: 2.0 and 0.0 in the authors' code.
        std_eps: z-score std floor (1e-8).
    """

    def __init__(self, dim: int, num_heads: int, alpha_init: float = 2.0, tau_init: float = 0.0, std_eps: float = 1e-8):
        super().__init__()
        self.proj = nn.Linear(dim, num_heads)
        self.alpha = nn.Parameter(torch.full((num_heads,), alpha_init))
        self.tau = nn.Parameter(torch.full((num_heads,), tau_init))
        self.std_eps = std_eps

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``[B, T, d]`` → gate logits ``z`` ``[B, H, T]`` (≥ fp32)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        energy = F.linear(x.to(dtype), self.proj.weight.to(dtype), self.proj.bias.to(dtype)).transpose(-1, -2)
        return ega_gate_logits(energy, self.alpha.to(dtype), self.tau.to(dtype), self.std_eps)
