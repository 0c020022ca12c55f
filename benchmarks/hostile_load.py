"""The hostile half of ``serve_hostile.py``: every kind of request issue 41 hardened ``deploykit
serve`` against, sent continuously to a running server from a process of its own (so the
benchmark's valid client keeps its interpreter lock), each kind counted with how it was answered.

Kinds (``build_kinds``), each sent by its own thread, one request at a time, with ``PAUSE_S``
after each answer (a bounded load: these clients share the server's cores; what is measured is
one client hurting another through what a request makes the server do, not a flood):

* decode bombs ``check_structure`` refuses (``tests/image_bombs.py``'s builders): a progressive
  JPEG of 1,000 scans, a PNG / a JPEG / a WebP of 20,000 empty chunks, a JPEG padded with stray
  bytes, an APNG and an animated WebP, an RLE BMP, a PNG whose zTXt chunk Pillow cannot inflate;
  at full size also the worst accepted image with its chunks raised one over the limit;
* the worst image the server accepts (``decode_bounds.png_rgba16``: 16-bit RGBA, Adam7, at
  ``MAX_PIXELS``), by ``worst_senders`` threads with no pause: it costs a real decode;
* NaN and 3e38 tensors for ``logits_<res>``;
* raw HTTP: a gzip body under ``Content-Encoding: gzip``, the same under ``identity`` then
  ``gzip`` (two headers), JSON with a key twice, a non-ASCII digit
  ``Inference-Header-Content-Length``, JSON of ``MAX_JSON_VALUES + 1`` values;
* slow clients (``SlowClients``): HTTP connections trickling a request head that never ends, or
  a body after a whole head, and gRPC connections trickling HTTP/2's preface, one byte a second
  each, reopened when cut (issue 52, item 8: reconnecting as the deadlines cut them);
* held uploads (``HeldUploads``, issue 52, item 2): HTTP connections each sending all but the last
  byte of a largest body and waiting, reopened when answered or cut (from ``UPLOADER``);
* incomplete gRPC messages (``IncompleteGrpcMessages``, issue 52, item 1): one HTTP/2 connection
  of ``ModelInfer`` streams each declaring a largest message and sending what the server's
  flow-control windows let it, never the rest, reopened when cut (from ``GRPC_HOLDER``);
* one ``classify`` request of ``WORST_IN_ONE_REQUEST`` worst accepted images (issue 52, item 3):
  refused when they hold more pixels than one request may, else decoded.

Classify and tensor kinds alternate HTTP and gRPC (tritonclient). Outcomes are labelled
``"http 400"``, ``"grpc INVALID_ARGUMENT"``, ``"grpc OK"``, ``"cut by server"``, ...
"""

from __future__ import annotations

import gzip
import json
import select
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deploykit.inputs import imaging
from deploykit.serve.defaults import MAX_JSON_VALUES, MAX_REQUEST_BYTES

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # image_bombs.py: the tests' decode bombs
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "serve"))  # stub_triton.py: the front's tests' raw sender
import image_bombs
import stub_triton

PAUSE_S = 0.1  # after each answer, per cheap kind
TRICKLE_S = 1.0  # one byte per slow connection per second
TIMEOUT_S = 120.0  # longest wait for one hostile answer
REFUSED = frozenset({"http 400", "grpc INVALID_ARGUMENT"})
# The clients that hold bytes come from addresses of their own (any 127.x.y.z is this machine): the
# server's budgets are per client address, and each of these is a client of its own.
UPLOADER, GRPC_HOLDER = "127.0.0.2", "127.0.0.3"
WORST = "worst accepted image"
WORST_IN_ONE_REQUEST = 32  # a [32, 1] request: the classify model's largest batch


