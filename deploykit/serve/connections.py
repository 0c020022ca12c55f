"""What bounds the front's HTTP connections in time and memory (``front.py``).

* ``ByteBudget``: request-body bytes held at once, across every connection, and by any one
  connection (``per_holder``: an HTTP/1.1 connection holds one body at a time, but a gRPC
  connection multiplexes calls, so one client could otherwise hold the whole budget and leave
  everyone else 503). A body is counted as its bytes arrive, so a slow client holds only what it
  sent; one that would go over either limit is answered 503 with ``Retry-After``.
* ``ReceiveSlots``: gRPC messages being received at once, in all and by one connection. grpc
  buffers a message until it is whole and shows the front nothing before, so the bytes of an
  incomplete message cannot be counted as they arrive; instead grpc is asked for a call's message
  only once the call has a slot (until then the client can send no more than HTTP/2's initial
  stream window), and within the body deadline.
* ``TimedConnection``: aiohttp's connection handler, noting when the head of a request began
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


class ByteBudget:
    """Request-body bytes held at once, in all and by each holder (a connection); used on the
    front's event loop only (no lock).

    Args:
        limit: most bytes held at once in all.
        per_holder: most bytes one holder may hold at once; default ``limit``.
    """

    def __init__(self, limit: int, per_holder: int | None = None):
        self.limit, self.per_holder, self.used = limit, per_holder or limit, 0
        self._held: dict[object, int] = {}

    def take(self, count: int, holder: object = None) -> bool:
        """Count ``count`` more bytes in for ``holder``, unless that goes over either limit."""
        mine = self._held.get(holder, 0) + count
        if self.used + count > self.limit or (holder is not None and mine > self.per_holder):
            return False
        self.used += count
        if holder is not None:
            self._held[holder] = mine
        return True

    def give(self, count: int, holder: object = None) -> None:
        self.used -= count
        if holder is not None:
            left = self._held.pop(holder) - count
            if left:
                self._held[holder] = left


class HeldBytes:
    """The bytes one request holds of a ``ByteBudget``, given back at once by ``release``."""

    def __init__(self, budget: ByteBudget):
        self.budget, self.count = budget, 0

    def take(self, count: int) -> bool:
        if not self.budget.take(count):
            return False
        self.count += count
        return True

    def release(self) -> None:
        self.budget.give(self.count)
        self.count = 0


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
            self.clock = loop.time
            self.head_since: float | None = None
            self.busy = self.reading_body = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.head_since = self.clock()  # a new connection's first request is due now

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

        def __init__(self, handler, **kwargs):
            super().__init__(handler, **kwargs)
            self._connection_kwargs = kwargs

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
