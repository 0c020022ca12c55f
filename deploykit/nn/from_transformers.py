"""Hugging Face ``transformers`` checkpoints as deploykit models (``deploykit import hf DIR``).

A ``save_pretrained`` directory (``config.json`` with ``model_type`` and ``architectures``,
``model.safetensors`` in ``transformers``' names) is read without importing ``transformers``:
every config option that changes the forward is mapped onto ``ViTConfig`` or refused in one
line naming it, and the weights move by name onto deploykit's trunk (timm's names) as a strict
load, so a tensor this mapping does not place is refused too.

===================================  ==========================================================
``transformers``                     deploykit
===================================  ==========================================================
``ViTForImageClassification``        ``ape`` (plain bicubic resize, as ``interpolate_pos_encoding``),
                                     class token, ``classifier`` → ``head``
``ViTModel``                         the same trunk without head: the normed class token
                                     (``last_hidden_state[:, 0]``); its pooler (dense + tanh) is
                                     not part of that output and is left out, said in the output
``DeiTForImageClassification``       + the distillation token as one register token (its position
                                     row kept); the head reads the class token
``DeiTModel``                        the DeiT trunk: the normed class token
``Dinov2Model``                      LayerScale (``lambda1`` → ``ls1``/``ls2.gamma``), SwiGLU
                                     (``use_swiglu_ffn``); ``pooler_output``, the normed class token
``Dinov2WithRegistersModel``         + registers, which ``transformers`` gives no position: their
                                     rows of ``pos_embed`` are zero; antialiased bicubic resize
``DeiTForImageClassification``       + ``distilled``: ``distillation_classifier`` → ``head_dist`` on the
``WithTeacher``                      distillation token (timm's ``dist_token``), averaged with ``head``
``SiglipVisionModel``                no class token, ``ape`` (bicubic), tanh GELU (``gelu_pytorch_tanh``),
                                     q/k/v fused into ``qkv``; ``pooler_output``: its
                                     ``SiglipMultiheadAttentionPoolingHead`` as timm's ``map`` pooling
                                     (``probe`` → ``attn_pool.latent``, ``in_proj`` → ``q`` + ``kv``);
                                     ``vision_use_head`` false: every normed token
``SiglipForImageClassification``     the tower of ``vision_config``, mean of every normed token
                                     (``avg``), ``classifier`` → ``head``; the tower's pooling head,
                                     which its logits do not read, is left out (said in the output)
``Siglip2VisionModel``               the SigLIP tower at one image grid per graph (not NaFlex): the
                                     patch ``Linear`` as the equal convolution, the ``num_patches``
                                     table resized bilinearly with antialiasing, as its embeddings do
``DINOv3ViTModel``                   ``rope-axial`` as ``DINOv3ViTRopePositionEmbedding`` (patch
                                     centres in [-1, 1] per axis, rows first, 2π/θ^(4j/d),
                                     ``rotate_half``; timm's DINOv3 options), registers, LayerScale,
                                     q/k/v projections fused into ``qkv`` (a missing bias zero),
                                     ``use_gated_mlp`` → SwiGLU; ``pooler_output``
===================================  ==========================================================

Refused, in one line: ``Dinov2ForImageClassification`` (a head on the class token
concatenated with the mean patch token), any other ``model_type`` or architecture, and options
such as ``hidden_act`` other than exact GELU (SiLU for DINOv3's gated MLP), projections without
bias, pruned heads or non-square patches.

The preprocessing is read from ``preprocessor_config.json`` as ``transformers``' image processor
applies it: ``ViTImageProcessor`` resizes to ``size`` without cropping (``squash``, crop 1),
``DeiTImageProcessor`` resizes to ``size`` and centre-crops ``crop_size`` (``squash``),
``BitImageProcessor`` (DINOv2) resizes the short side and centre-crops (``center``),
``SiglipImageProcessor`` resizes to ``size`` (``squash``). ``Siglip2ImageProcessor`` resizes each
image to its own patch grid (NaFlex) and is refused.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from deploykit.encodings import get_config
from deploykit.errors import CheckpointError, ConfigError
from deploykit.nn.checkpoint import (
    CONFIG_FILE,
    DIRECTORY_LAYOUTS,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    Imported,
    imported_model,
    load_checkpoint,
    load_sharded_checkpoint,
)
from deploykit.nn.vit import ViTConfig

PREPROCESSOR_FILE = "preprocessor_config.json"

# PretrainedConfig's own fields and training-only settings: none changes an eval forward.
_BOOKKEEPING = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "id2label", "label2id",
    "num_labels", "problem_type", "initializer_range", "hidden_dropout_prob", "attention_probs_dropout_prob", "drop_path_rate",
    "return_dict", "output_hidden_states", "output_attentions", "use_return_dict", "chunk_size_feed_forward",
    "tie_word_embeddings", "is_encoder_decoder", "torchscript", "use_bfloat16", "finetuning_task", "tokenizer_class",
    "prefix", "bos_token_id", "pad_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "_attn_implementation_autoset", "_attn_implementation", "pruned_heads",
}  # fmt: skip
# The ViT family's options; encoder_stride is the masked-image decoder's, the pooler's only ViTModel's own.
_VIT_OPTIONS = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act", "layer_norm_eps",
    "image_size", "patch_size", "num_channels", "qkv_bias", "encoder_stride", "pooler_output_size", "pooler_act",
}  # fmt: skip
# DINOv2's: the backbone fields (out_features, ...) only configure Dinov2Backbone; the mask token is
# used only with bool_masked_pos, which an exported forward never takes.
_DINOV2_OPTIONS = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "mlp_ratio", "hidden_act", "layer_norm_eps", "image_size",
    "patch_size", "num_channels", "qkv_bias", "layerscale_value", "use_swiglu_ffn", "use_mask_token", "out_features",
    "out_indices", "stage_names", "apply_layernorm", "reshape_hidden_states", "num_register_tokens",
}  # fmt: skip
# SigLIP's vision tower (SiglipVisionConfig); SigLIP2's gives its native grid as num_patches instead of image_size.
_SIGLIP_OPTIONS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels", "image_size", "patch_size",
    "hidden_act", "layer_norm_eps", "attention_dropout", "vision_use_head",
}  # fmt: skip
_SIGLIP2_OPTIONS = (_SIGLIP_OPTIONS - {"image_size"}) | {"num_patches"}
# SiglipConfig's own fields around its vision_config: the text tower is not part of an image classifier.
_SIGLIP_OUTER = {"text_config", "vision_config", "initializer_factor"}
# transformers' hidden_act -> ViTConfig.act_layer (gelu_pytorch_tanh: F.gelu(approximate="tanh"))
_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
# DINOv3's: pos_embed_shift/jitter/rescale augment the RoPE coordinates in training only.
_DINOV3_OPTIONS = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act", "layer_norm_eps",
    "image_size", "patch_size", "num_channels", "layerscale_value", "num_register_tokens", "rope_theta", "query_bias",
    "key_bias", "value_bias", "proj_bias", "mlp_bias", "use_gated_mlp", "attention_dropout", "pos_embed_shift",
    "pos_embed_jitter", "pos_embed_rescale", "out_features", "out_indices", "stage_names", "apply_layernorm",
    "reshape_hidden_states",
}  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One ``transformers`` architecture this module maps.

    Attributes:
        model_type: the config's ``model_type``.
        prefix: where the trunk's weights sit in the file (``vit.`` under a classification head).
        head: the file has a classifier (``classifier`` → ``head``).
        options: the config keys this family reads or knows to be inert (of ``vision_config``
            where ``nested``).
        antialias: whether ``interpolate_pos_encoding`` resizes with antialiasing.
        interpolation: how it resizes (bicubic; SigLIP2 bilinear).
        nested: the options sit in the config's ``vision_config`` (``SiglipConfig``).
        distilled: DeiT's distillation head (``distillation_classifier`` → ``head_dist``).
        siglip: SigLIP's tower (``self_attn``, ``layer_norm1``, tanh GELU by default, its pooling head).
    """

    model_type: str
    prefix: str
    head: bool
    options: frozenset[str]
    antialias: bool = False
    interpolation: str = "bicubic"
    nested: bool = False
    distilled: bool = False
    siglip: bool = False


