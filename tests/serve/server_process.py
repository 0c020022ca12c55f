"""Start a server as a child process, find what it listens on, and stop it by process id.

Listening sockets are read from ``/proc`` (the socket inodes a process holds, matched against
``/proc/net/tcp{,6}`` in LISTEN state), so the "loopback only" check covers every process in
the server's tree (tritonserver and its Python stubs included), not just the ports we chose.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from deploykit.serve.bench import free_loopback_ports as free_ports  # noqa: F401  (the tests' import name)

_LISTEN = "0A"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return sorted(set(found))


def tritonserver_pid(pid: int) -> int:
    """The one tritonserver process below ``pid``."""
    found = [p for p in descendants(pid) if Path(f"/proc/{p}/comm").read_text().strip() == "tritonserver"]
    assert len(found) == 1, found
    return found[0]


def command_line_argument(pid: int, name: str) -> str:
    """The value after ``name`` on a process's command line, as any local user can read it."""
    arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return arguments[arguments.index(name) + 1]


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _decode_address(hex_addr: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc/net/tcp6 stores four little-endian 32-bit words
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return ip, int(port_hex, 16)


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """``(ip, port)`` of every TCP socket in LISTEN state held by ``pid`` or its descendants."""
    inodes = set()
    for p in [pid, *descendants(pid)]:
        inodes |= _socket_inodes(p)
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                found.add(_decode_address(fields[1]))
    return found


def wait_until(check: Callable[[], bool], proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Poll ``check`` until it is true; fail early if ``proc`` exits, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if check():
                return
        except Exception:  # the server is still starting: connection refused, not ready, ...
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not ready after {timeout_s} s:\n{log.read_text()[-4000:]}")


def process_tree(pid: int) -> list[tuple[int, str]]:
    """``pid`` and its descendants as ``(pid, start time)``: the start time tells a reused pid apart."""
    return [(p, _start_time(p)) for p in [pid, *descendants(pid)] if _start_time(p)]


def stop(proc: subprocess.Popen, tree: list[tuple[int, str]], timeout_s: float = 60, grace_s: float = 15) -> None:
    """SIGTERM the server by pid, wait for it; then make sure every process of its tree is gone.

    Anything of the tree still alive after the wait is killed by its own pid (checked against
    its start time first), and the test fails on it."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    stop_leftovers(tree, grace_s)


def stop_leftovers(tree: list[tuple[int, str]], grace_s: float = 15) -> None:
    """Wait for every process of ``tree`` to exit; kill (by pid) and fail on any still running."""
    deadline = time.monotonic() + grace_s  # helpers (Python stubs) notice their parent is gone by polling
    while (survivors := [pid for pid, started in tree if _start_time(pid) == started and not _zombie(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes left running after the server stopped: {survivors}"


def _stat_fields(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _start_time(pid: int) -> str:
    fields = _stat_fields(pid)
    return fields[19] if fields else ""  # field 22 of stat; the split starts at field 3


def _zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] == "Z"
