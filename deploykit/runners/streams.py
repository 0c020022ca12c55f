"""Inference streams on a CPU: several calls of one graph running at once, each on a share of the cores.

A runner built with ``streams`` > 1 owns that many independent executors (OpenVINO infer requests
of a ``THROUGHPUT``-hinted compiled model, ONNX Runtime sessions with the cores split between
them) and hands each call the next free one (``ExecutorPool``), so concurrent callers (a server's
model instances, Ray's thread pool) run in parallel rather than queueing behind one executor. One
call alone then runs on its stream's share of the cores only: ``deploykit profile`` measures both
ways on the chosen plan and keeps streams only where they raise throughput (``deploykit.profile.streams``).

A runner that also owns a ``wide`` executor (all the cores: the latency setting) schedules its calls
with ``StreamScheduler``: a call that finds the runner idle keeps the whole machine, a single image
on the wide executor and a batch spread row by row over every stream, and only calls that arrive
beside others share the cores out. One request alone is then answered as fast as without streams,
and a batch merged by a server's dynamic batcher fills every core as concurrent callers would
(``benchmarks/results/stream-spread.json``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

import numpy as np

from deploykit.errors import ConfigError

T = TypeVar("T")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_streams() -> int:
    """The stream count throughput mode starts from: one per usable core, at most 8 (a ViT's
    GEMMs keep one core busy per stream; more streams only multiply the activations held)."""
    return max(1, min(8, usable_cores()))


def check_streams(streams: int) -> int:
    """``streams`` if it is a stream count, from 1 to one per usable core (each stream holds its
    own session and activations: 64 streams on 2 cores only multiply memory); else a ``ConfigError``."""
    cores = usable_cores()
    if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= cores:
        raise ConfigError(f"streams must be an integer from 1 to the {cores} usable cores, got {str(streams)[:40]}")
    return streams


def threads_per_stream(streams: int, cores: int | None = None) -> int:
    """The cores of this machine split evenly between ``streams`` (at least one each)."""
    return max(1, (cores or usable_cores()) // streams)


class ExecutorPool(Generic[T]):
    """Executors one call each at a time: ``with pool.take() as executor:`` waits for a free one.

    A pool of one is a lock; a pool of N lets N callers run at once.
    """

    def __init__(self, executors: Sequence[T]):
        if not executors:
            raise ValueError("an executor pool needs at least one executor")
        self.size = len(executors)
        self._free: queue.SimpleQueue[T] = queue.SimpleQueue()
        for executor in executors:
            self._free.put(executor)

    @contextlib.contextmanager
    def take(self) -> Iterator[T]:
        executor = self._free.get()
        try:
            yield executor
        finally:
            self._free.put(executor)


Feed = Mapping[str, np.ndarray]


def feed_rows(feed: Feed) -> int | None:
    """The batch every input of ``feed`` shares (its leading dimension), or None when they differ."""
    rows = {len(v) if np.ndim(v) else None for v in feed.values()}
    return rows.pop() if len(rows) == 1 else None


class StreamScheduler(Generic[T]):
    """Where each call of a runner with streams and a whole-machine executor runs (module docstring).

    * The runner idle, one row: the ``wide`` executor, all cores.
    * The runner idle, several rows: the rows beyond a multiple of the stream count on the wide
      executor first, then the rest spread over the streams, each taking the next row as it finishes
      one. One row at a time is the cheapest per image on one core; the whole rounds leave no stream
      idle while another runs an odd row (five rows on two streams would take three rows' time).
    * Beside other calls: the next free stream takes the whole feed.

    Args:
        wide: the executor of all cores.
        streams: one executor per stream (two or more).
        run: ``run(executor, feed)`` → output name → array, batch first.
    """

    def __init__(self, wide: T, streams: Sequence[T], run: Callable[[T, Feed], dict[str, np.ndarray]]):
        if len(streams) < 2:
            raise ValueError("a stream scheduler needs two or more streams")
        self.wide, self.pool, self.run = wide, ExecutorPool(streams), run
        self._running = 0
        self._lock = threading.Lock()
        # the streams but one spread a batch; the calling thread runs the last
        self._helpers = ThreadPoolExecutor(len(streams) - 1, thread_name_prefix="stream")

    def __call__(self, feed: Feed) -> dict[str, np.ndarray]:
        with self._lock:
            alone = self._running == 0
            self._running += 1
        try:
            rows = feed_rows(feed) if alone else None
            if rows == 1:
                return self.run(self.wide, feed)
            if rows is not None and rows > 1:
                return self._spread(feed, rows)
            with self.pool.take() as executor:
                return self.run(executor, feed)
        finally:
            with self._lock:
                self._running -= 1

    def _spread(self, feed: Feed, rows: int) -> dict[str, np.ndarray]:
        odd = rows % self.pool.size
        head = [self.run(self.wide, {name: value[:odd] for name, value in feed.items()})] if odd else []
        answers: list[dict[str, np.ndarray] | None] = [None] * rows  # by row; the streams fill rows odd and after
        next_row = iter(range(odd, rows))
        taking = threading.Lock()

        def take_row() -> int | None:
            with taking:
                return next(next_row, None)

        def work() -> None:
            with self.pool.take() as executor:
                while (i := take_row()) is not None:
                    answers[i] = self.run(executor, {name: value[i : i + 1] for name, value in feed.items()})

        helpers = [self._helpers.submit(work) for _ in range(min(self.pool.size, rows - odd) - 1)]
        try:
            work()
        finally:
            for helper in helpers:
                helper.result()  # the first failure of a row fails the call
        parts = head + answers[odd:]
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}

    def close(self) -> None:
        self._helpers.shutdown(wait=True)