FAMILIES: dict[str, Family] = {
    "ViTForImageClassification": Family("vit", "vit.", True, frozenset(_VIT_OPTIONS)),
    "ViTModel": Family("vit", "", False, frozenset(_VIT_OPTIONS)),
    "DeiTForImageClassification": Family("deit", "deit.", True, frozenset(_VIT_OPTIONS)),
    "DeiTForImageClassificationWithTeacher": Family("deit", "deit.", True, frozenset(_VIT_OPTIONS), distilled=True),
    "DeiTModel": Family("deit", "", False, frozenset(_VIT_OPTIONS)),
    "Dinov2Model": Family("dinov2", "", False, frozenset(_DINOV2_OPTIONS)),
    # transformers' Dinov2WithRegistersEmbeddings resizes with antialias=True (Dinov2Embeddings without).
    "Dinov2WithRegistersModel": Family("dinov2_with_registers", "", False, frozenset(_DINOV2_OPTIONS), antialias=True),
    "DINOv3ViTModel": Family("dinov3_vit", "", False, frozenset(_DINOV3_OPTIONS)),
    "SiglipVisionModel": Family("siglip_vision_model", "", False, frozenset(_SIGLIP_OPTIONS), siglip=True),
    "SiglipForImageClassification": Family("siglip", "vision_model.", True, frozenset(_SIGLIP_OPTIONS), nested=True, siglip=True),
    # SigLIP2's tower at one fixed grid per graph (images in, not NaFlex's padded patch sequences);
    # transformers resizes its table bilinearly with antialiasing, per image
    "Siglip2VisionModel": Family(
        "siglip2_vision_model", "", False, frozenset(_SIGLIP2_OPTIONS), antialias=True, interpolation="bilinear", siglip=True
    ),
}
# Architectures of these model types whose forward the trunk does not compute, and why.
REFUSED = {
    "Dinov2ForImageClassification": "its head reads the class token concatenated with the mean patch token",
    "Dinov2WithRegistersForImageClassification": "its head reads the class token concatenated with the mean patch token",
}


