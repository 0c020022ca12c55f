"""What bounds the front's HTTP connections in time and memory (``front.py``).

* ``ByteBudget``: request-body bytes held at once, across every connection, and by any one
  client address across its connections (``per_holder``: four connections of one client each
  holding a largest body left 4 bytes of the budget and every other client 503). Part of the
  budget is kept for small requests (``small_room``): large bodies cannot fill it, so a 48 x 48
  image still gets in while others' large uploads hold the rest. A body is counted as its bytes
  arrive, so a slow client holds only what it sent; one that would go over a limit is answered
  503 with ``Retry-After``.
* ``client_address``: the holder of a connection: its peer's address without the port.
* ``ReceiveSlots``: gRPC messages being received at once, in all and by one connection. grpc
  buffers a message until it is whole and shows the front nothing before, so the bytes of an
  incomplete message cannot be counted as they arrive; instead grpc is asked for a call's message
  only once the call has a slot (until then the client can send no more than HTTP/2's initial
  stream window), and within the body deadline.
* ``TimedConnection``: aiohttp's connection handler, closing a client's connections past
  ``max_connections_per_client`` as they open, and noting when the head of a request began
  (the connection opened, or the first byte after an answer arrived) and whether the front's
  handler has taken it; ``cut_slow_heads`` closes the connections whose head is still not
  complete after the header deadline (a client sending one byte now and then would otherwise
  hold its connection open for as long as it liked). A keep-alive connection that sends nothing after an answer is
  idle, not slow: aiohttp's keep-alive timeout closes it. The body has a deadline of its own
  (``Front``).
"""

from __future__ import annotations

import asyncio
import functools

from deploykit._lazy import lazy_import

# A request of at most this many bytes is small: an image to classify, a preprocessed 224 x 224
# tensor (602 KB); its bytes may use the room kept for small requests.
SMALL_REQUEST_BYTES = 1 << 20


class ByteBudget:
    """Request-body bytes held at once, in all and by each holder (a client address); used on
    the front's event loop only (no lock).

    Bodies of at most ``small_request`` bytes are small, the others large: large bytes may use
    ``limit - small_room`` in all and ``per_holder`` per holder; small bytes the whole ``limit``
    (each is one request the server is working on or about to: a client sending many at once
    loads the server, which it may, and HTTP's are cut at the body deadline).

    Args:
        limit: most bytes held at once in all.
        per_holder: most large bytes one holder may hold at once; default ``limit``.
        small_room: bytes only small requests may use.
        small_request: the largest small request.
    """

    def __init__(self, limit: int, per_holder: int | None = None, small_room: int = 0, small_request: int = SMALL_REQUEST_BYTES):
        self.limit, self.per_holder, self.used, self.small_request = limit, per_holder or limit, 0, small_request
        self.large_limit, self.large_used = limit - small_room, 0
        self._held: dict[tuple[object, bool], int] = {}

    def take(self, count: int, holder: object = None, large: bool = True) -> bool:
        """Count ``count`` more bytes of a large (or small) request in for ``holder``, unless that
        goes over a limit."""
        mine = self._held.get((holder, large), 0) + count
        if self.used + count > self.limit or (large and self.large_used + count > self.large_limit):
            return False
        if large and holder is not None and mine > self.per_holder:
            return False
        self.used += count
        self.large_used += count if large else 0
        self._held[holder, large] = mine
        return True

    def give(self, count: int, holder: object = None, large: bool = True) -> None:
        self.used -= count
        self.large_used -= count if large else 0
        left = self._held.pop((holder, large)) - count
        if left:
            self._held[holder, large] = left


class HeldBytes:
    """The bytes one request holds of a ``ByteBudget`` for its client, given back at once by
    ``release``; large unless its declared length is small."""

    def __init__(self, budget: ByteBudget, holder: object = None, declared: int | None = None):
        self.budget, self.holder, self.count = budget, holder, 0
        self.large = declared is None or declared > budget.small_request  # a chunked body's length is unknown

    def take(self, count: int) -> bool:
        if not self.budget.take(count, self.holder, self.large):
            return False
        self.count += count
        return True

    def release(self) -> None:
        if self.count:
            self.budget.give(self.count, self.holder, self.large)
        self.count = 0


# One client's share of the file descriptors the process may open: slow clients reconnecting as
# they are cut kept 10 of 12 valid probes out of a server at 256 descriptors (issue 52, item 8).
CLIENT_SHARE_OF_FILES = 8


