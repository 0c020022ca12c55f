"""The bounded front of ``deploykit serve``: the only sockets clients reach.

Triton listens on loopback ports of its own, answering only requests that carry a random token
(``triton_server.py``); this front listens on ``--host`` at the public HTTP, gRPC and metrics ports,
adds the token, and passes on what it has checked (``requests.py``):

* HTTP (aiohttp): ``POST .../infer`` bodies are read as sent (aiohttp inflates nothing), counted
  against ``max_request_bytes`` (413) and against ``max_inflight_bytes`` for every body held at
  once, per client address for large ones (503 with ``Retry-After``; ``ByteBudget``) as they
  arrive, checked, and forwarded byte for byte with the one header length that was checked; a
  ``Content-Encoding`` other than ``identity`` in any of its headers is 415 (Triton would inflate
  the body unbounded). Only the KServe v2 read endpoints (health, metadata, readiness, config,
  statistics) and inference are forwarded, everything else (model control, shared memory,
  tracing, logging) is 404 here. A model config loses the parameters that hold a file-system
  path (PyTriton's workspace).
* gRPC (grpcio): the same endpoints of ``inference.GRPCInferenceService``, unary calls only
  (``ModelStreamInfer`` is not served); messages over ``max_request_bytes`` are refused by grpc;
  a call's message is asked of grpc only when the call gets a receive slot (``ReceiveSlots``:
  ``max_inflight_bytes // max_request_bytes`` messages received at once, one per connection),
  and must be whole ``body_timeout_s`` after the call began (DEADLINE_EXCEEDED, the call cut);
  until then a call's stream holds at most HTTP/2's initial window, and a connection at most
  ``GRPC_STREAMS`` calls. The messages of calls in flight count against ``max_inflight_bytes``
  as HTTP bodies do (``ByteBudget``: large ones of one client address against
  ``max_request_bytes``, a quarter kept for small ones; UNAVAILABLE beyond); each ``ModelInfer``
  request is parsed and checked.
* metrics: ``GET /metrics``.

Deadlines (``connections.py``): a request head not complete ``header_timeout_s`` after it began
(the connection opened, or its first byte arrived) and a body not read within ``body_timeout_s``
cut the connection (the body with a 408); gRPC handshakes get ``header_timeout_s``.

Errors Triton answers with 5xx / INTERNAL (PyTriton sends a Python traceback for any exception of
a bound function) reach the client as the exception's message in one line without traceback,
frame list or path (``requests.client_message``); the original goes to the ``deploykit`` log at
debug level.

Shutdown (``drain``): new HTTP requests get 503 and ``Connection: close``, gRPC calls UNAVAILABLE;
bodies still arriving are cut (503: nothing of them reached Triton); requests already inside are
answered, for at most ``drain_timeout_s``. Then the HTTP door closes without cutting anyone
(``door.py``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import socket
import threading
from dataclasses import dataclass, field

from deploykit._lazy import lazy_import
from deploykit.errors import DeployKitError
from deploykit.serve import defaults
from deploykit.serve.connections import (
    SMALL_REQUEST_BYTES,
    ByteBudget,
    HeldBytes,
    ReceiveSlots,
    client_address,
    connection_cap,
    cut_slow_heads,
    timed_server_class,
)
from deploykit.serve.door import accept_queue_length, listening_sockets, refuse_new_connections
from deploykit.serve.requests import (
    HEADER_LENGTH,
    RequestRejected,
    check_grpc_infer,
    check_http_infer,
    check_infer_headers,
    client_message,
    holds_path,
    public_model_config,
)

_log = logging.getLogger(__name__)

MODEL = r"/v2/models/[A-Za-z0-9._-]+(?:/versions/[0-9]+)?"
HTTP_READ = re.compile(rf"^/v2(?:/health/(?:live|ready))?$|^/v2/models/stats$|^{MODEL}(?:/ready|/config|/stats)?$")
HTTP_INFER = re.compile(rf"^{MODEL}/infer$")
HTTP_CONFIG = re.compile(rf"^{MODEL}/config$")
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
ANSWER_HEADERS = ("Content-Type", HEADER_LENGTH)
# Triton's restricted-API header (PyTriton's TRITON_ACCESS_HEADER); over gRPC it carries Triton's prefix.
TOKEN_HEADER = "triton-access-token"
GRPC_TOKEN_KEY = "triton-grpc-protocol-" + TOKEN_HEADER
INLINE_CHECK_BYTES = 1 << 20  # parsed and checked in well under a millisecond
SMALL_BODY = 64 * 1024  # checked on the event loop; larger bodies are parsed in a worker thread
CHECKS_AT_ONCE = 2  # larger bodies checked at once: each may take up to ~100 B per JSON value
LINGER_S = 10.0  # aiohttp's default
# Calls one gRPC connection may have open (HTTP/2's MAX_CONCURRENT_STREAMS; grpc's default is
# unbounded): each may hold an initial window of message bytes while it waits for a receive slot.
GRPC_STREAMS = 128
# HTTP/2's initial stream window the front announces, and keeps: grpc would otherwise widen it to
# its estimate of the connection's bandwidth-delay product (megabytes on loopback) for every call.
GRPC_STREAM_WINDOW = 64 * 1024
DOOR_CLOSE_S = 2.0  # longest wait, once no new handshake completes, for queued and open connections


@dataclass(frozen=True)
class FrontOptions:
    """Where the front listens, what it forwards to, and its limits.

    Attributes:
        host: the public address (``--host``).
        http_port, grpc_port, metrics_port: the public ports.
        upstream_http, upstream_grpc, upstream_metrics: Triton's ports on 127.0.0.1.
        max_request_bytes: largest request body / gRPC message accepted.
        drain_timeout_s: longest wait for requests in flight at shutdown.
        header_timeout_s: longest an HTTP request head may take to arrive, from its first byte
            (or the connection's opening); also gRPC's handshake deadline.
        body_timeout_s: longest an HTTP request body may take to arrive, once its head is in.
        max_inflight_bytes: request-body bytes held at once across every connection.
        max_json_values: most values one request's JSON may hold.
        upstream_token: the token Triton asks of every request (its restricted APIs); empty:
            none is sent.
        metrics_host: the address of the metrics port; None: ``host``.
        max_connections_per_client: HTTP connections one client address may hold open at once
            (those past it are closed as they open); at most an eighth of the process's file
            descriptors (``connections.connection_cap``).
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
    header_timeout_s: float = defaults.HEADER_TIMEOUT_S
    body_timeout_s: float = defaults.BODY_TIMEOUT_S
    max_inflight_bytes: int = defaults.IN_FLIGHT_BODIES * defaults.MAX_REQUEST_BYTES
    max_json_values: int = defaults.MAX_JSON_VALUES
    upstream_token: str = field(default="", repr=False)
    metrics_host: str | None = None
    max_connections_per_client: int = defaults.MAX_CONNECTIONS_PER_CLIENT


class Front:
    """The front's servers on an event loop of their own thread; ``start`` binds every port."""

    def __init__(self, options: FrontOptions):
        self.options = options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="deploykit-front", daemon=True)
        self._draining, self._inflight = False, 0
        # a fair share: no one client holds more than one largest request's bytes at once, and
        # large requests leave a quarter of the budget to small ones
        small_room = max(0, min(options.max_inflight_bytes // 4, options.max_inflight_bytes - options.max_request_bytes))
        self._budget = ByteBudget(
            options.max_inflight_bytes,
            per_holder=options.max_request_bytes,
            small_room=small_room,
            small_request=min(SMALL_REQUEST_BYTES, options.max_request_bytes // 8),
        )
        # as many gRPC messages received at once as the budget holds largest requests, one per connection
        self._receiving = ReceiveSlots(options.max_inflight_bytes // options.max_request_bytes, per_holder=1)
        self._stopping = asyncio.Event()  # set at drain: bodies still arriving are cut
        self._checks = asyncio.Semaphore(CHECKS_AT_ONCE)  # bounds the memory of checks running at once
        self._runners, self._grpc, self._channel, self._session, self._watchdog = [], None, None, None, None
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

    @property
    def bytes_held(self) -> int:
        """Request-body bytes the front holds now, across every connection."""
        return self._budget.used

    def drain(self) -> int:
        """Stop taking requests, cut bodies still arriving, answer the requests in flight (at
        most ``drain_timeout_s``), close.

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
        web, aiohttp = lazy_import("aiohttp.web"), lazy_import("aiohttp")
        o = self.options
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        server_class = timed_server_class()
        endpoints = (
            (o.host, o.http_port, o.upstream_http, self._http),
            (o.metrics_host or o.host, o.metrics_port, o.upstream_metrics, self._metrics),
        )
        for host, port, upstream, route in endpoints:
            handler = functools.partial(self._handle, route, f"http://127.0.0.1:{upstream}")
            # auto_decompress=False: the body checked is the body as sent, whatever Content-Encoding says;
            # lingering_time: the rest of a refused body is read (so the client reads the answer, not a
            # reset) within the body deadline at most
            server = server_class(
                handler,
                max_connections_per_client=connection_cap(o.max_connections_per_client),
                access_log=None,
                auto_decompress=False,
                lingering_time=min(LINGER_S, o.body_timeout_s),
            )
            runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=1.0)
            await runner.setup()
            self._runners.append(runner)
            for sock in listening_sockets(host, port):
                self._listeners.append(sock)
                await web.SockSite(runner, sock).start()
        self._watchdog = asyncio.ensure_future(cut_slow_heads([runner.server for runner in self._runners], o.header_timeout_s))
        await self._start_grpc()

    async def _start_grpc(self) -> None:
        grpc, o = lazy_import("grpc"), self.options
        upstream = [("grpc.max_send_message_length", o.max_request_bytes), ("grpc.max_receive_message_length", -1)]
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{o.upstream_grpc}", options=upstream)
        self._grpc = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", o.max_request_bytes),
                ("grpc.max_send_message_length", -1),
                ("grpc.server_handshake_timeout_ms", max(1, int(o.header_timeout_s * 1000))),
                ("grpc.max_concurrent_streams", GRPC_STREAMS),
                ("grpc.http2.bdp_probe", 0),
                ("grpc.http2.lookahead_bytes", GRPC_STREAM_WINDOW),
            ]
        )
        self._grpc.add_generic_rpc_handlers((_GrpcHandler(self),))
        if self._grpc.add_insecure_port(f"{o.host}:{o.grpc_port}") == 0:
            raise OSError(f"gRPC port {o.grpc_port} is not available")
        await self._grpc.start()

    async def _drain(self) -> int:
        self._draining = True
        self._stopping.set()  # bodies still arriving are cut: none of them reached Triton
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
        if self._watchdog is not None:
            self._watchdog.cancel()
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
        if status == 503:
            response.headers["Retry-After"] = "1"
        if close:
            response.force_close()  # sends "Connection: close" and closes after the answer
        return response

    async def _handle(self, route, upstream: str, request):
        """Every HTTP request: refused while draining, else ``route``'s answer; the connection
        knows when a handler has its request (``connections.TimedConnection``)."""
        connection = request.protocol
        if self._draining:
            return self._error(503, "server is shutting down", close=True)
        connection.taken(has_body=request.method == "POST" and bool(HTTP_INFER.match(request.path)))
        self._inflight += 1
        held = HeldBytes(self._budget, client_address(request.remote), request.content_length)
        try:
            response = await route(upstream, request, held)
        finally:
            held.release()
            self._inflight -= 1
            connection.answered()
        if self._draining:
            response.force_close()  # the client's next request finds the door closing: no keep-alive
        return response

    async def _http(self, upstream: str, request, held: HeldBytes):
        body = header_length = None
        if request.method == "POST" and HTTP_INFER.match(request.path):
            try:
                header_length = check_infer_headers(request.headers.items())
                body = await self._read_body(request, held)
                request.protocol.body_read()
                await self._check(body, header_length)
            except RequestRejected as err:
                return self._error(err.status, str(err), close=body is None)  # a body not read to its end: close
        elif not (request.method in ("GET", "HEAD") and HTTP_READ.match(request.path)):
            return self._error(404, f"not served: {request.method} {request.path[:80]}", close=request.body_exists)
        return await self._upstream(upstream, request, body, header_length)

    async def _metrics(self, upstream: str, request, held: HeldBytes):
        if request.method != "GET" or request.path != "/metrics":
            return self._error(404, f"not served: {request.method} {request.path[:80]}", close=request.body_exists)
        return await self._upstream(upstream, request, None, None)

    async def _read_body(self, request, held: HeldBytes) -> bytearray:
        """The whole body, within ``body_timeout_s``, cut at shutdown.

        Raises:
            RequestRejected: 413 over ``max_request_bytes``; 503 over the byte budget or at
                shutdown; 408 past the deadline; 400 when the client cut it short.
        """
        web, o = lazy_import("aiohttp.web"), self.options
        if request.content_length is not None and request.content_length > o.max_request_bytes:
            raise RequestRejected(f"request body over {o.max_request_bytes} bytes", status=413)
        reading = asyncio.ensure_future(self._collect(request.content, held))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({reading, stopping}, timeout=o.body_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reading, stopping):
                task.cancel()
            await asyncio.gather(reading, stopping, return_exceptions=True)
        if reading.cancelled():
            if self._stopping.is_set():
                raise RequestRejected("server is shutting down", status=503)
            raise RequestRejected(f"request body not received within {o.body_timeout_s:g} s", status=408)
        try:
            return reading.result()
        except (web.RequestPayloadError, ConnectionError) as err:
            raise RequestRejected(f"request body cut short: {err}") from None

    async def _collect(self, content, held: HeldBytes) -> bytearray:
        body, limit = bytearray(), self.options.max_request_bytes
        async for chunk in content.iter_any():
            if len(body) + len(chunk) > limit:
                raise RequestRejected(f"request body over {limit} bytes", status=413)
            if not held.take(len(chunk)):
                o = self.options
                raise RequestRejected(
                    f"the server holds {o.max_inflight_bytes} bytes of request bodies in all, "
                    f"at most {o.max_request_bytes} of large ones per client; retry",
                    status=503,
                )
            body += chunk
        return body

    async def _check(self, body: bytearray, header_length: str | None) -> None:
        check = functools.partial(check_http_infer, body, header_length, self.options.max_json_values)
        if len(body) <= SMALL_BODY:
            check()
            return
        async with self._checks:
            await asyncio.to_thread(check)

    async def _upstream(self, upstream: str, request, body: bytearray | None, header_length: str | None):
        web, aiohttp = lazy_import("aiohttp.web"), lazy_import("aiohttp")
        headers = {"Accept-Encoding": "identity"}
        if "Content-Type" in request.headers:
            headers["Content-Type"] = request.headers["Content-Type"]
        if header_length is not None:
            headers[HEADER_LENGTH] = header_length
        if self.options.upstream_token:
            headers[TOKEN_HEADER] = self.options.upstream_token
        # HEAD (load balancers' probe) is asked of Triton as GET, which it serves; aiohttp answers
        # the client's HEAD with the GET's status and headers and no body
        method = "GET" if request.method == "HEAD" else request.method
        try:
            async with self._session.request(method, upstream + request.rel_url.raw_path_qs, data=body, headers=headers) as answer:
                payload = await answer.read()
                status, kept = answer.status, {h: answer.headers[h] for h in ANSWER_HEADERS if h in answer.headers}
        except aiohttp.ClientError as err:
            _log.debug("Triton did not answer %s %s: %r", request.method, request.path, err)
            return self._error(502, "the inference server did not answer")
        if status >= 500:
            _log.debug("Triton answered %s %s with %d: %s", request.method, request.path, status, payload[:4000])
            return self._error(status, client_message(_error_text(payload)))
        if status == 200 and method == "GET" and HTTP_CONFIG.match(request.path):
            payload = json.dumps(public_model_config(json.loads(payload))).encode()
        return web.Response(body=payload, status=status, headers=kept)

    async def _grpc_receive(self, messages, connection: str, context) -> bytes:
        """The call's one message, asked of grpc once the connection has a receive slot, whole
        within ``body_timeout_s`` of the call's start (else the call is cut)."""
        grpc, timeout_s = lazy_import("grpc"), self.options.body_timeout_s

        async def in_turn() -> bytes | None:
            await self._receiving.take(connection)
            try:
                return await anext(messages, None)
            finally:
                self._receiving.give(connection)

        try:
            request = await asyncio.wait_for(in_turn(), timeout_s)  # not asyncio.timeout: Python 3.10 has none
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request message not received within {timeout_s:g} s")
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request message")
        return request

    async def _grpc_call(self, method: str, messages, context):
        grpc = lazy_import("grpc")
        connection = context.peer()  # the client's address and port: one per connection
        request = await self._grpc_receive(messages, connection, context)
        client, large = client_address(connection), len(request) > self._budget.small_request
        if not self._budget.take(len(request), client, large):
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the server holds {self.options.max_inflight_bytes} bytes of requests in all, "
                f"at most {self.options.max_request_bytes} of large ones per client; retry",
            )
        self._inflight += 1
        try:
            if method.endswith("/ModelInfer"):
                # a small message is checked on the loop: a worker thread's handoff would cost more
                # than the check; a large one in a thread, so the loop serves other calls meanwhile
                small = len(request) <= INLINE_CHECK_BYTES
                message = _checked_grpc_infer(request) if small else await asyncio.to_thread(_checked_grpc_infer, request)
                if message:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            token = self.options.upstream_token
            try:
                answer = await self._channel.unary_unary(method)(
                    request, timeout=context.time_remaining(), metadata=((GRPC_TOKEN_KEY, token),) if token else None
                )
            except grpc.aio.AioRpcError as err:
                code, details = err.code(), err.details() or ""
                if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                    _log.debug("Triton answered %s with %s: %s", method, code, details[:4000])
                    details = client_message(details)
                await context.abort(code, details)
            return _public_grpc_config(answer) if method.endswith("/ModelConfig") else answer
        finally:
            self._inflight -= 1
            self._budget.give(len(request), client, large)


def _error_text(payload: bytes) -> str:
    """The ``error`` of a KServe v2 JSON error body, else the body as text."""
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


def _public_grpc_config(answer: bytes) -> bytes:
    """A serialized ``ModelConfigResponse`` without the parameters that hold a file-system path."""
    service_pb2 = lazy_import("tritonclient.grpc.service_pb2")
    response = service_pb2.ModelConfigResponse.FromString(answer)
    for key in [key for key, value in response.config.parameters.items() if holds_path(value.string_value)]:
        del response.config.parameters[key]
    return response.SerializeToString()


class _GrpcHandler:
    """grpc's generic handler: the allowed unary methods, forwarded as bytes. Each is served as a
    client-streaming method (the same frames on the wire) so that the front, not grpc, decides when
    a call's message is read: a unary handler's message is read in full before it runs."""

    def __init__(self, front: Front):
        self.front = front
        self._grpc = lazy_import("grpc")

    def service(self, details):
        method = details.method
        if not method.startswith(GRPC_SERVICE) or method[len(GRPC_SERVICE) :] not in GRPC_METHODS:
            return None  # grpc answers UNIMPLEMENTED
        front = self.front

        async def call(messages, context):
            if front._draining:
                await context.abort(self._grpc.StatusCode.UNAVAILABLE, "server is shutting down")
            return await front._grpc_call(method, messages, context)

        return self._grpc.stream_unary_rpc_method_handler(call)
