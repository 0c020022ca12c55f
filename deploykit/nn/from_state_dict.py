"""A ViT or DeiT-III trained elsewhere with one of deploykit's encodings (``deploykit import vit``).

SaPE² and GeoPE have no public training code: a model trained with them comes as a state dict in
timm's ViT names (``patch_embed.proj.weight``, ``blocks.{i}.attn.qkv.weight``, ``ls1.gamma`` for
DeiT-III's LayerScale, ...) plus the encoding's own parameters under deploykit's names
(``pos_enc.blocks.{i}.sape_x.pos_emb`` for SaPE², none for GeoPE), bare or in a training script's
container. What the weights say is read from them: width, depth, patch size, channels, classes,
MLP width, qkv bias, LayerScale, class and register tokens, the APE's grid, SaPE²'s table size.
What they cannot say comes from options: the head count (``--model``'s, as a packed qkv does not
record it), the encoding and its options (``--encoding``, ``--set``), the image size where no
APE gives it. A file that is not a timm-named ViT is refused naming its first key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from torch import Tensor

from deploykit.encodings import get_config
from deploykit.errors import CheckpointError, ConfigError
from deploykit.nn.checkpoint import Imported, TrainingCheckpoint, block_count, imported_model, options_applied, shape_of
from deploykit.nn.factory import create_model
from deploykit.nn.vit import ViTConfig

# What every timm ViT state dict holds, whatever its encoding.
_TRUNK_KEYS = ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight", "norm.weight")


def convert(
    checkpoint: TrainingCheckpoint,
    ema: bool = False,
    model: str = "vit_small_patch16",
    encoding: str = "ape",
    img_size: int = 0,
    options: Sequence[str] = (),
) -> Imported:
    """The model a timm-named ViT state dict with ``encoding`` describes (see the module docstring).

    Raises:
        CheckpointError: not a timm-named ViT, or weights the described model cannot take.
        ConfigError: an unknown model, encoding or option.
    """
    weights = checkpoint.chosen(ema)
    missing = [k for k in _TRUNK_KEYS if k not in weights]
    if missing:
        first = next(iter(weights))
        raise CheckpointError(
            f"{checkpoint.path} is not a ViT state dict in timm's names: its first key is {first!r} and it has no {missing[0]!r}; "
            "deploykit import vit takes timm's ViT/DeiT-III names plus the encoding's (for another paper's file, see deploykit import --help)"
        )
    base = create_model(model, encoding=encoding).cfg
    read = _read_sizes(weights, checkpoint.path)
    if read["embed_dim"] % base.num_heads:
        raise ConfigError(
            f"width {read['embed_dim']} does not split into --model {model}'s {base.num_heads} heads; pick a size with as many heads"
        )
    cfg = dataclasses.replace(base, **read, encoding=options_applied(get_config(encoding), options))
    ape = _ape_grid(weights, cfg)
    if ape is not None and "no_embed_class" in {f.name for f in dataclasses.fields(cfg.encoding)}:  # an encoding with timm's APE
        side, no_embed_class = ape
        cfg = dataclasses.replace(
            cfg, img_size=side * cfg.patch_size, encoding=dataclasses.replace(cfg.encoding, no_embed_class=no_embed_class)
        )
    elif img_size:
        cfg = dataclasses.replace(cfg, img_size=img_size)
    cfg = _encoding_sizes(cfg, weights)
    built = imported_model(cfg, weights, checkpoint.path)
    assumed = {"num_heads": cfg.num_heads, "encoding": encoding, **({} if ape else {"img_size": cfg.img_size})}
    return Imported(built, f"vit:{checkpoint.path}", {k: read[k] for k in ("depth", "embed_dim", "num_classes")}, assumed)


def _read_sizes(weights: dict[str, Tensor], source) -> dict:
    embed_dim, in_chans, patch, _ = shape_of(weights, "patch_embed.proj.weight", 4, source)
    hidden = shape_of(weights, "blocks.0.mlp.fc1.weight", 2, source)[0]
    return dict(
        embed_dim=embed_dim,
        in_chans=in_chans,
        patch_size=patch,
        depth=block_count(weights, source),
        num_classes=shape_of(weights, "head.weight", 2, source)[0] if "head.weight" in weights else 0,
        mlp_ratio=hidden / embed_dim,
        qkv_bias="blocks.0.attn.qkv.bias" in weights,
        init_values=1.0 if "blocks.0.ls1.gamma" in weights else None,  # LayerScale (DeiT-III); the weights set it
        class_token="cls_token" in weights,
        reg_tokens=shape_of(weights, "reg_token", 3, source)[1] if "reg_token" in weights else 0,
    )


def _ape_grid(weights: dict[str, Tensor], cfg: ViTConfig) -> tuple[int, bool] | None:
    """The learned APE's patch grid side and whether it leaves the prefix tokens out (timm's
    ``no_embed_class``, DeiT-III's), or None without an APE or for a table that is no square grid."""
    if "pos_embed" not in weights:
        return None
    rows, prefix = weights["pos_embed"].shape[1], int(cfg.class_token) + cfg.reg_tokens
    for no_embed_class, patches in ((False, rows - prefix), (True, rows)):
        side = math.isqrt(max(patches, 0))
        if patches > 0 and side * side == patches:
            return side, no_embed_class
    return None


def _encoding_sizes(cfg: ViTConfig, weights: dict[str, Tensor]) -> ViTConfig:
    """Encoding options the weights fix: SaPE²'s table entries (``npos_max``)."""
    table = weights.get("pos_enc.blocks.0.sape_x.pos_emb")
    if table is not None and cfg.encoding.npos_max is None:  # only SaPE² holds these tables
        return dataclasses.replace(cfg, encoding=dataclasses.replace(cfg.encoding, npos_max=table.shape[-1]))
    return cfg
