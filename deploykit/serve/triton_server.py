"""``deploykit serve``: the pipeline behind a real Triton Inference Server (via PyTriton).

Triton speaks the KServe v2 protocol over HTTP and gRPC, batches requests dynamically, answers
``/v2/health/{live,ready}`` and per-model readiness, and keeps statistics
(``/v2/models/<name>/stats``: inference count vs execution count shows how many requests each
batch merged). Models served from one export directory:

``logits_<res>`` (one per exported resolution, e.g. ``logits_224``, ``logits_384x256``)
    input ``images`` FP32 ``[B, 3, H, W]`` (preprocessed); outputs ``logits`` FP32
    ``[B, classes]``, ``classes`` INT64 ``[B, k]`` and ``scores`` FP32 ``[B, k]`` (softmax,
    best first). Dynamic batching merges the requests queued while the model is busy, up to
    ``max_batch_size``, and waits for none by default (``max_queue_delay_us`` 0: a request alone
    runs at once). One model instance per call the pipeline's runner runs at once (its inference
    streams, chosen by ``deploykit profile``), so that many batches run in parallel. Where the
    pipeline chose a CPU backend, the model is a Triton Python-backend model of our own
    (``triton_logits_model.py``): each instance is a stub process with its own runner of the
    same backend and graph, on its share of the cores, reading requests from Triton's shared
    memory; a request with NaN/Inf or out-of-range pixels is INVALID_ARGUMENT with one line.
    An engine (TensorRT, TensorRT-RTX) stays in this process, where its CUDA context and plugins
    live, bound to the pipeline's runner through PyTriton, whose proxy adds a hop into this
    process and back (``benchmarks/results/serve_overhead.json``).
``classify``
    input ``image`` BYTES ``[B, 1]`` (encoded PNG/JPEG/...); outputs ``classes``, ``scores``
    and ``resolution`` INT64 ``[B, 2]`` (where each image was routed). A Triton Python-backend
    model of our own (``triton_classify_model.py``, in Triton's stub processes): it checks each
    image's size from its header, decodes, routes and preprocesses with ``deploykit.inputs.imaging``
    (the pipeline's code), and sends each resolution's images to ``logits_<res>``, whose
    dynamic batcher merges them with other clients' tensors. Its own model because PyTriton
    (0.7, and its main branch) answers any exception of a bound function with HTTP 500 / gRPC
    INTERNAL and a Python traceback; a Python-backend model can say INVALID_ARGUMENT.

Triton rejects a wrong dtype, a wrong rank or a batch over ``max_batch_size`` before any model
runs; ``classify`` rejects non-image bytes and images over the limits with HTTP 400 / gRPC
INVALID_ARGUMENT and one line, per request (other clients' requests batched with it are
answered). The server keeps serving.

Startup: the host and ports are checked before anything starts (a taken port or an unusable
host is one error line); every model is written into Triton's repository before tritonserver
starts, and tritonserver opens its ports only once it has loaded them all, so
``/v2/health/ready`` never answers 200 while a model is still loading.

Clients never reach tritonserver itself: it listens on loopback ports of its own, and the
bounded front (``front.py``) listens on ``host`` and the three public ports once Triton is
ready, passing on only requests that ``requests.py`` checked (size, JSON depth, shapes, finite
values). Shutdown drains the front, then stops Triton; a tritonserver that dies on its own ends
``serve`` with a ``DeployKitError``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import shutil
import socket
import sysconfig
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deploykit import _nvml
from deploykit._lazy import lazy_import
from deploykit.answers import top_k
from deploykit.catalog import OUTPUT_NAME
from deploykit.errors import ConfigError, DeployKitError, InputError
from deploykit.inputs import imaging
from deploykit.inputs.resolutions import resolution_tag
from deploykit.serve import defaults
from deploykit.serve.classifier import INPUT_NAME, ImageLimits
from deploykit.serve.door import free_loopback_ports
from deploykit.serve.front import Front, FrontOptions
from deploykit.serve.pipeline import Pipeline
from deploykit.serve.triton_log import TritonLog
from deploykit.serve.triton_repo import copy_python_model

_log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
MAX_REQUEST_BYTES = defaults.MAX_REQUEST_BYTES

CLASSIFY_MODEL = "classify"
CLASSIFY_MODEL_SOURCE = Path(__file__).with_name("triton_classify_model.py")
LOGITS_MODEL_SOURCE = Path(__file__).with_name("triton_logits_model.py")


def logits_model_name(resolution: tuple[int, int]) -> str:
    """``(224, 224)`` → ``"logits_224"``."""
    return f"logits_{resolution_tag(resolution)}"


@dataclass(frozen=True)
class ServerOptions:
    """How ``deploykit serve`` runs Triton.

    Attributes:
        host: address every endpoint binds to (loopback by default: nothing is exposed).
        http_port, grpc_port, metrics_port: the three endpoints' ports.
        metrics_host: address the metrics port binds to; None: ``host`` (a deployment may expose
            inference and keep metrics on loopback, or the other way round).
        max_batch_size: largest batch one request may carry and one execution may merge.
        max_queue_delay_us: how long the dynamic batcher waits to fill a batch (microseconds).
        backend: pipeline backend (``"auto"``, ``"ort"``, ...).
        precision: the precision plan served (its graphs at every exported resolution); None: fp32,
            or on a CPU the plan ``deploykit profile`` chose (``Pipeline``).
        top_k: classes returned per image.
        exit_timeout_s: how long Triton waits for in-flight requests on shutdown.
        limits: the largest image ``classify`` decodes (pixels, encoded bytes).
        classify_instances: ``classify`` model instances (processes decoding in parallel).
        max_request_bytes: largest HTTP request body / gRPC message the front accepts.
        drain_timeout_s: at shutdown, how long requests in flight are waited for.
        header_timeout_s: longest an HTTP request head may take to arrive (the front cuts the
            connection after it); also the gRPC handshake's deadline.
        body_timeout_s: longest an HTTP request body may take to arrive (408, connection cut).
        verbosity: Triton's own log: -1 errors, 0 warnings and errors, 1 everything, 2 verbose.
        streams: inference streams of the CPU runners (``Pipeline``); None: what ``deploykit
            profile`` measured, else 1. Each ``logits_<res>`` model gets one instance per stream.
    """

    host: str = defaults.HOST
    http_port: int = defaults.HTTP_PORT
    grpc_port: int = defaults.GRPC_PORT
    metrics_port: int = defaults.METRICS_PORT
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    max_queue_delay_us: int = defaults.MAX_QUEUE_DELAY_US
    backend: str = defaults.BACKEND
    precision: str | None = None
    top_k: int = defaults.TOP_K
    exit_timeout_s: int = 5
    limits: ImageLimits = field(default_factory=ImageLimits)
    classify_instances: int = 2
    max_request_bytes: int = MAX_REQUEST_BYTES
    drain_timeout_s: float = defaults.DRAIN_TIMEOUT_S
    header_timeout_s: float = defaults.HEADER_TIMEOUT_S
    body_timeout_s: float = defaults.BODY_TIMEOUT_S
    verbosity: int = 0
    streams: int | None = None
    metrics_host: str | None = None

    @property
    def metrics_address(self) -> str:
        """Where the metrics port binds: ``metrics_host``, else ``host``."""
        return self.metrics_host or self.host

    def __post_init__(self) -> None:
        if min(self.max_batch_size, self.top_k, self.classify_instances, self.max_request_bytes) < 1 or self.max_queue_delay_us < 0:
            raise ConfigError(
                f"need max_batch_size >= 1, max_queue_delay_us >= 0, top_k >= 1, classify_instances >= 1, max_request_bytes >= 1; got "
                f"{self.max_batch_size}, {self.max_queue_delay_us}, {self.top_k}, {self.classify_instances}, {self.max_request_bytes}"
            )
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ConfigError(f"header_timeout_s and body_timeout_s must be > 0, got {self.header_timeout_s}, {self.body_timeout_s}")
        ports = (self.http_port, self.grpc_port, self.metrics_port)
        if len(set(ports)) != 3 or not all(0 < p < 65536 for p in ports):
            raise ConfigError(f"http, grpc and metrics ports must be three different ports in 1-65535, got {ports}")


@contextlib.contextmanager
def interpreter_libpython_first() -> Iterator[None]:
    """Put this interpreter's ``libpython`` first on ``LD_LIBRARY_PATH`` while Triton starts.

    Triton's Python backend runs each model in a stub process linked against
    ``libpython3.X.so``; the dynamic loader resolves it from the system directories, so a venv
    made from pyenv / conda / a self-built Python gets the distribution's libpython of another
    patch release, running this interpreter's standard library (seen here: Debian's 3.11.2 with
    pyenv's 3.11.7 stdlib fails in ``multiprocessing.resource_tracker``). PyTriton copies this
    process's environment into tritonserver's when it starts it, and the stubs inherit it; so
    the variable is set only for that start and restored afterwards. Evidence:
    triton-inference-server/python_backend README ("the stub dynamically links to a specific
    libpython"), NVIDIA/cudf-spark-examples#505 (the same fix for PyTriton).
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    library = sysconfig.get_config_var("LDLIBRARY") or ""
    if not (sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and (Path(libdir) / library).is_file()):
        yield  # a static interpreter: there is no libpython of ours to point at
        return
    before = os.environ.get("LD_LIBRARY_PATH")
    os.environ["LD_LIBRARY_PATH"] = libdir + (os.pathsep + before if before else "")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_LIBRARY_PATH", None)
        else:
            os.environ["LD_LIBRARY_PATH"] = before


def check_listen_addresses(options: ServerOptions) -> None:
    """Refuse, in one line and before anything starts, a host this machine cannot listen on or a
    port already taken (tritonserver would report it in its log and exit, after loading every model).

    Raises:
        ConfigError: the host does not resolve or is not local, or a port is in use.
    """
    endpoints = (("HTTP", options.host, options.http_port), ("gRPC", options.host, options.grpc_port))
    for label, host, port in (*endpoints, ("metrics", options.metrics_address, options.metrics_port)):
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except (socket.gaierror, UnicodeError) as err:
            raise ConfigError(f"cannot listen on host {host!r}: {getattr(err, 'strerror', None) or err}") from err
        with socket.socket(family, kind, proto) as probe:
            # SO_REUSEADDR: a port a previous server left in TIME_WAIT counts as free, a listening one does not
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as err:
                raise ConfigError(f"cannot listen on {host}:{port} ({label} port): {err.strerror or err}") from err


def _logits_fn(pipeline: Pipeline) -> Callable:
    """The function bound through PyTriton to ``logits_<res>`` where its runner stays in this process
    (an engine: ``runs_in_triton``): one batch merged from several requests.

    A request with NaN/Inf values, or values beyond ``±imaging.MAX_INPUT_MAGNITUDE``, gets NaN
    logits and scores and classes -1; the other requests of its batch get their answers. (The
    front refuses such requests with 400 before Triton; this is for a local process that reached
    Triton itself. Raising would answer every request of the batch with PyTriton's traceback and
    workspace paths: PyTriton has no error without one.)
    """
    batch = lazy_import("pytriton.decorators").batch

    @batch
    def infer(images: np.ndarray) -> dict[str, np.ndarray]:
        if len(images) == 0:
            raise InputError("empty batch: send at least one image")
        usable = (np.abs(images.reshape(len(images), -1)) <= imaging.MAX_INPUT_MAGNITUDE).all(axis=1)  # NaN compares False
        if usable.all():  # the common case: the answer is the runner's own array, no copy into another
            logits = pipeline.checked_logits(images)
        else:
            logits = np.full((len(images), pipeline.num_classes), np.nan, np.float32)
            if usable.any():
                logits[usable] = pipeline.checked_logits(images[usable])
        classes, scores = top_k(logits, pipeline.top_k)
        classes[~usable], scores[~usable] = -1, np.nan
        return {OUTPUT_NAME: logits, "classes": classes, "scores": scores}

    return infer


def runs_in_triton(pipeline: Pipeline, resolution: tuple[int, int]) -> bool:
    """Whether the runner of ``resolution`` runs in Triton's own Python backend (a CPU backend of the
    table: ``triton_logits_model.py``) rather than bound through PyTriton to this process (an engine,
    whose CUDA context and plugins live here, or a runner a caller made)."""
    from deploykit.runners.table import CPU, find

    found = find(pipeline.backends[resolution])
    return found is not None and found.device == CPU


def logits_config(pipeline: Pipeline, resolution: tuple[int, int], options: ServerOptions) -> str:
    """``config.pbtxt`` of a ``logits_<res>`` Python-backend model. A runner that spreads a batch over
    its streams (``Runner.spreads_batches``) gets one instance, a stub process running it with those
    streams, and every merged batch; any other gets one instance per call it runs at once, the cores
    split between them."""
    from deploykit.runners.streams import threads_per_stream

    k = min(options.top_k, pipeline.num_classes)
    runner = pipeline.served[resolution].runner
    streams = runner.parallel_calls if runner.spreads_batches else 1
    instances = 1 if runner.spreads_batches else runner.parallel_calls
    backend = pipeline.backends[resolution]
    settings = dict(
        backend=backend,
        graph=str(pipeline.served[resolution].graph.resolve()),
        streams=streams,
        threads=threads_per_stream(instances) if instances > 1 else 0,
        top_k=k,
        label=f"{backend} model at {resolution_tag(resolution)}",
    )
    return python_model_config(
        logits_model_name(resolution),
        options,
        [(INPUT_NAME, "TYPE_FP32", (pipeline.config.in_chans, *resolution))],
        [(OUTPUT_NAME, "TYPE_FP32", (pipeline.num_classes,)), ("classes", "TYPE_INT64", (k,)), ("scores", "TYPE_FP32", (k,))],
        instances,
        settings,
    )


def python_model_config(name: str, options: ServerOptions, inputs: list, outputs: list, instances: int, settings: dict) -> str:
    """``config.pbtxt`` of one of ``deploykit serve``'s Python-backend models: ``inputs`` and
    ``outputs`` as ``(name, data type, dims)``, ``instances`` stub processes on the CPU, the dynamic
    batcher's wait from ``options``, and ``settings`` travelling as one JSON parameter."""

    def tensors(specs: list) -> list[str]:
        return [f'{{ name: "{n}" data_type: {t} dims: [ {", ".join(str(d) for d in dims)} ] }}' for n, t, dims in specs]

    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: {options.max_batch_size}\n'
        f"input [ {', '.join(tensors(inputs))} ]\n"
        "output [\n" + ",\n".join(f"  {t}" for t in tensors(outputs)) + "\n]\n"
        f"instance_group [ {{ kind: KIND_CPU count: {instances} }} ]\n"
        f"dynamic_batching {{ max_queue_delay_microseconds: {options.max_queue_delay_us} }}\n"
        f'parameters [ {{ key: "settings" value: {{ string_value: {json.dumps(json.dumps(settings))} }} }} ]\n'
    )


