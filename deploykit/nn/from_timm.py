"""timm's ViT, DeiT-III, RoPE-ViT, DINOv3 and EVA-02 models as deploykit models (``deploykit import timm``).

A timm model is read module by module: every convention it uses becomes a field of the
deploykit config (``ViTConfig`` and the encoding's config), and anything the trunk does not
reproduce is refused in one line naming it. The weights then move by name, as a strict load:

==========  ====================================  ===========================================
family      timm                                  deploykit
==========  ====================================  ===========================================
ViT         ``VisionTransformer`` (``vit_*``)     ``ape`` (timm's antialiased resize), class
                                                  token or ``avg``/``max``/``avgmax``/none
                                                  pooling, ``fc_norm``, register tokens
DeiT-III    ``VisionTransformer`` (``deit3_*``)   + LayerScale ``ls1``/``ls2``, ``ape`` with
                                                  ``no_embed_class``
RoPE-ViT    ``Eva`` (``vit_*_rope_*``)            ``rope-axial``/``rope-mixed`` (integer
                                                  coordinates, ``xy``, interleaved pairs),
                                                  ``_ape`` variants: ``ape=True``,
                                                  ``no_embed_class``; LayerScale
DINOv3      ``Eva`` (``vit_*_dinov3*``)           ``rope-axial`` with ``coords="centered"``,
                                                  ``axis_order="yx"``, ``angle_scale=2π``,
                                                  ``pairs="halves"``; 4 registers, LayerScale,
                                                  SwiGLU, ``q_bias``/``v_bias`` → ``qkv.bias``;
                                                  no head: pooled features
EVA-02      ``Eva`` (``eva02_*``, the CLIP        ``rope-axial`` with ``ref_grid`` (timm's
            towers ``eva02_*_clip_*``)            ``ref_feat_shape``), ``axis_order="yx"``,
                                                  θ 10⁴, + ``ape``; ``swiglu_packed`` (Ti/S,
                                                  ``GluMlp``) or ``swiglu`` + ``mlp_norm``
                                                  (B/L), ``attn_norm`` (CLIP), q/v biases
==========  ====================================  ===========================================

Eva's names differ from timm's ``VisionTransformer`` (which deploykit's trunk keeps):
``gamma_1``/``gamma_2`` → ``ls1.gamma``/``ls2.gamma``, ``rope.freqs`` → ``pos_enc.freqs``,
``q_bias`` + zero ``k_bias`` + ``v_bias`` → ``qkv.bias``, and EVA-02 B/L's ``q_proj``,
``k_proj`` (no bias), ``v_proj`` → one ``qkv``.

A checkpoint file is first read as timm reads it for that model: through the
``checkpoint_filter_fn`` of its family (``timm_checkpoint``), so DINOv3 files in Meta's own
layout and EVA's original names import as ``timm.create_model(..., pretrained=True)`` loads them.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import io
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from deploykit._lazy import lazy_import
from deploykit._terminal import quiet_logger
from deploykit.encodings import EncodingConfig, encoding_name, get_config
from deploykit.errors import CheckpointError, ConfigError, one_line
from deploykit.nn.checkpoint import load_weights, read_training_checkpoint, with_encoding_options
from deploykit.nn.vit import VisionTransformer, ViTConfig


def import_timm(
    name: str, weights: str | os.PathLike | None = None, options: Sequence[str] = (), ema: bool = False, **model_kwargs: Any
) -> VisionTransformer:
    """A deploykit model equal to timm's ``name``.

    Args:
        name: a timm model name (``timm.list_models()``).
        weights: a ``.safetensors`` or ``.pth``/``.pt``/``.bin`` checkpoint (read with
            ``weights_only=True``): what ``timm.create_model(name, pretrained=True,
            pretrained_cfg_overlay=dict(file=weights))`` loads (``timm_checkpoint``); ``None``
            takes timm's pretrained weights from the hub.
        options: ``key=value`` encoding options changed after the import (``antialias=false``).
        ema: take the file's EMA copy of the weights (``model_ema``, ``state_dict_ema``).
        **model_kwargs: passed to ``timm.create_model`` (``num_classes``, ``global_pool``, or
            sizes such as ``depth``).

    Raises:
        ConfigError: a name timm does not know, kwargs it refuses, or a model that uses
            something deploykit does not map (named in the message).
        CheckpointError: weights that are not that model's (keys named, with counts), or
            pretrained weights that cannot be downloaded.
        MissingDependencyError: timm is not installed or does not import.
    """
    if ema and weights is None:
        raise ConfigError("--ema takes the EMA copy of a checkpoint file: pass the file with --weights")
    source = timm_model(name, **model_kwargs)
    cfg = config_from_timm(source, name)  # refuses what deploykit does not map before any weights are read
    if weights is None:
        load_weights(source, pretrained_state_dict(name, **model_kwargs), f"timm's pretrained {name}")
    else:
        load_weights(source, timm_checkpoint(weights, source, name, ema), weights)
    model = VisionTransformer(cfg)
    load_weights(model, state_dict_from_timm(source.state_dict()), f"converted from timm {name}")
    return with_encoding_options(model.eval(), options, f"timm {name}")


def parse_model_kwargs(assignments: Sequence[str]) -> dict[str, Any]:
    """``["num_classes=0", "global_pool=token"]`` → kwargs for ``timm.create_model``: each value a
    Python literal (``0``, ``True``, ``(224, 224)``) or else a string."""
    kwargs = {}
    for text in assignments:
        key, sep, value = text.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ConfigError(f"--model-kwargs {one_line(repr(text), 80)} is not key=value")
        if len(value) > MAX_KWARG_CHARS:  # the literal reader recurses once per bracket: a long one fails inside it
            raise ConfigError(
                f"--model-kwargs {key.strip()[:40]}= has a value of {len(value):,} characters; "
                f"timm's arguments are short literals (at most {MAX_KWARG_CHARS:,})"
            )
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            kwargs[key.strip()] = value.strip()
    return kwargs


# The longest --model-kwargs value: timm's arguments are numbers, names and short tuples.
MAX_KWARG_CHARS = 1024


def timm_model(name: str, **model_kwargs: Any) -> nn.Module:
    """timm's ``name`` (eval mode, initial weights), built with ``model_kwargs``."""
    timm = lazy_import("timm")
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models()"
        raise ConfigError(f"timm has no model {name!r}{hint}")
    try:
        return timm.create_model(name, pretrained=False, **model_kwargs).eval()
    except (TypeError, ValueError, AssertionError) as err:
        raise ConfigError(f"timm cannot build {name} with {model_kwargs}: {_first_line(err)}") from err


