"""Independent oracles for the serving tests: ONNX Runtime called directly (no deploykit
runner) and a float64 softmax / top-k written out here, not taken from the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from deploykit.data import preprocess


def ort_logits(export_dir: Path, images: np.ndarray) -> np.ndarray:
    """``[B, 3, h, w]`` float32 through the exported graph at ``(h, w)``, by ONNX Runtime."""
    manifest = json.loads((export_dir / "manifest.json").read_text())
    (graph,) = [g for g in manifest["graphs"] if tuple(g["resolution"]) == images.shape[-2:]]
    session = ort.InferenceSession(str(export_dir / graph["file"]), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"images": images})[0]


def preprocessed(export_dir: Path, image: np.ndarray, resolution: tuple[int, int]) -> np.ndarray:
    config = json.loads((export_dir / "config.json").read_text())
    return preprocess(image, resolution, config["mean"], config["std"])


def softmax_top_k(logits: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """Per row, the k (class, probability) pairs with the highest probability, best first."""
    rows = []
    for row in logits.astype(np.float64):
        p = np.exp(row - row.max())
        p /= p.sum()
        rows.append(sorted(enumerate(p.tolist()), key=lambda cp: (-cp[1], cp[0]))[:k])
    return rows
