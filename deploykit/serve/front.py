"""The bounded front of ``deploykit serve``: the only sockets clients reach.

Triton listens on loopback ports of its own; this front listens on ``--host`` at the public HTTP,
gRPC and metrics ports and passes on what it has checked (``requests.py``):

* HTTP (aiohttp): bodies over ``max_request_bytes`` are refused (413) while being read, before any
  parser sees them; ``POST .../infer`` bodies are checked and forwarded byte for byte; compressed
  request bodies are refused (415: Triton would inflate them unbounded); only the KServe v2 read
  endpoints (health, metadata, readiness, config, statistics) and inference are forwarded,
  everything else (model control, shared memory, tracing, logging) is 404 here.
* gRPC (grpcio): the same endpoints of ``inference.GRPCInferenceService``, unary calls only
  (``ModelStreamInfer`` is not served); messages over ``max_request_bytes`` are refused by grpc;
  each ``ModelInfer`` request is parsed and checked.
* metrics: ``GET /metrics``.

Errors Triton answers with 5xx / INTERNAL (PyTriton sends a Python traceback for any exception of
a bound function) reach the client as one line without traceback or path
(``requests.client_message``); the original goes to the ``deploykit`` log at debug level.

Shutdown (``drain``): new HTTP requests get 503 and ``Connection: close``, gRPC calls UNAVAILABLE;
requests already inside are answered, for at most ``drain_timeout_s``. Then the HTTP door closes
without cutting anyone (``door.py``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
from dataclasses import dataclass

from deploykit._lazy import lazy_import
from deploykit.errors import DeployKitError
from deploykit.serve.door import accept_queue_length, listening_sockets, refuse_new_connections
from deploykit.serve.requests import HEADER_LENGTH, RequestRejected, check_grpc_infer, check_http_infer, client_message

_log = logging.getLogger(__name__)

MODEL = r"/v2/models/[A-Za-z0-9._-]+(?:/versions/[0-9]+)?"
HTTP_READ = re.compile(rf"^/v2(?:/health/(?:live|ready))?$|^/v2/models/stats$|^{MODEL}(?:/ready|/config|/stats)?$")
HTTP_INFER = re.compile(rf"^{MODEL}/infer$")
GRPC_SERVICE = "/inference.GRPCInferenceService/"
GRPC_METHODS = (
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "ModelConfig",
    "ModelStatistics",
)
FORWARDED_HEADERS = ("Content-Type", HEADER_LENGTH)
SMALL_BODY = 64 * 1024  # checked on the event loop; larger bodies are parsed in a worker thread
DOOR_CLOSE_S = 2.0  # longest wait, once no new handshake completes, for queued and open connections


@dataclass(frozen=True)
class FrontOptions:
    """Where the front listens and what it forwards to.

    Attributes:
        host: the public address (``--host``).
        http_port, grpc_port, metrics_port: the public ports.
        upstream_http, upstream_grpc, upstream_metrics: Triton's ports on 127.0.0.1.
        max_request_bytes: largest request body / gRPC message accepted.
        drain_timeout_s: longest wait for requests in flight at shutdown.
    """

    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    upstream_http: int
    upstream_grpc: int
    upstream_metrics: int
    max_request_bytes: int
    drain_timeout_s: float


class Front:
    """The front's servers on an event loop of their own thread; ``start`` binds every port."""

    def __init__(self, options: FrontOptions):
        self.options = options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="deploykit-front", daemon=True)
        self._draining, self._inflight = False, 0
        self._runners, self._grpc, self._channel, self._session = [], None, None, None
        self._listeners: list[socket.socket] = []  # the HTTP and metrics sockets, which the front owns

    def start(self) -> None:
        """Listen on every public port.

        Raises:
            DeployKitError: a port cannot be listened on.
        """
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        except OSError as err:
            self.close()
            raise DeployKitError(f"cannot listen on {self.options.host}: {err.strerror or err}") from err

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def drain(self) -> int:
        """Stop taking requests, answer those in flight (at most ``drain_timeout_s``), close.

        Returns:
            How many requests were still in flight when the wait ended (0: all answered).
        """
        if not self._thread.is_alive():
            return 0
        left = asyncio.run_coroutine_threadsafe(self._drain(), self._loop).result()
        self.close()
        return left

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    # -- on the loop ------------------------------------------------------------------------------

    async def _start(self) -> None:
        web, aiohttp, grpc = lazy_import("aiohttp.web"), lazy_import("aiohttp"), lazy_import("grpc")
        o = self.options
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        for port, upstream, handler in ((o.http_port, o.upstream_http, self._http), (o.metrics_port, o.upstream_metrics, self._metrics)):
            app = web.Application(client_max_size=o.max_request_bytes)
            app["upstream"] = f"http://127.0.0.1:{upstream}"
            app.router.add_route("*", "/{tail:.*}", handler)
            runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
            await runner.setup()
            self._runners.append(runner)
            for sock in listening_sockets(o.host, port):
                self._listeners.append(sock)
                await web.SockSite(runner, sock, shutdown_timeout=1.0).start()
        upstream = [("grpc.max_send_message_length", o.max_request_bytes), ("grpc.max_receive_message_length", -1)]
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{o.upstream_grpc}", options=upstream)
        self._grpc = grpc.aio.server(
            options=[("grpc.max_receive_message_length", o.max_request_bytes), ("grpc.max_send_message_length", -1)]
        )
        self._grpc.add_generic_rpc_handlers((_GrpcHandler(self),))
        if self._grpc.add_insecure_port(f"{o.host}:{o.grpc_port}") == 0:
            raise OSError(f"gRPC port {o.grpc_port} is not available")
        await self._grpc.start()

    async def _drain(self) -> int:
        self._draining = True
        deadline = self._loop.time() + self.options.drain_timeout_s
        while self._inflight and self._loop.time() < deadline:
            await asyncio.sleep(0.02)
        left = self._inflight
        await self._close_http_door(min(deadline, self._loop.time() + DOOR_CLOSE_S))
        await self._grpc.stop(grace=max(0.1, deadline - self._loop.time()))
        return left

    async def _close_http_door(self, deadline: float) -> None:
        """No new handshake completes; each connection already made, queued or open, gets its
        answer (503 from here on) and is closed by it, until ``deadline``."""
        for sock in self._listeners:
            refuse_new_connections(sock)

        def pending() -> bool:
            queued = any(accept_queue_length(sock) for sock in self._listeners)
            return queued or any(runner.server is not None and runner.server.connections for runner in self._runners)

        while pending() and self._loop.time() < deadline:
            await asyncio.sleep(0.02)

    async def _close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners = []
        for sock in self._listeners:
            sock.close()
        self._listeners = []
        if self._grpc is not None:
            await self._grpc.stop(grace=None)
        for closable in (self._session, self._channel):
            if closable is not None:
                await closable.close()

    def _error(self, status: int, message: str, close: bool = False):
        web = lazy_import("aiohttp.web")
        response = web.json_response({"error": message}, status=status)
        if close:
            response.force_close()  # sends "Connection: close" and closes after the answer
        return response

    async def _http(self, request):
        if self._draining:
            return self._error(503, "server is shutting down", close=True)
        self._inflight += 1
        try:
            response = await self._forward_http(request)
        finally:
            self._inflight -= 1
        if self._draining:
            response.force_close()  # the client's next request finds the door closing: no keep-alive
        return response

    async def _forward_http(self, request):
        web = lazy_import("aiohttp.web")
        body = None
        if request.method == "POST" and HTTP_INFER.match(request.path):
            if request.headers.get("Content-Encoding", "identity").lower() != "identity":
                return self._error(415, "compressed request bodies are not served; send them uncompressed")
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                return self._error(413, f"request body over {self.options.max_request_bytes} bytes")
            try:
                if len(body) <= SMALL_BODY:
                    check_http_infer(body, request.headers.get(HEADER_LENGTH))
                else:
                    await asyncio.to_thread(check_http_infer, body, request.headers.get(HEADER_LENGTH))
            except RequestRejected as err:
                return self._error(err.status, str(err))
        elif not (request.method in ("GET", "HEAD") and HTTP_READ.match(request.path)):
            return self._error(404, f"not served: {request.method} {request.path[:80]}")
        return await self._upstream(request, body)

    async def _metrics(self, request):
        if request.method != "GET" or request.path != "/metrics":
            return self._error(404, f"not served: {request.method} {request.path[:80]}")
        return await self._upstream(request, None)

    async def _upstream(self, request, body: bytes | None):
        web, aiohttp = lazy_import("aiohttp.web"), lazy_import("aiohttp")
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers} | {"Accept-Encoding": "identity"}
        url = request.app["upstream"] + request.rel_url.raw_path_qs
        try:
            async with self._session.request(request.method, url, data=body, headers=headers) as answer:
                payload = await answer.read()
                status, kept = answer.status, {h: answer.headers[h] for h in FORWARDED_HEADERS if h in answer.headers}
        except aiohttp.ClientError as err:
            _log.debug("Triton did not answer %s %s: %r", request.method, request.path, err)
            return self._error(502, "the inference server did not answer")
        if status >= 500:
            _log.debug("Triton answered %s %s with %d: %s", request.method, request.path, status, payload[:4000])
            return self._error(status, client_message(_error_text(payload)))
        return web.Response(body=payload, status=status, headers=kept)

    async def _grpc_call(self, method: str, request: bytes, context):
        grpc = lazy_import("grpc")
        self._inflight += 1
        try:
            if method.endswith("/ModelInfer"):
                message = await asyncio.to_thread(_checked_grpc_infer, request)
                if message:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            remaining = context.time_remaining()
            try:
                return await self._channel.unary_unary(method)(request, timeout=remaining)
            except grpc.aio.AioRpcError as err:
                code, details = err.code(), err.details() or ""
                if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                    _log.debug("Triton answered %s with %s: %s", method, code, details[:4000])
                    details = client_message(details)
                await context.abort(code, details)
        finally:
            self._inflight -= 1