def pretrained_state_dict(name: str, **model_kwargs: Any) -> dict[str, Tensor]:
    """timm's pretrained weights for ``name`` (from the hub, or its local cache).

    Raises:
        CheckpointError: they cannot be had (no network, no such weights), in one line.
    """
    timm = lazy_import("timm")
    try:
        # The hub client logs each failed request and retry as a warning of its own (two dozen
        # lines over a minute without network): its final error is the one line shown.
        with quiet_logger("huggingface_hub"):
            return timm.create_model(name, pretrained=True, **model_kwargs).state_dict()
    except Exception as err:  # hub and network errors come in many types (OSError, HTTP, offline mode, ...)
        raise CheckpointError(
            f"cannot fetch timm's pretrained weights for {name} ({type(err).__name__}: {_first_line(err)}); "
            "pass a local checkpoint with --weights FILE"
        ) from err


def _first_line(err: BaseException) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


# ------------------------------------------------------------------------------ checkpoint files

# What a timm model factory gives its family's ``checkpoint_filter_fn`` beyond the defaults, by
# the timm module the model name is registered in: ``_create_deit`` moves DeiT-III's ``gamma_N``
# into ``lsN.gamma``.
_FILTER_OPTIONS = {"deit": dict(adapt_layer_scale=True)}