def logits_models(triton, repository: Path, pipeline: Pipeline, options: ServerOptions) -> list[str]:
    """One ``logits_<res>`` model per resolution: written into Triton's model ``repository`` as a
    Python-backend model where its runner runs on the CPU (``runs_in_triton``), else bound to the
    pipeline through PyTriton's ``triton``. Returns their names."""
    names = []
    for res in pipeline.resolutions:
        name = logits_model_name(res)
        if runs_in_triton(pipeline, res):
            (repository / name / "1").mkdir(parents=True)
            (repository / name / "config.pbtxt").write_text(logits_config(pipeline, res, options))
            shutil.copyfile(LOGITS_MODEL_SOURCE, repository / name / "1" / "model.py")
        else:
            _bind_logits_model(triton, pipeline, res, options)
        names.append(name)
    return names


def _bind_logits_model(triton, pipeline: Pipeline, res: tuple[int, int], options: ServerOptions) -> None:
    mc = lazy_import("pytriton.model_config")
    k = min(options.top_k, pipeline.num_classes)
    triton.bind(
        model_name=logits_model_name(res),
        # one model instance per call the runner runs at once (its inference streams): PyTriton runs
        # a list of functions as instances in parallel, and the batcher hands each its own batch
        infer_func=[_logits_fn(pipeline) for _ in range(pipeline.parallel_calls(res))],
        inputs=[mc.Tensor(name=INPUT_NAME, dtype=np.float32, shape=(pipeline.config.in_chans, *res))],
        outputs=[
            mc.Tensor(name=OUTPUT_NAME, dtype=np.float32, shape=(pipeline.num_classes,)),
            mc.Tensor(name="classes", dtype=np.int64, shape=(k,)),
            mc.Tensor(name="scores", dtype=np.float32, shape=(k,)),
        ],
        config=mc.ModelConfig(
            max_batch_size=options.max_batch_size,
            batcher=mc.DynamicBatcher(max_queue_delay_microseconds=options.max_queue_delay_us),
        ),
        strict=True,
    )


