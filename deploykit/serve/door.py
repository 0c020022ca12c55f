"""The sockets of the front's door: loopback ports for Triton, the public listening sockets, and
closing the door at shutdown without resetting anyone.

Closing a listening socket resets the connections in its accept queue (clients that connected
but were never accepted), so at shutdown the listeners first stop completing new handshakes
(``refuse_new_connections``: a socket filter dropping SYNs; the client retransmits after a second
and is refused by then), every queued connection is accepted and answered
(``accept_queue_length`` says when none is left), and only then do the sockets close.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import sys
from collections.abc import Iterable


def free_loopback_ports(count: int, exclude: Iterable[int] = ()) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now, none of ``exclude`` (ports promised
    to someone who has not bound them yet: tritonserver's own must not take the front's)."""
    exclude = set(exclude)
    sockets: list[socket.socket] = []
    try:
        while len(ports := [s.getsockname()[1] for s in sockets if s.getsockname()[1] not in exclude]) < count:
            sockets.append(socket.socket())  # held bound until the end: no port is handed out twice
            sockets[-1].bind(("127.0.0.1", 0))
        return ports
    finally:
        for s in sockets:
            s.close()


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound TCP sockets for every address ``host`` resolves to, as asyncio's ``create_server``
    makes them (``SO_REUSEADDR``; IPv6 sockets IPv6-only); the front owns them so that it can
    close its door (``refuse_new_connections``)."""
    sockets, seen = [], set()
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            if address in seen:
                continue
            seen.add(address)
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


# Classic BPF run by Linux on each segment reaching the socket, from the TCP header on: a segment
# whose flags are SYN without ACK (a new handshake) is dropped, anything else is kept.
_DROP_SYN = (
    (0x30, 0, 0, 13),  # ldb [13]          the TCP flags byte
    (0x54, 0, 0, 0x12),  # and #(SYN|ACK)
    (0x15, 0, 1, 0x02),  # jeq #SYN, drop, keep
    (0x06, 0, 0, 0),  # drop: ret #0
    (0x06, 0, 0, 0xFFFFFFFF),  # keep: ret #-1
)
_SO_ATTACH_FILTER = 26


def refuse_new_connections(sock: socket.socket) -> bool:
    """Stop ``sock`` (listening) from completing new TCP handshakes while those already queued
    stay acceptable; a client connecting now is refused once the socket closes (its SYN is
    retransmitted after about a second). Linux only.

    Returns:
        Whether the filter was attached (False where the platform has no socket filters).
    """
    if not sys.platform.startswith("linux"):
        return False
    program = (_SockFilter * len(_DROP_SYN))(*(_SockFilter(*op) for op in _DROP_SYN))
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, bytes(_SockFprog(len(_DROP_SYN), program)))
    except OSError:
        return False
    return True


def accept_queue_length(sock: socket.socket) -> int:
    """Connections a listening socket has completed but not yet handed to ``accept`` (Linux's
    ``tcpi_unacked`` of a listener); 0 where TCP_INFO is not available."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (OSError, AttributeError):
        return 0
    return struct.unpack_from("I", info, 24)[0]  # after 8 one-byte fields and rto, ato, snd_mss, rcv_mss