@dataclass(frozen=True)
class LoadSpec:
    """What the hostile process sends, and where (picklable: it crosses into a spawned process).

    Attributes:
        http_port, grpc_port: the server's public ports on 127.0.0.1.
        model: the ``logits_<res>`` model tensors and raw requests go to.
        resolution: its ``(height, width)``.
        worst: the worst accepted image's bytes.
        worst_senders: threads sending it, each with one in flight.
        at_limits: also send the worst image with its chunks raised over the limit.
        slow_http, slow_grpc: slow connections kept open at once.
    """

    http_port: int
    grpc_port: int
    model: str
    resolution: tuple[int, int]
    worst: bytes = field(repr=False)
    worst_senders: int
    at_limits: bool
    slow_http: int = 32
    slow_grpc: int = 4
    slow_bodies: int = 16
    held_uploads: int = 4
    incomplete_grpc_streams: int = 8
    max_request_bytes: int = MAX_REQUEST_BYTES


@dataclass(frozen=True)
class Kind:
    """One hostile kind: how to send it once (``send(clients, i)`` → outcome label) and what the
    server should answer."""

    name: str
    send: Callable[[Clients, int], str]
    expected: frozenset[str]
    senders: int = 1
    pause_s: float = PAUSE_S


class Clients:
    """One thread's tritonclient clients, HTTP and gRPC (tritonclient's HTTP client is not thread-safe)."""

    def __init__(self, http_port: int, grpc_port: int):
        import tritonclient.grpc
        import tritonclient.http

        self.modules = {"http": tritonclient.http, "grpc": tritonclient.grpc}
        self.http = tritonclient.http.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=TIMEOUT_S)
        self.grpc = tritonclient.grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")

    def call(self, protocol: str, model: str, name: str, array: np.ndarray) -> tuple[str, object]:
        """One request; its outcome label and tritonclient's result (None when refused)."""
        from tritonclient.utils import InferenceServerException

        module = self.modules[protocol]
        tensor = module.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else "FP32")
        tensor.set_data_from_numpy(array)
        client = self.http if protocol == "http" else self.grpc
        try:
            result = client.infer(model, [tensor], **({"client_timeout": TIMEOUT_S} if protocol == "grpc" else {}))
        except InferenceServerException as err:
            return f"{protocol} {str(err.status()).removeprefix('StatusCode.')}", None
        except OSError as err:  # the connection cut or refused: an answer of its own
            return f"{protocol} {type(err).__name__}", None
        return f"{protocol} {'200' if protocol == 'http' else 'OK'}", result

    def infer(self, protocol: str, model: str, name: str, array: np.ndarray) -> str:
        return self.call(protocol, model, name, array)[0]


def raw_request(port: int, head: bytes, body: bytes) -> str:
    """Send ``head`` (request line and headers) and ``body`` as given, on a connection of its own
    (the front's tests' sender), and say how it was answered."""
    import http.client

    try:
        status, _, _ = stub_triton.raw_request(port, head, body, TIMEOUT_S)
        return f"http {status}"
    except (OSError, http.client.HTTPException) as err:
        return f"error {type(err).__name__}"


def infer_head(model: str, length: int, *headers: str) -> bytes:
    lines = [f"POST /v2/models/{model}/infer HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {length}", *headers]
    return "\r\n".join(lines).encode("utf-8")


def infer_json(tensor: np.ndarray, duplicate: bool = False) -> bytes:
    """A KServe v2 JSON request for ``tensor``; ``duplicate``: its ``inputs`` key written twice."""
    inputs = json.dumps([{"name": "images", "shape": list(tensor.shape), "datatype": "FP32", "data": tensor.ravel().tolist()}])
    twice = f', "inputs": {inputs}' if duplicate else ""
    return f'{{"inputs": {inputs}{twice}}}'.encode()


def _alternating(send: Callable[[Clients, str], str]) -> Callable[[Clients, int], str]:
    return lambda clients, i: send(clients, ("http", "grpc")[i % 2])


def _image_kind(name: str, data: bytes, expected: frozenset[str] = REFUSED, senders: int = 1, pause_s: float = PAUSE_S) -> Kind:
    array = np.array([[data]], dtype=object)
    return Kind(name, _alternating(lambda c, p: c.infer(p, "classify", "image", array)), expected, senders, pause_s)