def classify_config(pipeline: Pipeline, options: ServerOptions) -> str:
    """``config.pbtxt`` of the ``classify`` Python-backend model; its settings travel as one JSON parameter."""
    k = min(options.top_k, pipeline.num_classes)
    settings = dict(
        resolutions=[list(r) for r in pipeline.resolutions],
        models=[logits_model_name(r) for r in pipeline.resolutions],
        preprocessing=pipeline.config.preprocessing.to_dict(),
        max_pixels=options.limits.max_pixels,
        max_bytes=options.limits.max_bytes,
        max_side=options.limits.max_side,
        max_aspect=options.limits.max_aspect,
        max_request_pixels=options.limits.request_pixels,
        max_batch_size=options.max_batch_size,
    )
    return python_model_config(
        CLASSIFY_MODEL,
        options,
        [(imaging.ENCODED_INPUT, "TYPE_STRING", (1,))],
        [("classes", "TYPE_INT64", (k,)), ("scores", "TYPE_FP32", (k,)), ("resolution", "TYPE_INT64", (2,))],
        options.classify_instances,
        settings,
    )


def write_classify_model(repository: Path, pipeline: Pipeline, options: ServerOptions) -> str:
    """Write the ``classify`` model (config, ``model.py`` and the imaging module beside it) into a
    Triton model repository; return its name."""
    version = repository / CLASSIFY_MODEL / "1"
    version.mkdir(parents=True)
    (repository / CLASSIFY_MODEL / "config.pbtxt").write_text(classify_config(pipeline, options))
    copy_python_model(CLASSIFY_MODEL_SOURCE, version)
    return CLASSIFY_MODEL


