"""``deploykit serve-bench``: served vs in-process throughput and latency, measured the way
Triton's ``perf_analyzer`` and NVIDIA's AIPerf measure a server.

    run          the orchestration (``BenchOptions``, ``bench_serving``) and the served targets
    loadgen      closed loop (``Concurrency``) and open loop (``RequestRate``, ``send_times``)
    search       the largest load whose p99 stays within a limit
    triton_stats Triton's per-model statistics over a level
    clients      our gRPC and HTTP clients, ``perf_analyzer`` as a child process
    server       ``deploykit serve`` as a child process
    records      the typed results (``Level``, ``SideStats``, ``BenchReport``)
    aiperf       the results in AIPerf's ``profile_export_aiperf.json``/``.csv`` schema
    plot         throughput against p50/p99 (``--plot``)
"""

from deploykit.serve.bench.clients import perf_analyzer_level
from deploykit.serve.bench.records import BenchReport, Level, SideStats
from deploykit.serve.bench.run import BenchOptions, bench_serving
from deploykit.serve.bench.server import ServerProcess
from deploykit.serve.door import free_loopback_ports

__all__ = [
    "BenchOptions",
    "BenchReport",
    "Level",
    "ServerProcess",
    "SideStats",
    "bench_serving",
    "free_loopback_ports",
    "perf_analyzer_level",
]
