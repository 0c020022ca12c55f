"""A Vision Transformer trunk with timm's module and state-dict names and three PE hooks.

Names match timm's ``VisionTransformer`` (``patch_embed.proj``, ``cls_token``, ``reg_token``,
``pos_embed``, ``blocks.N.{norm1,attn.qkv,attn.proj,ls1.gamma,norm2,mlp.fc1,mlp.fc2,ls2.gamma}``,
``norm``, ``fc_norm``, ``head``; timm's ``SwiGLU`` ``mlp.fc1_g``/``mlp.fc1_x``, the sub-norms
``attn.norm``/``mlp.norm``), so a timm
state dict loads; modules a config does not use (LayerScale, registers, ``fc_norm``) hold no keys. The positional encoding lives in ``pos_enc``; keys it declares top-level (the
APE's ``pos_embed``) are renamed on save/load so they keep timm's names.

The model computes its encoding's tables once per forward (``forward``) or takes them from the
caller (``forward_with_tables``), which is how export bakes them as constants.

Over 400 lines, as timm's ``vision_transformer.py``: the config and the modules whose names
make up the state dict (patch embedding, attention, block, trunk) read together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deploykit._fields import FLOAT32_TINY, Range, check_values, dataclass_values, show
from deploykit.catalog import IMAGES_INPUT
from deploykit.encodings import (
    EncodingConfig,
    Hook,
    PETables,
    TrunkDims,
    config_from_dict,
    config_to_dict,
    create_encoding,
    geope,
    get_config,
    gridpe,
)
from deploykit.errors import ConfigError, ResolutionError, unknown_choice
from deploykit.inputs import imaging
from deploykit.inputs.datasets import DATASETS
from deploykit.inputs.kinds import ImageInput

# Bounds on a config's numbers, checked before anything is allocated (``deploykit._fields``). The
# sizes reach far past any published ViT (ViT-22B: width 6144, depth 48, 48 heads) and stop long
# before sizes whose weights could exist at all: a width of 10^9 overflowed PyTorch's storage size
# with a traceback instead of being refused.
MAX_HIDDEN = 1 << 20
TRUNK_RANGES = {
    "embed_dim": Range(1, 1 << 16),
    "depth": Range(1, 1 << 10),
    "num_heads": Range(1, 1 << 12),
    "mlp_ratio": Range(0, 64, low_open=True),
    "norm_eps": Range(FLOAT32_TINY, 1.0),  # LayerNorm's epsilon, a float32 attribute in the graph (NaN or < 0: ORT refuses it)
}
VIT_RANGES = {
    **TRUNK_RANGES,
    "img_size": Range(1, 1 << 16),
    "patch_size": Range(1, 1 << 12),
    "in_chans": Range(1, 1 << 10),
    "num_classes": Range(0, 1 << 24),
    "reg_tokens": Range(0, 1 << 10),
    "mlp_hidden_dim": Range(1, MAX_HIDDEN),
    "std": Range(0, None, low_open=True),  # inputs are divided by it: a zero gives Inf/NaN inputs
}
# How far normalisation may take a [0, 1] pixel: ImageNet's mean/std reach 2.6; past this an
# input overflows fp16 plans and saturates the model, so the export would only fail later.
MAX_NORMALISED = 1e4


def check_config(cfg, ranges) -> None:
    """Every value of a model config against its annotation and ``ranges`` (``check_values``), then
    what the sizes must agree on: the heads divide ``embed_dim``, the MLP's width is in range.

    Raises:
        ConfigError: naming the field.
    """
    check_values(type(cfg), dataclass_values(cfg), ranges)
    if cfg.embed_dim % cfg.num_heads:
        raise ConfigError(f"embed_dim {cfg.embed_dim} is not divisible by num_heads {cfg.num_heads}")
    hidden = getattr(cfg, "mlp_hidden_dim", None) or int(cfg.embed_dim * cfg.mlp_ratio)
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ConfigError(
            f"mlp_ratio {cfg.mlp_ratio:g} makes the MLP {hidden:,} wide for embed_dim {cfg.embed_dim:,}; it must be 1 to {MAX_HIDDEN:,}"
        )


def check_fields(cls, data: dict[str, Any]) -> None:
    """``ConfigError`` naming the unknown fields of a config dict, or the missing ``cls.required`` ones."""
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        more = f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ConfigError(f"model config has unknown field(s) {', '.join(show(name) for name in unknown[:5])}{more}")
    missing = [name for name in cls.required if name not in data]
    if missing:
        raise ConfigError(f"model config is missing required field(s) {missing}; no default fits every checkpoint")


def check_normalisation(mean, std, channels: int) -> None:
    """``ConfigError`` unless there is one mean and one std per input channel and they keep a
    [0, 1] pixel within ``MAX_NORMALISED`` (types, finiteness and ``std > 0``: ``VIT_RANGES``)."""
    if len(mean) != channels or len(std) != channels:
        raise ConfigError(f"mean and std need one value per input channel (in_chans {channels}), got {len(mean)} and {len(std)} values")
    for i, (m, s) in enumerate(zip(mean, std)):
        reach = max(abs(m), abs(1 - m)) / s
        if not reach <= MAX_NORMALISED:
            raise ConfigError(
                f"mean[{i}] {m:g} and std[{i}] {s:g} take [0, 1] pixels to {reach:.3g}; normalisation may reach "
                f"{MAX_NORMALISED:g} at most (mean and std are on [0, 1] pixels, e.g. 0.485 and 0.229)"
            )


def encoding_from_dict(value) -> EncodingConfig:
    """A config's ``encoding`` object (``{"name": "ape", ...options}``) → its encoding config."""
    if not (isinstance(value, dict) and type(value.get("name")) is str):
        raise ConfigError(f'encoding must be an object naming the encoding (e.g. {{"name": "ape"}}), got {show(value)}')
    return config_from_dict(value)