def timm_checkpoint(path: str | os.PathLike, model: nn.Module, name: str, ema: bool = False) -> dict[str, Tensor]:
    """The weights in the file at ``path`` as timm's ``name`` loads them with
    ``pretrained_cfg_overlay=dict(file=path)``: read as a training script wrote them
    (``read_training_checkpoint``: a container's weights, DDP's prefix), then passed through the
    ``checkpoint_filter_fn`` of the model's family (the module of its class), as timm's factory
    does. The filter maps DINOv3 in Meta's layout, EVA/EVA-02 and OpenCLIP names, OpenAI CLIP
    and DINOv2 files onto timm's names, and resizes a patch embedding or ``pos_embed`` of another
    size.

    Raises:
        CheckpointError: a file that cannot be read, q/v biases that the filter would drop, or a
            file the filter fails on.
    """
    state = read_training_checkpoint(path).chosen(ema)
    _check_qkv_biases_kept(state, model, name, path)
    timm = lazy_import("timm")
    options = next((opts for module, opts in _FILTER_OPTIONS.items() if timm.models.is_model_in_modules(name, [module])), {})
    family = sys.modules[type(model).__module__]  # timm.models.vision_transformer, timm.models.eva
    try:
        # Eva's DINOv3 branch prints the error of a lookup it expects to fail (no q_bias): noise here.
        with contextlib.redirect_stdout(io.StringIO()):
            return family.checkpoint_filter_fn(state, model, **options)
    except (KeyError, ValueError, RuntimeError, TypeError, AttributeError, IndexError) as err:
        raise CheckpointError(f"timm's checkpoint filter for {name} cannot read {path} ({type(err).__name__}: {_first_line(err)})") from err


def _check_qkv_biases_kept(state: dict[str, Tensor], model: nn.Module, name: str, path) -> None:
    """Eva's filter drops a DINOv3 file's ``qkv.bias`` where the timm model has no qkv bias (its
    ``vit_*_dinov3`` models: Meta's distilled B/L/H weights hold zero biases); biases that are not
    zero would be lost without a word, so they are refused. Only the q and v thirds count: Meta
    masks the k third (``bias_mask``), and timm's k bias is zero."""
    params = {k for k, _ in model.named_parameters()}
    biases = [k for k in state if k.startswith("blocks.") and k.endswith(".attn.qkv.bias")]  # Meta's names are timm's here
    dropped = [k for k in biases if k not in params and k.replace("qkv.bias", "q_bias") not in params]
    lost = [k for k in dropped if state[k].shape[-1] % 3 == 0 and any(part.any() for part in state[k].chunk(3, dim=-1)[::2])]
    if lost:
        more = f" (+{len(lost) - 1} more)" if len(lost) > 1 else ""
        raise CheckpointError(
            f"{path} holds non-zero q/v biases ({lost[0]}{more}) but timm {name} has no qkv bias; "
            "import the variant with qkv bias (DINOv3: *_qkvb) or pass --model-kwargs qkv_bias=True"
        )


# ----------------------------------------------------------------------------------- configs


class _Refusals:
    """Collects what a timm model uses that deploykit does not map, for one error line."""

    def __init__(self, name: str, family: str):
        self.name, self.family, self.items = name, family, []

    def check(self, ok: bool, what: str) -> None:
        if not ok and what not in self.items:
            self.items.append(what)

    def raise_any(self) -> None:
        if self.items:
            raise ConfigError(f"cannot import timm {self.name} ({self.family}), not supported: {'; '.join(self.items)}")


def config_from_timm(model: nn.Module, name: str) -> ViTConfig:
    """The ``ViTConfig`` (trunk + encoding) that computes what timm's ``model`` computes.

    Raises:
        ConfigError: a model class deploykit does not import, or an unsupported option of it.
    """
    readers = _readers()
    reader = readers.get(type(model))
    if reader is None:
        raise ConfigError(
            f"cannot import timm {name}: its class {type(model).__name__} is not supported; deploykit imports "
            f"{' and '.join(c.__name__ for c in readers)} models (ViT, DeiT-III, RoPE-ViT, DINOv3, EVA-02)"
        )
    refuse = _Refusals(name, type(model).__name__)
    _check_trunk(model, refuse)
    encoding = reader(model, refuse)
    refuse.raise_any()  # the fields below read modules these checks vouched for
    try:
        return ViTConfig(**_trunk_fields(model), encoding=encoding)
    except ConfigError as err:
        raise ConfigError(f"cannot import timm {name}: {err}") from err


