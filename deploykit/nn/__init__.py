"""The ViT trunk (timm-compatible names) with three positional-encoding hooks."""

from deploykit.nn.vit import (
    MODEL_CONFIGS,
    ViTConfig,
    VisionTransformer,
    create_model,
    list_models,
)
from deploykit.nn.checkpoint import load_checkpoint, load_model, save_model

__all__ = [
    "MODEL_CONFIGS",
    "ViTConfig",
    "VisionTransformer",
    "create_model",
    "list_models",
    "load_checkpoint",
    "load_model",
    "save_model",
]