@dataclass(frozen=True)
class ViTConfig:
    """Architecture of the trunk plus its positional encoding.

    Attributes:
        img_size: the resolution the model is built for (the encoding's native grid).
        norm_eps: LayerNorm epsilon (timm ViTs use 1e-6).
        num_classes: classifier outputs; 0 means no head: the model returns its pooled (or, with
            ``global_pool=""``, per-token) features, as timm's ``num_classes=0``.
        class_token: prepend a class token.
        reg_tokens: register tokens after the class token (timm's ``reg_tokens``; DINOv3: 4).
        global_pool: ``token`` (the class token), ``avg``/``max``/``avgmax`` over the patch tokens
            (prefix tokens excluded, as timm), ``map`` (timm's ``AttentionPoolLatent``: a learned
            latent query attends over every token, ``attn_pool``), or ``""`` (every token);
            ``None`` means ``token`` with a class token, else ``avg``.
        fc_norm: the final LayerNorm comes after pooling (timm's ``fc_norm``) instead of before.
        embed_norm: a LayerNorm on the patch tokens right after the embedding (timm's
            ``PatchEmbed(norm_layer=...)``, ``patch_embed.norm``; the WePE authors' ``patch_norm``).
        init_values: LayerScale (``ls1``/``ls2``, DeiT-III, DINOv3) with this initial value;
            ``None`` means no LayerScale.
        mlp_layer: ``mlp`` (fc1, GELU, fc2), ``swiglu`` (timm's ``SwiGLU``: SiLU(fc1_g) * fc1_x, fc2)
            or ``swiglu_packed`` (timm's ``GluMlp`` as EVA-02 Ti/S use it: one fc1 whose first
            half is the gate).
        mlp_norm: a LayerNorm on the MLP's hidden units before fc2 (EVA-02 B/L's sub-LN, timm's
            ``scale_mlp``/``scale_mlp_norm``: ``mlp.norm``).
        attn_norm: a LayerNorm on the attention output before ``proj`` (EVA-02 CLIP's sub-LN,
            timm's ``scale_attn_inner``/``scale_attn_norm``: ``attn.norm``).
        mlp_hidden_dim: the MLP's hidden width; ``None`` means ``int(embed_dim * mlp_ratio)``.
        act_layer: the activation of ``mlp`` MLPs (and of the ``map`` pool's MLP): ``gelu``
            (exact erf) or ``gelu_tanh`` (tanh approximation: SigLIP, timm's ``act_layer='gelu_tanh'``).
        qk_norm: a LayerNorm over each head's channels on q and k before the encoding's q/k hook
            and the scaling (timm's ``qk_norm``: ``attn.q_norm``, ``attn.k_norm``).
        distilled: DeiT's distillation token and head: the one register token is timm's
            ``dist_token`` and a second head ``head_dist`` reads it, averaged with ``head`` (on the
            class token) at inference, as timm's ``VisionTransformerDistilled`` and
            ``transformers``' ``DeiTForImageClassificationWithTeacher`` do.
        mean, std: input normalisation the model expects (per channel, on [0, 1] pixels).
        dataset: the ``deploykit.zoo`` dataset the weights were trained on, if any; validation
            then takes its real inputs from that dataset's test split.
        crop_pct, crop_mode, interpolation: how an image becomes an input, with ``mean``/``std``
            (timm's eval transform, ``deploykit.inputs.imaging.Preprocessing``; an import from timm
            takes them from the model's ``pretrained_cfg``).
    """

    img_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    class_token: bool = True
    reg_tokens: int = 0
    global_pool: str | None = None
    fc_norm: bool = False
    embed_norm: bool = False
    init_values: float | None = None
    mlp_layer: str = "mlp"
    mlp_hidden_dim: int | None = None
    mlp_norm: bool = False
    attn_norm: bool = False
    act_layer: str = "gelu"
    qk_norm: bool = False
    distilled: bool = False
    norm_eps: float = 1e-6
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    encoding: EncodingConfig = field(default_factory=lambda: get_config("ape"))
    dataset: str | None = None
    crop_pct: float = imaging.DEFAULT_CROP_PCT
    crop_mode: str = "center"
    interpolation: str = "bicubic"

    # What config.json must say: the architecture and encoding have no default that fits every
    # checkpoint. Missing other fields take timm's ViT values (mlp_ratio 4, qkv bias, class
    # token, LayerNorm eps 1e-6, ImageNet mean/std).
    required: ClassVar[tuple[str, ...]] = ("img_size", "patch_size", "num_classes", "embed_dim", "depth", "num_heads", "encoding")

    def __post_init__(self):
        """Every check of the values, in one place, before any module is built (``check_config``)."""
        check_config(self, VIT_RANGES)
        if not isinstance(self.encoding, EncodingConfig):
            raise ConfigError(f"encoding must be an encoding config, got {show(self.encoding)}")
        if self.img_size % self.patch_size:
            raise ConfigError(f"img_size {self.img_size} is not a multiple of patch_size {self.patch_size}")
        if self.pool not in POOLS:
            raise ConfigError(f"global_pool must be one of {POOLS}, got {self.global_pool!r}")
        if self.pool == "token" and not self.class_token:
            raise ConfigError("global_pool 'token' needs class_token true (or global_pool avg, max, avgmax or '')")
        if self.mlp_layer not in MLP_LAYERS:
            raise ConfigError(f"mlp_layer must be one of {MLP_LAYERS}, got {self.mlp_layer!r}")
        if self.act_layer not in ACTIVATIONS:
            raise ConfigError(f"act_layer must be one of {tuple(ACTIVATIONS)}, got {self.act_layer!r}")
        if self.act_layer != "gelu" and self.mlp_layer != "mlp":
            raise ConfigError(f"act_layer {self.act_layer!r} needs mlp_layer 'mlp' ({self.mlp_layer} gates with SiLU)")
        if self.distilled and not (self.pool == "token" and self.reg_tokens == 1 and self.num_classes):
            raise ConfigError("distilled needs global_pool 'token', reg_tokens 1 (the distillation token) and num_classes > 0")
        check_normalisation(self.mean, self.std, self.in_chans)
        if self.dataset is not None and self.dataset not in DATASETS:
            raise ConfigError(f"dataset must be null or one of {', '.join(DATASETS)} (deploykit.zoo), got {show(self.dataset)}")
        try:
            imaging.check_preprocessing(self.crop_pct, self.crop_mode, self.interpolation)
        except ValueError as err:
            raise ConfigError(str(err)) from err

    @property
    def preprocessing(self) -> imaging.Preprocessing:
        """How an image becomes this model's input (calibration, validation and serving use it)."""
        return imaging.Preprocessing(self.mean, self.std, self.crop_pct, self.crop_mode, self.interpolation)

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + self.reg_tokens

    @property
    def pool(self) -> str:
        """``global_pool`` with its default resolved."""
        if self.global_pool is None:
            return "token" if self.class_token else "avg"
        return self.global_pool

    @property
    def hidden_dim(self) -> int:
        return self.mlp_hidden_dim or int(self.embed_dim * self.mlp_ratio)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["encoding"] = config_to_dict(self.encoding)
        data["mean"], data["std"] = list(self.mean), list(self.std)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ViTConfig:
        data = dict(data)
        check_fields(cls, data)
        if "encoding" in data:
            data["encoding"] = encoding_from_dict(data["encoding"])
        for key in ("mean", "std"):
            if isinstance(data.get(key), list):  # anything else is refused by __post_init__, naming it
                data[key] = tuple(data[key])
        return cls(**data)


