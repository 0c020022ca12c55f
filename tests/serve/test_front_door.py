"""How the serving front closes its door at shutdown (``deploykit.serve.door``): on a real
loopback listener, a connection already queued survives and is served, a newcomer's handshake
does not complete, and once the socket closes that newcomer is refused rather than reset."""

from __future__ import annotations

import socket
import sys

import pytest

from deploykit.serve.door import accept_queue_length, free_loopback_ports, listening_sockets, refuse_new_connections

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="socket filters and TCP_INFO are Linux's")


@pytest.fixture
def listener():
    (sock,) = listening_sockets("127.0.0.1", 0)
    sock.listen(8)
    yield sock
    sock.close()


def test_without_the_filter_a_newcomer_connects(listener):
    """The control: the same connect that the closed door holds back completes on an open one."""
    newcomer = socket.create_connection(listener.getsockname(), timeout=5)
    assert accept_queue_length(listener) == 1
    newcomer.close()


def test_closed_door_keeps_the_queued_connection_and_refuses_the_newcomer(listener):
    address = listener.getsockname()
    queued = socket.create_connection(address, timeout=5)
    assert accept_queue_length(listener) == 1
    assert refuse_new_connections(listener)

    held = socket.socket()
    held.settimeout(0.3)
    with pytest.raises(TimeoutError):  # its SYN is dropped: no handshake, nothing queued
        held.connect(address)
    held.close()
    assert accept_queue_length(listener) == 1

    accepted, _ = listener.accept()  # the queued client is still served, both ways
    queued.sendall(b"request")
    assert accepted.recv(16) == b"request"
    accepted.sendall(b"answer")
    assert queued.recv(16) == b"answer"
    accepted.close()
    queued.close()

    listener.close()
    late = socket.socket()
    late.settimeout(30)
    with pytest.raises(ConnectionRefusedError):  # the retransmitted SYN meets a closed port
        late.connect(address)
    late.close()


def test_free_ports_are_distinct_and_skip_the_ports_promised_elsewhere(monkeypatch):
    """tritonserver's own ports are picked before the front binds its public ones, so they must
    skip those: the kernel may hand a just-released public port out again."""
    from deploykit.serve import door

    handed = iter([5001, 5002, 5003, 5004])  # what bind(("127.0.0.1", 0)) returns, in turn

    class KernelPorts:
        def bind(self, address):
            assert address == ("127.0.0.1", 0)
            self.port = next(handed)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(door.socket, "socket", KernelPorts)
    assert door.free_loopback_ports(2, exclude=[5001, 5003]) == [5002, 5004]


def test_free_ports_on_the_real_loopback_are_free_and_distinct():
    public = free_loopback_ports(3)
    internal = free_loopback_ports(20, exclude=public)
    assert len(set(internal)) == 20 and not set(internal) & set(public)
    for port in internal:  # free: each binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
