"""The MoPE repository's GPT as a deploykit sequence model (``deploykit import mope FILE``).

``AthanasiosZeris/energy-gated-attention``'s ``paper2_ega_mope/gpt_phase4_memfix.py`` trains a
character-level GPT and saves ``{"model_state", "optimizer_state", "history", "step"}``. Its
state dict says everything the forward needs: depth (``blocks.N``), heads (one module per head,
``blocks.N.heads.H``), width and vocabulary (``tok_emb``), block size (every head's ``tril``
buffer), the attention (EGA-1 heads carry ``proj``, ``alpha``, ``tau``) and the positional
encoding (``pe.log_omega``/``pe.log_sigma`` of ``MorletPE``, or the learned ``pos_emb``). Four
of its Table-2 models are deploykit sequence models: EGA-MORLET, PE-MORLET, EGA-1 and BASE-DOT.
The others are refused by the key that shows them (PE-SINCOS ``pe.pe``, PE-ROPE ``theta``,
CONV-L4/L8 ``lag_weights``), as is any key that script's GPT does not save.

=======================================  ==============================================
the script's ``GPT``                     ``SequenceTransformer``
=======================================  ==============================================
``tok_emb.weight`` (= ``head.weight``)   ``token_embed.weight`` (the head stays tied)
``pe.log_omega``, ``pe.log_sigma``       ``pos_enc.log_omega``, ``pos_enc.log_sigma``
``pos_emb.weight`` ``[C, d]``            ``pos_embed`` ``[1, C, d]`` (``ape``)
``blocks.N.ln1``, ``ln2``                ``blocks.N.norm1``, ``norm2``
``blocks.N.heads.H.{query,key,value}``   ``blocks.N.attn.qkv``: rows ``[q_0..q_H-1, k_0.., v_0..]``
``blocks.N.heads.H.proj``                ``blocks.N.attn.gate.proj`` row ``H``
``blocks.N.heads.H.alpha``, ``tau``      ``blocks.N.attn.gate.alpha[H]``, ``tau[H]``
``blocks.N.proj``                        ``blocks.N.attn.proj``
``blocks.N.ff.0``, ``ff.2``              ``blocks.N.mlp.fc1``, ``fc2``
``ln_f``                                 ``norm``
``heads.H.tril``, ``pe.pos``             (checked: the causal mask and positions 0..C-1)
=======================================  ==============================================

The script's fixed constants (not in the file, not options of it) are the config's: MoPE's
``0.95π`` cap, ``1e-3`` σ floor, ``1e-8`` envelope term and admissibility 5; EGA's ``1e-8`` std
floor; LayerNorm's ``1e-5``; dropout 0.1 (training only).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from deploykit.encodings import EncodingConfig
from deploykit.encodings.ape import ApeConfig
from deploykit.encodings.mope import MoPEConfig
from deploykit.errors import CheckpointError, ConfigError
from deploykit.nn.checkpoint import Imported, TrainingCheckpoint, imported_model, shape_of
from deploykit.nn.sequence import SequenceConfig

SCRIPT = "gpt_phase4_memfix.py"
# MorletPE.forward's constants: ω = min(e^logω, 0.95π), σ = max(e^logσ, 1e-3), ω ← 5/σ where
# ωσ < 5, envelope exp(-b² / (2σ² + 1e-8)), b = 0, 1, ... (digest mope.md §1.3).
SCRIPT_MOPE = MoPEConfig(
    init="code", admissibility=5.0, omega_cap=0.95 * math.pi, sigma_floor=1e-3, envelope_eps=1e-8, clamp_grad="hard", origin="corner"
)
SCRIPT_DROPOUT = 0.1  # its DROPOUT; inert in the deployed (eval) forward
# The script's names for its models (Table 2), by attention and positional encoding.
MODEL_NAMES = {("ega", "mope"): "EGA-MORLET", ("dot", "mope"): "PE-MORLET", ("ega", "ape"): "EGA-1", ("dot", "ape"): "BASE-DOT"}

# Every tensor name the script's GPT saves for the models deploykit computes.
_OWN_KEYS = re.compile(
    r"tok_emb\.weight|head\.weight|ln_f\.(weight|bias)|pe\.(log_omega|log_sigma|pos)|pos_emb\.weight"
    r"|blocks\.\d+\.(ln1|ln2|proj|ff\.0|ff\.2)\.(weight|bias)"
    r"|blocks\.\d+\.heads\.\d+\.((query|key|value)\.weight|proj\.(weight|bias)|alpha|tau|tril)"
)
# Keys of the script's other models, each naming the part deploykit's sequence model lacks.
_OTHER_MODELS = (
    (re.compile(r"pe\.pe"), "PE-SINCOS's fixed sin/cos table"),
    (re.compile(r"blocks\.\d+\.heads\.\d+\.theta"), "PE-ROPE's rotary attention"),
    (re.compile(r"blocks\.\d+\.heads\.\d+\.lag_weights"), "CONV-L4/CONV-L8's convolution attention"),
)
_EXPECTED = "tok_emb.weight, pe.log_omega or pos_emb.weight, blocks.N.heads.H.{query,key,value}.weight, blocks.N.ff.0.weight, ln_f.weight"


@dataclass(frozen=True)
class GptLayout:
    """The script's GPT as its state dict describes it.

    Attributes:
        vocab_size, embed_dim: ``tok_emb``'s shape (``VOCAB``, ``N_EMBED``).
        depth, num_heads: ``N_LAYER`` (``blocks.N``), ``N_HEAD`` (``blocks.0.heads.H``).
        context: ``BLOCK_SIZE``, the side of every head's ``tril`` buffer.
        mlp_hidden: ``ff.0``'s width (``4·N_EMBED``).
        attention: ``ega`` (``EGA1Attention`` heads) or ``dot`` (``DotProductAttention``).
        encoding: ``mope`` (``MorletPE``) or ``ape`` (the learned ``pos_emb``).
    """

    vocab_size: int
    embed_dim: int
    depth: int
    num_heads: int
    context: int
    mlp_hidden: int
    attention: str
    encoding: str

    @property
    def name(self) -> str:
        return MODEL_NAMES[self.attention, self.encoding]

    def config(self) -> SequenceConfig:
        encoding: EncodingConfig = SCRIPT_MOPE if self.encoding == "mope" else ApeConfig()
        return SequenceConfig(
            vocab_size=self.vocab_size,
            context=self.context,
            embed_dim=self.embed_dim,
            depth=self.depth,
            num_heads=self.num_heads,
            mlp_ratio=self.mlp_hidden / self.embed_dim,
            qkv_bias=False,
            attention=self.attention,
            causal=True,
            dropout=SCRIPT_DROPOUT,
            norm_eps=1e-5,
            encoding=encoding,
        )

    def read(self) -> dict[str, object]:
        """What ``Imported.read`` reports, in the script's terms."""
        return dict(
            model=self.name,
            depth=self.depth,
            heads=self.num_heads,
            embed_dim=self.embed_dim,
            vocab=self.vocab_size,
            block_size=self.context,
            attention=self.attention,
            encoding=self.encoding,
        )