POOLS = ("token", "avg", "max", "avgmax", "map", "")
MLP_LAYERS = ("mlp", "swiglu", "swiglu_packed")
# act_layer -> nn.GELU's approximate (timm's names: gelu, gelu_tanh)
ACTIVATIONS = {"gelu": "none", "gelu_tanh": "tanh"}

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # Standard sizes at patch 16 (timm's vit_{tiny,small,base}_patch16_224).
    "vit_tiny_patch16": dict(embed_dim=192, depth=12, num_heads=3),
    "vit_small_patch16": dict(embed_dim=384, depth=12, num_heads=6),
    "vit_base_patch16": dict(embed_dim=768, depth=12, num_heads=12),
    # The papers' settings (documented in each encoding module): GridPE's ViT-S uses 4 heads of
    # dim 96; GeoPE's CIFAR runs use patch 4 at 32 px (its ImageNet ViT-S/B are the standard sizes).
    "vit_small_patch16_4heads": gridpe.PAPER_MODEL,
    "vit_small_patch4_32": geope.PAPER_MODELS["vit_small_cifar"],
    "vit_base_patch4_32": geope.PAPER_MODELS["vit_base_cifar"],
}


class PatchEmbed(nn.Module):
    """Image ``[B, C, H, W]`` → tokens ``[B, (H/p)(W/p), D]`` by a stride-``p`` convolution, then
    ``norm`` (timm's ``norm_layer``; an ``Identity``, which holds no keys, when there is none)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, norm: nn.Module | None = None):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = norm if norm is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


def sub_norm(enabled: bool, width: int, eps: float) -> nn.Module:
    """A LayerNorm inside a branch (``attn.norm``, ``mlp.norm``), or an Identity that holds no keys."""
    return nn.LayerNorm(width, eps=eps) if enabled else nn.Identity()


class Mlp(nn.Module):
    """``fc2(norm(GELU(fc1(x))))``; ``norm`` is a LayerNorm on the hidden units when asked, as timm's ``Mlp``;
    ``act`` is an ``ACTIVATIONS`` name (exact erf GELU, timm's default, or its tanh approximation)."""

    def __init__(self, dim: int, hidden: int, norm: bool = False, eps: float = 1e-6, act: str = "gelu"):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate=ACTIVATIONS[act])
        self.norm = sub_norm(norm, hidden, eps)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.norm(self.act(self.fc1(x))))


