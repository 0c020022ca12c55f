"""The JSON file a benchmark writes: the command that made it, the CPU it ran on (captured before
the measurement: the load average at the start is part of it), what it measured, and how long that took."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from deploykit._io import write_json_atomic
from deploykit.backends.environment import capture_environment


def write_results(script: str, argv: list[str] | None, output_dir: Path, quick: bool, measured: Callable[[], dict]) -> Path:
    """Run ``measured`` (the result's own fields, records last) and write
    ``output_dir/<script's name>[-quick].json``, underscores as hyphens; returns its path."""
    name = Path(script).stem
    start = time.perf_counter()
    result = dict(
        command=f"python benchmarks/{name}.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv)),
        environment=capture_environment(torch.device("cpu")),
        **measured(),
        wall_s=None,
    )
    result["wall_s"] = round(time.perf_counter() - start)
    path = output_dir / f"{name.replace('_', '-')}{'-quick' if quick else ''}.json"
    write_json_atomic(path, result)
    print(f"wrote {path}")
    return path