def _readers() -> dict[type, Callable[[nn.Module, _Refusals], EncodingConfig | None]]:
    timm = lazy_import("timm")
    return {
        timm.models.vision_transformer.VisionTransformer: _vit_encoding,
        timm.models.deit.VisionTransformerDistilled: _vit_encoding,  # DeiT's distillation token and head
        timm.models.eva.Eva: _eva_encoding,
    }


def _check_trunk(model: nn.Module, refuse: _Refusals) -> None:
    """What ``VisionTransformer`` and ``Eva`` can hold that deploykit's trunk does not reproduce."""
    layers = lazy_import("timm.layers")
    embed = model.patch_embed
    (ph, pw), (ih, iw) = embed.patch_size, embed.img_size
    refuse.check(ph == pw and ih == iw, f"non-square patches or input size ({ph}x{pw}, {ih}x{iw})")
    refuse.check(
        type(embed) is layers.PatchEmbed and isinstance(embed.norm, nn.Identity), "a patch embedding other than a plain convolution"
    )
    refuse.check(embed.proj.bias is not None, "a patch embedding without bias")
    refuse.check(not getattr(embed, "dynamic_img_pad", False), "dynamic_img_pad")
    refuse.check(isinstance(model.norm_pre, nn.Identity), "a norm before the blocks (pre_norm)")
    if getattr(model, "attn_pool", None) is not None:
        _check_attention_pool(model.attn_pool, model, refuse, layers)
    refuse.check(not getattr(model, "pool_include_prefix", False), "pooling that includes prefix tokens")
    refuse.check(not (isinstance(model.norm, nn.Identity) and isinstance(model.fc_norm, nn.Identity)), "no final norm")
    norms = [m for m in model.modules() if isinstance(m, (nn.LayerNorm, layers.RmsNorm))]
    refuse.check(
        all(type(m) in (nn.LayerNorm, layers.LayerNorm) and m.elementwise_affine and m.eps == norms[0].eps for m in norms),
        "norms other than one affine LayerNorm (RmsNorm, mixed eps)",
    )
    for block in model.blocks:
        _check_block(block, model.embed_dim, refuse, layers)


# Pre-norm blocks and attentions whose forward deploykit's Block reproduces (given the checks below).
_BLOCKS = ("Block", "EvaBlock")
_ATTENTIONS = ("Attention", "EvaAttention", "AttentionRope")
# timm.layers MLP -> ViTConfig.mlp_layer
_MLP_LAYERS = {"Mlp": "mlp", "SwiGLU": "swiglu", "GluMlp": "swiglu_packed"}


def _separate_qkv(attn: nn.Module) -> bool:
    """EVA-02 B/L's ``q_proj``/``k_proj``/``v_proj`` (k without bias), which fuse into one ``qkv``."""
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    return all(isinstance(m, nn.Linear) for m in projections) and attn.k_proj.bias is None


def _has_qkv_bias(attn: nn.Module) -> bool:
    """Biases on q and v: ``qkv.bias`` (ViT), Eva's ``q_bias``/``v_bias``, or ``q_proj``/``v_proj`` biases."""
    q = attn.qkv if getattr(attn, "qkv", None) is not None else attn.q_proj
    return q.bias is not None or getattr(attn, "q_bias", None) is not None


