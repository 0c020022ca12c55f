"""The serving commands: ``serve`` (Triton or Ray Serve), ``serve-bench`` and ``package triton``.

Registered on the ``deploykit`` group by ``deploykit.cli``; parse options, call the serving
library, print through ``deploykit.cli.render``, as the other commands do.
"""

from __future__ import annotations

import click

from deploykit.cli import render
from deploykit.cli.options import (
    EXPORT_DIR,
    Command,
    Group,
    Resolution,
    batching_options,
    defaulted,
    image_limit_options,
    json_option,
    output_option,
    parse_counts,
    path_option,
    plugins_option,
    precision_option,
    verbosity,
)
from deploykit.serve import defaults as serve_defaults

__all__ = ["package", "serve", "serve_bench"]


streams_option = click.option(
    "--streams",
    type=click.IntRange(min=1),
    default=None,
    help="Inference streams of the CPU runners (ONNX Runtime, OpenVINO), each serving one request at a time in parallel; "
    "ONNX Runtime's also spread a merged batch and run a lone request on all cores "
    "[default: what deploykit profile measured for its choice, else 1].",
)


@click.command(cls=Command)
@EXPORT_DIR
@defaulted("--host", default=serve_defaults.HOST, help="Address every endpoint binds to (metrics: unless --metrics-host).")
@defaulted("--port", default=serve_defaults.HTTP_PORT, help="HTTP port (KServe v2).")
@defaulted("--grpc-port", default=serve_defaults.GRPC_PORT, help="gRPC port (KServe v2).")
@defaulted("--metrics-port", default=serve_defaults.METRICS_PORT, help="Prometheus metrics port.")
@click.option("--metrics-host", default=None, help="Address the metrics port binds to [default: --host].")
@batching_options("Largest batch per request and per merged execution.", "Dynamic batcher wait to fill a batch.")
@defaulted("--backend", "-b", default=serve_defaults.BACKEND, help="auto (TensorRT if usable, else ONNX Runtime) or a backend name.")
@precision_option(
    "Precision plan to serve: its graphs (or engines) at every resolution the export holds for it "
    "[default: fp32, or on a CPU the fastest validated plan deploykit profile chose for the directory]."
)
@defaulted("--top-k", default=serve_defaults.TOP_K, help="Classes returned per image.")
@streams_option
@image_limit_options
@defaulted(
    "--max-request-bytes",
    type=click.IntRange(min=1),
    default=serve_defaults.MAX_REQUEST_BYTES,
    help="Largest HTTP request body or gRPC message accepted (Triton behind it never sees a larger one).",
)
@defaulted(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=serve_defaults.DRAIN_TIMEOUT_S,
    help="On SIGTERM / Ctrl-C: seconds to answer the requests in flight before exiting.",
)
@click.option("--ray", "use_ray", is_flag=True, help="Serve on Ray Serve instead (HTTP on --host/--port; POST image bytes).")
@defaulted("--replicas", default=serve_defaults.RAY_REPLICAS, help="Ray Serve replicas (with --ray).")
@click.option("--ray-address", default=None, help="Existing Ray cluster to join (with --ray); default: start a local one.")
def serve(export_dir, max_image_pixels, max_image_bytes, use_ray, replicas, ray_address, **settings):
    """Serve an export directory with Triton Inference Server (KServe v2 over HTTP and gRPC), or Ray Serve."""
    from deploykit.serve.classifier import ImageLimits

    limits = ImageLimits(max_pixels=max_image_pixels, max_bytes=max_image_bytes)
    if use_ray:
        _serve_ray(export_dir, limits, replicas, ray_address, **settings)
    else:
        _serve_triton(export_dir, limits, **settings)


def _serve_ray(
    export_dir,
    limits,
    replicas,
    address,
    *,
    max_queue_delay_us,
    grpc_port,
    metrics_port,
    metrics_host,
    max_request_bytes,
    drain_timeout,
    **settings,
):
    """``serve --ray``: Ray Serve on ``--host``/``--port`` (the gRPC and metrics ports, the request
    size limit and the drain timeout are Triton's)."""
    from deploykit.serve.ray_serve import RayOptions, serve_ray
    from deploykit.serve.triton_server import warn_if_exposed

    warn_if_exposed(settings["host"])
    # host, port, max_batch_size, backend, precision, top_k: the same names
    options = RayOptions(num_replicas=replicas, batch_wait_timeout_s=max_queue_delay_us / 1e6, limits=limits, **settings)
    console = render.console()
    serve_ray(
        export_dir, options, address=address, on_ready=lambda backends: render.serving_on_ray(console, backends, options.host, options.port)
    )


def _serve_triton(export_dir, limits, *, port, drain_timeout, **settings):
    """``serve``: Triton until SIGTERM or Ctrl-C, which stop taking requests, answer those in flight, exit 0."""
    import signal
    import threading

    from deploykit.serve.triton_server import ServerOptions
    from deploykit.serve.triton_server import serve as run_server

    options = ServerOptions(http_port=port, drain_timeout_s=drain_timeout, limits=limits, verbosity=verbosity(), **settings)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    console = render.console()
    run_server(export_dir, options, on_ready=lambda ready: render.serving(console, ready), stop=stop)
    render.say(console, "stopped")