def _error_text(payload: bytes) -> str:
    """The ``error`` of a KServe v2 JSON error body, else the body as text."""
    import json

    try:
        return str(json.loads(payload)["error"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return payload.decode("utf-8", "replace")


def _checked_grpc_infer(request: bytes) -> str | None:
    """The client's error in a serialized ``ModelInferRequest``, or None."""
    service_pb2 = lazy_import("tritonclient.grpc.service_pb2")
    try:
        check_grpc_infer(service_pb2.ModelInferRequest.FromString(request))
    except RequestRejected as err:
        return str(err)
    except Exception as err:  # protobuf's DecodeError (its module differs between protobuf builds)
        return f"malformed ModelInferRequest: {type(err).__name__}"
    return None


class _GrpcHandler:
    """grpc's generic handler: the allowed unary methods, forwarded as bytes."""

    def __init__(self, front: Front):
        self.front = front
        self._grpc = lazy_import("grpc")

    def service(self, details):
        method = details.method
        if not method.startswith(GRPC_SERVICE) or method[len(GRPC_SERVICE) :] not in GRPC_METHODS:
            return None  # grpc answers UNIMPLEMENTED
        front = self.front

        async def call(request: bytes, context):
            if front._draining:
                await context.abort(self._grpc.StatusCode.UNAVAILABLE, "server is shutting down")
            return await front._grpc_call(method, request, context)

        return self._grpc.unary_unary_rpc_method_handler(call)