def over_chunk_limit(png: bytes) -> bytes:
    """``png`` with empty private chunks before IEND until it holds one chunk over ``MAX_CHUNKS``."""
    chunks = imaging.read_structure(png).chunks
    end = png.rindex(b"IEND") - 4
    return png[:end] + image_bombs.png_chunk(b"prVt", b"") * (imaging.MAX_CHUNKS + 1 - chunks) + png[end:]


def bomb_kinds(spec: LoadSpec) -> list[Kind]:
    """The decode bombs ``check_structure`` refuses, and the worst accepted image."""
    png = image_bombs.encoded("PNG")
    end = png.rindex(b"IEND") - 4
    bombs = {
        "jpeg of 1000 scans": image_bombs.progressive_jpeg(1_000),
        "png of 20000 chunks": image_bombs.png_with_chunks(imaging.MAX_CHUNKS),
        "jpeg of 20000 segments": image_bombs.jpeg_with_segments(imaging.MAX_CHUNKS),
        "webp of 20000 chunks": image_bombs.webp_with_chunks(imaging.MAX_CHUNKS),
        "jpeg of 1 MiB stray bytes": image_bombs.jpeg_with_stray_bytes(2**20, b"\xff"),
        "apng": image_bombs.animated("PNG", 2),
        "animated webp": image_bombs.animated("WEBP", 3),
        "rle8 bmp": image_bombs.bmp_rle8(),
        "png with a corrupt zTXt chunk": png[:end] + image_bombs.png_chunk(b"zTXt", b"key\0\x01data") + png[end:],
    }
    if spec.at_limits:
        bombs["worst accepted, one chunk over the limit"] = over_chunk_limit(spec.worst)
    kinds = [_image_kind(name, data) for name, data in bombs.items()]
    accepted = frozenset({"http 200", "grpc OK"})
    # one request of many worst images: over the per-request pixel bound at full size (refused
    # before any is decoded), within it in the quick run's small ones (decoded, answered)
    size = imaging.read_structure(spec.worst).size
    many = REFUSED if WORST_IN_ONE_REQUEST * size[0] * size[1] > imaging.REQUEST_IMAGES_OF_MAX * imaging.MAX_PIXELS else accepted
    batch = np.array([[spec.worst]] * WORST_IN_ONE_REQUEST, dtype=object)
    in_one = Kind(
        f"{WORST_IN_ONE_REQUEST} worst accepted images in one request",
        _alternating(lambda c, p: c.infer(p, "classify", "image", batch)),
        many,
    )
    return [*kinds, _image_kind(WORST, spec.worst, accepted, spec.worst_senders, pause_s=0.0), in_one]


def tensor_kinds(spec: LoadSpec) -> list[Kind]:
    """NaN and 3e38 tensors over tritonclient; the raw HTTP kinds the front refuses."""
    tensor = np.random.default_rng(3).standard_normal((1, 3, *spec.resolution), dtype=np.float32)
    nan, huge = tensor.copy(), tensor.copy()
    nan[0, 1, 2, 3], huge[0, 1, 2, 3] = np.nan, 3e38
    packed = gzip.compress(infer_json(tensor))
    duplicate = infer_json(tensor, duplicate=True)
    header = json.dumps({"inputs": [{"name": "images", "shape": list(tensor.shape), "datatype": "FP32"}]}).encode()
    binary = header[:-3] + b', "parameters": {"binary_data_size": %d}}]}' % tensor.nbytes + tensor.tobytes()
    over_cap = b'{"inputs": [{"name": "images", "shape": [1], "datatype": "FP32", "data": [' + b"0," * MAX_JSON_VALUES + b"0]}]}"

    def raw(body: bytes, *headers: str) -> Callable[[Clients, int], str]:
        head = infer_head(spec.model, len(body), *headers)
        return lambda clients, i: raw_request(spec.http_port, head, body)

    non_ascii = "Inference-Header-Content-Length: \u0661\u0662"  # Arabic-Indic "12": str.isdigit() says yes, atoi reads 0
    return [
        Kind("nan tensor", _alternating(lambda c, p: c.infer(p, spec.model, "images", nan)), REFUSED),
        Kind("3e38 tensor", _alternating(lambda c, p: c.infer(p, spec.model, "images", huge)), REFUSED),
        Kind("gzip body", raw(packed, "Content-Encoding: gzip"), frozenset({"http 415"})),
        Kind("gzip body, identity then gzip", raw(packed, "Content-Encoding: identity", "Content-Encoding: gzip"), frozenset({"http 415"})),
        Kind("json with a key twice", raw(duplicate), frozenset({"http 400"})),
        Kind("non-ascii header length", raw(binary, non_ascii), frozenset({"http 400"})),
        Kind(f"json of {MAX_JSON_VALUES + 1} values", raw(over_cap), frozenset({"http 413"})),
    ]


