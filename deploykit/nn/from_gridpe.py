"""GridPE's official checkpoints as deploykit models (``deploykit import gridpe FILE``).

BoyangL1/Gridpe trains its image models with DeiT's ``VIT/deit/main.py``, which saves
``best_checkpoint.pth`` = ``{'model', 'optimizer', 'lr_scheduler', 'epoch', 'model_ema', 'scaler',
'args'}`` (``args``: the script's ``argparse.Namespace``). The models (``models_gridpe.py``'s
``gridpe_deit_{small,base,large}_patch16_LS``) are DeiT-III "LS" trunks whose attention rotates q
and k by GridPE (``VIT/GridAttn/gridAttn.py``); everything about them is read from the file:

==============================  =====================================================
read                            from
==============================  =====================================================
depth                           the ``blocks.N.`` keys
heads                           ``blocks.0.attn.grid_pe.omegas`` ``[heads, 3, 2]``
width, patch, channels          ``cls_token``, ``patch_embed.proj.weight``
MLP width, qkv bias, classes    ``blocks.0.mlp.fc1.weight``, ``blocks.0.attn.qkv.bias``, ``head.weight``
GridPE directions               every block's ``omegas`` (a random draw per block and head,
                                unseeded: never regenerated)
input size, eval crop           ``args.input_size``, ``args.eval_crop_ratio``
model name, epoch               ``args.model``, ``epoch``
==============================  =====================================================

What the code fixes for every ``gridpe_*`` model is set here, not assumed: LayerNorm eps 1e-6,
LayerScale on both branches, class-token pooling, no absolute position embedding
(``use_ape=False``), and GridPE's frequency base 10000 (``mag_s = 10000^(-2·3·s/head_dim)``),
directions in direction-major order (``q.view(B, H, N, 3, S, 2)``: ``p = i·S + s``), interleaved
pairs, raw integer ``(row, col)`` patch positions (recomputed for every input size), the class
token unrotated. The evaluation transform is DeiT's ``datasets.build_transform``: resize the
short side to ``int(input_size / eval_crop_ratio)`` (bicubic), centre-crop ``input_size``,
ImageNet mean/std (no resize or crop at all for ``input_size <= 32``).

Names: ``blocks.N.gamma_1``/``gamma_2`` → ``blocks.N.ls1.gamma``/``ls2.gamma`` (timm's), the
per-block ``blocks.N.attn.grid_pe.omegas`` ``[H, 3, 2]`` → ``pos_enc.omegas`` ``[depth, H, 3, 2]``;
every other key keeps its name. A file that is not such a checkpoint is refused in one line
naming the first key that is not what a GridPE DeiT holds.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor

from deploykit._fields import show
from deploykit.encodings import get_config
from deploykit.errors import CheckpointError, ConfigError
from deploykit.nn.checkpoint import Imported, TrainingCheckpoint, block_count, imported_model, shape_of
from deploykit.nn.vit import ViTConfig

# VIT/GridAttn/gridAttn.py: mag = 1 / 10000 ** (2 * n * s / head_dim), n = 3 directions in 2-D.
OFFICIAL_BASE = 10000.0
DIRECTIONS, SPATIAL_DIM = 3, 2
# models_gridpe.py: norm_layer=partial(nn.LayerNorm, eps=1e-6) in every gridpe_* model;
# models_v2.vit_models: LayerScale initialised to init_scale=1e-4 (the trained gammas replace it).
NORM_EPS = 1e-6
INIT_SCALE = 1e-4
# timm.data.constants, which datasets.build_transform normalises with.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# main.py's parser defaults, for the arguments a file's args lack.
MAIN_DEFAULTS = {"input_size": 224, "eval_crop_ratio": 0.875}

# What every gridpe_* state dict holds, in the order checked: the first one absent names the refusal.
_EXPECTED = (
    ("cls_token", "the class token [1, 1, width]"),
    ("patch_embed.proj.weight", "the patch embedding's convolution [width, channels, patch, patch]"),
    ("blocks.0.attn.qkv.weight", "block 0's fused qkv projection [3·width, width]"),
    ("blocks.0.attn.grid_pe.omegas", "block 0's GridPE directions [heads, 3, 2] (a plain DeiT or RoPE-ViT has none)"),
    ("blocks.0.gamma_1", "block 0's LayerScale (the DeiT-III 'LS' block)"),
    ("blocks.0.mlp.fc1.weight", "block 0's MLP"),
    ("norm.weight", "the final LayerNorm"),
    ("head.weight", "the classifier [classes, width]"),
)


def convert(checkpoint: TrainingCheckpoint, ema: bool = False) -> Imported:
    """The deploykit model whose forward is the official ``gridpe_vit_models.forward``.

    Args:
        checkpoint: the file as ``main.py`` saved it (``read_training_checkpoint``).
        ema: take ``model_ema`` instead of ``model``.

    Raises:
        CheckpointError: not a GridPE DeiT checkpoint (the first key that is not one named, with
            what was expected), weights that disagree with the file's ``args``, or no EMA copy.
        ConfigError: sizes deploykit's trunk refuses.
    """
    state = checkpoint.chosen(ema)
    weights = "model_ema" if ema else checkpoint.container or "the state dict"
    where = f"{checkpoint.path} ({weights})"
    _check_keys(state, where)
    depth = _depth(state, where)
    heads = _heads(state, depth, where)
    width, channels, patch = _patch_embedding(state, where)
    classes = shape_of(state, "head.weight", 2, where)[0]
    hidden = shape_of(state, "blocks.0.mlp.fc1.weight", 2, where)[0]
    args, assumed = _arguments(checkpoint, where)
    _check_args(args, heads, classes, where)
    epoch = checkpoint.extras.get("epoch")
    known = {"model": args["model"], "epoch": epoch if type(epoch) is int else None}  # anything else is no epoch main.py saves
    read = {
        **{k: v for k, v in known.items() if v is not None},  # a bare state dict names neither
        "weights": weights,
        "depth": depth,
        "heads": heads,
        "embed_dim": width,
        "patch_size": patch,
        "classes": classes,
        "input_size": args["input_size"],
        "eval_crop_ratio": args["eval_crop_ratio"],
    }
    try:
        cfg = ViTConfig(
            img_size=args["input_size"],
            patch_size=patch,
            in_chans=channels,
            num_classes=classes,
            embed_dim=width,
            depth=depth,
            num_heads=heads,
            mlp_ratio=hidden / width,
            mlp_hidden_dim=hidden,
            qkv_bias="blocks.0.attn.qkv.bias" in state,
            class_token=True,
            global_pool="token",
            init_values=INIT_SCALE,
            norm_eps=NORM_EPS,
            encoding=official_encoding(),
            **eval_preprocessing(args["input_size"], args["eval_crop_ratio"]),
        )
    except ConfigError as err:
        raise ConfigError(f"cannot import {where}: {err}") from err
    model = imported_model(cfg, state_dict_from_gridpe(state, depth), where)
    return Imported(model, f"gridpe:{checkpoint.path}", read, assumed)


def official_encoding():
    """GridPE as ``gridAttn.py`` computes it (module doc); ``indivisible_head_dim="error"`` as its
    ``assert head_dim % (2 * (dimension + 1)) == 0``."""
    return get_config(
        "gridpe",
        base=OFFICIAL_BASE,
        orientation="random",
        layout="direction_major",
        coords="raw",
        direction_norm="unit",
        indivisible_head_dim="error",
        pairs="interleaved",
    )


def eval_preprocessing(input_size: int, eval_crop_ratio: float) -> dict[str, Any]:
    """``ViTConfig``'s preprocessing fields for DeiT's eval transform (``datasets.build_transform``).

    Raises:
        ConfigError: a crop ratio above 1 (DeiT would pad the crop; deploykit's crop_pct is at most 1).
    """
    if not 0 < eval_crop_ratio <= 1:
        raise ConfigError(f"args.eval_crop_ratio {eval_crop_ratio!r}: deploykit's preprocessing takes crop ratios in (0, 1]")
    # Up to 32 px DeiT resizes nothing (resize_im = input_size > 32): a crop_pct of 1 keeps an input of that size as it is.
    crop_pct = 1.0 if input_size <= 32 else float(eval_crop_ratio)
    return dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, crop_pct=crop_pct, crop_mode="center", interpolation="bicubic")


def state_dict_from_gridpe(state: dict[str, Tensor], depth: int) -> dict[str, Tensor]:
    """An official state dict under deploykit's names (module doc). Pure renaming, and the
    per-block directions stacked (float32 values, exactly, in the encoding's float64 buffer)."""
    out = {}
    for key, value in state.items():
        block, _, leaf = key.rpartition(".")
        if leaf in ("gamma_1", "gamma_2"):
            out[f"{block}.ls{leaf[-1]}.gamma"] = value
        elif not key.endswith(".attn.grid_pe.omegas"):
            out[key] = value
    out["pos_enc.omegas"] = torch.stack([state[f"blocks.{i}.attn.grid_pe.omegas"] for i in range(depth)]).to(torch.float64)
    return out


def _not_gridpe(where: str, key: str, expected: str, state: dict[str, Tensor]) -> CheckpointError:
    first = ", ".join(list(state)[:3]) + (", ..." if len(state) > 3 else "")
    return CheckpointError(
        f"{where} is not a GridPE DeiT checkpoint (BoyangL1/Gridpe's VIT/deit/main.py): {key} {expected}; its weights begin {first}"
    )


def _check_keys(state: dict[str, Tensor], where: str) -> None:
    for key, what in _EXPECTED:
        if key not in state:
            raise _not_gridpe(where, key, f"is missing, expected {what}", state)
    if "pos_embed" in state:  # gridpe_vit_models(use_ape=True): no gridpe_* model of the repository builds one
        raise _not_gridpe(where, "pos_embed", "is there, expected none: the gridpe_* models have no absolute position embedding", state)


def _depth(state: dict[str, Tensor], where: str) -> int:
    try:
        return block_count(state, where)
    except CheckpointError as err:
        raise _not_gridpe(where, "the blocks", f"are not numbered 0 to depth-1 ({err})", state) from err


def _heads(state: dict[str, Tensor], depth: int, where: str) -> int:
    omegas = state["blocks.0.attn.grid_pe.omegas"]
    if omegas.ndim != 3 or tuple(omegas.shape[1:]) != (DIRECTIONS, SPATIAL_DIM) or not omegas.shape[0]:
        raise _not_gridpe(
            where,
            f"blocks.0.attn.grid_pe.omegas {list(omegas.shape)}",
            "expected [heads, 3, 2]: GridPE of 2-D image positions, 3 directions each",
            state,
        )
    for i in range(depth):
        key = f"blocks.{i}.attn.grid_pe.omegas"
        if key not in state or state[key].shape != omegas.shape:
            found = list(state[key].shape) if key in state else "missing"
            raise _not_gridpe(where, f"{key} ({found})", f"expected {list(omegas.shape)} as in block 0", state)
    return omegas.shape[0]


def _patch_embedding(state: dict[str, Tensor], where: str) -> tuple[int, int, int]:
    weight = state["patch_embed.proj.weight"]
    width = shape_of(state, "cls_token", 3, where)[-1]
    if weight.ndim != 4 or 0 in weight.shape or weight.shape[2] != weight.shape[3] or weight.shape[0] != width:
        raise _not_gridpe(where, f"patch_embed.proj.weight {list(weight.shape)}", "expected [width, channels, patch, patch]", state)
    return weight.shape[0], weight.shape[1], weight.shape[2]


# The arguments of main.py's parser that the import reads, and what argparse gives each
# (``type=int``, ``type=float``, a string): a file holding anything else was not written by it.
_ARG_KINDS = {"input_size": "an integer", "eval_crop_ratio": "a number", "num_heads": "an integer", "nb_classes": "an integer"}


def _arguments(checkpoint: TrainingCheckpoint, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``args``' model name, input size and eval crop; main.py's defaults (reported as assumed)
    for any of the last two a file does not hold. Each value is checked to be of the type
    main.py's parser gives it before anything compares, prints or builds from it.

    Raises:
        CheckpointError: a value of another type, named and shown short.
    """
    args, assumed = {k: v for k, v in checkpoint.args.items() if k in (*_ARG_KINDS, "model")}, {}
    for name, kind in _ARG_KINDS.items():
        if name in args:
            args[name] = _typed(args[name], kind, f"{where}: args.{name}")
    if not isinstance(args.setdefault("model", None), (str, type(None))):
        raise CheckpointError(f"{where}: args.model is {show(args['model'])}; main.py's --model is a model name")
    for name, default in MAIN_DEFAULTS.items():
        if name not in args:
            args[name] = assumed[name] = default
    return args, assumed


def _typed(value: Any, kind: str, what: str) -> int | float:
    """``value`` as main.py's parser would have given it (numpy's numbers taken as Python's)."""
    if not isinstance(value, bool) and isinstance(value, numbers.Integral):
        return int(value)
    if kind == "a number" and isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise CheckpointError(f"{what} is {show(value)}; main.py's parser gives {kind}{' (finite)' * (kind == 'a number')}")


def _check_args(args: dict[str, Any], heads: int, classes: int, where: str) -> None:
    """The file's ``args`` describe the weights beside them (main.py built the model from them)."""
    name = args.get("model")
    if name is not None and not name.startswith("gridpe_"):
        raise CheckpointError(f"{where}: args.model is {show(name)}, not a gridpe_* model, although the weights hold GridPE directions")
    for arg, held, what in (("num_heads", heads, "blocks.0.attn.grid_pe.omegas holds"), ("nb_classes", classes, "head.weight has")):
        if arg in args and args[arg] != held:
            raise CheckpointError(f"{where}: args.{arg} is {args[arg]} but {what} {held}; the weights are not the model the args describe")
