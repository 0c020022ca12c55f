"""Fused SaPE² attention (flash-attention style): the bias is computed tile by tile inside the
attention kernel and never written to memory.

Program ``(i, bh)`` owns the ``BLOCK`` queries of tile ``i``. For each key tile ``j`` it computes
``S = s_attn · q_I k_Jᵀ + c · (‖Zx_I − Zx_J‖ + ‖Zy_I − Zy_J‖)`` (the bias tile by
``kernels._bias_tile``, exactly as the bias kernel computes it; zero for prefix rows/columns),
then updates the running maximum, normaliser and output of an online softmax. Extra memory beyond q, k, v and the output:
none (the signatures are rebuilt in registers). With ``c = s_attn = d^-1/2`` this is Eq. 16.

Importing this module needs Triton (``pip install 'deploykit[triton]'``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from deploykit.plugins.sape2.kernels import BLOCK, _bias_tile, kernel_constants


@triton.jit
def sape2_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_x_ptr,
    table_y_ptr,
    out_ptr,
    H: tl.constexpr,
    W: tl.constexpr,
    P: tl.constexpr,
    D: tl.constexpr,
    M: tl.constexpr,
    SCALE: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GATHER: tl.constexpr,
    ATTN_SCALE: tl.constexpr,
    BIAS_SCALE: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK), B·h)``; q, k, v, out ``[B·h, T, D]``; tables ``[D, M]``."""
    T: tl.constexpr = P + H * W
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q_ptr += bh * T * D
    k_ptr += bh * T * D
    v_ptr += bh * T * D
    q_i = tl.load(q_ptr + rows[:, None] * D + offs_d[None, :], mask=(rows[:, None] < T) & mask_d[None, :], other=0.0).to(tl.float32)
    running_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    normaliser = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    for start in range(0, T, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_range = cols < T
        kv_mask = in_range[:, None] & mask_d[None, :]
        k_j = tl.load(k_ptr + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v_j = tl.load(v_ptr + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        bias = _bias_tile(q_ptr, k_ptr, table_x_ptr, table_y_ptr, rows, cols, H, W, P, D, M, SCALE, MODE, BLOCK, BLOCK_D, BLOCK_M, GATHER)
        scores = tl.dot(q_i, tl.trans(k_j), input_precision="ieee") * ATTN_SCALE + bias * BIAS_SCALE
        scores = tl.where(in_range[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        normaliser = normaliser * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs, v_j, input_precision="ieee")
        running_max = new_max
    out = acc / normaliser[:, None]
    tl.store(
        out_ptr + bh * T * D + rows[:, None] * D + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < T) & mask_d[None, :],
    )


def sape2_attention_triton(q, k, v, table_x, table_y, grid, scale, mode, num_prefix_tokens, bias_divided_by_sqrt_d=True, gather=None):
    """``softmax(q kᵀ/√d + c·bias) v`` ``[B, h, T, d]`` with ``c = 1/√d`` (Eq. 16) or 1, never
    materialising the ``[T, T]`` bias."""
    import torch

    B, h, T, D = q.shape
    out = torch.empty_like(q)
    consts = kernel_constants(grid, num_prefix_tokens, D, table_x.shape[1], scale, mode, gather)
    attn_scale = D**-0.5
    sape2_attention_kernel[(triton.cdiv(T, BLOCK), B * h)](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        table_x.contiguous(),
        table_y.contiguous(),
        out,
        **consts,
        ATTN_SCALE=attn_scale,
        BIAS_SCALE=attn_scale if bias_divided_by_sqrt_d else 1.0,
    )
    return out
