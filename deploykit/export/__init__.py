"""PyTorch → ONNX: tables baked per resolution, graph lint, export directories."""

from deploykit.export.bundle import MANIFEST_FILE, GraphEntry, Manifest, export, load_reference
from deploykit.export.lint import LintIssue, check_graph, lint_graph
from deploykit.export.onnx_export import (
    DEFAULT_OPSET,
    OUTPUT_NAME,
    BakedModel,
    onnx_from_model,
    parse_resolution,
    resolution_tag,
    save_onnx,
)

__all__ = [
    "DEFAULT_OPSET",
    "MANIFEST_FILE",
    "OUTPUT_NAME",
    "BakedModel",
    "GraphEntry",
    "LintIssue",
    "Manifest",
    "check_graph",
    "export",
    "lint_graph",
    "load_reference",
    "onnx_from_model",
    "parse_resolution",
    "resolution_tag",
    "save_onnx",
]
