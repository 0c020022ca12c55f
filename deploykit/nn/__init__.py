"""The ViT trunk (timm-compatible names) with three positional-encoding hooks, and the causal
sequence model that carries 1-D MoPE + EGA; ``deploy_spec`` tells what deployment needs of either."""

from deploykit.nn import from_transformers  # noqa: F401  registers the transformers directory layout with load_model
from deploykit.nn.checkpoint import load_checkpoint, load_model, save_model
from deploykit.nn.factory import create_model, list_models
from deploykit.nn.sequence import SEQUENCE_CONFIGS, SequenceConfig, SequenceTransformer
from deploykit.nn.spec import DeploySpec, deploy_spec
from deploykit.nn.vit import MODEL_CONFIGS, VisionTransformer, ViTConfig

__all__ = [
    "MODEL_CONFIGS",
    "DeploySpec",
    "SEQUENCE_CONFIGS",
    "SequenceConfig",
    "SequenceTransformer",
    "ViTConfig",
    "VisionTransformer",
    "create_model",
    "deploy_spec",
    "list_models",
    "load_checkpoint",
    "load_model",
    "save_model",
]
