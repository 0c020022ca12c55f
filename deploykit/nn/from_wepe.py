"""The WePE authors' ViT-Ti checkpoints as deploykit models (``deploykit import wepe``).

``W_Ti.py`` of github.com/1131230221/Weierstrass-Elliptic-Function-Positional-Encoding saves
``model.state_dict()`` of its ``ImprovedViT_Ti`` as ``best_wef_vit_ti.pth`` (and the same weights
under ``model`` in its resume file ``checkpoint_vit_ti.pth``). The weights move by name:

=========================================  ==============================================
``W_Ti.py``                                deploykit
=========================================  ==============================================
``patch_embed.{weight,bias}`` (a Conv2d)   ``patch_embed.proj.*``
``patch_norm.*``                           ``patch_embed.norm.*`` (``embed_norm``)
``pos_encoding.projection.{0,1}.*``        ``pos_enc.proj.*``, ``pos_enc.norm.*``
``pos_encoding.cls_pos_embedding``         ``pos_enc.cls_pos``
``pos_encoding.pos_scale`` ``[1]``         ``pos_enc.pos_scale`` ``[]``
``pos_encoding.log_alpha_scale``           ``pos_enc.alpha_raw`` (``alpha_scale_param="exp"``)
``pos_encoding.alpha_learn``               ``pos_enc.omega3_raw`` (``clamp_omega3``)
``blocks.N.attn.in_proj_{weight,bias}``    ``blocks.N.attn.qkv.*`` (rows q, k, v, as timm)
``blocks.N.attn.out_proj.*``               ``blocks.N.attn.proj.*``
``blocks.N.mlp.{0,3}.*``                   ``blocks.N.mlp.{fc1,fc2}.*``
=========================================  ==============================================

The file says the depth, width, classes, patch size, input channels, MLP width and whether ℘′ is
fed (the projection's input width, 4 or 2). It does not say the heads (``nn.MultiheadAttention``'s
``in_proj_weight`` is ``[3D, D]`` for any head count) or the image size (WePE keeps no table of
positions): ``deploykit.cli.importers`` assumes the script's 3 and 224. ``W_Ti.py`` fixes the rest in
code, and the config records it: LayerNorm eps 1e-5 everywhere, exact GELU, class-token pooling,
the square lattice ``ω1 = ω3 = ϖ`` (``g3 = 0``), the mapping scale 0.4, ``α_scale = exp(·)``
clamped to [0.002, 0.8], ``ω3′`` clamped to [0.02, 8], ``β_pos`` scaling the class-token row too,
and its evaluation transform (``Resize((224, 224))``: a bilinear squash, CIFAR-100 mean and std).

One difference is kept on purpose: deploykit evaluates ℘ exactly, where ``W_Ti.py`` sums the
lattice over ``|m|, |n| ≤ 12``: on the model ``tests/nn/test_from_wepe.py`` records, 1.6e-4
relative on ℘ and 3.7e-5 on the logits (it measures both), inside fp32 validation (1e-4).
"""

from __future__ import annotations

import re

from torch import Tensor

from deploykit.encodings import get_config
from deploykit.encodings.wepe import LEMNISCATE
from deploykit.errors import CheckpointError, ConfigError
from deploykit.nn.checkpoint import Imported, TrainingCheckpoint, block_count, imported_model, shape_of
from deploykit.nn.vit import ViTConfig

# (official key, deploykit key) patterns: every key W_Ti.py's ImprovedViT_Ti saves, and only those.
KEY_MAP = tuple(
    (re.compile(official), ours)
    for official, ours in (
        (r"patch_embed\.(weight|bias)", r"patch_embed.proj.\1"),
        (r"patch_norm\.(weight|bias)", r"patch_embed.norm.\1"),
        (r"cls_token", "cls_token"),
        (r"pos_encoding\.projection\.0\.(weight|bias)", r"pos_enc.proj.\1"),
        (r"pos_encoding\.projection\.1\.(weight|bias)", r"pos_enc.norm.\1"),
        (r"pos_encoding\.cls_pos_embedding", "pos_enc.cls_pos"),
        (r"pos_encoding\.pos_scale", "pos_enc.pos_scale"),
        (r"pos_encoding\.log_alpha_scale", "pos_enc.alpha_raw"),
        (r"pos_encoding\.alpha_learn", "pos_enc.omega3_raw"),
        (r"blocks\.(\d+)\.(norm1|norm2)\.(weight|bias)", r"blocks.\1.\2.\3"),
        (r"blocks\.(\d+)\.attn\.in_proj_(weight|bias)", r"blocks.\1.attn.qkv.\2"),
        (r"blocks\.(\d+)\.attn\.out_proj\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
        (r"blocks\.(\d+)\.mlp\.0\.(weight|bias)", r"blocks.\1.mlp.fc1.\2"),
        (r"blocks\.(\d+)\.mlp\.3\.(weight|bias)", r"blocks.\1.mlp.fc2.\2"),
        (r"(norm|head)\.(weight|bias)", r"\1.\2"),
    )
)
EXPECTED = "patch_embed, patch_norm, cls_token, pos_encoding.*, blocks.N.{norm1,attn.in_proj_*,attn.out_proj,norm2,mlp.0,mlp.3}, norm, head"
# Keys of the repository's other variants, refused by name: what they are, not just "unexpected".
VARIANTS = {
    "pos_embedding": "W_Ti.py's learned-APE baseline (use_wef=False), not WePE",
    # projection_type='mlp': Linear, LayerNorm, GELU, Dropout, Linear (4), LayerNorm (5)
    "pos_encoding.projection.4.weight": "the MLP projection (projection_type='mlp'); deploykit's WePE projects with one Linear",
    "pos_encoding.proj.0.weight": "train_wef_cifar_subsets.py's model, whose keys W_Ti.py's do not match",
}
# What W_Ti.py's test_transform does to an image: Resize((224, 224)) (PIL bilinear, no crop),
# ToTensor, Normalize with CIFAR-100's mean and std.
EVAL_TRANSFORM = dict(
    mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762), crop_pct=1.0, crop_mode="squash", interpolation="bilinear"
)
NORM_EPS = 1e-5  # nn.LayerNorm's default: every norm of ImprovedViT_Ti
# The keys the sizes are read from (and WePE's own scale), by their W_Ti.py names.
REQUIRED = ("patch_embed.weight", "pos_encoding.projection.0.weight", "pos_encoding.pos_scale", "blocks.0.mlp.0.weight", "head.weight")


