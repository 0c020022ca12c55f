"""serve-bench's load generators: the open loop's schedule (a pure function of rate, count,
schedule and seed), that it sends on schedule whether or not answers came, that it bounds and
counts what it cannot send, and the p99 search over a stand-in measure function."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from deploykit.errors import ConfigError
from deploykit.serve.bench.loadgen import Concurrency, RequestRate, closed_loop, open_loop, send_times
from deploykit.serve.bench.records import LatencyMs
from deploykit.serve.bench.search import largest_within


def test_constant_schedule_sends_every_one_over_rate_from_zero():
    np.testing.assert_allclose(send_times(50, 5, "constant"), [0.0, 0.02, 0.04, 0.06, 0.08])


def test_poisson_schedule_is_fixed_by_its_seed_and_keeps_the_rate():
    times = send_times(200, 20_000, "poisson", seed=3)
    np.testing.assert_array_equal(times, send_times(200, 20_000, "poisson", seed=3))
    assert not np.array_equal(times, send_times(200, 20_000, "poisson", seed=4))
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps >= 0).all()
    assert np.mean(gaps) == pytest.approx(1 / 200, rel=0.03)  # exponential gaps: mean 1/rate ...
    assert np.std(gaps) == pytest.approx(1 / 200, rel=0.05)  # ... and standard deviation 1/rate


@pytest.mark.parametrize("rate, schedule", [(0, "poisson"), (-5, "constant"), (10, "bursty")])
def test_a_bad_rate_or_schedule_is_refused(rate, schedule):
    with pytest.raises(ConfigError):
        RequestRate(rate, schedule)


def test_open_loop_sends_on_schedule_while_earlier_requests_are_unanswered():
    """Five requests due 10 ms apart against a server that holds every answer until all five
    arrived: a closed loop of one would send the second only after the first answer."""
    arrived, all_sent = [], threading.Event()

    def held(item):
        arrived.append(time.perf_counter())
        if len(arrived) == 5:
            all_sent.set()
        assert all_sent.wait(5), "the open loop waited for an answer before sending on"

    due = send_times(100, 5, "constant")
    began = time.perf_counter()
    stats = open_loop(held, list(range(5)), due, max_outstanding=8, client="test")
    assert stats.sent == 5 and stats.requests == 5 and stats.dropped == 0
    # None before its time: the k-th arrival follows the k-th send, which is due[k] after a start later than `began`.
    assert all(at >= began + due_s for at, due_s in zip(sorted(arrived), due, strict=True))


def test_open_loop_bounds_unanswered_requests_and_counts_the_dropped():
    in_flight, most = [0], [0]
    lock = threading.Lock()

    def slow(item):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.3)  # far longer than the 20 ms schedule, so the third request finds both slots held
        with lock:
            in_flight[0] -= 1

    stats = open_loop(slow, list(range(20)), send_times(1000, 20, "constant"), max_outstanding=2, client="test")
    assert most[0] <= 2
    assert stats.dropped > 0 and stats.sent + stats.dropped == 20 and stats.requests == stats.sent


def test_open_loop_fails_the_level_when_a_request_fails():
    def failing(item):
        raise RuntimeError(f"request {item} failed")

    with pytest.raises(RuntimeError, match="failed"):
        open_loop(failing, [0, 1], send_times(1000, 2, "constant"), max_outstanding=2, client="test")


def test_closed_loop_keeps_exactly_its_concurrency_in_flight():
    in_flight, seen = [0], set()
    lock = threading.Lock()

    def call(item):
        with lock:
            in_flight[0] += 1
            seen.add(in_flight[0])
        time.sleep(0.01)
        with lock:
            in_flight[0] -= 1

    stats = closed_loop(call, list(range(12)), 3, "test")
    assert max(seen) == 3 and stats.requests == 12 and stats.throughput_rps > 0


def test_latency_distribution_is_numpys_in_milliseconds():
    samples_ns = np.random.default_rng(1).integers(1_000_000, 9_000_000, 101)
    ms = samples_ns / 1e6
    dist = LatencyMs.from_ns(samples_ns)
    assert dist.count == 101 and dist.sum == pytest.approx(ms.sum()) and dist.std == pytest.approx(np.std(ms, ddof=1))
    for p in (1, 5, 10, 25, 50, 75, 90, 95, 99):
        assert getattr(dist, f"p{p}") == pytest.approx(np.percentile(ms, p))


def test_each_load_names_itself_for_perf_analyzer():
    assert Concurrency(8).perf_analyzer_args() == ["--concurrency-range", "8:8"]
    args = RequestRate(50, "constant", max_outstanding=16).perf_analyzer_args()
    assert args == ["--request-rate-range", "50:50", "--request-distribution", "constant", "--max-threads", "16"]


def test_p99_search_bisects_to_the_largest_rate_within_the_limit():
    """p99 = 0.5 ms per request/s: within 30 ms up to 60 requests/s."""
    result = largest_within(lambda rate: 0.5 * rate, 30.0, 10, 100, integer=False, steps=6)
    assert 60 - 90 / 2**6 <= result.best <= 60
    assert all(p.within == (p.value <= 60) for p in result.probes)
    assert [p.value for p in result.probes[:2]] == [10, 100]  # both bounds first, as perf_analyzer's binary search


def test_p99_search_over_concurrency_stops_at_adjacent_integers():
    result = largest_within(lambda c: 2.0 * c, 21.0, 1, 32, integer=True)
    assert result.best == 10 and all(isinstance(p.value, int) for p in result.probes)


def test_p99_search_answers_none_below_the_lowest_and_the_highest_when_all_is_within():
    assert largest_within(lambda c: 50.0, 10.0, 1, 8, integer=True).best is None
    everything = largest_within(lambda c: 1.0, 10.0, 1, 8, integer=True)
    assert everything.best == 8 and len(everything.probes) == 2
    with pytest.raises(ConfigError):
        largest_within(lambda c: 1.0, 10.0, 8, 1, integer=True)
