"""The largest load whose p99 stays within a limit: ``perf_analyzer``'s ``--latency-threshold``
with ``--binary-search``, over any measure function (a request rate or a concurrency)."""

from __future__ import annotations

from collections.abc import Callable

from deploykit.errors import ConfigError
from deploykit.serve.bench.records import Probe, SearchResult

# Bisections after the two bounds: a rate range of 8x is then known to within about 6 %.
SEARCH_STEPS = 5


def largest_within(
    measure: Callable[[float], float], limit_ms: float, low: float, high: float, *, integer: bool, steps: int = SEARCH_STEPS
) -> SearchResult:
    """Bisect ``[low, high]`` for the largest load whose ``measure`` (its p99, ms) is ``<= limit_ms``.

    ``low`` is measured first (beyond the limit there: no answer), then ``high`` (within it: the
    answer), then at most ``steps`` midpoints, assuming p99 grows with load as
    ``perf_analyzer``'s binary search does. ``integer`` loads (concurrency) stop when the bounds
    are adjacent.

    Raises:
        ConfigError: ``low`` above ``high``, a bound below 1 for integer loads, or a limit that
            is not positive.
    """
    if not limit_ms > 0 or not 0 < low <= high or (integer and low < 1):
        raise ConfigError(f"need a positive p99 limit and 0 < low <= high, got {limit_ms} ms and [{low}, {high}]")
    probes: list[Probe] = []

    def within(value: float) -> bool:
        p99 = measure(value)
        probes.append(Probe(value, p99, p99 <= limit_ms))
        return probes[-1].within

    if not within(low):
        return SearchResult(limit_ms, None, tuple(probes))
    if high == low or within(high):
        return SearchResult(limit_ms, high, tuple(probes))
    good, bad = low, high
    for _ in range(steps):
        mid = (good + bad) // 2 if integer else (good + bad) / 2
        if mid <= good:
            break
        if within(mid):
            good = mid
        else:
            bad = mid
    return SearchResult(limit_ms, good, tuple(probes))
