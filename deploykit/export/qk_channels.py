"""Reorder each head's q/k channels at export so the encoding mixes contiguous slices.

Rotary encodings rotate interleaved channel pairs and GeoPE its channel triplets; read in the
trained layout, that is a strided Slice or a last-axis Gather per q and k in every block, which
ONNX Runtime copies one element at a time (GeoPE's two gathers were a fifth of a ViT-S forward).
Permuting the q and k output rows of every ``qkv`` projection by the same order (and the q/k
norms' weights with them: a norm over a whole head does not see the order) changes no q·k, so
the model computes the same function while the encoding reads whole slices
(``PositionalEncoding.contiguous_qk_form``). Values and v are untouched; the graph's weights keep
their timm names with the q/k rows reordered.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from deploykit.encodings import PositionalEncoding
from deploykit.nn.factory import Model


def with_contiguous_qk_channels(model: Model) -> tuple[Model, torch.Tensor | None]:
    """``(model, None)`` when its encoding already reads contiguous channels (or has no q/k hook);
    otherwise a copy with every block's q/k projection rows reordered and the encoding swapped for
    its contiguous form, with the order (``QKChannelOrder.order``). The caller's model is never
    changed."""
    pos_enc = model.pos_enc  # a sequence model's MoPE1d (None with a learned table) mixes no q/k channels
    form = pos_enc.contiguous_qk_form() if isinstance(pos_enc, PositionalEncoding) else None
    if form is None:
        return model, None
    reordered = copy.deepcopy(model)
    reordered.pos_enc = form.encoding
    projections = [m.qkv for m in reordered.modules() if isinstance(getattr(m, "qkv", None), nn.Linear)]
    if len(projections) != model.cfg.depth:
        raise RuntimeError(f"expected one qkv projection per block ({model.cfg.depth}), found {len(projections)}")
    # q/k norms (timm's qk_norm) normalise over a head's channels, which a permutation keeps; their
    # per-channel weight and bias follow the channels.
    norms = [
        n for m in reordered.modules() for n in (getattr(m, "q_norm", None), getattr(m, "k_norm", None)) if isinstance(n, nn.LayerNorm)
    ]
    with torch.no_grad():
        for qkv in projections:
            _reorder_qk_rows(qkv, model.cfg.num_heads, form.order)
        for norm in norms:
            for param in (norm.weight, norm.bias):
                if param is not None:
                    param.data = param.data[form.order.to(param.device)]
    return reordered, form.order


def _reorder_qk_rows(qkv: nn.Linear, heads: int, order: torch.Tensor) -> None:
    """Rows of ``qkv`` are ``[3, heads, d]`` (q, k, v); reorder the ``d`` axis of q and k."""
    for param in (qkv.weight, qkv.bias):
        if param is None:
            continue
        rows = param.data.view(3, heads, -1, *param.shape[1:])
        rows[:2] = rows[:2, :, order.to(param.device)]  # indexing copies before the write
