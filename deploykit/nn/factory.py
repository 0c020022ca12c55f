"""One entry point for every architecture: ViT classifiers and the 1-D sequence model.

``config.json`` says which one it describes by its ``architecture`` field (absent means ViT,
as written before sequence models existed).
"""

from __future__ import annotations

from typing import Any

from deploykit.catalog import SEQUENCE_ARCHITECTURE
from deploykit.encodings import EncodingConfig
from deploykit.errors import ConfigError, unknown_choice
from deploykit.nn.sequence import SEQUENCE_CONFIGS, SequenceConfig, SequenceTransformer, create_sequence_model
from deploykit.nn.spec import deploy_spec
from deploykit.nn.vit import MODEL_CONFIGS, VisionTransformer, ViTConfig, create_vit_model

Model = VisionTransformer | SequenceTransformer
ModelConfig = ViTConfig | SequenceConfig


def list_models() -> list[str]:
    """Every named model of either architecture, sorted."""
    return sorted([*MODEL_CONFIGS, *SEQUENCE_CONFIGS])


def create_model(name: str, *, encoding: str | EncodingConfig | None = None, **overrides: Any) -> Model:
    """Build a named model; ``encoding`` defaults to the architecture's own (ViT: ``ape``, sequence: ``mope``)."""
    if name in SEQUENCE_CONFIGS:
        return create_sequence_model(name, encoding=encoding, **overrides)
    if name in MODEL_CONFIGS:
        return create_vit_model(name, encoding=encoding or "ape", **overrides)
    raise ConfigError(unknown_choice("model", name, list_models()))


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """Read a ``config.json`` dict of either architecture."""
    if not isinstance(data, dict):
        raise ConfigError(f"a model config is a JSON object, got {type(data).__name__}")
    if data.get("architecture", "vit") == SEQUENCE_ARCHITECTURE:
        return SequenceConfig.from_dict(data)
    return ViTConfig.from_dict(data)


def build_model(cfg: ModelConfig) -> Model:
    return deploy_spec(cfg).build()
