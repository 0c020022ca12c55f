"""Atomic writes: outputs appear complete or not at all, and never clobber on failure.

Two kinds of destination: files inside what deploykit owns (an export directory, a model
directory: ``atomic_path``, which replaces a planted symlink rather than writing through it), and
a file the user named on the command line (``output_file``: a symlink's target, a FIFO or a
character device are written as the user asked; anything else that is not a regular file is
refused, as is a link the kernel's ``protected_symlinks`` would not follow; an existing file is
replaced with a warning, never silently)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deploykit.errors import DeployKitError

_log = logging.getLogger(__name__)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; rename it onto ``dest`` only if the block succeeds.

    The temporary file lives in the destination directory so ``os.replace`` is an atomic rename
    on the same filesystem. On any exception the temporary file is removed and ``dest`` is left
    exactly as it was.

    Raises:
        DeployKitError: the destination directory cannot be created or written.
    """
    dest = Path(dest)
    check_file_destination(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    except OSError as err:
        raise DeployKitError(f"cannot write {dest}: {err.strerror or err}") from err
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # mkstemp makes the file private (0600); give it the permissions a plain open() would
        # (or ``mode``: those of the file it replaces).
        os.chmod(tmp_path, 0o666 & ~_umask() if mode is None else mode)
        try:
            os.replace(tmp_path, dest)
        except OSError as err:
            raise DeployKitError(f"cannot write {dest}: {err.strerror or err}") from err
    finally:
        tmp_path.unlink(missing_ok=True)


def check_file_destination(dest: str | os.PathLike) -> None:
    """Refuse, before any work, a destination ``output_file`` would refuse after it.

    Raises:
        DeployKitError: ``dest`` is a directory, or (through a symlink or not) a socket or a block
            device rather than a regular file, a FIFO or a character device.
    """
    _output_target(Path(dest))


def _output_target(dest: Path) -> tuple[Path, os.stat_result | None]:
    """Where the bytes for ``dest`` go (a symlink's final target; the link stays as the user made
    it) and what is there now (None: nothing)."""
    _refuse_protected_links(dest)
    target = Path(os.path.realpath(dest))
    try:
        found = os.stat(target)
    except FileNotFoundError:
        return target, None
    except OSError as err:
        raise DeployKitError(f"cannot write {dest}: {err.strerror or err}") from err
    if stat.S_ISDIR(found.st_mode):
        raise DeployKitError(f"cannot write {dest}: it is a directory; give a file name")
    if not (stat.S_ISREG(found.st_mode) or stat.S_ISFIFO(found.st_mode) or stat.S_ISCHR(found.st_mode)):
        kind = "socket" if stat.S_ISSOCK(found.st_mode) else "block device" if stat.S_ISBLK(found.st_mode) else "special file"
        raise DeployKitError(f"cannot write {dest}: it is a {kind}; give a regular file, a FIFO or a character device")
    return target, found


def _refuse_protected_links(dest: Path) -> None:
    """Refuse a path whose resolution follows a symlink the kernel's ``protected_symlinks`` would
    not follow: one in a sticky world-writable directory (``/tmp``), owned by neither this process's
    user nor the directory's owner. ``realpath`` resolves links itself, so the kernel, which applies
    that rule only to a link it follows on ``open``, never sees one: without this check root's
    ``--report /tmp/r.json`` writes wherever another user's planted link points
    (https://www.kernel.org/doc/html/latest/admin-guide/sysctl/fs.html#protected-symlinks).

    Raises:
        DeployKitError: such a link, named with its owner.
    """
    pending = list(reversed((Path.cwd() / dest).parts))  # not normalised: ``link/..`` is the link's target's parent
    current = Path(pending.pop())
    for _ in range(_MAX_COMPONENTS):
        if not pending:
            return
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        try:
            found = os.lstat(current / part)
        except OSError:  # not there (yet), or unreadable: nothing beyond it is followed
            return
        if not stat.S_ISLNK(found.st_mode):
            current = current / part
            continue
        _check_link_owner(current, part, found)
        target = Path(os.readlink(current / part))
        if target.is_absolute():
            current = Path(target.anchor)
        pending.extend(reversed(target.parts[1:] if target.is_absolute() else target.parts))
    # a loop of links: realpath and open refuse it themselves


# Components and links one path may take to resolve (Linux follows 40 links at most).
_MAX_COMPONENTS = 4096


def _check_link_owner(directory: Path, name: str, link: os.stat_result) -> None:
    held = os.stat(directory)
    shared = held.st_mode & stat.S_ISVTX and held.st_mode & stat.S_IWOTH
    if shared and link.st_uid not in (os.geteuid(), held.st_uid):
        raise DeployKitError(
            f"cannot write {directory / name}: it is a symbolic link owned by uid {link.st_uid} in the sticky world-writable "
            f"directory {directory}, which the kernel's protected_symlinks would not follow; remove it or give another name"
        )


@contextlib.contextmanager
def output_file(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write a file the user named (``--json``, ``--report``, ``--plot``...);
    when the block succeeds its bytes go to ``dest``:

    * a new name, or an existing regular file: replaced atomically (an existing file keeps its
      permissions, and its replacement is logged as a warning: never silent);
    * a symlink: the same, at its target; the link itself stays;
    * a FIFO or a character device (``/dev/stdout``, a shell's ``>(...)``): written in place, never
      replaced by a regular file.

    Raises:
        DeployKitError: a directory, socket or block device; or the write failed (``/dev/full``).
    """
    dest = Path(dest)
    target, found = _output_target(dest)
    if found is None or stat.S_ISREG(found.st_mode):
        if found is not None:
            _log.warning("replacing %s, which existed before this command", dest)
        with atomic_path(target, None if found is None else stat.S_IMODE(found.st_mode)) as tmp:
            yield tmp
        return
    with tempfile.TemporaryDirectory(prefix="deploykit-output-") as work:
        tmp = Path(work) / dest.name
        yield tmp
        try:
            with open(target, "wb") as stream:  # O_TRUNC means nothing to a FIFO or a device
                stream.write(tmp.read_bytes())
        except OSError as err:
            raise DeployKitError(f"cannot write {dest}: {err.strerror or err}") from err


def write_output_text(dest: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a file the user named (``output_file``) and return the path."""
    with output_file(dest) as tmp:
        tmp.write_text(text)
    return Path(dest)


def write_output_json(dest: str | os.PathLike, obj: Any) -> Path:
    """Serialise ``obj`` as indented JSON to a file the user named (``output_file``)."""
    return write_output_text(dest, _json_text(obj))


@contextlib.contextmanager
def directory_lock(dest: str | os.PathLike) -> Iterator[None]:
    """Hold ``dest`` for one writer: an exclusive ``flock`` on ``.NAME.lock`` beside it, released
    and the file removed on exit. A second writer is refused at once, in one line. The kernel
    drops the lock when its holder dies, however it dies (``kill -9`` included), so a lock is
    never stale: whoever takes it knows no other writer of ``dest`` is alive.

    Raises:
        DeployKitError: another process holds the lock, or the directory beside ``dest`` cannot
            be written.
    """
    import fcntl

    dest = Path(dest)
    path = dest.parent / f".{dest.name}.lock"
    for _ in range(8):  # a holder that is just releasing removes the file we opened: open it again
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            # O_NOFOLLOW: a symlink planted at the lock's name is refused, not followed and truncated.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as err:
            planted = "is a symbolic link; remove it" if err.errno == errno.ELOOP else (err.strerror or str(err))
            raise DeployKitError(f"cannot lock {dest}: {path} {planted}") from err
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise DeployKitError(f"cannot lock {dest}: {path} is not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DeployKitError(
                f"{dest} is being written by {holder}; wait until it finishes (a second export into it would lose one of the two), "
                "or choose another --output"
            ) from None
        if _names_file(path, fd):
            break
        os.close(fd)
    else:
        raise DeployKitError(f"cannot lock {dest}: {path} keeps being replaced")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"deploykit process {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # before unlocking: nobody can lock this file and believe it current
        os.close(fd)


def _names_file(path: Path, fd: int) -> bool:
    """``path`` still names the open file ``fd`` (not removed or replaced since it was opened)."""
    try:
        here, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


# A staging directory of ``dest`` (``tempfile.mkdtemp``: 8 characters from [a-z0-9_]), and the
# previous ``dest`` moved aside during the swap; the fixed shape matches no other directory's.
_STAGE = r"\.{name}\.[a-z0-9_]{{8}}\.staging(\.previous)?"


def clear_stale_stages(dest: str | os.PathLike) -> list[str]:
    """Remove what writers of ``dest`` that died left beside it; call it holding ``directory_lock(dest)``,
    which proves they are dead. A staging directory is removed. A previous ``dest`` moved aside
    by a swap is put back when ``dest`` itself is missing (the writer died between the swap's two
    renames), and removed otherwise.

    Returns:
        One line per directory removed or restored, to tell the user.
    """
    dest = Path(dest)
    pattern = re.compile(_STAGE.format(name=re.escape(dest.name)))
    done = []
    found = sorted(p for p in dest.parent.iterdir() if pattern.fullmatch(p.name)) if dest.parent.is_dir() else []
    for stale in sorted(found, key=lambda p: not p.name.endswith(".previous")):  # a previous first: it may be all there is
        if stale.name.endswith(".previous") and not dest.exists():
            os.replace(stale, dest)
            done.append(f"restored {dest} from {stale.name}, where an interrupted export had moved it")
        else:
            shutil.rmtree(stale, ignore_errors=True)
            done.append(f"removed {stale.name}, left by an export that did not finish")
    return done


@contextlib.contextmanager
def staged_directory(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty directory beside ``dest`` to fill; swap it in for ``dest`` only if the
    block succeeds.

    Whatever ``dest`` held before is gone after a successful block (the caller carries over what
    should stay). On any exception, ``KeyboardInterrupt`` included, the staging directory is
    removed and ``dest`` is left exactly as it was. The swap is two renames on one filesystem;
    if the second one fails, the first is undone.

    Raises:
        DeployKitError: ``dest`` is a file, or the directory beside it cannot be written.
    """
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise DeployKitError(f"cannot write {dest}: it exists and is not a directory")
    stage = directory_beside(dest, suffix=".staging")
    try:
        yield stage
        _swap_in(stage, dest)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def directory_beside(dest: str | os.PathLike, suffix: str = "") -> Path:
    """A new empty directory beside ``dest`` (to fill, then rename onto it), with the permissions a
    plain ``mkdir`` would give (``mkdtemp`` makes it private, 0700, and a rename keeps that).

    Raises:
        DeployKitError: the directory beside ``dest`` cannot be written.
    """
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        made = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=suffix, dir=dest.parent))
        os.chmod(made, 0o777 & ~_umask())
    except OSError as err:
        raise DeployKitError(f"cannot write {dest}: {err.strerror or err}") from err
    return made


def _swap_in(stage: Path, dest: Path) -> None:
    """Rename ``stage`` to ``dest``, moving an existing ``dest`` aside first and deleting it after."""
    previous = stage.with_name(stage.name + ".previous")
    try:
        if not dest.exists():
            os.replace(stage, dest)
            return
        os.replace(dest, previous)
        try:
            os.replace(stage, dest)
        except BaseException:
            os.replace(previous, dest)
            raise
    except OSError as err:
        raise DeployKitError(f"cannot replace {dest}: {err.strerror or err}") from err
    shutil.rmtree(previous, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_bounded_text(path: str | os.PathLike, limit: int) -> str:
    """The text of ``path``, read only when it is a regular file of at most ``limit`` bytes: a FIFO
    planted in its place would block the read forever, ``/dev/zero`` never end it.

    Raises:
        FileNotFoundError: nothing there (callers say what that means).
        DeployKitError: not a regular file, larger than ``limit``, unreadable or not UTF-8.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: opening a FIFO does not wait for a writer
    except FileNotFoundError:
        raise
    except OSError as err:
        raise DeployKitError(f"cannot read {path}: {err.strerror or err}") from err
    with os.fdopen(fd, "rb") as stream:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise DeployKitError(f"{path} is not a regular file; deploykit reads its files only from regular files")
        if found.st_size > limit:
            raise DeployKitError(f"{path} holds {found.st_size:,} bytes; a file deploykit wrote there holds at most {limit:,}")
        data = stream.read(limit + 1)
    if len(data) > limit:  # grew while read
        raise DeployKitError(f"{path} holds more than {limit:,} bytes; a file deploykit wrote there holds at most {limit:,}")
    try:
        return data.decode()
    except UnicodeDecodeError as err:
        raise DeployKitError(f"{path} is not UTF-8 text: {err.reason}") from err


def write_text_atomic(dest: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``dest`` atomically and return the path."""
    with atomic_path(dest) as tmp:
        tmp.write_text(text)
    return Path(dest)


def write_json_atomic(dest: str | os.PathLike, obj: Any) -> Path:
    """Serialise ``obj`` as indented JSON to ``dest`` atomically and return the path."""
    return write_text_atomic(dest, _json_text(obj))


def _json_text(obj: Any) -> str:
    """What every JSON file deploykit writes holds: indented, keys in the order given, a final newline."""
    return json.dumps(obj, indent=2, sort_keys=False) + "\n"
