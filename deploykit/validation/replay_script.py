"""Replay a ``deploykit validate --bundle`` check with numpy and ONNX Runtime alone.

``deploykit validate --bundle DIR`` copies this file into ``DIR`` as ``replay_ort.py``; it must
run on a host with no deploykit, so it imports nothing from deploykit (``tests/test_validate_bundle.py``
runs it in an interpreter that cannot import deploykit). It reads ``bundle.json``, runs each
graph on its saved inputs and judges the outputs against the float64 PyTorch reference with the
tolerance deploykit used: max abs error, worst and mean per-row cosine, NaN/Inf. When a check
fails and the bundle holds block activations, the graph with its block outputs marked is run
and the first block whose output leaves the tolerance is named (errors relative to
max(1, max |reference|), as deploykit judges blocks).

Usage: ``python replay_ort.py [BUNDLE_DIR]`` (default: the script's directory); exit 0 when
every check passes, 1 otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def row_cosines(reference, actual):
    """Cosine of each row ``[rows, last dim]``: 1 where both rows are zero, 0 where one is."""
    norm_r, norm_a = np.linalg.norm(reference, axis=1), np.linalg.norm(actual, axis=1)
    both_zero = (norm_r == 0) & (norm_a == 0)
    return np.where(both_zero, 1.0, (reference * actual).sum(1) / np.maximum(norm_r * norm_a, 1e-300))


def judge(reference, actual, tolerance, scale=1.0):
    """``(failures, metrics)`` of ``actual`` against ``reference`` (errors divided by ``scale``)."""
    ref = reference.astype(np.float64).reshape(-1, reference.shape[-1])
    act = actual.astype(np.float64).reshape(-1, actual.shape[-1])
    nonfinite = int((~np.isfinite(act)).sum())
    max_abs = float(np.abs(np.nan_to_num(act, nan=np.inf) - ref).max()) / scale
    cosines = np.where(np.isfinite(act).all(1), row_cosines(ref, np.nan_to_num(act)), np.nan)
    metrics = {"max_abs": max_abs, "cosine": float(np.min(cosines)), "mean_cosine": float(np.mean(cosines)), "nan_inf": nonfinite}
    failures = []
    if nonfinite:
        failures.append(f"{nonfinite} NaN/Inf")
    if tolerance["max_abs"] is not None and not max_abs <= tolerance["max_abs"]:
        failures.append(f"max abs {max_abs:.3g} > {tolerance['max_abs']:.3g}")
    if not metrics["cosine"] >= tolerance["min_cosine"]:
        failures.append(f"cosine {metrics['cosine']:.6f} < {tolerance['min_cosine']}")
    if not metrics["mean_cosine"] >= tolerance["min_mean_cosine"]:
        failures.append(f"mean cosine {metrics['mean_cosine']:.6f} < {tolerance['min_mean_cosine']}")
    return failures, metrics


def run(graph, feeds, outputs=None):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    session = onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    return dict(zip(outputs or [o.name for o in session.get_outputs()], session.run(outputs, feeds)))


def first_divergent_block(bundle, check, feeds, tolerance):
    blocks = check.get("blocks")
    if not blocks:
        return None
    reference = np.load(bundle / blocks["reference"])
    actual = run(bundle / blocks["graph"], feeds, [b["tensor"] for b in blocks["names"]])
    for block in blocks["names"]:
        ref = reference[block["module"]]
        failures, _ = judge(ref, actual[block["tensor"]], tolerance, scale=max(1.0, float(np.abs(ref).max())))
        if failures:
            return f"{block['module']} (tensor {block['tensor']}): {', '.join(failures)}"
    return "head (every block agrees)"


def main(argv):
    bundle = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent
    manifest = json.loads((bundle / "bundle.json").read_text())
    tolerance = manifest["tolerance"]
    failed = 0
    for check in manifest["checks"]:
        feeds = {name: np.load(bundle / files["npy"]) for name, files in check["inputs"].items()}
        actual = run(bundle / check["graph"], feeds)
        for name, files in check["outputs"].items():
            failures, metrics = judge(np.load(bundle / files["npy"]), actual[name], tolerance)
            shown = ", ".join(f"{k} {v:.6g}" for k, v in metrics.items())
            print(f"{'FAIL' if failures else 'PASS'} {check['graph']} {name}: {shown}" + (f" ({'; '.join(failures)})" if failures else ""))
            if failures:
                failed += 1
                block = first_divergent_block(bundle, check, feeds, tolerance)
                if block:
                    print(f"  first divergent block: {block}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
