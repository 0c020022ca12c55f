"""Throughput mode on a CPU, chosen by measurement: how many inference streams ``deploykit serve``
runs each profiled plan with.

``deploykit profile EXPORT_DIR`` first chooses each resolution's plan by latency (``choice.py``).
For a chosen plan whose runner has streams (``STREAM_BACKENDS``: OpenVINO's ``THROUGHPUT`` hint,
ONNX Runtime's split sessions; ``deploykit.runners.streams``) it then measures the images per
second the plan answers when calls arrive concurrently, with one stream called by one thread (the
latency setting as served) and with ``machine_streams()`` streams called by as many threads, in
interleaved rounds. Streams are kept only when they answer at least ``GAIN_MARGIN`` times as many
images; the choice file records the count and the gain (``Choice.streams``, ``streams_gain``), and
``describe_backends`` states them.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from deploykit.errors import DeployKitError
from deploykit.export.directory import Choice, ExportDir
from deploykit.runners.streams import machine_streams
from deploykit.runners.table import stream_names

STREAM_BACKENDS = tuple(stream_names())  # the table's backends whose runners take streams
# Streams cost memory (a session or infer request each; ONNX Runtime's also keep a session of all
# the cores for a lone call) and, on OpenVINO, a lone call its share of the cores: kept only for a
# clear gain, beyond what a short timing on a busy machine gives by noise alone.
GAIN_MARGIN = 1.1
ROUND_S = 0.5  # per setting and round
ROUNDS = 2


def concurrent_throughput(runner, feed: dict[str, np.ndarray], concurrency: int, duration_s: float) -> float:
    """Images per second ``runner`` answers with ``concurrency`` threads each calling ``infer(feed)``
    back to back for ``duration_s`` (one untimed call per thread first)."""
    rows = len(next(iter(feed.values())))
    counts = [0] * concurrency
    window: list[float] = []  # [start, deadline], set as the last caller finishes warming up

    def open_window() -> None:
        now = time.perf_counter()
        window[:] = [now, now + duration_s]

    start = threading.Barrier(concurrency, action=open_window)

    def call(slot: int) -> None:
        runner.infer(feed)  # warm-up: first-call allocations
        start.wait()
        while time.perf_counter() < window[1]:
            runner.infer(feed)
            counts[slot] += 1

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) * rows / (time.perf_counter() - window[0])


def pick_streams(throughput: dict[int, float], margin: float = GAIN_MARGIN) -> tuple[int, float]:
    """``(streams, gain over one stream)``: the count with the most images per second, if that beats
    one stream's by ``margin``; else ``(1, 1.0)``."""
    best = max(throughput, key=throughput.__getitem__)
    gain = throughput[best] / throughput[1]
    return (best, gain) if best != 1 and gain >= margin else (1, 1.0)


def measure_streams(
    factory: Callable[..., object], graph: Path, batch: int, candidates: Sequence[int] = (), round_s: float = ROUND_S
) -> dict[int, float]:
    """Images per second of ``graph`` at ``batch`` per stream count (1 and ``candidates``, default
    ``machine_streams()``), each count called by as many threads as its runner runs calls at once.

    Args:
        factory: the backend's runner factory (``factory(graph, streams=n)``).
    """
    counts = sorted({1, *(candidates or (machine_streams(),))})
    runners = {n: factory(graph, streams=n) for n in counts}
    measured = dict.fromkeys(counts, 0.0)
    try:
        for runner in runners.values():
            runner.activate()
        feed = _feed(graph, batch)
        for _ in range(ROUNDS):  # interleaved: a load change hits every setting alike
            for n, runner in runners.items():
                measured[n] += concurrent_throughput(runner, feed, runner.parallel_calls, round_s) / ROUNDS
    finally:
        for runner in runners.values():
            if runner.is_active:
                runner.deactivate()
    return measured


def _feed(graph: Path, batch: int) -> dict[str, np.ndarray]:
    """Seeded inputs of ``batch`` rows for each input of ``graph`` (its batch dimension set, the
    others as declared): normalised-pixel-like values, or zeros for integer inputs."""
    import onnx

    rng = np.random.default_rng(0)
    feed = {}
    for value in onnx.load(str(graph), load_external_data=False).graph.input:
        tensor = value.type.tensor_type
        shape = [batch] + [d.dim_value or 1 for d in tensor.shape.dim[1:]]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        feed[value.name] = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype)
    return feed


def with_measured_streams(
    export_dir: str | os.PathLike, choices: dict[str, list[Choice]], progress: Callable[[str], None] | None = None, round_s: float = ROUND_S
) -> dict[str, list[Choice]]:
    """``choices`` (resolution tag → choices of ``export_dir``'s graphs, ``choice.chosen_plans``)
    with streams measured (module docstring) for each whose backend has them, and the verdict
    recorded in it.

    Raises:
        DeployKitError: a chosen graph is missing or changed.
    """
    from deploykit.backends.registry import create_runner
    from deploykit.inputs.resolutions import resolution_tag

    if not any(choice.backend in STREAM_BACKENDS for entries in choices.values() for choice in entries) or machine_streams() <= 1:
        return choices
    directory = ExportDir(export_dir)
    manifest = directory.manifest()
    graphs = {(resolution_tag(g.resolution), g.precision): g for g in manifest.graphs}
    measured_choices = {}
    for tag, entries in choices.items():
        measured_choices[tag] = []
        for choice in entries:
            if choice.backend in STREAM_BACKENDS:
                if (tag, choice.precision) not in graphs:
                    raise DeployKitError(f"{directory} holds no {choice.precision} graph at {tag}; run deploykit profile again")
                graph = directory.graph(graphs[tag, choice.precision], manifest.encoding)
                if progress:
                    progress(f"{choice.backend} {choice.precision} @ {tag} batch {choice.batch}: measuring inference streams")
                streams, gain = pick_streams(measure_streams(partial(create_runner, choice.backend), graph, choice.batch, round_s=round_s))
                choice = replace(choice, streams=streams, streams_gain=round(gain, 3))
            measured_choices[tag].append(choice)
    return measured_choices
