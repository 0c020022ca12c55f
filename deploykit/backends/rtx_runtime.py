"""TensorRT-RTX execution contexts: its runtime configuration (CUDA graphs) and its runtime cache.

TensorRT-RTX compiles an engine's kernels for the GPU when they first run ("by default compiles
GPU kernels during runtime"), so without a runtime cache every process compiles them again.
Its runtime cache holds them: created from the context's ``IRuntimeConfig``, filled while the
context runs, serialized to a file and deserialized by the next process, which TensorRT-RTX
checks against its own version, the GPU and the CUDA driver, refusing (``deserialize`` returns
False) a cache from elsewhere ("Working with Runtime Cache", TensorRT-RTX docs). ``RuntimeCache``
keeps it in one file beside the engine (``engine_cache.runtime_cache_path``), read when the
context is created and written atomically when the runner deactivates; one it refuses is
replaced by the kernels this process compiles.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from deploykit._io import atomic_path
from deploykit.errors import DeployKitError

_log = logging.getLogger(__name__)


class RuntimeCache:
    """TensorRT-RTX's runtime cache of one engine, kept in ``path``.

    Args:
        path: the cache file (need not exist).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.cache: Any = None  # the IRuntimeCache: outlives every context created with it

    def attach(self, config: Any) -> None:
        """Give ``config`` (an ``IRuntimeConfig``) the cache, holding what ``path`` holds when
        TensorRT-RTX accepts it.

        Raises:
            DeployKitError: TensorRT-RTX refuses to create or set the cache.
        """
        cache = config.create_runtime_cache()
        if cache is None:
            raise DeployKitError("TensorRT-RTX could not create a runtime cache (TensorRT's errors are in the debug log)")
        if self.path.is_file() and not cache.deserialize(self.path.read_bytes()):
            _log.info("%s is from another GPU, driver or TensorRT-RTX version: its kernels are compiled again and replace it", self.path)
        if not config.set_runtime_cache(cache):
            raise DeployKitError("TensorRT-RTX did not take the runtime cache (TensorRT's errors are in the debug log)")
        self.cache = cache

    def save(self) -> None:
        """Write the cache, with what this process compiled, atomically over ``path``. A cache that
        cannot be written (a read-only export directory, a full disk) is a warning, not a failure:
        the run it follows succeeded, and the next process only compiles the kernels again."""
        if self.cache is None:
            return
        data = bytes(self.cache.serialize())
        try:
            with atomic_path(self.path) as tmp:
                tmp.write_bytes(data)
        except (DeployKitError, OSError) as err:
            _log.warning("TensorRT-RTX's runtime cache was not saved (%s); the next run compiles the kernels again", err)


def rtx_context(engine: Any, trt: Any, cuda_graph: bool = False, cache: RuntimeCache | None = None) -> Any:
    """An execution context of a TensorRT-RTX engine, created from a runtime configuration: one
    that captures and replays a CUDA graph per input shape itself when ``cuda_graph``
    (``IRuntimeConfig.cuda_graph_strategy = WHOLE_GRAPH_CAPTURE``), and that keeps its compiled
    kernels in ``cache``.

    Raises:
        DeployKitError: TensorRT-RTX could not create the context.
    """
    config = engine.create_runtime_config()
    if cuda_graph:
        config.cuda_graph_strategy = trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
    if cache is not None:
        cache.attach(config)
    context = engine.create_execution_context(config)
    if not context:
        with_graphs = " with CUDA graphs" if cuda_graph else ""
        raise DeployKitError(f"TensorRT-RTX could not create an execution context{with_graphs} (TensorRT's errors are in the debug log)")
    return context
