"""Comparing a backend's outputs with the reference: metrics and pass/fail tolerances.

numpy only and free of deploykit imports, so the exporter (which checks an INT8 plan before
writing it) and ``deploykit.validate`` judge outputs with the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    """Pass/fail thresholds on the logits.

    Attributes:
        max_abs: largest absolute difference; None: not checked (INT8 moves logits by design).
        min_cosine: worst per-input cosine similarity.
        min_mean_cosine: mean per-input cosine similarity.
        min_top1: share of real inputs whose arg-max agrees with the reference.
        min_top5: mean overlap of the two top-5 sets on the real inputs.
        real_only: judge cosine on the real inputs only. Seeded noise lies outside the range an
            INT8 plan was calibrated on, so its outputs say nothing about the plan; they are
            still run and reported, and NaN/Inf anywhere still fails.
    """

    max_abs: float | None
    min_cosine: float
    min_mean_cosine: float = -1.0
    min_top1: float = 0.0
    min_top5: float = 0.0
    real_only: bool = False


def looser(a: Tolerance, b: Tolerance) -> Tolerance:
    """The tolerance that accepts what either accepts, bound by bound (a graph's own plan run by a
    runtime that lowers its precision further is held to the looser of the two)."""
    return Tolerance(
        max_abs=None if a.max_abs is None or b.max_abs is None else max(a.max_abs, b.max_abs),
        min_cosine=min(a.min_cosine, b.min_cosine),
        min_mean_cosine=min(a.min_mean_cosine, b.min_mean_cosine),
        min_top1=min(a.min_top1, b.min_top1),
        min_top5=min(a.min_top5, b.min_top5),
        real_only=a.real_only or b.real_only,
    )


def compare_logits(reference: np.ndarray, actual: np.ndarray, num_real: int, tolerance: Tolerance, top_k: bool = True) -> dict:
    """Metrics of ``actual`` against ``reference`` (both ``[B, classes]``, or ``[B, D]`` features), in float64.

    Top-k agreement is measured on the last ``num_real`` rows (the real images) when there are
    any: top-1 is the share of images with the same arg-max; top-5 is the mean overlap of the
    two top-5 sets. Features (``top_k=False``) get None there: max abs and cosine decide.
    Cosines are per row, over every row or (``tolerance.real_only``) the real ones.
    """
    ref, act = reference.astype(np.float64), actual.astype(np.float64)
    nan_count, inf_count = int(np.isnan(act).sum()), int(np.isinf(act).sum())
    ref_nan, ref_inf = int(np.isnan(ref).sum()), int(np.isinf(ref).sum())
    diff = np.abs(np.nan_to_num(act, nan=np.inf) - ref)
    max_abs = float(diff.max())
    rows = slice(len(ref) - num_real, None) if num_real else slice(None)
    top1 = top5 = None
    if top_k:
        top1 = float(np.mean(ref[rows].argmax(-1) == act[rows].argmax(-1)))
        k = min(5, ref.shape[-1])
        top_ref, top_act = np.argsort(-ref[rows], -1)[:, :k], np.argsort(-act[rows], -1)[:, :k]
        top5 = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(top_ref, top_act)]))
    judged = rows if tolerance.real_only else slice(None)
    # A row holding NaN or Inf has no cosine: NaN, which prints as such and fails every bound.
    finite = np.isfinite(ref[judged]).reshape(len(ref[judged]), -1).all(1) & np.isfinite(act[judged]).reshape(len(act[judged]), -1).all(1)
    cosines = np.where(finite, row_cosines(ref[judged], np.nan_to_num(act[judged])), np.nan)
    metrics = dict(
        max_abs=max_abs,
        mean_abs=float(diff.mean()),
        max_rel=float((diff / (np.abs(ref) + 1e-6)).max()),
        cosine=float(cosines.min()),
        mean_cosine=float(cosines.mean()),
        top1_agreement=top1,
        top5_agreement=top5,
        nan_count=nan_count,
        inf_count=inf_count,
    )
    failures = []
    if ref_nan or ref_inf:
        failures.append(f"the PyTorch reference has {ref_nan} NaN / {ref_inf} Inf")
    if nan_count or inf_count:
        failures.append(f"{nan_count} NaN / {inf_count} Inf")
    if tolerance.real_only and not num_real:
        failures.append("no real inputs to judge on")
    if tolerance.max_abs is not None and not max_abs <= tolerance.max_abs:
        failures.append(f"max abs {max_abs:.3g} > {tolerance.max_abs:g}")
    if finite.all() and not metrics["cosine"] >= tolerance.min_cosine:  # else the NaN/Inf failure says it
        failures.append(f"cosine {metrics['cosine']:.7f} < {tolerance.min_cosine}")
    if finite.all() and not metrics["mean_cosine"] >= tolerance.min_mean_cosine:
        failures.append(f"mean cosine {metrics['mean_cosine']:.5f} < {tolerance.min_mean_cosine}")
    if top_k and not top1 >= tolerance.min_top1:
        failures.append(f"top-1 agreement {top1:.1%} < {tolerance.min_top1:.0%}")
    if top_k and not top5 >= tolerance.min_top5:
        failures.append(f"top-5 overlap {top5:.1%} < {tolerance.min_top5:.0%}")
    return {**metrics, "failures": failures, "passed": not failures}


def first_divergent(reference: Sequence[np.ndarray], actual: Sequence[np.ndarray], tolerance: Tolerance, num_real: int = 0) -> int | None:
    """The index of the first pair of block outputs (``[N, ...]`` each, in block order) that
    leaves ``tolerance``, or None when every pair keeps it: the one search behind
    ``deploykit.validate`` (a backend against PyTorch) and the int8 plan check (the planned graph
    against the fp32 graph).

    Block outputs are compared on a relative scale (error / max(1, max |reference|)), since
    activations grow with depth, and by the tolerance's worst and mean per-input cosine (over
    the last ``num_real`` inputs when it judges real inputs only).
    """
    for i, (ref, act) in enumerate(zip(reference, actual, strict=True)):
        ref, act = ref.astype(np.float64), act.astype(np.float64)
        rows = slice(len(ref) - num_real, None) if tolerance.real_only and num_real else slice(None)
        scale = max(1.0, float(np.abs(ref).max()))
        too_far = tolerance.max_abs is not None and not float(np.abs(act - ref).max()) / scale <= tolerance.max_abs
        cosines = row_cosines(ref[rows], act[rows])
        if too_far or cosines.min() < tolerance.min_cosine or cosines.mean() < tolerance.min_mean_cosine:
            return i
    return None


def output_rows(outputs: np.ndarray) -> np.ndarray:
    """Output rows as the exporter's checks compare them: ``[rows, last dim]`` float64 (a
    classifier's logits one row per input, a sequence model's or a backbone's every token a row)."""
    return outputs.astype(np.float64).reshape(-1, outputs.shape[-1])


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row (everything after the first axis): 1 where both rows are
    zero, 0 where only one is (a NaN output zeroed by ``nan_to_num`` must not look perfect)."""
    a, b = a.reshape(len(a), -1), b.reshape(len(b), -1)
    norm_a, norm_b = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    both_zero = (norm_a == 0) & (norm_b == 0)
    return np.where(both_zero, 1.0, (a * b).sum(1) / np.maximum(norm_a * norm_b, 1e-300))


def worst_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest of ``row_cosines``."""
    return float(row_cosines(a, b).min())