def build_kinds(spec: LoadSpec) -> list[Kind]:
    return [*bomb_kinds(spec), *tensor_kinds(spec)]


class Tally:
    """What each kind sent and how it was answered; shared by the sender threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes: dict[str, Counter] = {}
        self.answer_ns: dict[str, list[int]] = {}
        self.cut_after_s: dict[str, list[float]] = {}

    def add(self, kind: str, outcome: str, answer_ns: int | None = None, cut_after_s: float | None = None) -> None:
        with self.lock:
            self.outcomes.setdefault(kind, Counter())[outcome] += 1
            if answer_ns is not None:
                self.answer_ns.setdefault(kind, []).append(answer_ns)
            if cut_after_s is not None:
                self.cut_after_s.setdefault(kind, []).append(cut_after_s)


def send_continuously(kind: Kind, spec: LoadSpec, tally: Tally, running: threading.Barrier, stop: threading.Event) -> None:
    """One sender thread: ``kind`` once, its answer counted, ``kind.pause_s``, again until ``stop``.
    After its first answer it waits at ``running`` for every other kind's: from then on the load
    is in its steady state (clients connected, every kind in flight)."""
    clients = Clients(spec.http_port, spec.grpc_port)
    i = 0
    while not stop.is_set():
        start = time.perf_counter_ns()
        outcome = kind.send(clients, i)
        tally.add(kind.name, outcome, answer_ns=time.perf_counter_ns() - start)
        if i == 0:
            running.wait()
        i += 1
        if kind.pause_s:
            stop.wait(kind.pause_s)


@dataclass
class _Slow:
    sock: socket.socket
    opened: float
    sent: int = 0


class SlowClients:
    """Connections that send one byte of a request a second and never finish it: an HTTP request
    head with an endless header, or HTTP/2's connection preface for gRPC. Each one the server
    cuts is counted with how long it lasted, and replaced."""

    HTTP_HEAD = b"POST /v2/models/classify/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096
    BODY_HEAD = b"POST /v2/models/classify/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4096\r\n\r\n"
    GRPC_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

    def __init__(self, spec: LoadSpec, tally: Tally):
        self.tally = tally
        self.kinds = {  # name: (port, bytes sent at once on opening, bytes to trickle, connections kept open)
            "slow http head": (spec.http_port, b"", self.HTTP_HEAD, spec.slow_http),
            "slow http body": (spec.http_port, self.BODY_HEAD, b"a" * 4095, spec.slow_bodies),
            "slow grpc handshake": (spec.grpc_port, b"", self.GRPC_PREFACE[:-1], spec.slow_grpc),
        }
        self.open: dict[str, list[_Slow]] = {name: [] for name in self.kinds}

    def _connect(self, port: int, opening: bytes) -> _Slow:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(opening)
        return _Slow(sock, time.monotonic())

    def run(self, running: threading.Barrier, stop: threading.Event) -> None:
        for name, (port, opening, _, count) in self.kinds.items():
            self.open[name] = [self._connect(port, opening) for _ in range(count)]
        running.wait()
        while not stop.wait(TRICKLE_S):
            for name, (port, opening, data, _) in self.kinds.items():
                self.open[name] = [self._trickle(name, port, opening, data, slow) for slow in self.open[name]]
        for name, connections in self.open.items():
            for slow in connections:
                self.tally.add(name, "open at stop")
                slow.sock.close()

    def _trickle(self, name: str, port: int, opening: bytes, data: bytes, slow: _Slow) -> _Slow:
        """One more byte on ``slow``; a new connection in its place when the server cut it."""
        try:
            readable, _, _ = select.select([slow.sock], [], [], 0)
            if readable and not slow.sock.recv(65536):
                raise ConnectionResetError("closed by the server")
            slow.sock.send(data[slow.sent : slow.sent + 1] or b"a")
            slow.sent += 1
            return slow
        except OSError:
            self.tally.add(name, "cut by server", cut_after_s=time.monotonic() - slow.opened)
            slow.sock.close()
            return self._connect(port, opening)


class HeldUploads:
    """``held_uploads`` HTTP connections, each sending a head declaring a largest body and all but
    its last byte, then waiting: the server answers 503 (over the client's share) or 408 (the body
    deadline), or the connection is open at stop. Reopened after each answer."""

    NAME = "slow large upload, all but its last byte"

    def __init__(self, spec: LoadSpec, tally: Tally):
        self.spec, self.tally = spec, tally

    def run(self, running: threading.Barrier, stop: threading.Event) -> None:
        threads = [threading.Thread(target=self._one, args=(stop,), daemon=True) for _ in range(self.spec.held_uploads)]
        for thread in threads:
            thread.start()
        running.wait()
        for thread in threads:
            thread.join()

    def _one(self, stop: threading.Event) -> None:
        size, chunk = self.spec.max_request_bytes, b"\0" * (1 << 20)
        while not stop.is_set():
            opened = time.monotonic()
            with socket.create_connection(("127.0.0.1", self.spec.http_port), timeout=TIMEOUT_S, source_address=(UPLOADER, 0)) as sock:
                outcome = None
                try:
                    sock.sendall(infer_head(self.spec.model, size) + b"\r\n\r\n")
                    left = size - 1
                    while left and outcome is None:
                        sock.sendall(chunk[: min(left, len(chunk))])
                        left -= min(left, len(chunk))
                        if select.select([sock], [], [], 0)[0]:
                            outcome = sock.recv(12).decode(errors="replace").removeprefix("HTTP/1.1 ") or "cut by server"
                    while outcome is None and not stop.is_set():
                        if select.select([sock], [], [], 0.5)[0]:
                            outcome = sock.recv(12).decode(errors="replace").removeprefix("HTTP/1.1 ") or "cut by server"
                except OSError:
                    outcome = "cut by server"
                self.tally.add(self.NAME, f"http {outcome}" if outcome and outcome[:1].isdigit() else (outcome or "open at stop"))
                if outcome is not None:
                    self.tally.cut_after_s.setdefault(self.NAME, []).append(time.monotonic() - opened)
            stop.wait(PAUSE_S)


class IncompleteGrpcMessages:
    """One HTTP/2 connection of ``incomplete_grpc_streams`` ``ModelInfer`` streams, each declaring a
    largest message and sending what the server's windows let it, never the rest; counted when
    the server ends a stream (reset, or a status: its body deadline) and reopened when all ended."""

    NAME = "slow grpc messages, never finished"

    def __init__(self, spec: LoadSpec, tally: Tally):
        self.spec, self.tally = spec, tally

    def run(self, running: threading.Barrier, stop: threading.Event) -> None:
        import h2.config
        import h2.connection
        import h2.events

        first = True
        while not stop.is_set():
            sock = socket.create_connection(("127.0.0.1", self.spec.grpc_port), timeout=TIMEOUT_S, source_address=(GRPC_HOLDER, 0))
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            streams, opened = [], time.monotonic()
            for _ in range(self.spec.incomplete_grpc_streams):
                stream = conn.get_next_available_stream_id()
                headers = [(":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer")]
                conn.send_headers(stream, [*headers, (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])
                streams.append(stream)
            sock.sendall(conn.data_to_send())
            message = self.spec.max_request_bytes
            sent, ended = dict.fromkeys(streams, 0), set()
            prefix = b"\0" + message.to_bytes(4, "big")
            if first:
                running.wait()
                first = False
            sock.settimeout(0.2)
            while len(ended) < len(streams) and not stop.is_set():
                for stream in streams:
                    room = 0 if stream in ended else min(message + 4 - sent[stream], conn.local_flow_control_window(stream), 1 << 14)
                    if room > 0:
                        data = (prefix + b"\0" * (room - 5)) if sent[stream] == 0 and room >= 5 else b"\0" * room
                        conn.send_data(stream, data)
                        sent[stream] += len(data)
                try:
                    sock.sendall(conn.data_to_send())
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    ended.update(streams)
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, (h2.events.StreamReset, h2.events.TrailersReceived, h2.events.StreamEnded)):
                        ended.add(event.stream_id)
            for stream in streams:
                self.tally.add(self.NAME, "cut by server" if stream in ended else "open at stop")
            if ended:
                self.tally.cut_after_s.setdefault(self.NAME, []).append(time.monotonic() - opened)
            sock.close()


def run_load(spec: LoadSpec, started, stop, results) -> None:
    """The hostile process: every kind of ``build_kinds`` and the slow clients until ``stop`` is
    set; ``started`` is set once every kind has been answered once and the slow connections are
    open; then the tally goes to ``results`` (a queue), with this process's CPU seconds from
    ``started`` on.

    ``started``, ``stop``: multiprocessing events; ``results``: a multiprocessing queue."""
    kinds = build_kinds(spec)
    tally, halt = Tally(), threading.Event()
    holders = [SlowClients(spec, tally), HeldUploads(spec, tally), IncompleteGrpcMessages(spec, tally)]
    barrier = threading.Barrier(sum(k.senders for k in kinds) + len(holders) + 1)
    threads = [threading.Thread(target=holder.run, args=(barrier, halt), daemon=True) for holder in holders]
    threads += [
        threading.Thread(target=send_continuously, args=(kind, spec, tally, barrier, halt), daemon=True)
        for kind in kinds
        for _ in range(kind.senders)
    ]
    for thread in threads:
        thread.start()
    barrier.wait()
    started.set()
    cpu_start = time.process_time()
    stop.wait()
    halt.set()
    for thread in threads:
        thread.join(TIMEOUT_S)
    results.put(dict(kinds=summarize(kinds, tally), cpu_s=time.process_time() - cpu_start))


def summarize(kinds: list[Kind], tally: Tally) -> list[dict]:
    """Per kind: requests sent, outcomes, how many were answered as expected; answer latency of
    the accepted kind, how long slow connections lasted."""
    from deploykit.profile.timing import LatencyStats

    cut = {"cut by server"}
    held = {HeldUploads.NAME: {"http 503", "http 408", "cut by server"}, IncompleteGrpcMessages.NAME: cut}
    slow = {"slow http head": cut, "slow http body": cut, "slow grpc handshake": cut}
    expected = {k.name: k.expected for k in kinds} | slow | held
    records = []
    for name, wanted in expected.items():
        outcomes = tally.outcomes.get(name, Counter())
        record = dict(kind=name, sent=sum(outcomes.values()), outcomes=dict(sorted(outcomes.items())), expected=sorted(wanted))
        record["as_expected"] = sum(n for outcome, n in outcomes.items() if outcome in wanted)
        if name == WORST and tally.answer_ns.get(name):
            stats = LatencyStats.from_ns(tally.answer_ns[name])
            record["answer_ms"] = dict(p50=round(stats.p50_ms, 1), max=round(stats.max_ms, 1))
        if tally.cut_after_s.get(name):
            record["cut_after_s"] = dict(min=round(min(tally.cut_after_s[name]), 2), max=round(max(tally.cut_after_s[name]), 2))
        records.append(record)
    return records
