"""deploykit's names, without importing PyTorch: what it offers (for ``deploykit list``) and what
its graphs are made of.

What it offers is defined where the things are: ``@register_encoding("name", ...)`` in each
encoding module, the size tables ``MODEL_CONFIGS`` (``deploykit.nn.vit``) and ``SEQUENCE_CONFIGS``
(``deploykit.nn.sequence``). Those modules need PyTorch to import (a second or two), so the names
are read from their source instead: the decorators' first argument and the tables' literal keys.

The names of an exported graph are a contract between the models that trace it (``deploykit.nn``,
whose ``DeploySpec`` hands them to export), the checks that read it and what feeds it without
PyTorch (runners, serving, Triton's model configs), so they are defined here, once.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

# A model's one graph input, by architecture: a ViT's images ``[N, C, H, W]`` float32, a sequence
# model's token ids ``[N, T]`` int64.
IMAGES_INPUT = "images"
TOKENS_INPUT = "tokens"
OUTPUT_NAME = "logits"  # every graph's one output (a headless backbone's features too)
# ``config.json``'s ``architecture`` of a sequence model (absent: a ViT).
SEQUENCE_ARCHITECTURE = "sequence_transformer"
# Initializer-name prefixes of positional tables: export bakes them under ``pe_tables.``
# (``BakedModel.pe_tables``); ``pos_embed`` is timm's learned APE.
TABLE_PREFIX = "pe_tables."
TABLE_PREFIXES = (TABLE_PREFIX, "pos_embed")

_PACKAGE = Path(__file__).parent
_SIZE_TABLES = {"nn/vit.py": "MODEL_CONFIGS", "nn/sequence.py": "SEQUENCE_CONFIGS"}


def encodings() -> list[str]:
    """Every registered encoding name, sorted (``deploykit.encodings.list_encodings()``)."""
    return list(_encodings(_PACKAGE))


@functools.cache
def _encodings(package: Path) -> tuple[str, ...]:
    # Read once per package directory: every manifest read checks its encoding against these, and a walk parses every encoding module.
    names = []
    for source in sorted((package / "encodings").glob("*.py")):
        for node in ast.walk(_tree(source)):
            if isinstance(node, ast.ClassDef):
                names += [_first_string(d) for d in node.decorator_list if _calls(d, "register_encoding")]
    return tuple(sorted(names))


def models() -> list[str]:
    """Every named model size, sorted (``deploykit.nn.list_models()``)."""
    names = []
    for relative, table in _SIZE_TABLES.items():
        (value,) = [
            node.value
            for node in _tree(_PACKAGE / relative).body
            if isinstance(node, ast.AnnAssign | ast.Assign) and table in [t.id for t in _targets(node)]
        ]
        names += [key.value for key in value.keys]
    return sorted(names)


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _calls(node: ast.expr, function: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == function


def _first_string(call: ast.Call) -> str:
    return ast.literal_eval(call.args[0])


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.Name]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t for t in targets if isinstance(t, ast.Name)]