def _check_block(block: nn.Module, embed_dim: int, refuse: _Refusals, layers) -> None:
    refuse.check(type(block).__name__ in _BLOCKS, f"{type(block).__name__} blocks")
    refuse.check(type(getattr(block, "attn", None)).__name__ in _ATTENTIONS, "attention variants")
    if type(block).__name__ not in _BLOCKS:
        return
    attn, mlp = block.attn, block.mlp
    qk_norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
    refuse.check(
        all(m is None or isinstance(m, nn.Identity) for m in qk_norms)
        or all(isinstance(m, nn.LayerNorm) and m.normalized_shape == (attn.head_dim,) for m in qk_norms),
        "q/k norms other than a LayerNorm over each head's channels",
    )
    refuse.check(getattr(attn, "gate", None) is None, "gated attention")
    refuse.check(getattr(attn, "qkv", None) is not None or _separate_qkv(attn), "separate q/k/v projections with a k bias")
    refuse.check(attn.head_dim * attn.num_heads == embed_dim, "an attention width other than embed_dim")
    refuse.check(attn.proj.bias is not None, "an attention projection without bias")
    refuse.check(type(mlp) in [getattr(layers, name) for name in _MLP_LAYERS], f"MLP {type(mlp).__name__}")
    refuse.check(all(m.bias is not None for m in mlp.modules() if isinstance(m, nn.Linear)), "MLP projections without bias")
    if type(mlp) is layers.Mlp:
        refuse.check(_gelu(mlp.act) is not None, f"MLP activation {mlp.act}")
    else:  # SwiGLU, GluMlp: SiLU gate, first half of GluMlp's fc1 (gate_last=False, timm's SwiGLUPacked)
        refuse.check(
            type(mlp.act) is nn.SiLU and not getattr(mlp, "gate_last", False), f"{type(mlp).__name__} with {mlp.act} or the gate last"
        )
    attn_scale, mlp_scale = _layer_scale(block)
    refuse.check(attn_scale is None or mlp_scale is not None, "LayerScale on the attention branch only")


def _check_attention_pool(pool: nn.Module, model: nn.Module, refuse: _Refusals, layers) -> None:
    """timm's ``AttentionPoolLatent`` (``global_pool='map'``) as deploykit's trunk computes it: one
    latent, biased q/kv, no q/k norm or position, an ``Mlp`` with the blocks' activation."""
    refuse.check(type(pool).__name__ == "AttentionPoolLatent", f"attention pooling {type(pool).__name__}")
    if type(pool).__name__ != "AttentionPoolLatent":
        return
    refuse.check(
        pool.latent.shape[1] == 1 and getattr(pool, "pos_embed", None) is None,
        "attention pooling with several latents or a position embedding",
    )
    refuse.check(
        all(isinstance(getattr(pool, n, nn.Identity()), nn.Identity) for n in ("q_norm", "k_norm")), "attention pooling with q/k norms"
    )
    refuse.check(pool.q.bias is not None and pool.kv.bias is not None, "attention pooling without q/kv biases")
    refuse.check(pool.num_heads == model.blocks[0].attn.num_heads, "attention pooling with its own head count")
    trunk_mlp = model.blocks[0].mlp
    refuse.check(type(pool.mlp) is layers.Mlp and type(trunk_mlp) is layers.Mlp, "attention pooling's MLP beside a gated one")
    if type(pool.mlp) is layers.Mlp and type(trunk_mlp) is layers.Mlp:
        refuse.check(_gelu(pool.mlp.act) == _gelu(trunk_mlp.act), "attention pooling's MLP activation")
        refuse.check(pool.mlp.fc1.out_features == trunk_mlp.fc1.out_features, "attention pooling's MLP width")


def _gelu(act: nn.Module) -> str | None:
    """``ViTConfig.act_layer`` of an MLP activation: ``gelu`` (erf), ``gelu_tanh``, None for others
    (torch's ``nn.GELU`` or timm's ``GELU``/``GELUTanh`` classes)."""
    if type(act) is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    return {"GELU": "gelu", "GELUTanh": "gelu_tanh"}.get(type(act).__name__)


