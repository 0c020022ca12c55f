"""The one exception family users see.

The CLI turns any ``DeployKitError`` into a one-line message and exit code 1, so every message
says what was expected, what was found, and, where it helps, what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class DeployKitError(Exception):
    """Base class for every error deploykit raises on bad input or a failed check."""


class CheckpointError(DeployKitError):
    """A checkpoint is missing, corrupt, of an unsupported format, or does not fit the model."""


class ResolutionError(DeployKitError):
    """A resolution the model cannot take (e.g. not a multiple of the patch size)."""


class ConfigError(DeployKitError):
    """An unknown encoding/model name or an unsupported option."""


class ExportError(DeployKitError):
    """Export to ONNX failed, or the exported graph failed the lint."""


class ValidationError(DeployKitError):
    """An exported artifact disagrees with the PyTorch reference beyond tolerance."""


class StaleEngineError(DeployKitError):
    """A serialized engine whose fingerprint does not match the current environment."""


class InputError(DeployKitError):
    """A request the pipeline cannot take: wrong dtype or shape, or bytes that are not an image."""


class MissingDependencyError(DeployKitError):
    """An optional package needed for the requested feature is not installed."""


def one_line(text: object, limit: int = 600) -> str:
    """``text`` flattened to one line (tool messages span lines) and capped at ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def listed(items: list[str], shown: int = 5) -> str:
    """``a, b, c, d, e and 7 more``: at most ``shown`` names in a one-line message."""
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def unknown_choice(what: str, value: object, choices: Iterable[str], render: Callable[[object], str] = repr) -> str:
    """``unknown model 'vit_x'; choose one of: a, b, c``: how every refusal of a name outside a
    fixed set reads (``render`` shows the value: ``repr``, or ``_fields.show`` for config values)."""
    return f"unknown {what} {render(value)}; choose one of: {', '.join(choices)}"
