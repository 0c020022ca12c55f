"""Scale-out on Ray Serve: the same ``Pipeline`` in replicas spread over a Ray cluster.

Entry points::

    deploykit serve DIR --ray --replicas 4                        # CLI, blocks until Ctrl-C
    serve.run(deploykit.serve.ray_serve.build_app(DIR, RayOptions(num_replicas=4)))   # Python

Each replica opens its own pipeline from ``export_dir``, which must therefore be readable at
the same path on every node (shared storage, or the directory copied to each node). Requests
are batched per replica by ``@serve.batch`` (``max_batch_size`` images, waiting at most
``batch_wait_timeout_s``). HTTP: ``POST /`` with encoded image bytes as the body, answered
with JSON; Python: ``handle.classify.remote(image)`` with anything ``Pipeline`` takes.
Every answer names the node and replica that computed it, so load spreading can be seen.

The pipeline is synchronous (decoding, ONNX Runtime / TensorRT calls), so a replica runs it in
a worker thread: the replica's event loop keeps accepting requests, forming the next batch and
answering other calls while a batch computes.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from deploykit._lazy import lazy_import
from deploykit.errors import ConfigError
from deploykit.export.directory import ExportDir
from deploykit.serve import defaults
from deploykit.serve.classifier import ImageLimits, read_image_config


@dataclass(frozen=True)
class RayOptions:
    """How the pipeline is deployed on Ray Serve.

    Attributes:
        num_replicas: pipeline copies (Ray places them over the cluster's nodes).
        max_batch_size: most requests one replica merges into one pipeline call.
        batch_wait_timeout_s: how long a replica waits to fill a batch.
        backend, top_k, precision: as in ``Pipeline``.
        ray_actor_options: per-replica resources (``{"num_cpus": 1}``, custom resources, ...).
        host, port: where Ray Serve's HTTP proxy listens.
        limits: the largest image a replica decodes (pixels, encoded bytes).
        streams: inference streams of each replica's CPU runners, as in ``Pipeline``.
    """

    num_replicas: int = defaults.RAY_REPLICAS
    # the same dynamic batching as Triton's (serve --ray passes these two on)
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    batch_wait_timeout_s: float = defaults.MAX_QUEUE_DELAY_US / 1e6
    backend: str = defaults.BACKEND
    top_k: int = defaults.TOP_K
    precision: str | None = None
    ray_actor_options: dict = field(default_factory=lambda: {"num_cpus": 1})
    host: str = defaults.HOST
    port: int = defaults.HTTP_PORT
    limits: ImageLimits = field(default_factory=ImageLimits)
    streams: int | None = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.max_batch_size < 1 or self.batch_wait_timeout_s < 0:
            raise ConfigError(
                f"need num_replicas >= 1, max_batch_size >= 1, batch_wait_timeout_s >= 0; got {self.num_replicas}, "
                f"{self.max_batch_size}, {self.batch_wait_timeout_s}"
            )


class PipelineReplica:
    """One replica: a ``Pipeline`` behind a per-replica dynamic batcher (``@serve.batch``)."""

    def __init__(self, export_dir: str, options: RayOptions):
        ray = lazy_import("ray")
        serve = lazy_import("ray.serve")
        from deploykit.serve.pipeline import Pipeline

        self.pipeline = Pipeline.for_server(export_dir, options)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._batched = serve.batch(max_batch_size=options.max_batch_size, batch_wait_timeout_s=options.batch_wait_timeout_s)(self._run)

    async def _run(self, images: list) -> list[dict]:
        # @serve.batch takes coroutines only; the synchronous pipeline runs in a worker thread
        predictions = await asyncio.to_thread(self.pipeline, images)
        return [
            {
                "classes": list(p.classes),
                "scores": list(p.scores),
                "resolution": list(p.resolution),
                "node_id": self.node_id,
                "replica": self.replica_id,
                "batch_size": len(images),
            }
            for p in predictions
        ]

    async def classify(self, image) -> dict:
        """One image (array, PIL image, bytes or path) → its prediction and where it ran."""
        from deploykit.serve.pipeline import decode_image

        decoded = await asyncio.to_thread(decode_image, image, self.pipeline.limits)  # here: a bad image fails alone
        return await self._batched(decoded)

    async def backends(self) -> list[str]:
        """``Pipeline.describe_backends()`` of this replica."""
        return self.pipeline.describe_backends()

    async def __call__(self, request) -> dict:
        """HTTP: the request body is one encoded image."""
        from deploykit.errors import InputError

        starlette = lazy_import("starlette.responses")
        try:
            return await self.classify(await request.body())
        except InputError as err:
            return starlette.JSONResponse({"error": str(err)}, status_code=400)


def build_app(export_dir: str | os.PathLike, options: RayOptions = RayOptions()):
    """The Ray Serve application (pass it to ``ray.serve.run``)."""
    serve = lazy_import("ray.serve")
    deployment = serve.deployment(
        PipelineReplica,
        name="deploykit",
        num_replicas=options.num_replicas,
        ray_actor_options=dict(options.ray_actor_options),
        # a replica must admit at least two batches' worth, or @serve.batch never fills a batch
        max_ongoing_requests=2 * options.max_batch_size,
    )
    return deployment.bind(str(os.path.abspath(export_dir)), options)


# Ray Serve's own settings, read by its controller from the environment of Ray's processes.
PROXY_CHECK_TIMEOUTS = ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S")
PROXY_CHECK_TIMEOUT_S = 120


def serve_ray(export_dir: str | os.PathLike, options: RayOptions = RayOptions(), address: str | None = None, on_ready=None) -> None:
    """Deploy on a Ray cluster (``address``; default: a local one) and block until interrupted.

    ``on_ready`` is called once the replicas run, with one replica's ``describe_backends()``.

    Raises:
        MissingDependencyError: Ray Serve is not installed (``pip install 'deploykit[ray]'``).
        DeployKitError: not an export directory of an image classifier (a sequence model's, say).
    """
    ray = lazy_import("ray")
    serve = lazy_import("ray.serve")
    # What the replicas would refuse one by one, inside Ray's logs: refused here, in one line.
    read_image_config(Path(export_dir), ExportDir(export_dir).manifest())
    if not address:
        # A local cluster's processes inherit this environment. Serve's proxy gets 5 s to report
        # ready (10 s for health checks); on a busy machine it misses that, and the controller
        # kills the proxy it is starting. A setting of the user's own wins.
        for key in PROXY_CHECK_TIMEOUTS:
            os.environ.setdefault(key, str(PROXY_CHECK_TIMEOUT_S))
    ray.init(address=address) if address else ray.init(include_dashboard=False)
    try:
        serve.start(http_options={"host": options.host, "port": options.port})
        handle = serve.run(build_app(export_dir, options), name="deploykit", route_prefix="/")
        if on_ready:
            on_ready(handle.backends.remote().result())
        threading.Event().wait()  # until KeyboardInterrupt / SIGTERM turned into one
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