def _trunk_fields(model: nn.Module) -> dict[str, Any]:
    """``ViTConfig`` fields shared by ``VisionTransformer`` and ``Eva`` (after ``_check_trunk``)."""
    embed, block = model.patch_embed, model.blocks[0]
    hidden = block.mlp.fc2.in_features
    distilled = getattr(model, "dist_token", None) is not None
    return dict(
        img_size=embed.img_size[0],
        patch_size=embed.patch_size[0],
        in_chans=embed.proj.in_channels,
        num_classes=model.num_classes,
        embed_dim=model.embed_dim,
        depth=len(model.blocks),
        num_heads=block.attn.num_heads,
        mlp_ratio=hidden / model.embed_dim,
        mlp_hidden_dim=hidden,
        mlp_layer=_MLP_LAYERS[type(block.mlp).__name__],
        mlp_norm=not isinstance(block.mlp.norm, nn.Identity),  # EVA-02's sub-LNs (timm's scale_mlp, scale_attn_inner)
        attn_norm=not isinstance(getattr(block.attn, "norm", nn.Identity()), nn.Identity),
        qkv_bias=_has_qkv_bias(block.attn),
        class_token=model.cls_token is not None,
        reg_tokens=1 if distilled else 0 if model.reg_token is None else model.reg_token.shape[1],
        distilled=distilled,
        qk_norm=isinstance(getattr(block.attn, "q_norm", None), nn.LayerNorm),
        act_layer=(_gelu(block.mlp.act) if type(block.mlp).__name__ == "Mlp" else None) or "gelu",  # gated MLPs gate with SiLU
        global_pool=model.global_pool,
        fc_norm=not isinstance(model.fc_norm, nn.Identity),
        init_values=_layer_scale(block)[0],
        norm_eps=block.norm1.eps,
        **preprocessing_fields(model.pretrained_cfg),
    )


# timm.data.constants: IMAGENET_DEFAULT_MEAN / _STD, DEFAULT_CROP_PCT, DEFAULT_CROP_MODE.
_TIMM_DEFAULTS = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=0.875, crop_mode="center", interpolation="bicubic")


