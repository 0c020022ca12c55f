"""A small causal sequence transformer that carries 1-D MoPE and Energy-Gated Attention.

MoPE's paper (digest ``shared/spec/mope.md`` §4.2, §6.1) evaluates a character-level GPT, not a
ViT: pre-LN blocks, GELU MLP, final LayerNorm, LM head tied to the token embedding, MoPE added
to the token embeddings, and EGA-1 attention in the headline model. Here sequence length plays
the role that resolution plays for the ViT: one exported graph per length, with the MoPE table
baked as a constant ``[1, T, d]``.

Departures from the authors' script, none of which changes the function computed:

* q/k/v of all heads are one ``Linear(d, 3d)`` (the script has a module per head; same maps).
* EGA's per-head energy projections are one ``Linear(d, H)`` (``EnergyGate``).
* The tied head is ``F.linear(x, token_embed.weight)``, so the weight is stored once.

The module names follow the ViT trunk (``blocks.N.norm1``, ``attn.qkv``, ``mlp.fc1``, ``norm``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deploykit._fields import Range
from deploykit.catalog import SEQUENCE_ARCHITECTURE, TOKENS_INPUT
from deploykit.encodings import EncodingConfig, PETables, config_to_dict, get_config
from deploykit.encodings.ape import ApeConfig
from deploykit.encodings.mope import (
    PAPER_MODEL as MOPE_PAPER_MODEL,
)
from deploykit.encodings.mope import (
    EnergyGate,
    MoPE1d,
    MoPEConfig,
    causal_mask,
    ega_attention,
    ega_log_gate,
    ega_weights_train,
)
from deploykit.errors import ConfigError, ResolutionError, unknown_choice
from deploykit.inputs.kinds import TokenInput
from deploykit.nn.vit import TRUNK_RANGES, Mlp, check_config, check_fields, encoding_from_dict

_ATTENTIONS = ("dot", "ega")
# Bounds on the config's numbers (``deploykit._fields``), as the ViT's (``TRUNK_RANGES``).
SEQUENCE_RANGES = {
    **TRUNK_RANGES,
    "vocab_size": Range(1, 1 << 24),
    "context": Range(1, 1 << 20),
    "dropout": Range(0, 1),
}


@dataclass(frozen=True)
class SequenceConfig:
    """Architecture of the causal sequence model plus its positional encoding.

    Attributes:
        vocab_size: token vocabulary (65 characters in the paper).
        context: the length the model is built for; the learned APE covers exactly this many
            positions, MoPE any length.
        attention: ``ega`` (EGA-1, the paper's EGA-MORLET) or ``dot`` (PE-MORLET).
        causal: mask future keys (the paper's GPT); EGA's z-score still spans the whole window.
        dropout: embedding, attention-probability and projection dropout (training only).
        ega_alpha_init, ega_tau_init: EGA gate slope and threshold at init (2.0, 0.0 in [C]).
        norm_eps: LayerNorm epsilon (PyTorch's default 1e-5, as the authors' script).
        encoding: ``mope`` (1-D MoPE, envelope origin at position 0) or ``ape`` (learned table).
    """

    vocab_size: int = 65
    context: int = 256
    embed_dim: int = 256
    depth: int = 6
    num_heads: int = 8
    mlp_ratio: float = 4.0
    qkv_bias: bool = False
    attention: str = "ega"
    causal: bool = True
    dropout: float = 0.1
    ega_alpha_init: float = 2.0
    ega_tau_init: float = 0.0
    norm_eps: float = 1e-5
    encoding: EncodingConfig = field(default_factory=lambda: MoPEConfig(origin="corner"))

    architecture: ClassVar[str] = SEQUENCE_ARCHITECTURE
    # What config.json must say (check_fields); the rest default to the authors' script.
    required: ClassVar[tuple[str, ...]] = ("vocab_size", "context", "embed_dim", "depth", "num_heads", "attention", "causal", "encoding")

    def __post_init__(self):
        """Every check of the values, in one place, before any module is built (``check_config``)."""
        check_config(self, SEQUENCE_RANGES)
        if self.attention not in _ATTENTIONS:
            raise ConfigError(f"attention must be one of {_ATTENTIONS}, got {self.attention!r}")
        if not isinstance(self.encoding, (MoPEConfig, ApeConfig)):
            raise ConfigError(f"sequence models support the mope and ape encodings, got {type(self.encoding).__name__}")

    def to_dict(self) -> dict[str, Any]:
        data = {"architecture": SEQUENCE_ARCHITECTURE, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
        data["encoding"] = config_to_dict(self.encoding)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SequenceConfig:
        data = {k: v for k, v in data.items() if k != "architecture"}
        check_fields(cls, data)
        if "encoding" in data:
            data["encoding"] = encoding_from_dict(data["encoding"])
        return cls(**data)


# The paper's char model (EGA-MORLET, digest §4.2) and its dot-product ablation (PE-MORLET);
# a tiny size for tests and quick profiling.
SEQUENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "char_gpt_ega": {
        k: MOPE_PAPER_MODEL[k] for k in ("vocab_size", "context", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "dropout")
    },
    "char_gpt_dot": {
        k: MOPE_PAPER_MODEL[k] for k in ("vocab_size", "context", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "dropout")
    }
    | {"attention": "dot"},
    "seq_tiny_ega": dict(embed_dim=64, depth=2, num_heads=4),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention, plain or energy-gated (EGA-1)."""

    def __init__(self, cfg: SequenceConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.embed_dim // cfg.num_heads
        self.causal = cfg.causal
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim, bias=cfg.qkv_bias)
        self.gate = EnergyGate(cfg.embed_dim, cfg.num_heads, cfg.ega_alpha_init, cfg.ega_tau_init) if cfg.attention == "ega" else None
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.proj_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """``x`` ``[B, T, d]``; ``mask`` the additive ``[T, T]`` causal mask (None when not causal)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.gate is None:
            drop = self.attn_drop.p if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
        elif self.training:
            # The authors' training form: softmax, dropout, gate, renormalise (digest §3).
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            if mask is not None:
                scores = scores + mask
            gate = torch.sigmoid(self.gate(x)).to(scores.dtype)
            out = ega_weights_train(scores, gate, dropout=self.attn_drop) @ v
        else:
            # Eval form softmax(s + log g): one additive key bias, fused-attention friendly.
            out = ega_attention(q, k, v, ega_log_gate(self.gate(x)), mask)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, T, C)))


class SequenceBlock(nn.Module):
    def __init__(self, cfg: SequenceConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.mlp = Mlp(cfg.embed_dim, int(cfg.embed_dim * cfg.mlp_ratio))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.drop(self.mlp(self.norm2(x)))


class SequenceTransformer(nn.Module):
    """Causal language model ``tokens [B, T] int64 → logits [B, T, vocab]``.

    Shares the ViT trunk's deployment interface (``input_name``, ``input_kind``, ``default_shape``,
    ``check_shape``, ``shape_of``, ``shape_tables``, ``hidden_states``, ``forward_head``), so
    export, validation and profiling treat a sequence length like a resolution.
    """

    input_name: ClassVar[str] = TOKENS_INPUT

    def __init__(self, cfg: SequenceConfig):
        super().__init__()
        self.cfg = cfg
        self.token_embed = nn.Embedding(cfg.vocab_size, cfg.embed_dim)
        if isinstance(cfg.encoding, MoPEConfig):
            self.pos_enc = MoPE1d(cfg.embed_dim, cfg.encoding)
            self.pos_embed = None
        else:
            self.pos_enc = None
            self.pos_embed = nn.Parameter(torch.zeros(1, cfg.context, cfg.embed_dim))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([SequenceBlock(cfg) for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style, as the authors' script: N(0, 0.02) linears and embeddings, zero biases.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed, std=0.02)

    @property
    def input_kind(self) -> TokenInput:
        """What the model takes, for making and checking its inputs (``deploykit.inputs.kinds``)."""
        return TokenInput(self.cfg.vocab_size)

    @property
    def default_shape(self) -> tuple[int]:
        return (self.cfg.context,)

    def check_shape(self, shape: tuple[int, ...]) -> tuple[int]:
        """``(T,)`` from a parsed ``--resolution`` (``256`` parses as ``(256, 256)``)."""
        if len(shape) == 2 and shape[0] != shape[1]:
            raise ResolutionError(f"a sequence model takes one length, not {shape[0]}x{shape[1]}")
        length = int(shape[0])
        if length <= 0:
            raise ResolutionError(f"sequence length must be positive, got {length}")
        if self.pos_embed is not None and length > self.cfg.context:
            raise ResolutionError(f"the learned position table covers {self.cfg.context} positions; length {length} is longer")
        return (length,)

    def shape_of(self, tokens: Tensor) -> tuple[int]:
        return (tokens.shape[-1],)

    def num_tokens(self, shape: tuple[int, ...]) -> int:
        """Tokens the blocks attend over: the length."""
        return self.check_shape(shape)[0]

    def shape_tables(self, shape: tuple[int]) -> PETables:
        """Float64 per-length constants: the position table ``pos_embed`` ``[1, T, d]`` (MoPE from
        its effective ω, σ) and, for a causal model, the additive ``causal_mask`` ``[T, T]``."""
        (length,) = self.check_shape(shape)
        table = self.pos_enc(length)[None] if self.pos_enc is not None else self.pos_embed[:, :length].double()
        tables = {"pos_embed": table}
        if self.cfg.causal:
            tables["causal_mask"] = causal_mask(length).to(table.device)
        return PETables(model=tables)

    def forward(self, tokens: Tensor) -> Tensor:
        dtype = self.token_embed.weight.dtype
        tables = self.shape_tables(self.shape_of(tokens)).map(lambda t: t.to(device=tokens.device, dtype=dtype))
        return self.forward_with_tables(tokens, tables)

    def forward_with_tables(self, tokens: Tensor, tables: PETables) -> Tensor:
        return self.forward_head(self.forward_features(tokens, tables))

    def forward_features(self, tokens: Tensor, tables: PETables) -> Tensor:
        """The final normed hidden states ``[B, T, d]``."""
        return self.norm(self.hidden_states(tokens, tables)[-1])

    def hidden_states(self, tokens: Tensor, tables: PETables) -> list[Tensor]:
        """Hidden states after the embedding and after every block: ``depth + 1`` × ``[B, T, d]``."""
        x = self.drop(self.token_embed(tokens) + tables.model["pos_embed"])
        outputs = [x]
        mask = tables.model.get("causal_mask")
        for block in self.blocks:
            x = block(x, mask)
            outputs.append(x)
        return outputs

    def forward_head(self, x: Tensor) -> Tensor:
        return F.linear(x, self.token_embed.weight)  # tied LM head


def create_sequence_model(name: str, *, encoding: str | EncodingConfig | None = None, **overrides: Any) -> SequenceTransformer:
    """Build a named sequence model; ``encoding`` ``mope`` (default, origin at position 0) or ``ape``."""
    if name not in SEQUENCE_CONFIGS:
        raise ConfigError(unknown_choice("sequence model", name, sorted(SEQUENCE_CONFIGS)))
    if encoding is None or encoding == "mope":
        encoding = MoPEConfig(origin="corner")  # the paper's b0 = 0; origin is unused in 1-D
    elif isinstance(encoding, str):
        encoding = get_config(encoding)
    try:
        cfg = SequenceConfig(**{**SEQUENCE_CONFIGS[name], **overrides, "encoding": encoding})
    except TypeError as err:
        raise ConfigError(f"invalid model option: {err}") from err
    return SequenceTransformer(cfg)