def triton_config(options: ServerOptions, ports: tuple[int, int, int], log_file: Path | None = None):
    """PyTriton's ``TritonConfig``: every endpoint on a loopback port of its own (``ports``: HTTP,
    gRPC, metrics), for the front to forward to; Triton's log into ``log_file``."""
    triton = lazy_import("pytriton.triton")
    return triton.TritonConfig(
        http_address=LOOPBACK,
        http_port=ports[0],
        grpc_address=LOOPBACK,
        grpc_port=ports[1],
        metrics_address=LOOPBACK,
        metrics_port=ports[2],
        exit_timeout_secs=options.exit_timeout_s,
        log_file=log_file,
        log_verbose=1 if options.verbosity >= 2 else None,
        allow_gpu_metrics=_nvml.driver_version() is not None,  # without a driver Triton's NVML/DCGM start only fails, loudly
    )


def security_config():
    """Triton's endpoints behind PyTriton's random access token (Triton's restricted APIs: a
    request without the ``triton-access-token`` header is answered 403 / UNAVAILABLE before Triton
    parses it). The front adds the token to what it forwards. ``health`` stays open: PyTriton's
    own readiness check at start (``ModelClient.wait_for_model``, 0.7 and main) sends no token,
    and its endpoints read no body. The token is in tritonserver's command line, which local
    users can read (README: Serving)."""
    triton = lazy_import("pytriton.triton")
    return triton.TritonSecurityConfig(restricted_endpoints=sorted(triton.VALID_TRITON_ENDPOINTS - {"health"}))