def preprocessing_fields(pretrained_cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``ViTConfig`` preprocessing fields (``mean``, ``std``, ``crop_pct``, ``crop_mode``,
    ``interpolation``) timm's own eval transform takes from a ``pretrained_cfg``: what
    ``timm.data.resolve_data_config`` resolves (a missing or empty entry takes timm's default),
    so that calibration, validation and serving preprocess as timm's ``create_transform`` would.
    The input size is the model's own (``img_size``)."""
    fields = {key: pretrained_cfg.get(key) or default for key, default in _TIMM_DEFAULTS.items()}
    fields["mean"], fields["std"] = (tuple(float(v) for v in fields[k]) for k in ("mean", "std"))
    fields["crop_pct"] = float(fields["crop_pct"])
    return fields


def _layer_scale(block: nn.Module) -> tuple[float | None, float | None]:
    """LayerScale's init value on the attention and MLP branches, None where absent (for trained
    weights only its presence matters)."""
    if hasattr(block, "ls1"):  # VisionTransformer: LayerScale modules or Identity
        return getattr(block.ls1, "init_values", None), getattr(block.ls2, "init_values", None)
    # Eva: gamma_1 / gamma_2 parameters or None
    return tuple(getattr(block, "init_values", None) if getattr(block, g, None) is not None else None for g in ("gamma_1", "gamma_2"))


def _ape(model: nn.Module) -> dict[str, Any]:
    # timm resizes pos_embed with resample_abs_pos_embed's defaults: bicubic, antialias=True.
    return dict(interpolation="bicubic", antialias=True, no_embed_class=bool(model.no_embed_class))


def _vit_encoding(model: nn.Module, refuse: _Refusals) -> EncodingConfig | None:
    """``VisionTransformer`` (ViT, DeiT-III): its learned APE."""
    refuse.check(model.pos_embed is not None, "a model without position embedding (pos_embed='none')")
    return get_config("ape", **_ape(model))


def _eva_encoding(model: nn.Module, refuse: _Refusals) -> EncodingConfig | None:
    """``Eva`` (RoPE-ViT, DINOv3): its RoPE, plus the learned APE of ``_ape`` variants."""
    layers = lazy_import("timm.layers")
    refuse.check(all(getattr(b.attn, "num_kv_groups", 1) == 1 for b in model.blocks), "grouped-query attention")
    rope, ape = model.rope, _ape(model) if model.pos_embed is not None else None
    if rope is None:
        refuse.check(ape is not None, "a model without position embedding")
        return get_config("ape", **ape) if ape else None
    extra = dict(ape=True, **ape) if ape else {}
    augments = any(getattr(rope, n, None) for n in ("shift_coords", "jitter_coords", "rescale_coords"))
    refuse.check(not augments, "RoPE coordinate augmentation")
    if isinstance(rope, layers.RotaryEmbeddingMixed):
        return get_config("rope-mixed", theta=float(rope.temperature), axis_order=_axis_order(rope.grid_indexing), **extra)
    if isinstance(rope, layers.RotaryEmbeddingCat):
        refuse.check(rope.grid_type == "index" and rope.grid_offset == 0, f"RoPE grid {rope.grid_type!r} (offset {rope.grid_offset})")
        refuse.check(not rope.in_pixels, "pixel-frequency RoPE bands (in_pixels)")
        # EVA-02: ref_feat_shape (rows, columns) rescales the index grid onto the pre-training one
        ref_grid = tuple(int(n) for n in rope.ref_feat_shape) if rope.ref_feat_shape is not None else None
        return get_config(
            "rope-axial",
            theta=float(rope.temperature),
            axis_order=_axis_order(rope.grid_indexing),
            pairs="halves" if rope.rotate_half else "interleaved",
            ref_grid=ref_grid,
            **extra,
        )
    if isinstance(rope, layers.RotaryEmbeddingDinoV3):
        refuse.check(rope.min_period is None and rope.max_period is None, "DINOv3 RoPE with min/max periods")
        refuse.check(rope.grid_offset == 0, f"RoPE grid offset {rope.grid_offset}")
        # angle = 2π c / period, period_j = θ^(4j/d): deploykit's θ^(-4j/d) frequencies in turns.
        return get_config(
            "rope-axial",
            theta=float(rope.temperature),
            coords="centered",
            normalize_coords=rope.normalize_coords,
            axis_order=_axis_order(rope.grid_indexing),
            angle_scale=2 * math.pi,
            pairs="halves" if rope.rotate_half else "interleaved",
            **extra,
        )
    refuse.check(False, f"RoPE {type(rope).__name__}")
    return None


def _axis_order(grid_indexing: str) -> str:
    """timm's meshgrid indexing → which coordinate the first angles follow: ``xy`` → x, ``ij`` → the row."""
    return {"xy": "xy", "ij": "yx"}[grid_indexing]


# ------------------------------------------------------------------------------------ weights


def state_dict_from_timm(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A timm ``VisionTransformer``/``Eva`` state dict under deploykit's names (timm
    ``VisionTransformer``'s; see the module doc). Pure renaming and concatenation: needs no timm."""
    out = {}
    for key, value in state.items():
        owner, _, leaf = key.rpartition(".")
        parent, _, module = owner.rpartition(".")
        if leaf in ("gamma_1", "gamma_2"):
            out[f"{owner}.ls{leaf[-1]}.gamma"] = value
        elif leaf == "q_bias":  # Eva's fused qkv: k has no bias (a zero buffer, not saved)
            out[f"{owner}.qkv.bias"] = torch.cat([value, torch.zeros_like(value), state[f"{owner}.v_bias"]])
        elif module == "q_proj":  # EVA-02 B/L: separate projections, k without bias
            k, v = state.get(f"{parent}.k_proj.{leaf}", torch.zeros_like(value)), state[f"{parent}.v_proj.{leaf}"]
            out[f"{parent}.qkv.{leaf}"] = torch.cat([value, k, v])
        elif leaf != "v_bias" and module not in ("k_proj", "v_proj"):
            out["pos_enc.freqs" if key == "rope.freqs" else key] = value
    return out


def describe(model: VisionTransformer, name: str) -> str:
    """One line for the CLI: what the import became."""
    cfg = model.cfg
    head = f"{cfg.num_classes} classes" if cfg.num_classes else f"features (global_pool {cfg.pool!r})"
    return f"timm {name}: {encoding_name(cfg.encoding)}, {cfg.depth} blocks of {cfg.embed_dim}, {head}"
