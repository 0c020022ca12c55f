"""One ``DeploySpec`` per model architecture: what export, profiling and the manifest need to
know about a model family, kept beside the models, as Optimum keeps an ``OnnxConfig`` per
architecture (``exporters/onnx/model_configs.py``).

A spec says the graph's input (name, dtype, shape at a resolution, which axes are dynamic), its
outputs, the matrix products of one forward (FLOPs), the preprocessing the manifest records,
sample inputs (kernel inputs and the raw inputs an end-to-end run starts from) and the
positional step profiled alone. Every family is one of two architectures: the ViT classifier
(``VitSpec``: deploykit's sizes, the zoo and every ``import timm`` family, which become a
``VisionTransformer``) and the causal sequence model (``SequenceSpec``: MoPE's char GPT with
EGA or dot attention).

``deploy_spec`` is the one place that tells the architectures apart by type; code outside this
module asks the spec, or takes what the model hands over (``input_kind``), and never compares a
graph name (``deploykit.catalog``) to choose what to do (``tests/nn/test_spec.py`` holds the
package to both).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from deploykit.catalog import OUTPUT_NAME
from deploykit.encodings import EncodingConfig, Hook
from deploykit.errors import ExportError
from deploykit.inputs import imaging
from deploykit.inputs.builtin import encode_chars, random_inputs, random_token_inputs, sample_text
from deploykit.nn.sequence import SequenceConfig, SequenceTransformer
from deploykit.nn.vit import VisionTransformer, ViTConfig

BATCH_AXIS = "batch"
MAX_BATCH = 4096  # the largest batch an exported graph declares
# End-to-end image inputs: seeded uint8 frames of a common camera size (preprocessing cost
# depends on the size, not on the content, so no image files are needed).
FRAME_SHAPE = (480, 640, 3)

Gemm = tuple[int, int, int, int]  # (count, m, k, n): count batched products [m, k] @ [k, n]


@dataclass(frozen=True)
class DeploySpec(ABC):
    """What deployment needs to know about one architecture, read from a model's config.

    Attributes:
        cfg: the model's config.
        input_name: the graph's one input.
        input_dtype: its dtype.
        output_names: the graph's outputs.
    """

    cfg: Any
    input_name: ClassVar[str]
    input_dtype: ClassVar[torch.dtype]
    output_names: ClassVar[tuple[str, ...]] = (OUTPUT_NAME,)

    @abstractmethod
    def build(self) -> torch.nn.Module:
        """A freshly initialised model of this config."""

    @abstractmethod
    def input_shape(self, resolution: tuple[int, ...], batch: int) -> tuple[int, ...]:
        """The input's shape at a checked resolution (``model.check_shape``)."""

    @abstractmethod
    def example_input(self, resolution: tuple[int, ...], batch: int) -> torch.Tensor:
        """An input to trace the export with."""

    @abstractmethod
    def input_dims(self, resolution_range: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> dict[int, Any]:
        """``torch.export`` dynamic shapes of the input: the batch always; with ``resolution_range =
        (min, max)`` also the spatial axes that vary, for architectures one graph can serve a range of.

        Raises:
            ExportError: a range for an architecture that takes none.
        """

    @abstractmethod
    def gemm_shapes(self, resolution: tuple[int, ...], batch: int) -> list[Gemm]:
        """Every matrix product of one forward as ``(count, m, k, n)``."""

    def flops(self, resolution: tuple[int, ...], batch: int) -> int:
        """FLOPs of one forward counted from the GEMMs (multiply-add = 2 FLOPs; elementwise work,
        softmax, LayerNorm and the positional step are a few percent and left out, as in the
        usual ViT counts)."""
        return sum(2 * count * m * k * n for count, m, k, n in self.gemm_shapes(resolution, batch))

    @property
    def preprocessing(self) -> imaging.Preprocessing | None:
        """How an image becomes an input (the manifest records it); ``None`` for token inputs."""
        return None

    @property
    def patch_size(self) -> int | None:
        """Pixels per patch side, for image models (the graph's metadata records it)."""
        return None

    @abstractmethod
    def random_inputs(self, batch: int, resolution: tuple[int, ...], seed: int) -> np.ndarray:
        """Seeded model inputs (noise images, random token ids) for kernel timing."""

    @abstractmethod
    def raw_inputs(self, batch: int, resolution: tuple[int, ...], rng: np.random.Generator) -> list:
        """What an end-to-end call starts from (camera frames, texts), one per batch row."""

    @abstractmethod
    def prepare(self, raw, resolution: tuple[int, ...]) -> np.ndarray:
        """One raw input (``raw_inputs``) as one row of the model's input."""

    @property
    def answers_top_k(self) -> bool:
        """Whether the output is logits whose top-k are the model's answers (compared by agreement);
        a backbone without a head (``num_classes=0``) outputs features, compared by cosine and max
        abs alone."""
        return True

    def ranked_logits(self, logits: np.ndarray) -> np.ndarray:
        """``[batch, classes]`` logits an answer is the top-k of."""
        return logits

    def with_encoding(self, encoding: EncodingConfig, min_length: int = 0) -> Any:
        """This config with another encoding (the APE twin ``profile`` compares against),
        covering at least ``min_length`` positions where a learned table has a length."""
        return dataclasses.replace(self.cfg, encoding=encoding)

    @abstractmethod
    def positional_step(self, model, resolution: tuple[int, ...], batch: int, device: torch.device) -> Callable[[], object]:
        """The positional step alone, on random activations (``profile``'s ``pe_step``)."""


def block_paths(model: torch.nn.Module) -> list[str]:
    """The module paths of a trunk's blocks, in order (``blocks.<i>``, timm's names): how export
    scopes and the PyTorch runner name each block's output."""
    paths = {id(module): name for name, module in model.named_modules()}
    return [paths[id(block)] for block in model.blocks]


def _batch_dim():
    return torch.export.Dim(BATCH_AXIS, min=1, max=MAX_BATCH)


def _block_gemms(batch: int, tokens: int, d: int, heads: int, hidden: int, fc1_count: int = 1) -> list[Gemm]:
    """One transformer block: qkv, q·kᵀ, softmax(.)·v, proj, fc1 (SwiGLU: two, gate and
    value; packed SwiGLU's one GEMM of twice the width counts the same), fc2."""
    rows, head_dim = batch * tokens, d // heads
    return [
        (1, rows, d, 3 * d),  # qkv
        (batch * heads, tokens, head_dim, tokens),  # q @ k^T
        (batch * heads, tokens, tokens, head_dim),  # softmax(.) @ v
        (1, rows, d, d),  # proj
        (fc1_count, rows, d, hidden),  # fc1, or fc1_g and fc1_x
        (1, rows, hidden, d),  # fc2
    ]


@dataclass(frozen=True)
class VitSpec(DeploySpec):
    """The ViT classifier (or headless backbone): ``images [batch, C, H, W]`` float32 → ``logits``;
    deploykit's sizes, the zoo's models and every family ``import timm`` reads."""

    cfg: ViTConfig
    input_name: ClassVar[str] = VisionTransformer.input_name
    input_dtype: ClassVar[torch.dtype] = torch.float32

    def build(self) -> VisionTransformer:
        return VisionTransformer(self.cfg)

    @property
    def answers_top_k(self) -> bool:
        return bool(self.cfg.num_classes)

    @property
    def patch_size(self) -> int:
        return self.cfg.patch_size

    @property
    def preprocessing(self) -> imaging.Preprocessing:
        return self.cfg.preprocessing

    def input_shape(self, resolution: tuple[int, int], batch: int) -> tuple[int, int, int, int]:
        return (batch, self.cfg.in_chans, *resolution)

    def example_input(self, resolution: tuple[int, int], batch: int) -> torch.Tensor:
        return torch.randn(self.input_shape(resolution, batch))

    def input_dims(self, resolution_range=None) -> dict[int, Any]:
        """Batch, and with a range the height and width that vary (as multiples of the patch)."""
        dims = {0: _batch_dim()}
        if resolution_range is None:
            return dims
        (low_h, low_w), (high_h, high_w) = resolution_range
        patch = self.cfg.patch_size
        for axis, name, lo, hi in ((2, "grid_h", low_h, high_h), (3, "grid_w", low_w, high_w)):
            if lo < hi:  # an axis without a range stays static
                dims[axis] = patch * torch.export.Dim(name, min=lo // patch, max=hi // patch)
        return dims

    def gemm_shapes(self, resolution: tuple[int, int], batch: int) -> list[Gemm]:
        """Patch embedding, per block qkv / q·kᵀ / attn·v / proj / fc1 / fc2, head."""
        cfg = self.cfg
        gh, gw = resolution[0] // cfg.patch_size, resolution[1] // cfg.patch_size
        tokens, d = gh * gw + cfg.num_prefix_tokens, cfg.embed_dim
        block = _block_gemms(batch, tokens, d, cfg.num_heads, cfg.hidden_dim, 1 if cfg.mlp_layer == "mlp" else 2)
        patch = (1, batch * gh * gw, cfg.in_chans * cfg.patch_size**2, d)
        heads = [(1, batch, d, cfg.num_classes)] * (2 if cfg.distilled else 1)  # DeiT's head and head_dist
        return [patch, *block * cfg.depth, *self._pool_gemms(tokens, batch), *heads]

    def _pool_gemms(self, tokens: int, batch: int) -> list[Gemm]:
        """``map`` pooling: the latent's q, kv over every token, one query's attention, proj, MLP."""
        cfg = self.cfg
        if cfg.pool != "map":
            return []
        d, heads = cfg.embed_dim, cfg.num_heads
        return [
            (1, 1, d, d),  # q of the latent
            (1, batch * tokens, d, 2 * d),  # kv
            (batch * heads, 1, d // heads, tokens),  # q @ k^T
            (batch * heads, 1, tokens, d // heads),  # softmax(.) @ v
            (1, batch, d, d),  # proj
            (1, batch, d, cfg.hidden_dim),  # mlp.fc1
            (1, batch, cfg.hidden_dim, d),  # mlp.fc2
        ]

    def random_inputs(self, batch: int, resolution: tuple[int, int], seed: int) -> np.ndarray:
        return random_inputs(batch, resolution, seed=seed)

    def raw_inputs(self, batch: int, resolution: tuple[int, int], rng: np.random.Generator) -> list[np.ndarray]:
        return [rng.integers(0, 256, FRAME_SHAPE, dtype=np.uint8) for _ in range(batch)]

    def prepare(self, frame: np.ndarray, resolution: tuple[int, int]) -> np.ndarray:
        return self.cfg.preprocessing(frame, resolution)

    def positional_step(self, model: VisionTransformer, resolution, batch: int, device: torch.device) -> Callable[[], object]:
        """Every hook the encoding uses, over every block where it runs per block (SaPE²+APE: a
        table add and a logits bias per block)."""
        cfg, pos_enc = self.cfg, copy.deepcopy(model.pos_enc).to(device)
        grid = model.grid(*resolution)
        tables = model.tables(grid, torch.float32, device)
        tokens = math.prod(grid) + cfg.num_prefix_tokens
        gen = torch.Generator().manual_seed(0)
        head_dim = cfg.embed_dim // cfg.num_heads
        x = torch.randn(batch, tokens, cfg.embed_dim, generator=gen).to(device)
        q, k = (torch.randn(batch, cfg.num_heads, tokens, head_dim, generator=gen).to(device) for _ in range(2))
        layer = lambda i: tables.layers[i] if tables.layers else {}
        steps = []
        if pos_enc.uses(Hook.TOKENS):
            steps.append(lambda: pos_enc.apply_tokens(x, tables.model))
        if pos_enc.uses(Hook.QK):
            steps.append(lambda: [pos_enc.apply_qk(q, k, layer(i)) for i in range(cfg.depth)])
        if pos_enc.uses(Hook.LOGITS):
            steps.append(lambda: [pos_enc.logits_bias(q, k, layer(i), grid) for i in range(cfg.depth)])
        return _inference(lambda: [s() for s in steps])


@dataclass(frozen=True)
class SequenceSpec(DeploySpec):
    """The causal sequence model (MoPE's char GPT): ``tokens [batch, T]`` int64 → ``logits
    [batch, T, vocab]``; a length plays the role of a resolution."""

    cfg: SequenceConfig
    input_name: ClassVar[str] = SequenceTransformer.input_name
    input_dtype: ClassVar[torch.dtype] = torch.int64

    def build(self) -> SequenceTransformer:
        return SequenceTransformer(self.cfg)

    def input_shape(self, resolution: tuple[int], batch: int) -> tuple[int, int]:
        return (batch, *resolution)

    def example_input(self, resolution: tuple[int], batch: int) -> torch.Tensor:
        return torch.randint(0, self.cfg.vocab_size, self.input_shape(resolution, batch))

    def input_dims(self, resolution_range=None) -> dict[int, Any]:
        if resolution_range is not None:
            raise ExportError("a resolution range needs a ViT; sequence models bake their tables and masks per length")
        return {0: _batch_dim()}

    def gemm_shapes(self, resolution: tuple[int], batch: int) -> list[Gemm]:
        """No patch embedding; EGA's energy projection per block; the tied LM head over every position."""
        cfg, (length,) = self.cfg, resolution
        d, heads, rows = cfg.embed_dim, cfg.num_heads, batch * length
        block = _block_gemms(batch, length, d, heads, int(d * cfg.mlp_ratio))
        if cfg.attention == "ega":
            block.append((1, rows, d, heads))  # energy r = x w_E + b_E, one scalar per head
        return [*block * cfg.depth, (1, rows, d, cfg.vocab_size)]

    def random_inputs(self, batch: int, resolution: tuple[int], seed: int) -> np.ndarray:
        return random_token_inputs(batch, resolution[0], self.cfg.vocab_size, seed=seed)

    def raw_inputs(self, batch: int, resolution: tuple[int], rng: np.random.Generator) -> list[str]:
        """Windows of the bundled text at random offsets."""
        text, (length,) = sample_text(), resolution
        starts = rng.integers(0, len(text), batch)
        return [(text * (length // len(text) + 2))[s : s + length] for s in starts]

    def prepare(self, text: str, resolution: tuple[int]) -> np.ndarray:
        return encode_chars(text, self.cfg.vocab_size)[: resolution[0]]

    def ranked_logits(self, logits: np.ndarray) -> np.ndarray:
        """The last position's next-token logits."""
        return logits[:, -1]

    def with_encoding(self, encoding: EncodingConfig, min_length: int = 0) -> SequenceConfig:
        return dataclasses.replace(self.cfg, encoding=encoding, context=max(self.cfg.context, min_length))

    def positional_step(self, model: SequenceTransformer, resolution, batch: int, device: torch.device) -> Callable[[], object]:
        """The table add on the token embeddings."""
        table = model.shape_tables(resolution).model["pos_embed"].detach().to(device, torch.float32)
        x = torch.randn(batch, resolution[0], self.cfg.embed_dim, generator=torch.Generator().manual_seed(0)).to(device)
        return lambda: x + table


def _inference(step: Callable[[], object]) -> Callable[[], object]:
    def run():
        with torch.inference_mode():
            return step()

    return run


# Config type → spec; the one dispatch on architecture.
SPECS: dict[type, type[DeploySpec]] = {ViTConfig: VitSpec, SequenceConfig: SequenceSpec}


def deploy_spec(model_or_cfg) -> DeploySpec:
    """The spec of a model (anything with a ``cfg``) or of a model config.

    Raises:
        TypeError: neither a deploykit model nor one of its configs.
    """
    cfg = model_or_cfg.cfg if isinstance(model_or_cfg, torch.nn.Module) else model_or_cfg
    for config_type, spec in SPECS.items():
        if isinstance(cfg, config_type):
            return spec(cfg)
    raise TypeError(f"no DeploySpec for {type(model_or_cfg).__name__}; deploykit deploys {', '.join(t.__name__ for t in SPECS)}")