def convert(checkpoint: TrainingCheckpoint, ema: bool = False) -> Imported:
    """The file's model as a ``SequenceTransformer`` whose forward is the script's (eval mode).

    Args:
        checkpoint: the file as ``read_training_checkpoint`` read it.
        ema: take the EMA copy (the script saves none, so this is refused).

    Raises:
        CheckpointError: ``--ema``, a key the script's GPT does not save or a model of it that
            deploykit does not compute (the first such key named), or tensors that disagree.
    """
    state = checkpoint.chosen(ema)
    source = str(checkpoint.path)
    layout = read_layout(state, source)
    weights = state_dict_from_mope(state, layout, source)  # every key and shape checked before a model is built
    model = imported_model(model_config(layout, source), weights, f"{source} (converted from {SCRIPT}'s names)")
    read = layout.read()
    if type(checkpoint.extras.get("step")) is int:
        read["step"] = checkpoint.extras["step"]
    return Imported(model, f"mope:{source}", read)


def model_config(layout: GptLayout, source: str) -> SequenceConfig:
    try:
        return layout.config()
    except ConfigError as err:
        raise CheckpointError(f"{source}: the GPT it holds cannot be built: {err}") from err


def read_layout(state: dict[str, Tensor], source: str) -> GptLayout:
    """Sizes, attention and encoding from the names and shapes in ``state``.

    Raises:
        CheckpointError: the first key that is not the script's GPT's, or a missing one.
    """
    check_keys(state, source)
    vocab_size, embed_dim = shape_of(state, "tok_emb.weight", 2, source)
    depth = _count(state, "blocks.{}", "blocks.0.ln1.weight", source)
    num_heads = _count(state, "blocks.0.heads.{}", "blocks.0.heads.0.query.weight", source)
    context = shape_of(state, "blocks.0.heads.0.tril", 2, source)[0]
    mlp_hidden = shape_of(state, "blocks.0.ff.0.weight", 2, source)[0]
    attention = "ega" if "blocks.0.heads.0.alpha" in state else "dot"
    if "pe.log_omega" in state:
        encoding = "mope"
    elif "pos_emb.weight" in state:
        encoding = "ape"
    else:
        raise CheckpointError(f"{source} holds neither pe.log_omega (the script's MorletPE) nor pos_emb.weight (its learned table)")
    return GptLayout(vocab_size, embed_dim, depth, num_heads, context, mlp_hidden, attention, encoding)


