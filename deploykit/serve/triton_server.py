"""``deploykit serve``: the pipeline behind a real Triton Inference Server (via PyTriton).

Triton speaks the KServe v2 protocol over HTTP and gRPC, batches requests dynamically, answers
``/v2/health/{live,ready}`` and per-model readiness, and keeps statistics
(``/v2/models/<name>/stats``: inference count vs execution count shows how many requests each
batch merged). Models served from one export directory:

``logits_<res>`` (one per exported resolution, e.g. ``logits_224``, ``logits_384x256``)
    input ``images`` FP32 ``[B, 3, H, W]`` (preprocessed); outputs ``logits`` FP32
    ``[B, classes]``, ``classes`` INT64 ``[B, k]`` and ``scores`` FP32 ``[B, k]`` (softmax,
    best first). Dynamic batching merges concurrent requests up to ``max_batch_size``.
``classify``
    input ``image`` BYTES ``[B, 1]`` (encoded PNG/JPEG/...); outputs ``classes``, ``scores``
    and ``resolution`` INT64 ``[B, 2]`` (where the pipeline routed each image). Not dynamically
    batched: PyTriton answers a merged batch with one error for all of it, so one client's
    undecodable bytes would fail other clients' requests.

Triton itself rejects a wrong dtype, a wrong rank or a batch over ``max_batch_size`` before the
model runs; the pipeline rejects an empty batch and non-image bytes. Either way the client gets
a KServe v2 error (HTTP 4xx/5xx with an ``error`` body, or a gRPC error status) and the server
keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deploykit._lazy import lazy_import
from deploykit.errors import ConfigError, InputError
from deploykit.export.onnx_export import resolution_tag
from deploykit.serve.pipeline import Pipeline, decode_image, top_k

CLASSIFY_MODEL = "classify"
_log = logging.getLogger(__name__)


def logits_model_name(resolution: tuple[int, int]) -> str:
    """``(224, 224)`` → ``"logits_224"``."""
    return f"logits_{resolution_tag(resolution)}"


@dataclass(frozen=True)
class ServerOptions:
    """How ``deploykit serve`` runs Triton.

    Attributes:
        host: address every endpoint binds to (loopback by default: nothing is exposed).
        http_port, grpc_port, metrics_port: the three endpoints' ports.
        max_batch_size: largest batch one request may carry and one execution may merge.
        max_queue_delay_us: how long the dynamic batcher waits to fill a batch (microseconds).
        backend: pipeline backend (``"auto"``, ``"ort"``, ...).
        top_k: classes returned per image.
        exit_timeout_s: how long Triton waits for in-flight requests on shutdown.
    """

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    max_batch_size: int = 32
    max_queue_delay_us: int = 2000
    backend: str = "auto"
    top_k: int = 5
    exit_timeout_s: int = 5

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_queue_delay_us < 0 or self.top_k < 1:
            raise ConfigError(
                f"need max_batch_size >= 1, max_queue_delay_us >= 0, top_k >= 1; got {self.max_batch_size}, "
                f"{self.max_queue_delay_us}, {self.top_k}"
            )
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


def _logits_fn(pipeline: Pipeline) -> Callable:
    batch = lazy_import("pytriton.decorators").batch

    @batch
    def infer(images: np.ndarray) -> dict[str, np.ndarray]:
        if len(images) == 0:
            raise InputError("empty batch: send at least one image")
        logits = pipeline.logits(images)
        classes, scores = top_k(logits, pipeline.top_k)
        return {"logits": logits, "classes": classes, "scores": scores}

    return infer


def _classify_fn(pipeline: Pipeline) -> Callable:
    batch = lazy_import("pytriton.decorators").batch

    @batch
    def infer(image: np.ndarray) -> dict[str, np.ndarray]:
        items = image.reshape(-1)
        if len(items) == 0:
            raise InputError("empty batch: send at least one image")
        predictions = pipeline([decode_image(bytes(item)) for item in items])
        return {
            "classes": np.array([p.classes for p in predictions], np.int64),
            "scores": np.array([p.scores for p in predictions], np.float32),
            "resolution": np.array([p.resolution for p in predictions], np.int64),
        }

    return infer


def bind_models(triton, pipeline: Pipeline, options: ServerOptions) -> list[str]:
    """Bind the ``logits_<res>`` models and ``classify`` to a PyTriton ``Triton``; return their names."""
    mc = lazy_import("pytriton.model_config")
    k = min(options.top_k, pipeline.num_classes)
    topk_outputs = [mc.Tensor(name="classes", dtype=np.int64, shape=(k,)), mc.Tensor(name="scores", dtype=np.float32, shape=(k,))]
    names = []
    for res in pipeline.resolutions:
        name = logits_model_name(res)
        triton.bind(
            model_name=name,
            infer_func=_logits_fn(pipeline),
            inputs=[mc.Tensor(name="images", dtype=np.float32, shape=(pipeline.config.in_chans, *res))],
            outputs=[mc.Tensor(name="logits", dtype=np.float32, shape=(pipeline.num_classes,)), *topk_outputs],
            config=mc.ModelConfig(
                max_batch_size=options.max_batch_size,
                batcher=mc.DynamicBatcher(max_queue_delay_microseconds=options.max_queue_delay_us),
            ),
            strict=True,
        )
        names.append(name)
    triton.bind(
        model_name=CLASSIFY_MODEL,
        infer_func=_classify_fn(pipeline),
        inputs=[mc.Tensor(name="image", dtype=bytes, shape=(1,))],
        outputs=[*topk_outputs, mc.Tensor(name="resolution", dtype=np.int64, shape=(2,))],
        config=mc.ModelConfig(max_batch_size=options.max_batch_size, batcher=None),
        strict=True,
    )
    return [*names, CLASSIFY_MODEL]


def triton_config(options: ServerOptions):
    """PyTriton's ``TritonConfig``: every endpoint on ``options.host``."""
    triton = lazy_import("pytriton.triton")
    return triton.TritonConfig(
        http_address=options.host,
        http_port=options.http_port,
        grpc_address=options.host,
        grpc_port=options.grpc_port,
        metrics_address=options.host,
        metrics_port=options.metrics_port,
        exit_timeout_secs=options.exit_timeout_s,
    )