def connection_cap(requested: int) -> int:
    """HTTP connections one client address may hold: ``requested``, and at most
    1/``CLIENT_SHARE_OF_FILES`` of the descriptors this process may open (its soft limit)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(1, min(requested, soft // CLIENT_SHARE_OF_FILES))


def client_address(peer: str | None) -> str:
    """The client's address of a peer as aiohttp (``"10.0.0.7"``) or grpc
    (``"ipv4:10.0.0.7:51234"``, ``"ipv6:[::1]:51234"``) gives it: its connections share one budget."""
    if not peer:
        return ""
    if peer.startswith(("ipv4:", "ipv6:")):
        host = peer[5:].rpartition(":")[0]
        return host.strip("[]")
    return peer


class ReceiveSlots:
    """Messages received at once, in all and by each holder (a connection), waited for in turn;
    used on the front's event loop only.

    Args:
        limit: most messages received at once in all.
        per_holder: most one holder receives at once.
    """

    def __init__(self, limit: int, per_holder: int = 1):
        self.limit, self.per_holder, self.used = max(1, limit), per_holder, 0
        self._held: dict[object, int] = {}
        self._waiters: list[asyncio.Future] = []

    async def take(self, holder: object) -> None:
        """Wait until ``holder`` may receive one more message, and count it in."""
        while self.used >= self.limit or self._held.get(holder, 0) >= self.per_holder:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.used += 1
        self._held[holder] = self._held.get(holder, 0) + 1

    def give(self, holder: object) -> None:
        self.used -= 1
        left = self._held.pop(holder) - 1
        if left:
            self._held[holder] = left
        for waiter in self._waiters:  # each checks again whether its turn came
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()


@functools.cache
def timed_server_class() -> type:
    """``TimedServer``: aiohttp's low-level server making ``TimedConnection`` handlers (classes
    made on first use: aiohttp is an optional extra, and every module imports without it)."""
    web = lazy_import("aiohttp.web")

    class TimedConnection(web.RequestHandler):
        """aiohttp's handler of one HTTP connection, which knows how long its request head takes.

        ``head_since`` is when the current request head began (None: no request is pending, or the
        front's handler has it); the front calls ``taken`` when its handler starts on a request,
        ``body_read`` once it has the body (bytes after that are the next request), ``answered``
        when it returns.
        """

        def __init__(self, manager, *, loop: asyncio.AbstractEventLoop, **kwargs):
            super().__init__(manager, loop=loop, **kwargs)
            self.clock, self.server = loop.time, manager
            self.head_since: float | None = None
            self.busy = self.reading_body = False
            self.client: str | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.head_since = self.clock()  # a new connection's first request is due now
            peer = transport.get_extra_info("peername")
            self.client = str(peer[0]) if peer else ""
            open_now = self.server.clients.get(self.client, 0) + 1
            self.server.clients[self.client] = open_now
            if self.server.max_connections_per_client and open_now > self.server.max_connections_per_client:
                transport.close()  # one client's connections never take every file descriptor

        def connection_lost(self, exc) -> None:
            if self.client is not None:
                left = self.server.clients.pop(self.client, 1) - 1
                if left:
                    self.server.clients[self.client] = left
                self.client = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if data and self.head_since is None and not (self.busy and self.reading_body):
                self.head_since = self.clock()
            super().data_received(data)

        def taken(self, has_body: bool) -> None:
            self.busy, self.reading_body, self.head_since = True, has_body, None

        def body_read(self) -> None:
            self.reading_body = False

        def answered(self) -> None:
            self.busy = self.reading_body = False

        def head_overdue(self, now: float, timeout_s: float) -> bool:
            return not self.busy and self.head_since is not None and now - self.head_since > timeout_s

    class TimedServer(web.Server):
        """aiohttp's low-level server, making ``TimedConnection`` handlers."""

        def __init__(self, handler, max_connections_per_client: int | None = None, **kwargs):
            super().__init__(handler, **kwargs)
            self._connection_kwargs = kwargs
            self.max_connections_per_client = max_connections_per_client
            self.clients: dict[str, int] = {}  # open connections by client address

        def __call__(self) -> TimedConnection:
            return TimedConnection(self, loop=asyncio.get_running_loop(), **self._connection_kwargs)

    return TimedServer


async def cut_slow_heads(servers: list, timeout_s: float) -> None:
    """Close, every fraction of ``timeout_s``, the connections whose request head is overdue;
    runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(min(0.5, timeout_s / 4))
        now = loop.time()
        for server in servers:
            for connection in list(server.connections):
                if connection.head_overdue(now, timeout_s):
                    connection.force_close()