@click.command("serve-bench", cls=Command)
@EXPORT_DIR
@defaulted(
    "--concurrency",
    multiple=True,
    default=(",".join(map(str, serve_defaults.BENCH_CONCURRENCY)),),
    help="Closed-loop levels, comma-separated or repeated (not run by default when --rate is given).",
)
@click.option(
    "--rate", "rates", multiple=True, help="Open-loop levels in requests/s, comma-separated or repeated: sent on schedule, answered or not."
)
@defaulted(
    "--schedule",
    type=click.Choice(serve_defaults.BENCH_SCHEDULES),
    default=serve_defaults.BENCH_SCHEDULE,
    help="The open loop's send times.",
)
@defaulted("--seed", default=0, help="Seed of the Poisson schedule.")
@defaulted(
    "--max-outstanding",
    type=click.IntRange(min=1),
    default=serve_defaults.BENCH_MAX_OUTSTANDING,
    help="Open loop: most unanswered requests; one due beyond that is dropped and counted.",
)
@click.option(
    "--p99-ms",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Also search, per side, the largest rate (or concurrency without --rate) whose p99 stays within this many ms.",
)
@defaulted("--requests", default=serve_defaults.BENCH_REQUESTS, help="Requests per level and side.")
@click.option("--resolution", "-r", type=Resolution(), default=None, help="Exported resolution to load (default: the first).")
@defaulted("--backend", "-b", default=serve_defaults.BENCH_BACKEND, help="Backend of both sides.")
@batching_options("The server's dynamic batching limit.", "The server's dynamic batching wait.")
@defaulted(
    "--client",
    type=click.Choice(serve_defaults.BENCH_CLIENTS),
    default=serve_defaults.BENCH_CLIENT,
    help="Load generator of the served side: Triton's perf_analyzer when installed, else our own.",
)
@streams_option
@click.option("--ray", is_flag=True, help="Measure serve --ray (Ray Serve, one PNG per HTTP request) instead of Triton.")
@defaulted("--replicas", default=serve_defaults.RAY_REPLICAS, help="Ray Serve replicas (with --ray).")
@json_option()
@path_option("--aiperf", "aiperf_dir", default=None, help="Directory for AIPerf's profile_export_aiperf.json/.csv, per side and level.")
@path_option("--plot", "plot_path", default=None, help="Throughput against p50/p99 latency PNG (needs matplotlib).")
@click.pass_context
def serve_bench(ctx, export_dir, concurrency, rates, json_path, aiperf_dir, plot_path, **settings):
    """Served (Triton, dynamic batching, or Ray Serve) vs in-process throughput and p50/p99 latency
    per concurrency (closed loop) and per request rate (open loop)."""
    from click.core import ParameterSource

    from deploykit._io import check_file_destination
    from deploykit._lazy import lazy_import
    from deploykit.serve.bench import BenchOptions, bench_serving
    from deploykit.serve.bench.aiperf import check_aiperf_dir, write_aiperf
    from deploykit.serve.bench.plot import plot_bench

    console = render.console()
    for path in filter(None, (json_path, plot_path)):  # before the benchmark, not after it
        check_file_destination(path)
    if aiperf_dir:
        check_aiperf_dir(aiperf_dir)
    if plot_path:
        lazy_import("matplotlib")
    if rates and ctx.get_parameter_source("concurrency") is ParameterSource.DEFAULT:
        concurrency = ()
    options = BenchOptions(
        concurrency=tuple(parse_counts(concurrency, "concurrency")), rates=tuple(map(float, parse_counts(rates, "rate"))), **settings
    )
    with render.steps(console, "serve-bench") as step:
        report = bench_serving(export_dir, options, progress=step)
    render.bench(report)
    if json_path:
        render.wrote(console, report.write_json(json_path))
    if aiperf_dir:
        render.wrote(console, write_aiperf(report, aiperf_dir))
    if plot_path:
        render.wrote(console, plot_bench(report, plot_path))


@click.group(cls=Group)
def package():
    """Package an export directory for a serving system."""


@package.command("triton")
@EXPORT_DIR
@output_option("Model repository to create.")
@batching_options()
@defaulted(
    "--preferred-batch-size",
    "preferred_batch_sizes",
    type=int,
    multiple=True,
    default=serve_defaults.PREFERRED_BATCH_SIZES,
    help="Repeatable; also the CUDA-graph batch sizes.",
)
@defaulted("--gpu-instances", default=serve_defaults.GPU_INSTANCES, help="Instances per GPU of each inference model.")
@defaulted(
    "--onnx-kind",
    type=click.Choice(serve_defaults.ONNX_KINDS),
    default=serve_defaults.ONNX_KIND,
    help="Instance kind of the ONNX Runtime variant.",
)
@image_limit_options
@plugins_option("Repeatable: plugin libraries (.so) the TensorRT engines were built with.")
def package_triton(export_dir, output, max_image_pixels, max_image_bytes, plugin_specs, preferred_batch_sizes, **settings):
    """Write a Triton model repository: TensorRT, ONNX Runtime and OpenVINO models per resolution, preprocessing ensembles."""
    from deploykit.backends.plugins import Plugins
    from deploykit.serve.classifier import ImageLimits
    from deploykit.serve.triton_repo import RepositoryOptions
    from deploykit.serve.triton_repo import package_triton as write_repository

    options = RepositoryOptions(
        preferred_batch_sizes=tuple(preferred_batch_sizes),
        limits=ImageLimits(max_pixels=max_image_pixels, max_bytes=max_image_bytes),
        **settings,  # max_batch_size, max_queue_delay_us, gpu_instances, onnx_kind: the same names
    )
    render.repository(render.console(), write_repository(export_dir, output, options, Plugins.resolve(plugin_specs)))