def security_config():
    """PyTriton's defaults, less ``statistics``: read-only counters any client may see. Model
    control, shared memory, tracing and logging stay behind PyTriton's random access token."""
    triton = lazy_import("pytriton.triton")
    restricted = [e for e in triton.DEFAULT_PROTECTED_ENDPOINTS if e != "statistics"]
    return triton.TritonSecurityConfig(restricted_endpoints=restricted)


def serve(export_dir: str | os.PathLike, options: ServerOptions = ServerOptions(), on_ready: Callable[[list[str]], None] | None = None) -> None:
    """Serve an export directory with Triton until interrupted (SIGINT / ``KeyboardInterrupt``).

    Args:
        export_dir: written by ``deploykit export``.
        options: ports, batching, backend.
        on_ready: called with the model names once every model is loaded.

    Raises:
        MissingDependencyError: PyTriton is not installed (``pip install 'deploykit[serve]'``).
        DeployKitError: the export directory cannot be served.
    """
    pytriton = lazy_import("pytriton.triton")
    with contextlib.ExitStack() as stack:
        pipeline = stack.enter_context(Pipeline(export_dir, backend=options.backend, top_k=options.top_k, batch_size=options.max_batch_size))
        with interpreter_libpython_first():
            # Entering launches tritonserver; the model stubs it starts later inherit its environment.
            triton = stack.enter_context(pytriton.Triton(config=triton_config(options), security_config=security_config()))
        names = bind_models(triton, pipeline, options)
        if on_ready:
            on_ready(names)
        triton.serve()  # returns on SIGINT, or when tritonserver dies; exiting the stack stops it
