"""A stand-in for tritonserver's HTTP port, and the front before it, in this process: the front's
tests see exactly what it forwards (method, path, headers, body) without starting Triton.

``StubTriton`` answers 200 ``{"outputs": []}`` to every inference, a model config holding a
workspace path as PyTriton writes it, and whatever ``answers`` says for a path.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import socket
import threading
from dataclasses import dataclass, field

from deploykit.serve.door import free_loopback_ports
from deploykit.serve.front import Front, FrontOptions

WORKSPACE = "/tmp/pytriton_workspace_stub1234"
CONFIG = {
    "name": "logits_32",
    "backend": "python",
    "max_batch_size": 8,
    "parameters": {"workspace-path": {"string_value": WORKSPACE}, "shared-memory-socket": {"string_value": "ipc:" + WORKSPACE + "/s"}},
}


@dataclass
class Forwarded:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class StubTriton:
    """Records every request; ``answers`` maps a path to ``(status, JSON-able body)``."""

    answers: dict = field(default_factory=dict, repr=False)
    seen: list[Forwarded] = field(default_factory=list, repr=False)

    def handler(self):
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stub.seen.append(Forwarded(self.command, self.path, list(self.headers.items()), body))
                if self.path in stub.answers:
                    status, payload = stub.answers[self.path]
                elif self.path.endswith("/config"):
                    status, payload = 200, CONFIG
                else:
                    status, payload = 200, {"outputs": []}
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        return Handler


@contextlib.contextmanager
def front_before_stub(**limits):
    """``(front, its HTTP port, the stub)``: a started ``Front`` on 127.0.0.1 forwarding to a
    ``StubTriton``; ``limits`` are ``FrontOptions`` fields."""
    stub = StubTriton()
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), stub.handler())
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    http_port, grpc_port, metrics_port, upstream_grpc, upstream_metrics = free_loopback_ports(5)
    options = {"max_request_bytes": 1 << 20, "drain_timeout_s": 30.0, **limits}
    front = Front(
        FrontOptions(
            "127.0.0.1", http_port, grpc_port, metrics_port, upstream.server_address[1], upstream_grpc, upstream_metrics, **options
        )
    )
    front.start()
    try:
        yield front, http_port, stub
    finally:
        front.close()
        upstream.shutdown()
        upstream.server_close()


def raw_request(port: int, head: bytes, body: bytes = b"", timeout_s: float = 30) -> tuple[int, dict, bytes]:
    """Send ``head`` (request line and headers, without the blank line) and ``body`` as given on
    a connection of its own; ``(status, headers, body)`` of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(head + b"\r\n\r\n" + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed before the whole body went: the answer is still there to read
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        return answer.status, dict(answer.getheaders()), answer.read()


def infer_head(length: int, *headers: str, path: str = "/v2/models/logits_32/infer") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {length}", *headers]
    return "\r\n".join(lines).encode("utf-8")
