"""What a classifier answers: the ``k`` best classes and their probabilities. One function, so
the served answer and the end-to-end call ``profile`` times do the same work (numpy only)."""

from __future__ import annotations

import numpy as np


def unranked(logits: np.ndarray, model: str) -> str | None:
    """Why ``logits`` ``[B, num_classes]`` are not ranked: rows holding NaN/Inf (a model fault, never
    ranked), naming ``model`` (e.g. ``"ort model at 224"``); None when every row is finite."""
    bad = np.flatnonzero(~np.isfinite(logits).all(axis=1))
    if not len(bad):
        return None
    return f"the {model} answered NaN/Inf for {len(bad)} of {len(logits)} images (first: {bad[0]}); not ranked"


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax in float64, then the ``k`` best classes per row.

    Args:
        logits: ``[B, num_classes]``.
        k: how many classes (capped at ``num_classes``).

    Returns:
        ``(classes [B, k] int64, scores [B, k] float32)``, best first; ties keep the lower index.
    """
    z = logits.astype(np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    probs = z / z.sum(axis=-1, keepdims=True)
    k = min(k, probs.shape[-1])
    classes = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    return classes.astype(np.int64), np.take_along_axis(probs, classes, axis=-1).astype(np.float32)
