"""Analytic FLOPs of one forward (multiply-add = 2 FLOPs), counted from the matrix products."""

from __future__ import annotations

from deploykit.nn.sequence import SequenceConfig


def gemm_shapes(cfg, resolution: tuple[int, int], batch: int) -> list[tuple[int, int, int, int]]:
    """Every matrix product of one forward as ``(count, m, k, n)`` (``count`` batched products of
    ``[m, k] @ [k, n]``): patch embedding, per block qkv / q·kᵀ / attn·v / proj / fc1 / fc2, head.
    For a sequence model (``resolution`` ``(T,)``): no patch embedding, EGA's energy projection
    per block, and the tied LM head over every position."""
    if isinstance(cfg, SequenceConfig):
        return _sequence_gemm_shapes(cfg, resolution[0], batch)
    gh, gw = resolution[0] // cfg.patch_size, resolution[1] // cfg.patch_size
    tokens = gh * gw + cfg.num_prefix_tokens
    d, heads, hidden, rows = cfg.embed_dim, cfg.num_heads, int(cfg.embed_dim * cfg.mlp_ratio), batch * tokens
    head_dim = d // heads
    block = [
        (1, rows, d, 3 * d),  # qkv
        (batch * heads, tokens, head_dim, tokens),  # q @ k^T
        (batch * heads, tokens, tokens, head_dim),  # softmax(.) @ v
        (1, rows, d, d),  # proj
        (1, rows, d, hidden),  # fc1
        (1, rows, hidden, d),  # fc2
    ]
    patch = (1, batch * gh * gw, cfg.in_chans * cfg.patch_size**2, d)
    head = (1, batch, d, cfg.num_classes)
    return [patch, *block * cfg.depth, head]


def _sequence_gemm_shapes(cfg: SequenceConfig, length: int, batch: int) -> list[tuple[int, int, int, int]]:
    d, heads, hidden, rows = cfg.embed_dim, cfg.num_heads, int(cfg.embed_dim * cfg.mlp_ratio), batch * length
    block = [
        (1, rows, d, 3 * d),
        (batch * heads, length, d // heads, length),
        (batch * heads, length, length, d // heads),
        (1, rows, d, d),
        (1, rows, d, hidden),
        (1, rows, hidden, d),
    ]
    if cfg.attention == "ega":
        block.append((1, rows, d, heads))  # energy r = x w_E + b_E, one scalar per head
    return [*block * cfg.depth, (1, rows, d, cfg.vocab_size)]


def model_flops(cfg, resolution: tuple[int, int], batch: int) -> int:
    """FLOPs of one forward counted from the GEMMs (elementwise work, softmax, LayerNorm and the
    positional step are a few percent and left out, as in the usual ViT counts)."""
    return sum(2 * count * m * k * n for count, m, k, n in gemm_shapes(cfg, resolution, batch))