class SwiGLU(nn.Module):
    """timm's ``SwiGLU`` (split gate and value projections): ``fc2(norm(SiLU(fc1_g(x)) * fc1_x(x)))``."""

    def __init__(self, dim: int, hidden: int, norm: bool = False, eps: float = 1e-6):
        super().__init__()
        self.fc1_g = nn.Linear(dim, hidden)
        self.fc1_x = nn.Linear(dim, hidden)
        self.act = nn.SiLU()
        self.norm = sub_norm(norm, hidden, eps)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.norm(self.act(self.fc1_g(x)) * self.fc1_x(x)))


class SwiGLUPacked(nn.Module):
    """timm's ``GluMlp`` with SiLU and the gate first (EVA-02 Ti/S): one ``fc1`` ``[2h, D]`` whose
    first ``h`` outputs gate the last ``h``: ``fc2(norm(SiLU(g) * x))`` with ``g, x = fc1(x)``."""

    def __init__(self, dim: int, hidden: int, norm: bool = False, eps: float = 1e-6):
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * hidden)
        self.act = nn.SiLU()
        self.norm = sub_norm(norm, hidden, eps)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(self.norm(self.act(gate) * value))


_MLPS = {"mlp": Mlp, "swiglu": SwiGLU, "swiglu_packed": SwiGLUPacked}


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch (Touvron et al. 2021, CaiT/DeiT-III): ``x * gamma``."""

    def __init__(self, dim: int, init_values: float):
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Attention(nn.Module):
    """Multi-head self-attention with the encoding's q/k and logits hooks; ``qk_norm`` normalises
    each head's q and k first (timm's ``q_norm``/``k_norm``, Identities holding no keys otherwise)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, norm: bool = False, eps: float = 1e-6, qk_norm: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = sub_norm(qk_norm, self.head_dim, eps)
        self.k_norm = sub_norm(qk_norm, self.head_dim, eps)
        self.norm = sub_norm(norm, dim, eps)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, pos_enc, tables: dict[str, Tensor], grid: tuple[int, int]) -> Tensor:
        B, N, C = x.shape
        # [B, N, 3D] -> [3, B, H, N, d]
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)  # before RoPE and the scaling, as timm's Attention
        bias = None
        if pos_enc.uses(Hook.QK):
            q, k = pos_enc.apply_qk(q, k, tables)
        if pos_enc.uses(Hook.LOGITS):
            bias = pos_enc.logits_bias(q, k, tables, grid)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(self.norm(x.transpose(1, 2).reshape(B, N, C)))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg.embed_dim, cfg.num_heads, cfg.qkv_bias, cfg.attn_norm, cfg.norm_eps, cfg.qk_norm)
        self.ls1 = LayerScale(cfg.embed_dim, cfg.init_values) if cfg.init_values is not None else nn.Identity()
        self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        mlp_act = dict(act=cfg.act_layer) if cfg.mlp_layer == "mlp" else {}
        self.mlp = _MLPS[cfg.mlp_layer](cfg.embed_dim, cfg.hidden_dim, cfg.mlp_norm, cfg.norm_eps, **mlp_act)
        self.ls2 = LayerScale(cfg.embed_dim, cfg.init_values) if cfg.init_values is not None else nn.Identity()

    def forward(self, x: Tensor, pos_enc, tables: dict[str, Tensor], grid: tuple[int, int]) -> Tensor:
        x = x + self.ls1(self.attn(self.norm1(x), pos_enc, tables, grid))
        return x + self.ls2(self.mlp(self.norm2(x)))


