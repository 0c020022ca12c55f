"""Atomic writes: outputs appear complete or not at all, and never clobber on failure."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deploykit.errors import DeployKitError


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; rename it onto ``dest`` only if the block succeeds.

    The temporary file lives in the destination directory so ``os.replace`` is an atomic rename
    on the same filesystem. On any exception the temporary file is removed and ``dest`` is left
    exactly as it was.

    Raises:
        DeployKitError: the destination directory cannot be created or written.
    """
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    except OSError as err:
        raise DeployKitError(f"cannot write {dest}: {err.strerror or err}") from err
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp makes the file private (0600); give it the permissions a plain open() would.
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, dest)
    finally:
        tmp_path.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(dest: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``dest`` atomically and return the path."""
    with atomic_path(dest) as tmp:
        tmp.write_text(text)
    return Path(dest)


def write_json_atomic(dest: str | os.PathLike, obj: Any) -> Path:
    """Serialise ``obj`` as indented JSON to ``dest`` atomically and return the path."""
    return write_text_atomic(dest, json.dumps(obj, indent=2, sort_keys=False) + "\n")