def check_keys(state: dict[str, Tensor], source: str) -> None:
    """Refuse, by its first key not of the four models, a file of another kind."""
    for key in state:
        if _OWN_KEYS.fullmatch(key):
            continue
        for pattern, what in _OTHER_MODELS:
            if pattern.fullmatch(key):
                raise CheckpointError(
                    f"{source} holds {key}: {what}, which deploykit's sequence model does not compute "
                    f"(it imports {', '.join(MODEL_NAMES.values())})"
                )
        raise CheckpointError(f"{source} is not a checkpoint of {SCRIPT}'s GPT: its key {key!r} is not one it saves; expected {_EXPECTED}")


def state_dict_from_mope(state: dict[str, Tensor], layout: GptLayout, source: str) -> dict[str, Tensor]:
    """``state`` under deploykit's names (module docstring); every tensor of ``state`` is used or
    checked, and one left over is refused by name."""
    d, n = layout.embed_dim, layout.context
    taken: set[str] = set()

    def take(key: str, shape: tuple[int, ...]) -> Tensor:
        tensor = _tensor(state, key, source, shape=shape)
        taken.add(key)
        return tensor

    token = take("tok_emb.weight", (layout.vocab_size, d))
    if not torch.equal(take("head.weight", (layout.vocab_size, d)), token):
        raise CheckpointError(f"{source}: head.weight differs from tok_emb.weight; the script ties them, and so does deploykit's model")
    out = {"token_embed.weight": token, "norm.weight": take("ln_f.weight", (d,)), "norm.bias": take("ln_f.bias", (d,))}
    if layout.encoding == "mope":
        for name in ("log_omega", "log_sigma"):
            out[f"pos_enc.{name}"] = take(f"pe.{name}", (d // 2,))
        _check_equal(take("pe.pos", (n,)), torch.arange(n), "pe.pos", "the positions 0..BLOCK_SIZE-1", source)
    else:
        out["pos_embed"] = take("pos_emb.weight", (n, d))[None]
    for i in range(layout.depth):
        out.update(_block(take, layout, i, source))
    left = [key for key in state if key not in taken]
    if left:
        raise CheckpointError(
            f"{source} holds {left[0]}, which the {layout.name} GPT it describes ({layout.depth} blocks × {layout.num_heads} heads) does not have"
        )
    return out


def _block(take, layout: GptLayout, i: int, source: str) -> dict[str, Tensor]:
    """Block ``i``: the per-head modules packed into ``qkv`` (and EGA's ``gate``), the rest renamed."""
    d, heads, hidden = layout.embed_dim, layout.num_heads, layout.mlp_hidden
    hs = d // heads
    src, dst = f"blocks.{i}.", f"blocks.{i}."
    out = {
        dst + "norm1.weight": take(src + "ln1.weight", (d,)),
        dst + "norm1.bias": take(src + "ln1.bias", (d,)),
        dst + "norm2.weight": take(src + "ln2.weight", (d,)),
        dst + "norm2.bias": take(src + "ln2.bias", (d,)),
        dst + "attn.proj.weight": take(src + "proj.weight", (d, d)),
        dst + "attn.proj.bias": take(src + "proj.bias", (d,)),
        dst + "mlp.fc1.weight": take(src + "ff.0.weight", (hidden, d)),
        dst + "mlp.fc1.bias": take(src + "ff.0.bias", (hidden,)),
        dst + "mlp.fc2.weight": take(src + "ff.2.weight", (d, hidden)),
        dst + "mlp.fc2.bias": take(src + "ff.2.bias", (d,)),
    }
    head = [f"{src}heads.{h}." for h in range(heads)]
    # qkv's rows are read as [3, H, hs] (CausalSelfAttention's reshape): all queries, then keys, then values.
    out[dst + "attn.qkv.weight"] = torch.cat([take(p + part + ".weight", (hs, d)) for part in ("query", "key", "value") for p in head])
    causal = torch.ones(layout.context, layout.context).tril()
    for p in head:
        _check_equal(take(p + "tril", causal.shape), causal, p + "tril", "the causal mask tril(ones)", source)
    if layout.attention == "ega":
        out[dst + "attn.gate.proj.weight"] = torch.cat([take(p + "proj.weight", (1, d)) for p in head])
        out[dst + "attn.gate.proj.bias"] = torch.cat([take(p + "proj.bias", (1,)) for p in head])
        out[dst + "attn.gate.alpha"] = torch.cat([take(p + "alpha", (1,)) for p in head])
        out[dst + "attn.gate.tau"] = torch.cat([take(p + "tau", (1,)) for p in head])
    return out


def _tensor(state: dict[str, Tensor], key: str, source: str, ndim: int | None = None, shape: tuple[int, ...] | None = None) -> Tensor:
    """``state[key]``, refused in one line when missing or not of the expected rank or shape."""
    if key not in state:
        raise CheckpointError(f"{source} has no {key}, which {SCRIPT}'s GPT saves; expected {_EXPECTED}")
    tensor = state[key]
    if (ndim is not None and tensor.ndim != ndim) or (shape is not None and tuple(tensor.shape) != tuple(shape)):
        expected = f"shape {tuple(shape)}" if shape is not None else f"{ndim} dimensions"
        raise CheckpointError(f"{source}: {key} has shape {tuple(tensor.shape)}; expected {expected}")
    return tensor


def _count(state: dict[str, Tensor], name: str, first: str, source: str) -> int:
    """How many ``name`` modules (``blocks.{}``) the keys hold, checked to run 0..n-1 (``first`` must exist)."""
    _tensor(state, first, source)
    pattern = re.compile(re.escape(name).replace(r"\{\}", r"(\d{1,18})") + r"\.")  # longer: no module of the script's
    indices = sorted({int(m.group(1)) for key in state if (m := pattern.match(key))})
    gap = next((i for i, index in enumerate(indices) if index != i), None)
    if gap is not None:
        raise CheckpointError(f"{source} has no {name.format(gap)} but has {name.format(indices[-1])}; {SCRIPT}'s GPT numbers them from 0")
    return len(indices)


def _check_equal(found: Tensor, expected: Tensor, key: str, what: str, source: str) -> None:
    if not torch.equal(found, expected.to(found.dtype)):
        raise CheckpointError(f"{source}: {key} is not {what}, which the script's forward assumes")
