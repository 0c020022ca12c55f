"""Should a server's ONNX Runtime sessions spin-wait? ViT-Tiny/16 at batch 1 and 4 on ONNX Runtime
with its thread pool spinning (its default), spinning only while a run lasts
(``session.force_spinning_stop``) and never spinning (``session.intra_op.allow_spinning`` 0), alone
and beside other work on the same cores: a child process that, like a server's front and Triton's
hop, wakes for a burst of CPU work on each request (``--burst-ms`` busy every ``--period-ms``).
Interleaved rounds; the median latency of each variant and its ratio to spinning's, per setting.

    .venv/bin/python benchmarks/ort_spinning.py [--rounds 5] [--calls 20] [--depth 12]

Writes ``benchmarks/results/ort-spinning.json``. The answer decides what ``Pipeline.for_server``'s
``shared_cores`` asks of ONNX Runtime. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from results_file import write_results

from deploykit.backends.onnxrt import session_options
from deploykit.export import export
from deploykit.nn import create_model

RESULTS = Path(__file__).parent / "results"
VARIANTS = {
    "spinning": {},
    "spinning within a run": {"session.force_spinning_stop": "1"},
    "not spinning": {"session.intra_op.allow_spinning": "0"},
}


def _other_work(stop, burst_s: float, period_s: float) -> None:
    """Busy for ``burst_s`` at the start of every ``period_s``, asleep otherwise, until ``stop``."""
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < burst_s:
            pass
        stop.wait(max(0.0, period_s - (time.perf_counter() - start)))


def _session(graph: Path, entries: dict[str, str]):
    import onnxruntime as ort

    options = session_options()
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])


def _median_ms(session, x: np.ndarray, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        session.run(None, {"images": x})
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def measure(args) -> dict:
    torch.manual_seed(0)
    res = (args.resolution, args.resolution)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=args.depth, img_size=args.resolution).eval()
    settings = []
    with tempfile.TemporaryDirectory(prefix="ort_spinning_") as work:
        export(model, [res], Path(work) / "export")
        graph = Path(work) / "export" / f"model_{args.resolution}.onnx"
        sessions = {name: _session(graph, entries) for name, entries in VARIANTS.items()}
        for batch in args.batch:
            x = np.random.default_rng(0).standard_normal((batch, 3, *res), dtype=np.float32)
            for label, busy in (("alone", False), ("beside other work", True)):
                stop = multiprocessing.Event()
                other = multiprocessing.Process(target=_other_work, args=(stop, args.burst_ms / 1e3, args.period_ms / 1e3))
                if busy:
                    other.start()
                medians = {name: [] for name in sessions}
                try:
                    for session in sessions.values():
                        _median_ms(session, x, 3)  # warm-up
                    for _ in range(args.rounds):
                        for name, session in sessions.items():
                            medians[name].append(_median_ms(session, x, args.calls))
                finally:
                    stop.set()
                    if busy:
                        other.join()
                ms = {name: float(np.median(m)) for name, m in medians.items()}
                print(f"batch {batch}, {label}: " + ", ".join(f"{n} {v:.1f} ms ({v / ms['spinning']:.2f}x)" for n, v in ms.items()))
                settings.append(
                    dict(batch=batch, setting=label, median_ms=ms, over_spinning={n: v / ms["spinning"] for n, v in ms.items()})
                )
    return dict(
        model=f"vit_tiny_patch16 depth {args.depth}, ape, {args.resolution} px",
        other_work=f"a process busy {args.burst_ms} ms every {args.period_ms} ms",
        settings=settings,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="calls per variant and round")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--depth", type=int, default=12, help="ViT-Tiny/16 depth")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--burst-ms", type=float, default=2.0, help="the other work's burst per period")
    parser.add_argument("--period-ms", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="depth 2, 2 rounds of 5 calls: checks the script runs")
    args = parser.parse_args()
    if args.quick:
        args.depth, args.rounds, args.calls = 2, 2, 5
    write_results(__file__, None, RESULTS, args.quick, lambda: measure(args))


if __name__ == "__main__":
    main()