def front_options(options: ServerOptions, internal: tuple[int, int, int], token: str) -> FrontOptions:
    """The front's options: the public ports and limits of ``options``, Triton's ``internal``
    ports (HTTP, gRPC, metrics) and its access token."""
    o = options
    return FrontOptions(
        o.host,
        o.http_port,
        o.grpc_port,
        o.metrics_port,
        *internal,
        max_request_bytes=o.max_request_bytes,
        drain_timeout_s=o.drain_timeout_s,
        header_timeout_s=o.header_timeout_s,
        body_timeout_s=o.body_timeout_s,
        max_inflight_bytes=defaults.IN_FLIGHT_BODIES * o.max_request_bytes,
        upstream_token=token,
        metrics_host=o.metrics_address,
    )


@dataclass(frozen=True)
class ServerReady:
    """What a started server serves, for the caller to print.

    Attributes:
        models: every model name.
        backends: ``Pipeline.describe_backends()``: what runs each resolution, what was skipped and why.
        http, grpc, metrics: the endpoints' ``host:port``.
    """

    models: list[str]
    backends: list[str]
    http: str
    grpc: str
    metrics: str


class TritonServer:
    """Triton serving one pipeline behind the bounded front; entering starts both and returns once
    every model is ready and the public ports listen.

    The models go into a PyTriton workspace's model store before tritonserver starts (PyTriton's
    "local model store" lifecycle), so tritonserver loads them all before it opens its ports;
    Triton listens on loopback ports of its own, and the front (``front.py``) opens the public
    ones after that.

    Args:
        pipeline: an open pipeline (its runners serve the ``logits_<res>`` models).
        options: ports, batching, limits.
    """

    def __init__(self, pipeline: Pipeline, options: ServerOptions = ServerOptions()):
        self.pipeline, self.options = pipeline, options
        self._triton = self._front = self._log = None

    def __enter__(self) -> TritonServer:
        pytriton = lazy_import("pytriton.triton")
        workspace = lazy_import("pytriton.utils.workspace").Workspace()
        check_listen_addresses(self.options)
        # Its own ports, none of the public ones: the front binds those only once Triton is ready.
        internal = tuple(free_loopback_ports(3, exclude=(self.options.http_port, self.options.grpc_port, self.options.metrics_port)))
        log_file = Path(workspace.path) / "tritonserver.log"
        self._log = TritonLog(log_file, self.options.verbosity, gpu=_nvml.driver_version() is not None)
        policy = pytriton.TritonLifecyclePolicy(launch_triton_on_startup=False, local_model_store=True)
        self._triton = pytriton.Triton(
            config=triton_config(self.options, internal, log_file),
            security_config=security_config(),
            workspace=workspace,
            triton_lifecycle_policy=policy,
        )
        try:
            names = logits_models(self._triton, workspace.model_store_path, self.pipeline, self.options)
            names.append(write_classify_model(workspace.model_store_path, self.pipeline, self.options))
            self._log.start()
            self._start()
            self._front = Front(front_options(self.options, internal, self._triton.get_access_token()))
            self._front.start()
        except BaseException:
            self.__exit__()
            raise
        o = self.options
        self.ready = ServerReady(
            names,
            self.pipeline.describe_backends(),
            f"{o.host}:{o.http_port}",
            f"{o.host}:{o.grpc_port}",
            f"{o.metrics_address}:{o.metrics_port}",
        )
        return self

    def _start(self) -> None:
        client_errors = lazy_import("pytriton.client.exceptions")
        try:
            with interpreter_libpython_first():
                # Launches tritonserver; the model stubs it starts inherit its environment.
                self._triton.run()
        except (TimeoutError, client_errors.PyTritonClientError) as err:
            raise DeployKitError(f"Triton did not become ready: {err}; its log above says why") from err
        if not self._triton.is_alive():
            raise DeployKitError("tritonserver exited while starting; its log above says why")

    def serve_forever(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set, then drain: stop taking requests and answer those in
        flight (at most ``drain_timeout_s``).

        Raises:
            DeployKitError: tritonserver (or the front) stopped on its own.
        """
        while not stop.wait(0.5):
            if not self._triton.is_alive():
                raise DeployKitError("the inference server (tritonserver) exited unexpectedly; its log above says why")
            if not self._front.alive:
                raise DeployKitError("the server's front stopped unexpectedly")
        left = self._front.drain()
        if left:
            _log.warning("%d requests still in flight after %g s were cut", left, self.options.drain_timeout_s)

    def __exit__(self, *exc) -> None:
        if self._front is not None:
            self._front.close()
        if self._triton is not None:
            self._triton.stop()
        if self._log is not None:
            self._log.stop()


def warn_if_exposed(host: str) -> None:
    """Log one warning when ``host`` is not a loopback address: nothing authenticates clients."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
        exposed = not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    except (OSError, ValueError):
        exposed = True
    if exposed:
        _log.warning(
            "serving on %s, beyond this machine, without authentication or TLS: anyone who reaches these ports can use the models; "
            "put an authenticating proxy in front (README: Serving)",
            host,
        )


def serve(
    export_dir: str | os.PathLike,
    options: ServerOptions = ServerOptions(),
    on_ready: Callable[[ServerReady], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve an export directory with Triton until ``stop`` is set, then drain and return.

    Args:
        export_dir: written by ``deploykit export``.
        options: ports, batching, backend, limits.
        on_ready: called once every model is loaded, with what is served.
        stop: set it (from a signal handler, another thread) to shut down gracefully; default:
            an event nothing sets, so only ``KeyboardInterrupt`` ends serving.

    Raises:
        MissingDependencyError: PyTriton is not installed (``pip install 'deploykit[serve]'``).
        ConfigError: the host or a port cannot be listened on.
        DeployKitError: the export directory cannot be served, or the inference server died.
    """
    check_listen_addresses(options)  # before anything loads: a taken port fails in a second
    lazy_import("pytriton.triton")  # a missing extra is said before the export is opened
    lazy_import("aiohttp.web")
    for host in dict.fromkeys((options.host, options.metrics_address)):
        warn_if_exposed(host)
    pipeline = Pipeline.for_server(export_dir, options)
    with pipeline, TritonServer(pipeline, options) as server:
        for res in pipeline.resolutions:
            if runs_in_triton(pipeline, res):  # its stubs loaded runners of their own
                pipeline.release(res)
        if on_ready:
            on_ready(server.ready)
        server.serve_forever(stop or threading.Event())