def convert(checkpoint: TrainingCheckpoint, ema: bool = False, *, num_heads: int, img_size: int) -> Imported:
    """``W_Ti.py``'s ``ImprovedViT_Ti`` as a deploykit ``VisionTransformer`` computing its forward.

    Args:
        checkpoint: the file as ``read_training_checkpoint`` reads it.
        ema: take the EMA copy (``W_Ti.py`` writes none, so this is refused).
        num_heads: attention heads per block (not in the file).
        img_size: the training resolution, the model's default input (not in the file).

    Raises:
        CheckpointError: a file of another kind (its first foreign key named) or weights that
            do not fit.
        ConfigError: assumptions the weights refuse (heads not dividing the width, ...).
    """
    official = checkpoint.chosen(ema)
    state = renamed(official, checkpoint.path)
    cfg = config_from_weights(official, checkpoint.path, num_heads=num_heads, img_size=img_size)
    model = imported_model(cfg, state, checkpoint.path)
    enc = model.pos_enc
    read = dict(
        depth=cfg.depth,
        embed_dim=cfg.embed_dim,
        mlp_hidden_dim=cfg.hidden_dim,
        patch_size=cfg.patch_size,
        num_classes=cfg.num_classes,
        omega3=round(float(enc.omega3().detach()), 4),
        alpha_scale=round(float(enc.alpha_scale().detach()), 4),
    )
    return Imported(model, f"wepe:{checkpoint.path}", read, dict(num_heads=num_heads, img_size=img_size))


def renamed(official: dict[str, Tensor], path) -> dict[str, Tensor]:
    """The official state dict under deploykit's names (``KEY_MAP``).

    Raises:
        CheckpointError: naming the first key ``W_Ti.py`` does not save, or the first of
            ``REQUIRED`` the file lacks.
    """
    state = {}
    for key, value in official.items():
        ours = next((pattern.sub(name, key) for pattern, name in KEY_MAP if pattern.fullmatch(key)), None)
        if ours is None:
            what = VARIANTS.get(key, f"expected {EXPECTED}")
            raise CheckpointError(f"{path} is not a checkpoint of W_Ti.py's ImprovedViT_Ti: its key {key!r} is not one it saves ({what})")
        state[ours] = value
    missing = next((key for key in REQUIRED if key not in official), None)
    if missing is not None:
        raise CheckpointError(f"{path} is not a whole checkpoint of W_Ti.py's ImprovedViT_Ti: it has no {missing!r}")
    if state["pos_enc.pos_scale"].numel() == 1:  # nn.Parameter(torch.ones(1)); deploykit's is a scalar
        state["pos_enc.pos_scale"] = state["pos_enc.pos_scale"].reshape(())
    return state


def config_from_weights(official: dict[str, Tensor], path, *, num_heads: int, img_size: int) -> ViTConfig:
    """The ``ViTConfig`` of ``W_Ti.py``'s weights (``renamed`` checked them): sizes from their
    shapes, the rest as ``W_Ti.py`` fixes it in code."""
    dim, in_chans, patch, _ = shape_of(official, "patch_embed.weight", 4, path)
    hidden = shape_of(official, "blocks.0.mlp.0.weight", 2, path)[0]
    encoding = get_config(
        "wepe",
        omega1=LEMNISCATE,
        lattice_omega3=LEMNISCATE,
        alpha_u=0.4,
        alpha_v=0.4,
        alpha_scale_param="exp",
        clamp_omega3=True,
        use_derivative=shape_of(official, "pos_encoding.projection.0.weight", 2, path)[1] == 4,
        scale_cls=True,
        norm_eps=NORM_EPS,
        feature_clamp=1e4,
    )
    try:
        return ViTConfig(
            img_size=img_size,
            patch_size=patch,
            in_chans=in_chans,
            num_classes=shape_of(official, "head.weight", 2, path)[0],
            embed_dim=dim,
            depth=block_count(official, path),
            num_heads=num_heads,
            mlp_ratio=hidden / dim,
            mlp_hidden_dim=hidden,
            qkv_bias="blocks.0.attn.in_proj_bias" in official,
            class_token=True,
            global_pool="token",
            embed_norm=True,
            norm_eps=NORM_EPS,
            encoding=encoding,
            **EVAL_TRANSFORM,
        )
    except ConfigError as err:
        raise ConfigError(
            f"cannot import {path} with num_heads {num_heads} and img_size {img_size}: {err} (see --num-heads, --img-size)"
        ) from err
