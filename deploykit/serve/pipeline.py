"""The in-process pipeline: images in, top-k classes out.

``deploykit.load(DIR)`` reads an export directory and returns a ``Pipeline``: decode (numpy
array, PIL image, file path or encoded bytes) → pick the exported resolution → preprocess from
the model config (resize, centre crop, normalise) → batch → run → softmax + top-k.

Resolution routing rule: an image whose ``(height, width)`` equals an exported resolution goes
to that graph; any other image goes to the exported resolution nearest in log-scale,
``|log(h_r / h)| + |log(w_r / w)|``, ties broken towards the larger resolution (more detail).
Preprocessing then resizes and crops it to that resolution, exactly as for a matching image.

Backend selection: ``backend="auto"`` tries the runner factories in the order the table of
backends ranks them (``deploykit.runners.table.auto_order``: TensorRT, TensorRT-RTX, ONNX
Runtime), skipping any not registered, and keeps the first whose
runner activates; each skipped backend's reason is kept in ``Pipeline.skipped`` and
``Pipeline.describe_backends()`` says it in a few lines. An engine that was built but could not
run (no GPU, a stale fingerprint, a plugin that does not load) is also logged as a warning, so
falling back to ONNX Runtime is never silent. Engine runners load the installed plugin packages
an engine's fingerprint names (``--plugins sape2`` at build); ``plugins`` adds others (a plugin
library). Any other value names one backend from the mapping, with no fallback. On a CPU (no GPU
backend usable) and with no ``precision`` asked for, ``auto`` first takes the plan ``deploykit
profile EXPORT_DIR`` measured fastest among the validated ones for that resolution at the batch
nearest ``batch_size`` (``deploykit.profile.choice``: e.g. OpenVINO on the int8 graph), when its
graph is unchanged since, with the inference streams profile measured raising its throughput under
concurrent calls (``deploykit.profile.streams``); ``describe_backends`` says which it took and why.

Threads: a pipeline may be called from several threads (a server's model instances, Ray's
thread pool). A runner that does not declare itself ``thread_safe`` (an engine's execution
context and buffers) is used by one thread at a time, behind a lock of its own; a runner with
several streams runs as many calls at once (``parallel_calls``), which a server gives as many
model instances, unless it spreads one call's batch over its streams (``spreads_batches``: ONNX
Runtime), when a server gives it one instance and whole merged batches.

Limits: an image over ``ImageLimits`` (pixels, encoded bytes) or over the decode-work limits of
``deploykit.inputs.imaging`` (chunks, scans, frames) is refused before it is decoded; bytes that do not
decode are one ``InputError``, whatever Pillow raised. Inputs beyond ``±imaging.MAX_INPUT_MAGNITUDE``
are refused, and so is an answer holding NaN/Inf (never ranked).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from deploykit._lazy import lazy_import
from deploykit.answers import top_k, unranked
from deploykit.catalog import OUTPUT_NAME
from deploykit.errors import ConfigError, DeployKitError, InputError, one_line
from deploykit.export.directory import ExportDir
from deploykit.export.manifest import Manifest
from deploykit.inputs import imaging
from deploykit.inputs.imaging import nearest_resolution
from deploykit.inputs.resolutions import resolution_tag
from deploykit.runners.base import Runner
from deploykit.runners.table import auto_order, gpu_names
from deploykit.serve.classifier import INPUT_NAME, ImageLimits, read_image_config

_log = logging.getLogger(__name__)

ImageLike = np.ndarray | bytes | str | os.PathLike | Any  # Any: a PIL image (PIL is optional)
RunnerFactory = Callable[[Path], Runner]


@dataclass(frozen=True)
class Prediction:
    """Top-k classes of one image, best first.

    Attributes:
        classes: class indices.
        scores: softmax probabilities of those classes (computed in float64).
        resolution: the exported ``(height, width)`` the image was routed to.
    """

    classes: tuple[int, ...]
    scores: tuple[float, ...]
    resolution: tuple[int, int]


def decode_image(item: ImageLike, limits: ImageLimits = ImageLimits()) -> np.ndarray:
    """One image as ``[H, W, 3]`` uint8.

    Accepts a uint8 array (``[H, W]``, ``[H, W, 1|3|4]``), a PIL image, encoded image bytes
    (PNG, JPEG, WebP, BMP) or a file path. Encoded images are size-checked from their header first.

    Raises:
        InputError: anything else, bytes / a file that is not a readable image, or an image
            over ``limits``.
    """
    try:
        if isinstance(item, np.ndarray):
            array = _rgb_array(item)
            limits.check(*array.shape[:2])
            return array
        if isinstance(item, (bytes, bytearray, memoryview, str, os.PathLike)):
            lazy_import("PIL.Image")  # a missing Pillow is named with its extra
            data = bytes(item) if isinstance(item, (bytes, bytearray, memoryview)) else _read_file(item, limits.max_bytes)
            return limits.decode(data)
        if hasattr(item, "convert") and hasattr(item, "size"):  # a PIL image, without importing PIL for the check
            limits.check(item.size[1], item.size[0])
            return _pil_rgb(item)
    except imaging.ImageRejected as err:
        raise InputError(f"{item}: {err}" if isinstance(item, (str, os.PathLike)) else str(err)) from err
    raise InputError(f"unsupported image type {type(item).__name__}; expected a uint8 array, PIL image, bytes or path")


def _pil_rgb(image) -> np.ndarray:
    """A PIL image's pixels as RGB; an opened image decodes only here, and corrupt data raises
    Pillow's ``SyntaxError``, ``EOFError``, ... : those are the image's ``ImageRejected``."""
    try:
        return np.array(image.convert("RGB"))
    except Exception as err:
        raise imaging.ImageRejected(f"cannot decode image: {one_line(err, 200) or type(err).__name__}") from err


def _read_file(path: str | os.PathLike, max_bytes: int) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # one byte more than allowed is enough to refuse it
    except OSError as err:
        raise InputError(f"cannot read {path}: {err.strerror or err}") from err
    return data


def _rgb_array(array: np.ndarray) -> np.ndarray:
    if array.dtype != np.uint8:
        raise InputError(f"image arrays must be uint8 [H, W(, C)], got dtype {array.dtype}")
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=-1)
    if array.ndim != 3 or array.shape[-1] not in (3, 4) or 0 in array.shape:
        raise InputError(f"image arrays must be [H, W], [H, W, 1], [H, W, 3] or [H, W, 4], got shape {list(array.shape)}")
    array = array[..., :3]
    return array if array.flags.writeable else array.copy()  # torch warns on read-only arrays (e.g. from Ray)


def activate_runner(onnx_path: Path, backend: str, factories: Mapping[str, RunnerFactory]) -> tuple[str, Runner, dict[str, str]]:
    """Create and activate the runner for one graph.

    Args:
        onnx_path: the exported graph.
        backend: ``"auto"`` (module rule) or a key of ``factories``.
        factories: backend name → ``factory(onnx_path) -> Runner``.

    Returns:
        ``(backend name, active runner, {skipped backend: reason})``.

    Raises:
        ConfigError: ``backend`` is not ``"auto"`` and not in ``factories``.
        DeployKitError: no backend could be activated (every reason listed).
    """
    if backend == "auto":
        order = auto_order()
        candidates = [b for b in order if b in factories] + [b for b in factories if b not in order]
    else:
        from deploykit.backends.registry import check_backend

        candidates = [check_backend(backend, ["auto", *factories])]
    skipped: dict[str, str] = {}
    for name in candidates:
        try:
            runner = factories[name](onnx_path)
            runner.activate()
        except DeployKitError as err:  # missing package, no GPU, stale engine, unparsable graph...
            skipped[name] = str(err)
            if backend == "auto" and _engine_built(onnx_path, name):
                _log.warning("%s: the %s engine built for it was not used: %s", onnx_path.name, name, err)
            continue
        return name, runner, skipped
    reasons = "; ".join(f"{name}: {why}" for name, why in skipped.items())
    raise DeployKitError(f"no backend could run {onnx_path.name}: {reasons}")


def _engine_built(onnx_path: Path, backend: str) -> bool:
    from deploykit.backends.engine_cache import engine_paths
    from deploykit.runners.table import engine_flavours

    engines = engine_flavours()
    return backend in engines and engine_paths(onnx_path, engines[backend].module)[0].is_file()


@dataclass(frozen=True)
class Served:
    """What serves one exported resolution: the active runner, its backend, the graph it runs and
    its precision plan, the backends tried before it with why each was skipped, why this one was
    taken (a profile's choice, or why that choice was not), and the lock its calls take when it is
    not thread-safe."""

    backend: str
    runner: Runner
    graph: Path
    plan: str
    skipped: Mapping[str, str]
    why: str
    lock: contextlib.AbstractContextManager

    @classmethod
    def of(cls, backend: str, runner: Runner, graph: Path, plan: str, skipped: Mapping[str, str] | None = None, why: str = "") -> Served:
        lock = contextlib.nullcontext() if runner.thread_safe else threading.Lock()
        return cls(backend, runner, graph, plan, dict(skipped or {}), why, lock)


class Pipeline:
    """Images → top-k classes, over every resolution of an export directory.

    Args:
        export_dir: written by ``deploykit export``.
        precision: the plan served (``"fp32"``, ``"fp16"``, ``"int8"``, ...): its graphs at every
            fixed resolution the export holds for it. None: fp32, or on a CPU the plan ``deploykit
            profile`` chose (module docstring).
        backend: ``"auto"`` or a backend name (see the module docstring).
        top_k: classes returned per image.
        batch_size: most images per runner call.
        limits: the largest image (pixels, encoded bytes) accepted; larger ones are refused
            before decoding.
        factories: backend name → runner factory; default ``deploykit.backends.registry.create_runner``
            for every backend of the table that runs a graph or an engine.
        plugins: for the engine backends of the default factories, the plugins the engines were
            built with (``Plugins``); None: the installed plugin packages each engine names.
        streams: inference streams of the runners that have them (ONNX Runtime, OpenVINO:
            ``deploykit.runners.streams``); None: what ``deploykit profile`` measured for its
            choice, else 1.

    Raises:
        DeployKitError: not an export directory, a graph changed since export, or no backend runs.
    """

    @classmethod
    def for_server(cls, export_dir: str | os.PathLike, options) -> Pipeline:
        """The pipeline a serving front runs, from the fields its options share
        (``ServerOptions``, ``RayOptions``): precision, backend, top-k, batch size, image limits, streams."""
        return cls(
            export_dir,
            precision=options.precision,
            backend=options.backend,
            top_k=options.top_k,
            batch_size=options.max_batch_size,
            limits=options.limits,
            streams=options.streams,
        )

    def __init__(
        self,
        export_dir: str | os.PathLike,
        *,
        precision: str | None = None,
        backend: str = "auto",
        top_k: int = 5,
        batch_size: int = 8,
        limits: ImageLimits = ImageLimits(),
        factories: Mapping[str, RunnerFactory] | None = None,
        plugins=None,
        streams: int | None = None,
    ):
        from deploykit.backends.registry import create_runner
        from deploykit.export.precision import check_precision
        from deploykit.runners.streams import check_streams
        from deploykit.runners.table import ENGINE, GRAPH, names, stream_names

        if factories is None:
            factories = {name: partial(create_runner, name, plugins=plugins) for name in names((GRAPH, ENGINE))}
        if top_k < 1 or batch_size < 1:
            raise ConfigError(f"top_k and batch_size must be >= 1, got {top_k} and {batch_size}")
        self.streams = streams if streams is None else check_streams(streams)
        if streams is not None and streams > 1:
            streaming = stream_names()
            factories = {name: partial(f, streams=streams) if name in streaming else f for name, f in factories.items()}
        self.export_dir = Path(export_dir)
        self.top_k, self.batch_size, self.limits = top_k, batch_size, limits
        self.precision = check_precision(precision or "fp32").name
        manifest = ExportDir(self.export_dir).manifest()
        self.config = read_image_config(self.export_dir, manifest)
        entries = manifest.graphs_at(self.precision)
        self.served: dict[tuple[int, int], Served] = {}
        try:
            for entry in entries:
                res = tuple(entry.resolution)
                served, why_not = self._profiled_choice(manifest, res, backend, factories) if precision is None else (None, "")
                if served is None:
                    path = ExportDir(self.export_dir).graph(entry, manifest.encoding)
                    name, runner, skipped = activate_runner(path, backend, factories)
                    served = Served.of(name, runner, path, self.precision, skipped, why_not)
                self.served[res] = served
        except BaseException:
            self.close()
            raise
        if not self.served:
            raise DeployKitError(f"{self.export_dir} holds no exported graph; run deploykit export")

    def _profiled_choice(self, manifest: Manifest, res, backend: str, factories) -> tuple[Served | None, str]:
        """``(what serves res, "")`` from ``deploykit profile``'s choice for ``res``, when ``backend``
        is auto, no GPU backend is usable, the choice's graph is unchanged and its runner activates;
        else ``(None, why it was not taken)`` ("" when there is no choice to take)."""
        from deploykit.backends.registry import available_backends
        from deploykit.export.manifest import sha256_file
        from deploykit.profile.choice import read_choice

        tag = resolution_tag(res)
        try:
            choice = read_choice(self.export_dir, tag, self.batch_size) if backend == "auto" else None
        except DeployKitError as err:  # the choice is advice: serve without it, and say why
            return None, f"profiled choice not taken: {err}"
        if choice is None or choice.backend not in factories:
            return None, ""
        gpu = [b for b in available_backends() if b in gpu_names()]
        if gpu:
            return None, f"GPU backend {gpu[0]} usable: profiled CPU choice ({choice.backend} {choice.precision}) not taken"
        try:
            graph = ExportDir(self.export_dir).graph(manifest.graph(res, choice.precision), manifest.encoding)
            if sha256_file(graph) != choice.graph_sha256:
                raise DeployKitError(f"{graph.name} changed since deploykit profile chose it; profile again")
            # streams asked for, else only where profile measured them paying (``deploykit.profile.streams``)
            if self.streams is None and choice.streams > 1:
                runner = factories[choice.backend](graph, streams=choice.streams)
            else:
                runner = factories[choice.backend](graph)
            runner.activate()
        except DeployKitError as err:
            return None, f"profiled choice {choice.backend} {choice.precision} not taken: {err}"
        why = f"fastest validated plan at batch {choice.batch} in deploykit profile ({choice.p50_ms:.2f} ms p50)"
        if self.streams is None and choice.streams > 1:
            why += f"; its streams answered {choice.streams_gain:.2f}x one stream's images under concurrent calls"
        return Served.of(choice.backend, runner, graph, choice.precision, why=why), ""

    @property
    def resolutions(self) -> list[tuple[int, int]]:
        return sorted(self.served)

    @property
    def runners(self) -> dict[tuple[int, int], Runner]:
        return {res: served.runner for res, served in self.served.items()}

    @property
    def backends(self) -> dict[tuple[int, int], str]:
        """The backend serving each resolution."""
        return {res: served.backend for res, served in self.served.items()}

    @property
    def plans(self) -> dict[tuple[int, int], str]:
        """The precision plan each resolution runs (fp32 unless profiled faster, or asked for)."""
        return {res: served.plan for res, served in self.served.items()}

    @property
    def skipped(self) -> dict[tuple[int, int], dict[str, str]]:
        """Per resolution, the backends tried before the one serving it, and why each was skipped."""
        return {res: dict(served.skipped) for res, served in self.served.items()}

    @property
    def num_classes(self) -> int:
        return self.config.num_classes

    def describe_backends(self) -> list[str]:
        """What runs each resolution and why the backends before it were skipped, one line per
        distinct fact: ``backend ort at 32, 48`` then ``skipped trt at 32, 48: <reason>``."""
        chosen: dict[str, list[str]] = {}
        skipped: dict[tuple[str, str], list[str]] = {}
        for res in self.resolutions:
            served = self.served[res]
            plan = "" if served.plan == "fp32" else f" {served.plan}"
            if served.runner.parallel_calls > 1:
                plan += f" with {served.runner.parallel_calls} inference streams"
                plan += " (a lone call on all cores)" if served.runner.spreads_batches else ""
            why = f" ({served.why})" if served.why else ""
            chosen.setdefault(f"{served.backend}{plan}", []).append(resolution_tag(res) + why)
            for name, reason in served.skipped.items():
                skipped.setdefault((name, reason), []).append(resolution_tag(res))
        return [f"backend {name} at {', '.join(tags)}" for name, tags in chosen.items()] + [
            f"skipped {name} at {', '.join(tags)}: {why}" for (name, why), tags in skipped.items()
        ]

    def parallel_calls(self, resolution: tuple[int, int]) -> int:
        """How many calls the runner of ``resolution`` runs at once (its inference streams): what a
        server gives it in concurrent model instances."""
        return self.served[resolution].runner.parallel_calls

    def route(self, size: tuple[int, int]) -> tuple[int, int]:
        """The exported resolution for an image of ``(height, width)`` (module rule)."""
        return nearest_resolution(size, self.resolutions)

    def preprocess(self, image: np.ndarray, resolution: tuple[int, int]) -> np.ndarray:
        """``[H, W, 3]`` uint8 → ``[3, h, w]`` float32, preprocessed as the model's ``config.json`` says
        (``deploykit.inputs.imaging.Preprocessing``, what calibration and validation applied)."""
        return self.config.preprocessing(image, resolution)

    def logits(self, images: np.ndarray) -> np.ndarray:
        """Run preprocessed ``[B, 3, h, w]`` float32 images at an exported resolution.

        Raises:
            InputError: wrong dtype, rank, channel count, a resolution that was not exported, or
                values that are NaN/Inf or beyond ``±imaging.MAX_INPUT_MAGNITUDE`` (the logits
                would be NaN, and their ranking meaningless).
            DeployKitError: the model answered NaN/Inf for some image (a model fault: the answer
                is refused rather than ranked).
        """
        if images.dtype != np.float32 or images.ndim != 4 or images.shape[1] != self.config.in_chans:
            raise InputError(f"expected float32 [B, {self.config.in_chans}, H, W], got {images.dtype} {list(images.shape)}")
        unusable = imaging.unusable_values(images)
        if unusable:
            raise InputError(unusable)
        return self.checked_logits(images)

    def checked_logits(self, images: np.ndarray) -> np.ndarray:
        """``logits`` of a batch whose dtype, rank and values the caller has checked already (a
        server's batch function checks them per request)."""
        res = tuple(images.shape[-2:])
        served = self.served.get(res)
        if served is None:
            have = ", ".join(resolution_tag(r) for r in self.resolutions)
            raise InputError(f"no graph at {resolution_tag(res)} (exported: {have})")
        with served.lock:
            parts = [
                served.runner.infer({INPUT_NAME: images[i : i + self.batch_size]})[OUTPUT_NAME]
                for i in range(0, len(images), self.batch_size)
            ]
        if len(parts) == 1:  # one runner call: its array as it is, not a copy
            logits = parts[0]
        else:
            logits = np.concatenate(parts) if parts else np.zeros((0, self.num_classes), np.float32)
        fault = unranked(logits, f"{served.backend} model at {resolution_tag(res)}")
        if fault:
            raise DeployKitError(fault)
        return logits

    def __call__(self, images: ImageLike | Sequence[ImageLike]) -> Prediction | list[Prediction]:
        """Classify one image or a list of images (a ``[N, H, W, C]`` uint8 array is N images).

        Returns:
            One ``Prediction`` for a single image, else a list in input order.
        """
        single = not isinstance(images, (list, tuple)) and not (isinstance(images, np.ndarray) and images.ndim == 4)
        decoded = [decode_image(images, self.limits)] if single else [decode_image(item, self.limits) for item in images]
        routes = [self.route(img.shape[:2]) for img in decoded]
        predictions: list[Prediction | None] = [None] * len(decoded)
        for res in dict.fromkeys(routes):
            index = [i for i, r in enumerate(routes) if r == res]
            batch = np.stack([self.preprocess(decoded[i], res) for i in index])
            classes, scores = top_k(self.logits(batch), self.top_k)
            for row, i in enumerate(index):
                predictions[i] = Prediction(tuple(classes[row].tolist()), tuple(scores[row].tolist()), res)
        return predictions[0] if single else predictions

    def release(self, resolution: tuple[int, int]) -> None:
        """Deactivate the runner of ``resolution`` and keep what was chosen for it, for a process
        that hands the plan to others (``deploykit serve``: Triton's stub processes run runners of
        their own, and this one would only hold its memory). Calls at that resolution fail after."""
        runner = self.served[resolution].runner
        if runner.is_active:
            runner.deactivate()

    def close(self) -> None:
        """Deactivate every runner (idempotent)."""
        for served in self.served.values():
            if served.runner.is_active:
                served.runner.deactivate()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(export_dir: str | os.PathLike, **options) -> Pipeline:
    """Open an export directory as a ``Pipeline`` (``options`` as in ``Pipeline``)."""
    return Pipeline(export_dir, **options)