def is_transformers_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory whose ``config.json`` is a ``transformers`` config (it names a
    ``model_type``; deploykit's own config never does)."""
    config = Path(path) / CONFIG_FILE
    if not (Path(path).is_dir() and config.is_file()):
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False  # read_config says what is wrong with it
    return isinstance(data, dict) and isinstance(data.get("model_type"), str)


def import_transformers(directory: str | os.PathLike) -> Imported:
    """The deploykit model computing the forward of the ``transformers`` model saved in ``directory``.

    Raises:
        ConfigError: a ``model_type``, architecture or option this mapping does not reproduce
            (named), or preprocessing it cannot express.
        CheckpointError: missing or unreadable files, or weights that are not the config's.
    """
    directory = Path(directory)
    data = _read_json(directory / CONFIG_FILE)
    family, architecture = _family(data, directory)
    try:  # a value of the wrong type (a string where a number goes) is refused in one line too
        cfg_fields, notes = _config_fields(data, family, architecture)
        preprocessing, read_from = _preprocessing(directory / PREPROCESSOR_FILE, cfg_fields["img_size"])
        cfg = ViTConfig(**cfg_fields, **preprocessing)
    except ConfigError as err:
        raise ConfigError(f"cannot import {directory} ({architecture}): {err}") from err
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise ConfigError(
            f"cannot import {directory} ({architecture}): a value of config.json or {PREPROCESSOR_FILE} is not of its type ({str(err)[:200]})"
        ) from err
    weights, state = _weights(directory)
    state, dropped = state_dict_from_transformers(state, family, cfg, str(weights))
    model = imported_model(cfg, state, weights)
    read = {"architecture": architecture, "depth": cfg.depth, "width": cfg.embed_dim, "heads": cfg.num_heads}
    read["output"] = _output(cfg)
    read["preprocessing"] = read_from
    if dropped:
        notes.append(f"left out {', '.join(dropped)}")
    if notes:
        read["note"] = "; ".join(notes)
    return Imported(model, f"hf:{directory}", read=read)


def _weights(directory: Path) -> tuple[Path, dict[str, Tensor]]:
    """The file the weights are named by and the state dict: ``model.safetensors``, or else the
    shards its index lists (as ``transformers`` looks for them, the single file first)."""
    single, index = directory / WEIGHTS_FILE, directory / WEIGHTS_INDEX_FILE
    if single.exists() or not index.exists():
        if not single.exists():
            raise CheckpointError(
                f"{directory} holds neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE} (save_pretrained with safe_serialization, the default, writes one)"
            )
        return single, load_checkpoint(single)
    return index, load_sharded_checkpoint(index)


def _output(cfg: ViTConfig) -> str:
    if cfg.num_classes:
        return f"{cfg.num_classes} classes" + (" (class and distillation heads averaged)" if cfg.distilled else "")
    return {"map": "the attention-pooled features (pooler_output)", "": "every normed token (last_hidden_state)"}.get(
        cfg.pool, "the normed class token"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} not found: a transformers directory holds config.json (save_pretrained writes it)") from err
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(f"cannot read {path}: {str(err)[:200]}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


def _family(data: dict[str, Any], directory: Path) -> tuple[Family, str]:
    model_type, architectures = data.get("model_type"), data.get("architectures") or []
    known_types = sorted({f.model_type for f in FAMILIES.values()})
    if model_type not in known_types:
        raise ConfigError(
            f"cannot import {directory}: transformers model_type {model_type!r} is not mapped; deploykit maps {', '.join(known_types)}"
        )
    if not (isinstance(architectures, list) and len(architectures) == 1 and isinstance(architectures[0], str)):
        raise ConfigError(f"cannot import {directory}: config.json names architectures {architectures!r}; deploykit needs exactly one")
    architecture = architectures[0]
    if architecture in REFUSED:
        raise ConfigError(f"cannot import {directory}: {architecture} is not mapped: {REFUSED[architecture]}")
    family = FAMILIES.get(architecture)
    if family is None or family.model_type != model_type:
        mapped = sorted(a for a, f in FAMILIES.items() if f.model_type == model_type)
        raise ConfigError(
            f"cannot import {directory}: architecture {architecture} is not mapped; for {model_type} deploykit maps {', '.join(mapped)}"
        )
    return family, architecture


def _square(value: Any, name: str) -> int:
    """``image_size``/``patch_size``: an int, or a pair that must be equal (deploykit's trunk is square)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ConfigError(f"{name} {list(value)} is not square; deploykit's trunk takes square patches and native sizes")
        value = value[0]
    if type(value) is not int:
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return value


def _config_fields(data: dict[str, Any], family: Family, architecture: str) -> tuple[dict[str, Any], list[str]]:
    """``ViTConfig`` fields (without preprocessing) and notes on what was left out."""
    labels = data.get("id2label") or {}
    data, where = _tower(data, family, architecture)
    act_layer = _act_layer(data, family, where)
    try:
        fields: dict[str, Any] = dict(_dims(data, family), class_token=True, global_pool="token", num_classes=0, act_layer=act_layer)
    except (ConfigError, TypeError, ValueError) as err:
        raise ConfigError(str(err)) from err
    notes = []
    if family.model_type in ("vit", "deit"):
        fields["mlp_hidden_dim"] = data.get("intermediate_size", 3072)
        fields["mlp_ratio"] = fields["mlp_hidden_dim"] / fields["embed_dim"]
        fields["reg_tokens"] = 1 if family.model_type == "deit" else 0  # DeiT's distillation token
        if not family.head and "pooler_act" in data:
            notes.append("the pooler (dense + tanh) is not the output: the normed class token is")
    elif family.siglip:
        notes += _siglip_fields(data, family, fields)
    elif family.model_type == "dinov3_vit":
        hidden = data.get("intermediate_size", 3072)
        gated = bool(data.get("use_gated_mlp", False))
        fields.update(mlp_hidden_dim=hidden, mlp_ratio=hidden / fields["embed_dim"], mlp_layer="swiglu" if gated else "mlp")
        fields["init_values"] = float(data.get("layerscale_value", 1.0))
        fields["reg_tokens"] = data.get("num_register_tokens", 0)
    else:
        ratio = data.get("mlp_ratio", 4)
        fields["init_values"] = float(data.get("layerscale_value", 1.0))
        fields["reg_tokens"] = data.get("num_register_tokens", 0) if family.model_type == "dinov2_with_registers" else 0
        if data.get("use_swiglu_ffn", False):
            # transformers' Dinov2SwiGLUFFN: two thirds of the MLP width, rounded up to a multiple of 8
            hidden = (int(int(fields["embed_dim"] * ratio) * 2 / 3) + 7) // 8 * 8
            fields.update(mlp_layer="swiglu", mlp_hidden_dim=hidden, mlp_ratio=hidden / fields["embed_dim"])
        else:
            fields.update(mlp_ratio=float(ratio), mlp_hidden_dim=int(fields["embed_dim"] * ratio))
    if family.head:
        fields["num_classes"] = len(labels) if isinstance(labels, dict) else 0
        fields["distilled"] = family.distilled
    fields["encoding"] = _encoding(data, family)
    return fields, notes


def _tower(data: dict[str, Any], family: Family, architecture: str) -> tuple[dict[str, Any], str]:
    """The vision tower's options (``SiglipConfig``: its ``vision_config``, the text tower's config
    beside it) once each is known, and how a refusal names one."""
    where = f"{architecture} option"
    if family.nested:
        _check_known(data, _SIGLIP_OUTER, where)
        data = data.get("vision_config")
        if not isinstance(data, dict):
            raise ConfigError(f"{architecture} config has no vision_config object")
        where = f"{architecture} vision_config option"
    _check_known(data, family.options, where)
    if data.get("pruned_heads"):
        raise ConfigError(f"{where} 'pruned_heads' is not mapped (heads of unequal count per layer)")
    return data, where


def _act_layer(data: dict[str, Any], family: Family, where: str) -> str:
    """``ViTConfig.act_layer`` from ``hidden_act``: exact GELU (SiLU in DINOv3's gated MLP), or
    SigLIP's tanh approximation; anything else, or projections without bias, refused."""
    gated = family.model_type == "dinov3_vit" and bool(data.get("use_gated_mlp", False))
    act = data.get("hidden_act", "gelu_pytorch_tanh" if family.siglip else "gelu")
    if family.siglip and act not in _ACTIVATIONS:
        raise ConfigError(f"{where} hidden_act={act!r} is not mapped (deploykit's MLP uses exact or tanh-approximated GELU)")
    if not family.siglip and act != ("silu" if gated else "gelu"):
        raise ConfigError(
            f"{where} hidden_act={act!r} is not mapped (deploykit's " + ("gated MLP uses SiLU)" if gated else "MLP uses exact GELU)")
        )
    for flag in ("proj_bias", "mlp_bias"):  # DINOv3's: deploykit's projections always carry a bias
        if data.get(flag, True) is not True:
            raise ConfigError(f"{where} {flag}={data[flag]!r} is not mapped (projections without bias)")
    return _ACTIVATIONS[act] if family.siglip else "gelu"


def _dims(data: dict[str, Any], family: Family) -> dict[str, Any]:
    """The trunk's sizes, patch, norm epsilon and q/k/v bias."""
    patch = _square(data.get("patch_size", 16), "patch_size")
    if family.model_type == "siglip2_vision_model":
        img_size = _native_grid(data) * patch
    else:
        img_size = _square(data.get("image_size", 224), "image_size")
    if family.model_type == "dinov3_vit":
        qkv_bias = any(data.get(k, True) for k in ("query_bias", "key_bias", "value_bias"))
    else:
        qkv_bias = data.get("qkv_bias", True)
    return dict(
        img_size=img_size,
        patch_size=patch,
        in_chans=data.get("num_channels", 3),
        embed_dim=data.get("hidden_size", 768),
        depth=data.get("num_hidden_layers", 12),
        num_heads=data.get("num_attention_heads", 12),
        qkv_bias=qkv_bias,
        norm_eps=float(data.get("layer_norm_eps", 1e-12 if family.model_type in ("vit", "deit") else 1e-6)),
    )


def _siglip_fields(data: dict[str, Any], family: Family, fields: dict[str, Any]) -> list[str]:
    """SigLIP's tower into ``fields``: no class token, the MLP's width, and the pooling its output
    is; notes on what that leaves out."""
    hidden = data.get("intermediate_size", 3072)
    fields.update(mlp_hidden_dim=hidden, mlp_ratio=hidden / fields["embed_dim"], class_token=False)
    if family.head:  # SiglipForImageClassification: the classifier reads the mean of every normed token
        fields["global_pool"] = "avg"
    elif data.get("vision_use_head", True):  # pooler_output: SiglipMultiheadAttentionPoolingHead, timm's map
        fields["global_pool"] = "map"
    else:
        fields["global_pool"] = ""
        return ["no pooling head (vision_use_head false): the output is every normed token (last_hidden_state)"]
    return []


def _encoding(data: dict[str, Any], family: Family):
    """The APE as ``interpolate_pos_encoding`` resizes it, or DINOv3's RoPE."""
    if family.model_type != "dinov3_vit":
        return get_config("ape", interpolation=family.interpolation, antialias=family.antialias, no_embed_class=False)
    # transformers' DINOv3ViTRopePositionEmbedding: patch centres in [-1, 1] per axis, rows first,
    # angle 2π·c/θ^(4j/d), rotate_half pairs; prefix tokens unrotated (as timm's DINOv3, deploykit/nn/from_timm.py)
    return get_config(
        "rope-axial",
        theta=float(data.get("rope_theta", 100.0)),
        coords="centered",
        normalize_coords="separate",
        axis_order="yx",
        angle_scale=2 * math.pi,
        pairs="halves",
    )


def _check_known(data: dict[str, Any], options: set[str] | frozenset[str], where: str) -> None:
    unknown = sorted(set(data) - options - _BOOKKEEPING)
    if unknown:
        raise ConfigError(f"{where} {unknown[0]!r} is not mapped (deploykit does not know what it changes)")


def _native_grid(data: dict[str, Any]) -> int:
    """SigLIP2's position table is a square grid of ``num_patches`` rows (``position_embedding_size``)."""
    count = data.get("num_patches", 256)
    side = math.isqrt(count) if type(count) is int and count > 0 else 0
    if side * side != count:
        raise ConfigError(f"num_patches {count!r} is not a square grid of positions")
    return side


# PIL's resample codes, as transformers' image processors store them.
_RESAMPLE = {2: "bilinear", 3: "bicubic"}
# The image processors whose steps deploykit's preprocessing reproduces (their Fast/Pil backends alike).
_PROCESSORS = ("ViTImageProcessor", "DeiTImageProcessor", "BitImageProcessor", "SiglipImageProcessor")


def _preprocessing(path: Path, img_size: int) -> tuple[dict[str, Any], str]:
    """``ViTConfig``'s preprocessing fields from ``preprocessor_config.json`` and where they came
    from; without the file, deploykit's defaults (ImageNet mean/std, centre crop 0.875)."""
    if not path.is_file():
        return {}, f"no {PREPROCESSOR_FILE}: deploykit's defaults"
    data = _read_json(path)
    kind = str(data.get("image_processor_type", ""))
    base = kind.removesuffix("Fast").removesuffix("Pil")
    refuse = lambda what: ConfigError(f"{PREPROCESSOR_FILE}: {what}")
    if base not in _PROCESSORS:
        raise refuse(f"image_processor_type {kind!r} is not mapped; deploykit maps {', '.join(_PROCESSORS)}")
    if data.get("do_resize", True) is False:
        raise refuse("do_resize false (images of any size) is not mapped")
    if data.get("do_rescale", True) and not math.isclose(float(data.get("rescale_factor", 1 / 255)), 1 / 255, rel_tol=1e-6):
        raise refuse(f"rescale_factor {data.get('rescale_factor')} is not 1/255")
    if data.get("do_rescale", True) is False:
        raise refuse("do_rescale false (pixels left in 0..255) is not mapped")
    resample = data.get("resample", 2)
    if resample not in _RESAMPLE:
        raise refuse(f"resample {resample!r} is not mapped (deploykit resizes bilinear (2) or bicubic (3))")
    fields: dict[str, Any] = dict(interpolation=_RESAMPLE[resample])
    if data.get("do_normalize", True):
        fields["mean"], fields["std"] = (tuple(float(v) for v in data.get(k, [0.5] * 3)) for k in ("image_mean", "image_std"))
    else:
        fields["mean"], fields["std"] = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    size = data.get("size") or {}
    crop = data.get("crop_size") if data.get("do_center_crop", base not in ("ViTImageProcessor", "SiglipImageProcessor")) else None
    if "shortest_edge" in size:  # resize the short side, then centre-crop (torchvision's Resize(int) + CenterCrop)
        out = _hw(crop, refuse) if crop else None
        if out is None:
            raise refuse("a short-side resize without a centre crop is not mapped")
        fields.update(crop_mode="center", crop_pct=out[0] / size["shortest_edge"])
    else:
        resized = _hw(size, refuse)
        out = _hw(crop, refuse) if crop else resized
        if resized[0] != resized[1] or out[0] != out[1]:
            raise refuse(f"a non-square resize or crop ({resized}, {out}) is not mapped")
        fields.update(crop_mode="squash", crop_pct=out[0] / resized[0])
    if out[0] != out[1] or out[0] != img_size:
        raise refuse(f"it makes {out[0]}x{out[1]} inputs but the model's image_size is {img_size}")
    return fields, f"{PREPROCESSOR_FILE} ({kind})"


def _hw(size: Any, refuse: Callable[[str], ConfigError]) -> tuple[int, int]:
    if not (isinstance(size, dict) and "height" in size and "width" in size):
        raise refuse(f"size {size!r} is not {{height, width}} or {{shortest_edge}}")
    return int(size["height"]), int(size["width"])


# transformers' names inside one encoder layer → timm's (deploykit's) names inside a block.
_LAYER_NAMES = {
    "layernorm_before": "norm1",
    "layernorm_after": "norm2",
    "attention.output.dense": "attn.proj",
    "attention.o_proj": "attn.proj",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "norm1": "norm1",
    "norm2": "norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
    "mlp.gate_proj": "mlp.fc1_g",
    "mlp.up_proj": "mlp.fc1_x",
    "mlp.down_proj": "mlp.fc2",
    "mlp.weights_out": "mlp.fc2",
    "layer_norm1": "norm1",  # SigLIP
    "layer_norm2": "norm2",
    "self_attn.out_proj": "attn.proj",
}
_EMBEDDINGS = {
    "embeddings.cls_token": "cls_token",
    "embeddings.distillation_token": "reg_token",
    "embeddings.register_tokens": "reg_token",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "embeddings.patch_embeddings.weight": "patch_embed.proj.weight",  # DINOv3: the convolution itself
    "embeddings.patch_embeddings.bias": "patch_embed.proj.bias",
    "norm.weight": "norm.weight",
    "norm.bias": "norm.bias",
    "layernorm.weight": "norm.weight",
    "layernorm.bias": "norm.bias",
    "embeddings.patch_embedding.bias": "patch_embed.proj.bias",  # SigLIP
    "post_layernorm.weight": "norm.weight",
    "post_layernorm.bias": "norm.bias",
}
# SigLIP's SiglipMultiheadAttentionPoolingHead → timm's AttentionPoolLatent (in_proj is split into q and kv).
_POOL_NAMES = {
    "head.probe": "attn_pool.latent",
    "head.attention.out_proj.weight": "attn_pool.proj.weight",
    "head.attention.out_proj.bias": "attn_pool.proj.bias",
    "head.layernorm.weight": "attn_pool.norm.weight",
    "head.layernorm.bias": "attn_pool.norm.bias",
    **{f"head.mlp.{fc}.{leaf}": f"attn_pool.mlp.{fc}.{leaf}" for fc in ("fc1", "fc2") for leaf in ("weight", "bias")},
}
_CLASSIFIERS = {"classifier": "head", "cls_classifier": "head", "distillation_classifier": "head_dist"}
# In the file, not in the output: the mask token (used only with bool_masked_pos) and ViTModel's pooler.
_LEFT_OUT = ("embeddings.mask_token", "pooler.dense.weight", "pooler.dense.bias")


def state_dict_from_transformers(
    state: dict[str, Tensor], family: Family, cfg: ViTConfig, source: str
) -> tuple[dict[str, Tensor], list[str]]:
    """A ``transformers`` state dict under deploykit's names, and the keys left out (``_LEFT_OUT``).
    Pure renaming and concatenation; a key it does not place is kept under its own name, so the
    strict load that follows names it."""
    out, dropped = {}, []
    for key, value in state.items():
        name = key[len(family.prefix) :] if family.prefix and key.startswith(family.prefix) else key
        classifier, _, leaf = name.partition(".")
        if name in _LEFT_OUT:
            dropped.append(name)
        elif name in _EMBEDDINGS:
            out[_EMBEDDINGS[name]] = value
        elif name == "embeddings.distillation_token":  # DeiT's: timm's dist_token in a distilled model
            out["dist_token" if cfg.distilled else "reg_token"] = value
        elif name == "embeddings.patch_embedding.weight":
            out["patch_embed.proj.weight"] = _patch_kernel(value, cfg)
        elif name == "embeddings.position_embeddings":
            out["pos_embed"] = _position_table(value, cfg)
        elif name == "embeddings.position_embedding.weight":  # SigLIP's nn.Embedding: [N, D], patches only
            out["pos_embed"] = value.unsqueeze(0)
        elif classifier in _CLASSIFIERS and leaf in ("weight", "bias"):
            out[f"{_CLASSIFIERS[classifier]}.{leaf}"] = value
        elif family.siglip and name.startswith("head."):
            if cfg.pool != "map":  # SiglipForImageClassification's logits do not read the tower's pooling head
                dropped.append("head.*")
            elif name in _POOL_NAMES:
                out[_POOL_NAMES[name]] = value
            elif name in ("head.attention.in_proj_weight", "head.attention.in_proj_bias") and value.shape[0] == 3 * cfg.embed_dim:
                q, kv = value.split([cfg.embed_dim, 2 * cfg.embed_dim])  # rows: q, k, v
                kind = name.rpartition("_")[2]
                out[f"attn_pool.q.{kind}"], out[f"attn_pool.kv.{kind}"] = q, kv
            else:
                out[key] = value
        elif name.startswith(("encoder.layer.", "encoder.layers.", "layer.")):  # DINOv3's layers sit at the top level
            index, _, inner = name.removeprefix("encoder.").removeprefix("layers.").removeprefix("layer.").partition(".")
            owner, _, leaf = inner.rpartition(".")
            attention, _, projection = owner.rpartition(".")
            if attention in ("attention", "self_attn") and projection in ("q_proj", "k_proj", "v_proj"):
                # DINOv3, SigLIP: separate projections, each bias optional; fused at the query's weight, a missing bias zero
                layer = key.removesuffix(f".{projection}.{leaf}")
                full = lambda proj, leaf, layer=layer: state.get(f"{layer}.{proj}.{leaf}")
                if full("q_proj", "weight") is None:
                    out[key] = value  # no query to join: the strict load names it
                elif projection == "q_proj" and leaf == "weight":
                    parts = [full(p, "weight") for p in ("q_proj", "k_proj", "v_proj")]
                    if any(t is None for t in parts):
                        raise CheckpointError(f"{source}: {key} has no k_proj/v_proj partner")
                    out[f"blocks.{index}.attn.qkv.weight"] = torch.cat(parts)
                    biases = [full(p, "bias") for p in ("q_proj", "k_proj", "v_proj")]
                    if any(t is not None for t in biases):
                        zeros = value.new_zeros(value.shape[0])
                        out[f"blocks.{index}.attn.qkv.bias"] = torch.cat([zeros if t is None else t for t in biases])
                continue
            if owner == "mlp.up_proj" and cfg.mlp_layer == "mlp":  # DINOv3's plain MLP: up, GELU, down
                out[f"blocks.{index}.mlp.fc1.{leaf}"] = value
                continue
            if owner == "attention.attention.query":  # the three projections become one qkv, as timm holds it
                parts = [state.get(key.replace(".query.", f".{p}.")) for p in ("query", "key", "value")]
                if any(p is None for p in parts):
                    raise CheckpointError(f"{source}: {key} has no key/value partner")
                out[f"blocks.{index}.attn.qkv.{leaf}"] = torch.cat(parts)
                continue
            if owner in ("attention.attention.key", "attention.attention.value"):  # in qkv with their query
                if key.replace(f".{owner.rpartition('.')[2]}.", ".query.") not in state:
                    raise CheckpointError(f"{source}: {key} has no query partner")
                continue
            if owner == "mlp.weights_in":  # transformers 4's packed SwiGLU: the first half gates the second
                gate, value_half = value.chunk(2, dim=0)
                out[f"blocks.{index}.mlp.fc1_g.{leaf}"], out[f"blocks.{index}.mlp.fc1_x.{leaf}"] = gate, value_half
                continue
            if owner in ("layer_scale1", "layer_scale2") and leaf == "lambda1":  # DINOv2's LayerScale
                out[f"blocks.{index}.ls{owner[-1]}.gamma"] = value
                continue
            mapped = _LAYER_NAMES.get(owner)
            out[f"blocks.{index}.{mapped}.{leaf}" if mapped else key] = value
        else:
            out[key] = value
    return out, sorted(set(dropped))


def _patch_kernel(weight: Tensor, cfg: ViTConfig) -> Tensor:
    """SigLIP2's patch embedding is a Linear over patches flattened as (row, column, channel)
    (``Siglip2ImageProcessor``'s ``convert_image_to_patches``): the same map as a stride-p
    convolution ``[D, C, p, p]``. SigLIP's is that convolution already."""
    p = cfg.patch_size
    if weight.ndim != 2 or weight.shape[1] != p * p * cfg.in_chans:
        return weight  # a convolution already, or of another shape: the strict load names it
    return weight.reshape(weight.shape[0], p, p, -1).permute(0, 3, 1, 2).contiguous()


def _position_table(table: Tensor, cfg: ViTConfig) -> Tensor:
    """DINOv2's registers come after the class token and get no position: zero rows there make
    deploykit's table (``[1, 1 + registers + patches, D]``) add what ``transformers`` adds."""
    if cfg.reg_tokens and table.shape[1] == 1 + (cfg.img_size // cfg.patch_size) ** 2:
        zeros = table.new_zeros(1, cfg.reg_tokens, table.shape[-1])
        return torch.cat([table[:, :1], zeros, table[:, 1:]], dim=1)
    return table


def describe(imported: Imported) -> str:
    """One line for the CLI: what the import became."""
    return imported.describe()


DIRECTORY_LAYOUTS.append((is_transformers_directory, lambda path: import_transformers(path).model))
