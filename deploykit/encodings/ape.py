"""Learned absolute position embedding (ViT baseline, Dosovitskiy et al. 2021).

The table is timm's ``pos_embed``: ``[1, P + gh0 * gw0, D]`` with the prefix tokens embedded too
(timm's default), or ``[1, gh0 * gw0, D]`` with ``no_embed_class`` (DeiT-III, RoPE-ViT + APE),
where the prefix tokens get no position (their rows of the baked table are zero).

For another grid the patch part is resampled as timm's ``resample_abs_pos_embed`` does (used by
``dynamic_img_size`` models in their forward and by ``set_input_size``/checkpoint loading):
``F.interpolate(mode="bicubic", align_corners=False, antialias=True)``. timm's default is
``antialias=True``, and it changes upsampling too: PyTorch's antialiased bicubic is the PIL
filter (Keys a = -0.5, weights renormalised at the edges), the plain one Keys a = -0.75 with
clamped edges. Computed in float64 on the host; at export the resampled table is a constant,
so the graph holds no Resize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deploykit.encodings._registry import register_encoding
from deploykit.encodings.base import EncodingConfig, Hook, PETables, PositionalEncoding, TrunkDims

INTERPOLATIONS = ("bicubic", "bilinear", "nearest")


@dataclass(frozen=True)
class ApeConfig(EncodingConfig):
    """Options of the learned APE.

    Attributes:
        interpolation: how the patch table is resized to another grid (timm: bicubic).
        antialias: ``F.interpolate``'s antialias, as timm's ``resample_abs_pos_embed`` (default
            True there and here); False is the plain bicubic older deploykit checkpoints used.
        no_embed_class: the table covers the patches only; prefix tokens get no position
            (timm's ``no_embed_class``).
    """

    interpolation: str = "bicubic"
    antialias: bool = True
    no_embed_class: bool = False

    def __post_init__(self):
        self.check_choices(interpolation=INTERPOLATIONS)


def resample_pos_embed(
    pos_embed: Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int,
    interpolation: str = "bicubic",
    antialias: bool = True,
) -> Tensor:
    """Resize the patch part of ``pos_embed`` ``[1, P + N0, D]`` to ``new_grid``; prefix rows kept.

    timm's ``resample_abs_pos_embed`` with the same arguments, computed in the dtype of
    ``pos_embed`` (callers pass float64; timm uses float32), joined by concatenation.
    """
    if tuple(old_grid) == tuple(new_grid):
        return pos_embed
    prefix, patches = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim = patches.shape[-1]
    # [1, N0, D] -> [1, D, gh0, gw0] -> resize -> [1, N, D]
    patches = patches.reshape(1, *old_grid, dim).permute(0, 3, 1, 2)
    align = False if interpolation != "nearest" else None
    patches = F.interpolate(patches, size=new_grid, mode=interpolation, align_corners=align, antialias=antialias)
    patches = patches.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim)
    return torch.cat([prefix, patches], dim=1)


def pos_embed_parameter(dims: TrunkDims, no_embed_class: bool) -> nn.Parameter:
    """timm's ``pos_embed`` ``[1, (P +) gh0 * gw0, D]``, zero until initialised."""
    num_tokens = (0 if no_embed_class else dims.num_prefix_tokens) + dims.grid[0] * dims.grid[1]
    return nn.Parameter(torch.zeros(1, num_tokens, dims.embed_dim))


def ape_table(pos_embed: Tensor, dims: TrunkDims, grid: tuple[int, int], config) -> Tensor:
    """The table added to the tokens ``[1, P + N, D]`` for ``grid``, float64.

    Args:
        pos_embed: the learned ``pos_embed`` parameter.
        dims: the trunk sizes (native grid, prefix tokens).
        grid: the patch grid of the input.
        config: any encoding config with ``interpolation``, ``antialias`` and ``no_embed_class``.
    """
    prefix = 0 if config.no_embed_class else dims.num_prefix_tokens
    table = resample_pos_embed(pos_embed.double(), dims.grid, grid, prefix, config.interpolation, config.antialias)
    if config.no_embed_class and dims.num_prefix_tokens:
        # timm adds the table to the patches before prepending the prefix tokens: a zero row is the same sum.
        table = torch.cat([table.new_zeros(1, dims.num_prefix_tokens, table.shape[-1]), table], dim=1)
    return table


@register_encoding("ape", ApeConfig)
class LearnedAPE(PositionalEncoding):
    """Learned absolute position embedding added to the tokens."""

    hook = Hook.TOKENS
    top_level_keys = ("pos_embed",)

    def __init__(self, config: ApeConfig, dims: TrunkDims):
        super().__init__(config, dims)
        self.pos_embed = pos_embed_parameter(dims, config.no_embed_class)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def tables(self, grid: tuple[int, int]) -> PETables:
        return PETables(model={"pos_embed": ape_table(self.pos_embed, self.dims, grid, self.config)})

    def apply_tokens(self, x: Tensor, tables: dict[str, Tensor]) -> Tensor:
        return x + tables["pos_embed"]