class AttentionPoolLatent(nn.Module):
    """timm's ``AttentionPoolLatent`` as its ``VisionTransformer`` builds it for ``global_pool='map'``
    (one latent, biased projections, no q/k norm or position): a learned query attends over every
    token, then a residual MLP on its LayerNorm: ``[B, N, D]`` → ``[B, D]``. ``transformers``'
    ``SiglipMultiheadAttentionPoolingHead`` computes the same (``probe`` = ``latent``; its
    ``in_proj`` splits into ``q`` and ``kv``)."""

    def __init__(self, dim: int, num_heads: int, hidden: int, eps: float, act: str):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, hidden, act=act)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q = self.q(self.latent).reshape(1, 1, self.num_heads, self.head_dim).transpose(1, 2).expand(B, -1, -1, -1)
        # [B, N, 2D] -> [2, B, H, N, d]
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, C))
        return x + self.mlp(self.norm(x))


class VisionTransformer(nn.Module):
    """ViT classifier taking any resolution that is a multiple of the patch size.

    The deployment interface shared with ``SequenceTransformer`` (``input_name``, ``input_kind``,
    ``default_shape``, ``check_shape``, ``shape_of``, ``shape_tables``) lets export, validation
    and profiling treat both alike; a shape here is ``(height, width)``. What differs between
    the architectures (inputs, FLOPs, preprocessing) is in ``deploykit.nn.spec``.

    Args:
        cfg: architecture and encoding.
    """

    input_name: ClassVar[str] = IMAGES_INPUT

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        embed_norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps) if cfg.embed_norm else None
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.in_chans, cfg.embed_dim, embed_norm)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.embed_dim)) if cfg.class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, cfg.embed_dim)) if cfg.reg_tokens else None
        native = cfg.img_size // cfg.patch_size
        dims = TrunkDims(cfg.embed_dim, cfg.num_heads, cfg.depth, cfg.num_prefix_tokens, (native, native))
        self.pos_enc = create_encoding(cfg.encoding, dims)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.depth)])
        final_norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.norm = nn.Identity() if cfg.fc_norm else final_norm
        self.fc_norm = final_norm if cfg.fc_norm else nn.Identity()
        self.attn_pool = (
            AttentionPoolLatent(cfg.embed_dim, cfg.num_heads, cfg.hidden_dim, cfg.norm_eps, cfg.act_layer) if cfg.pool == "map" else None
        )
        self.head = nn.Linear(cfg.embed_dim, cfg.num_classes) if cfg.num_classes else nn.Identity()
        self.head_dist = nn.Linear(cfg.embed_dim, cfg.num_classes) if cfg.distilled else None
        self._init_weights()
        self.register_state_dict_post_hook(_to_timm_names)
        self.register_load_state_dict_pre_hook(_from_timm_names)

    def _init_weights(self) -> None:
        # timm's "jax"-free default: trunc-normal linears, zero biases, small class token.
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if self.reg_token is not None:
            nn.init.normal_(self.reg_token, std=1e-6)
        if self.attn_pool is not None:
            nn.init.trunc_normal_(self.attn_pool.latent, std=self.cfg.embed_dim**-0.5)
        self.pos_enc.reset_parameters()

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Patch grid for an input size; raises ``ResolutionError`` unless both are multiples of the patch."""
        p = self.cfg.patch_size
        if height % p or width % p or height <= 0 or width <= 0:
            raise ResolutionError(
                f"resolution {height}x{width} is not a positive multiple of the patch size {p}; try {max(p, round(height / p) * p)}"
            )
        return height // p, width // p

    @property
    def default_shape(self) -> tuple[int, int]:
        return (self.cfg.img_size, self.cfg.img_size)

    @property
    def input_kind(self) -> ImageInput:
        """What the model takes, for making and checking its inputs (``deploykit.inputs.kinds``)."""
        cfg = self.cfg
        return ImageInput(cfg.in_chans, cfg.preprocessing, cfg.dataset, cfg.mean, cfg.std)

    def check_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The resolution itself, once checked against the patch size (``ResolutionError`` if not)."""
        self.grid(*shape)
        return tuple(shape)

    def num_tokens(self, shape: tuple[int, int]) -> int:
        """Tokens the blocks attend over at ``shape``: prefix tokens plus one per patch."""
        gh, gw = self.grid(*shape)
        return gh * gw + self.cfg.num_prefix_tokens

    def shape_of(self, images: Tensor) -> tuple[int, int]:
        return tuple(images.shape[-2:])

    def shape_tables(self, shape: tuple[int, int]) -> PETables:
        """The encoding's float64 tables for a ``(height, width)`` input."""
        return self.pos_enc.tables(self.grid(*shape))

    def tables(self, grid: tuple[int, int], dtype: torch.dtype, device: torch.device | str = "cpu") -> PETables:
        """The encoding's tables for ``grid``, built in float64 and cast to ``dtype`` on ``device``."""
        return self.pos_enc.tables(grid).map(lambda t: t.to(device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_with_tables(x, self.tables(self.grid(*x.shape[-2:]), x.dtype, x.device))

    def forward_with_tables(self, x: Tensor, tables: PETables) -> Tensor:
        return self.forward_head(self.forward_features(x, tables))

    def forward_features(self, x: Tensor, tables: PETables) -> Tensor:
        """The final normed tokens ``[B, P + N, D]``, as timm's ``forward_features``."""
        return self.norm(self.hidden_states(x, tables)[-1])

    def hidden_states(self, x: Tensor, tables: PETables) -> list[Tensor]:
        """Token sequences after the embedding and after every block: ``depth + 1`` × ``[B, P + N, D]``
        (what validation compares block by block to find the first that diverges)."""
        grid = self.grid(*x.shape[-2:])
        x = self.patch_embed(x)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if prefix:
            x = torch.cat([*prefix, x], dim=1)
        if self.pos_enc.uses(Hook.TOKENS):
            x = self.pos_enc.apply_tokens(x, tables.model)
        outputs = [x]
        for i, block in enumerate(self.blocks):
            x = block(x, self.pos_enc, tables.layers[i] if tables.layers else {}, grid)
            outputs.append(x)
        return outputs

    def forward_head(self, x: Tensor) -> Tensor:
        """Pooling (timm's ``global_pool_nlc``), ``fc_norm``, head, as timm's ``forward_head``: normed
        tokens ``[B, P + N, D]`` → ``[B, classes]`` (or ``[B, D]`` / ``[B, P + N, D]`` features without a head).
        A distilled model averages ``head`` on the class token and ``head_dist`` on the next one."""
        if self.head_dist is not None:
            return 0.5 * (self.head(self.fc_norm(x[:, 0])) + self.head_dist(self.fc_norm(x[:, 1])))
        return self.head(self.fc_norm(self.pool(x)))

    def pool(self, x: Tensor) -> Tensor:
        pool = self.cfg.pool
        if pool == "token":
            return x[:, 0]
        if pool == "map":
            return self.attn_pool(x)
        if not pool:
            return x
        patches = x[:, self.cfg.num_prefix_tokens :]
        if pool == "avg":
            return patches.mean(dim=1)
        if pool == "max":
            return patches.amax(dim=1)
        return 0.5 * (patches.amax(dim=1) + patches.mean(dim=1))  # avgmax


def _renames(module: VisionTransformer) -> dict[str, str]:
    """``pos_enc.<key>`` → ``<key>`` for the keys the encoding keeps at timm's top level, and a
    distilled model's token as timm's ``VisionTransformerDistilled`` names it (``dist_token``)."""
    renames = {f"pos_enc.{key}": key for key in module.pos_enc.top_level_keys}
    if module.cfg.distilled:
        renames["reg_token"] = "dist_token"
    return renames


def _to_timm_names(module, state_dict, prefix, local_metadata):
    for ours, timm_name in _renames(module).items():
        if prefix + ours in state_dict:
            state_dict[prefix + timm_name] = state_dict.pop(prefix + ours)


def _from_timm_names(module, state_dict, prefix, *args):
    for ours, timm_name in _renames(module).items():
        if prefix + timm_name in state_dict:
            state_dict[prefix + ours] = state_dict.pop(prefix + timm_name)


def create_vit_model(name: str, *, encoding: str | EncodingConfig = "ape", **overrides: Any) -> VisionTransformer:
    """Build a ViT from a named size and an encoding (``deploykit.nn.create_model`` picks the architecture).

    Args:
        name: one of ``MODEL_CONFIGS``.
        encoding: a registry name or a config from ``deploykit.encodings.get_config``.
        **overrides: any ``ViTConfig`` field (``num_classes``, ``img_size``, ...).

    Raises:
        ConfigError: unknown model or encoding name, or an invalid field.
    """
    if name not in MODEL_CONFIGS:
        raise ConfigError(unknown_choice("model", name, sorted(MODEL_CONFIGS)))
    enc = get_config(encoding) if isinstance(encoding, str) else encoding
    try:
        cfg = ViTConfig(**{**MODEL_CONFIGS[name], **overrides, "encoding": enc})
    except TypeError as err:
        raise ConfigError(f"invalid model option: {err}") from err
    return VisionTransformer(cfg)
