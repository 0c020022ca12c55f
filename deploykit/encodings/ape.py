"""Learned absolute position embedding (ViT baseline, Dosovitskiy et al. 2021).

The table is timm's ``pos_embed`` ``[1, P + gh0 * gw0, D]`` (prefix tokens embedded too, timm's
default ``no_embed_class=False``). For another grid the patch part is resampled bicubically,
as timm's ``resample_abs_pos_embed`` does, in float64 on the host; at export the resampled table
is a constant, so the graph holds no Resize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deploykit.encodings._registry import register_encoding
from deploykit.encodings.base import EncodingConfig, Hook, PETables, PositionalEncoding, TrunkDims

_MODES = ("bicubic", "bilinear", "nearest")


@dataclass(frozen=True)
class ApeConfig(EncodingConfig):
    """Options of the learned APE.

    Attributes:
        interpolation: how the patch table is resized to another grid (timm uses bicubic).
        antialias: antialiased downsampling when the target grid is smaller (timm default False).
    """

    interpolation: str = "bicubic"
    antialias: bool = False

    def __post_init__(self):
        self.check_choices(interpolation=_MODES)


def resample_pos_embed(
    pos_embed: Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int,
    interpolation: str = "bicubic",
    antialias: bool = False,
) -> Tensor:
    """Resize the patch part of ``pos_embed`` ``[1, P + N0, D]`` to ``new_grid``; prefix rows kept.

    Computed in the dtype of ``pos_embed`` (callers pass float64), and joined by concatenation.
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


@register_encoding("ape", ApeConfig)
class LearnedAPE(PositionalEncoding):
    """Learned absolute position embedding added to the tokens."""

    hook = Hook.TOKENS
    top_level_keys = ("pos_embed",)

    def __init__(self, config: ApeConfig, dims: TrunkDims):
        super().__init__(config, dims)
        num_tokens = dims.num_prefix_tokens + dims.grid[0] * dims.grid[1]
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, dims.embed_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def tables(self, grid: tuple[int, int]) -> PETables:
        table = resample_pos_embed(
            self.pos_embed.double(),
            self.dims.grid,
            grid,
            self.dims.num_prefix_tokens,
            self.config.interpolation,
            self.config.antialias,
        )
        return PETables(model={"pos_embed": table})

    def apply_tokens(self, x: Tensor, tables: dict[str, Tensor]) -> Tensor:
        return x + tables["pos_embed"]
