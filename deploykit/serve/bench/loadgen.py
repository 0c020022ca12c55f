"""Load generators, the two ways Triton's ``perf_analyzer`` and NVIDIA's AIPerf load a server:

closed loop (``Concurrency``)
    N requests in flight: each thread sends its next request when its last one is answered
    (``perf_analyzer --concurrency-range``). The server's speed sets the send rate.
open loop (``RequestRate``)
    Requests sent on a schedule, answered or not (``perf_analyzer --request-rate-range``,
    ``--request-distribution constant|poisson``; AIPerf ``--request-rate``, ``--arrival-pattern``):
    the schedule sets the send rate, so a server that falls behind shows it as queueing latency.
    At most ``max_outstanding`` requests wait for answers (a slow server cannot exhaust the
    client); a request due while that many are unanswered is dropped and counted.

Both time each request with ``perf_counter_ns`` from its send to its answer and call the same
``call(item)``, so the served and the in-process side are measured alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from deploykit.errors import ConfigError, unknown_choice
from deploykit.serve import defaults
from deploykit.serve.bench.records import LatencyMs, SideStats

SCHEDULES = defaults.BENCH_SCHEDULES
# A request sent this much after its scheduled time counts as late: the sleep of a loaded
# 2-core machine overshoots by up to a few hundred microseconds, which is noise, not lateness.
LATE_AFTER_S = 0.002


def send_times(rate_per_s: float, count: int, schedule: str = defaults.BENCH_SCHEDULE, seed: int = 0) -> np.ndarray:
    """When each of ``count`` requests is due, in seconds from the start (the first at 0).

    ``constant``: every ``1 / rate`` seconds. ``poisson``: exponential gaps of mean ``1 / rate``
    drawn from ``numpy.random.default_rng(seed)``, so a seed gives the same schedule every run.

    Raises:
        ConfigError: a rate that is not positive, or an unknown schedule.
    """
    if not rate_per_s > 0:
        raise ConfigError(f"a request rate must be positive, got {rate_per_s}")
    if schedule not in SCHEDULES:
        raise ConfigError(unknown_choice("schedule", schedule, SCHEDULES))
    if schedule == "constant":
        gaps = np.full(count, 1.0 / rate_per_s)
    else:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, count)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if count else np.zeros(0)


def closed_loop(call: Callable[[object], object], items: Sequence, concurrency: int, client: str) -> SideStats:
    """Send every item once from ``concurrency`` threads, each waiting for its answer."""
    latencies = [0] * len(items)

    def one(i: int) -> None:
        start = time.perf_counter_ns()
        call(items[i])
        latencies[i] = time.perf_counter_ns() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(items))))
    wall = time.perf_counter() - start
    return SideStats(LatencyMs.from_ns(latencies), len(items) / wall, client, sent=len(items))


def open_loop(call: Callable[[object], object], items: Sequence, due_s: np.ndarray, max_outstanding: int, client: str) -> SideStats:
    """Send item ``i`` at ``due_s[i]`` seconds from the start, answered or not; at most
    ``max_outstanding`` unanswered (a request due beyond that is dropped)."""
    slots = threading.BoundedSemaphore(max_outstanding)
    latencies: dict[int, int] = {}
    dropped = late = 0

    def one(i: int, sent_ns: int) -> None:
        try:
            call(items[i])
            latencies[i] = time.perf_counter_ns() - sent_ns
        finally:
            slots.release()

    futures = []
    with ThreadPoolExecutor(max_outstanding) as pool:
        start = time.perf_counter()
        for i, due in enumerate(due_s):
            wait = start + due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            elif -wait > LATE_AFTER_S:
                late += 1
            if not slots.acquire(blocking=False):
                dropped += 1
                continue
            futures.append(pool.submit(one, i, time.perf_counter_ns()))
    wall = time.perf_counter() - start
    for future in futures:
        future.result()  # a failed request fails the level, as in the closed loop
    done = list(latencies.values())
    return SideStats(LatencyMs.from_ns(done), len(done) / wall, client, sent=len(due_s) - dropped, dropped=dropped, late=late)


@dataclass(frozen=True)
class Concurrency:
    """Closed loop: ``requests_in_flight`` requests at once."""

    requests_in_flight: int
    kind = "concurrency"

    def __post_init__(self) -> None:
        if self.requests_in_flight < 1:
            raise ConfigError(f"need concurrency >= 1, got {self.requests_in_flight}")

    @property
    def value(self) -> int:
        return self.requests_in_flight

    def run(self, call: Callable[[object], object], items: Sequence, client: str) -> SideStats:
        return closed_loop(call, items, self.requests_in_flight, client)

    def warmup(self) -> Concurrency:
        return self

    def perf_analyzer_args(self) -> list[str]:
        return ["--concurrency-range", f"{self.requests_in_flight}:{self.requests_in_flight}"]

    def label(self) -> str:
        return f"concurrency {self.requests_in_flight:>3}"

    def run_label(self) -> str:
        return f"concurrency_{self.requests_in_flight}"

    def to_json(self) -> dict:
        return {"concurrency": self.requests_in_flight}


@dataclass(frozen=True)
class RequestRate:
    """Open loop: ``per_s`` requests per second on a ``schedule`` seeded by ``seed``."""

    per_s: float
    schedule: str = defaults.BENCH_SCHEDULE
    seed: int = 0
    max_outstanding: int = defaults.BENCH_MAX_OUTSTANDING
    kind = "rate"

    def __post_init__(self) -> None:
        send_times(self.per_s, 0, self.schedule)  # the rate and schedule checks
        if self.max_outstanding < 1:
            raise ConfigError(f"need max_outstanding >= 1, got {self.max_outstanding}")

    @property
    def value(self) -> float:
        return self.per_s

    def run(self, call: Callable[[object], object], items: Sequence, client: str) -> SideStats:
        return open_loop(call, items, send_times(self.per_s, len(items), self.schedule, self.seed), self.max_outstanding, client)

    def warmup(self) -> Concurrency:
        # connections and thread pools settle the same whatever the schedule: a few in flight
        return Concurrency(min(8, self.max_outstanding))

    def perf_analyzer_args(self) -> list[str]:
        return [
            "--request-rate-range",
            f"{self.per_s:g}:{self.per_s:g}",
            "--request-distribution",
            self.schedule,
            "--max-threads",
            str(self.max_outstanding),
        ]

    def label(self) -> str:
        return f"rate {self.per_s:>7.1f}/s"

    def run_label(self) -> str:
        return f"request_rate_{self.per_s:g}"

    def to_json(self) -> dict:
        return {"rate_rps": self.per_s, "schedule": self.schedule, "seed": self.seed, "max_outstanding": self.max_outstanding}
