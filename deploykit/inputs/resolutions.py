"""Resolutions as the command line and file names spell them: ``224``, ``384x256``, ``224,384``.

Torch-free (only ``deploykit.errors``), so commands that only read or write files (``deploykit
list``, ``package triton``) and the CLI's option types load nothing heavy.
"""

from __future__ import annotations

from collections.abc import Sequence

from deploykit.errors import ExportError, ResolutionError


def parse_resolution(value: int | str | tuple[int, int]) -> tuple[int, int]:
    """``224`` → ``(224, 224)``; ``"384x256"`` → ``(384, 256)`` (height × width).

    Raises:
        ExportError: not one or two integers joined by ``x``.
    """
    if isinstance(value, tuple):
        return value
    text = str(value).lower()
    try:
        parts = [int(p) for p in text.split("x")]
    except ValueError:
        raise ExportError(f"invalid resolution {value!r}; expected e.g. 224 or 384x256") from None
    if len(parts) == 1:
        return parts[0], parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise ExportError(f"invalid resolution {value!r}; expected e.g. 224 or 384x256")


def parse_resolutions(values: Sequence[str]) -> list[tuple[int, int]]:
    """``["224", "384,512", "384x256"]`` → resolutions in order, duplicates dropped.

    Raises:
        ResolutionError: a part is not a resolution.
    """
    out = []
    for value in values:
        for part in str(value).split(","):
            try:
                out.append(parse_resolution(part.strip()))
            except ExportError as err:
                raise ResolutionError(str(err)) from None
    return list(dict.fromkeys(out))


def resolution_tag(resolution: tuple[int, ...]) -> str:
    """``(224, 224)`` → ``"224"``, ``(384, 256)`` → ``"384x256"``, a sequence length ``(256,)`` → ``"256"``."""
    if len(resolution) == 1 or resolution[0] == resolution[1]:
        return str(resolution[0])
    return "x".join(map(str, resolution))
