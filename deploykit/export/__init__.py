"""PyTorch → ONNX: tables baked per resolution, graph lint, export directories.

The names below are imported on first use, so ``deploykit.export.manifest`` and
``deploykit.export.directory`` (what reads an export directory) load without PyTorch.
"""

from deploykit._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".bundle": ["export", "load_reference"],
        ".directory": ["ExportDir"],
        ".lint": ["LintIssue", "check_graph", "lint_graph"],
        ".manifest": ["MANIFEST_FILE", "GraphEntry", "Manifest"],
        ".onnx_export": ["DEFAULT_OPSET", "BakedModel", "onnx_from_model", "save_onnx"],
    },
)
