"""Inference streams on a CPU: several calls of one graph running at once, each on a share of the cores.

A runner built with ``streams`` > 1 owns that many independent executors (OpenVINO infer requests
of a ``THROUGHPUT``-hinted compiled model, ONNX Runtime sessions with the cores split between
them) and hands each call the next free one (``ExecutorPool``), so concurrent callers (a server's
model instances, Ray's thread pool) run in parallel rather than queueing behind one executor. One
call alone then runs on its stream's share of the cores only: ``deploykit profile`` measures both
ways on the chosen plan and keeps streams only where they raise throughput (``deploykit.profile.streams``).
"""

from __future__ import annotations

import contextlib
import os
import queue
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

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
    """``streams`` if it is a stream count (>= 1); else a ``ConfigError``."""
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ConfigError(f"streams must be an integer >= 1, got {streams!r}")
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
