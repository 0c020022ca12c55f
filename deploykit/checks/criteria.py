"""Criteria: what "good enough" means for a backend's outputs against a reference, and every
metric they judge by.

A bar (``Tolerance``, ``Agreement``) is a frozen value a precision plan names in its row of the
plan table; ``bar.start(reference)`` gives a ``Criterion``, which takes the outputs batch by
batch (``update``) and answers with a ``CheckResult`` (``result``). Streaming lets a check stop
as soon as its bar can no longer be met (``Criterion.still_possible``), as the INT8 fallback's
trials do.

Rows: outputs are compared as ``[rows, last dim]`` float64 (``runners.base.output_rows``: a
classifier's logits one row per input, a sequence model's or a backbone's every token a row).
``real`` marks the rows of real inputs (images, text), as opposed to seeded noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from deploykit.runners.base import output_rows


@dataclass(frozen=True)
class Reference:
    """The inputs a check runs and the reference's outputs on them.

    Attributes:
        inputs: ``[N, ...]`` model inputs, the real ones (images, text) last.
        outputs: the reference's outputs on them: ``[N, ..., last dim]``, or already as rows
            (``runners.base.output_rows``).
        num_real: how many of the inputs, at the end, are real rather than seeded noise.
        top_k: the outputs are logits, ranked by top-1 / top-5 agreement; a backbone's features
            are not (max abs and cosine decide).
    """

    inputs: np.ndarray
    outputs: np.ndarray
    num_real: int = 0
    top_k: bool = True

    @classmethod
    def of_outputs(cls, outputs: np.ndarray, num_real: int = 0, top_k: bool = True) -> Reference:
        """A reference to ``judge`` outputs already computed by: one row per input, the inputs
        themselves not kept (nothing runs them again)."""
        return cls(np.arange(len(outputs)), outputs, num_real, top_k)

    @cached_property
    def rows_per_input(self) -> int:
        """1 for a classifier's logits; ``T`` where every position of a sequence is a row."""
        return len(self.rows) // len(self.inputs)

    @cached_property
    def rows(self) -> np.ndarray:
        """The reference's outputs as ``[rows, last dim]`` float64."""
        return output_rows(self.outputs)

    @cached_property
    def real(self) -> np.ndarray:
        """Per row: whether it comes from a real input."""
        return np.arange(len(self.inputs)).repeat(self.rows_per_input) >= len(self.inputs) - self.num_real


@dataclass(frozen=True)
class CheckResult:
    """What one criterion (or several, ``combined``) said of a run.

    Attributes:
        passed: every bar was met.
        metrics: the measured values, by name (``max_abs``, ``top1_agreement``, ...).
        failures: one line per missed bar (``"max abs 0.3 > 0.0001"``), in the bars' order.
    """

    passed: bool
    metrics: Mapping[str, Any] = field(default_factory=dict)
    failures: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.passed

    @staticmethod
    def combined(results: Sequence[CheckResult]) -> CheckResult:
        """One result of several criteria: passed when all passed, metrics and failures joined."""
        metrics: dict[str, Any] = {}
        for result in results:
            metrics.update(result.metrics)
        return CheckResult(all(r.passed for r in results), metrics, tuple(f for r in results for f in r.failures))


class Criterion(Protocol):
    """A bar being checked: fed the reference and the outputs batch by batch, then asked."""

    def update(self, reference: np.ndarray, outputs: np.ndarray, real: np.ndarray) -> None:
        """Take one batch: ``[rows, last dim]`` float64 each, ``real`` a bool per row."""

    def result(self) -> CheckResult:
        """The verdict on every row taken so far."""

    def still_possible(self, total_rows: int) -> bool:
        """Whether the bar may still be met once ``total_rows`` rows are in."""


class Bar(Protocol):
    """A frozen threshold set, named by a precision plan (``export.precision.PLANS``)."""

    def start(self, reference: Reference) -> Criterion:
        """A criterion for outputs on ``reference``'s inputs."""

    def looser(self, other: Bar) -> Bar:
        """The bar that accepts what either accepts (same type as ``self``)."""


def bar_of(criteria: Sequence[Bar], kind: type) -> Bar:
    """The bar of type ``kind`` among ``criteria`` (a plan names at most one of each)."""
    return next(bar for bar in criteria if isinstance(bar, kind))


# ------------------------------------------------------------------------------------- metrics


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row (everything after the first axis): 1 where both rows are
    zero, 0 where only one is (a NaN output zeroed by ``nan_to_num`` must not look perfect)."""
    a, b = (x.reshape(x.shape[0], int(np.prod(x.shape[1:]))) for x in (a, b))  # a batch may hold no judged row
    norm_a, norm_b = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    both_zero = (norm_a == 0) & (norm_b == 0)
    return np.where(both_zero, 1.0, (a * b).sum(1) / np.maximum(norm_a * norm_b, 1e-300))


def worst_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest of ``row_cosines``."""
    return float(row_cosines(a, b).min())


def top1_matches(reference: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """Per row: whether the arg-max (the answer) is the reference's."""
    return reference.argmax(-1) == outputs.argmax(-1)


def top5_overlaps(reference: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """Per row: the share of the reference's top-5 (or top-k, fewer classes) also in the outputs' top-5."""
    k = min(5, reference.shape[-1])
    top_ref, top_out = np.argsort(-reference, -1)[:, :k], np.argsort(-outputs, -1)[:, :k]
    return np.array([len(set(a) & set(b)) / k for a, b in zip(top_ref, top_out)], dtype=np.float64)


def relative_errors(reference: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """Per row: ``‖y − y_ref‖ / ‖y_ref‖``."""
    return np.linalg.norm(outputs - reference, axis=-1) / np.maximum(np.linalg.norm(reference, axis=-1), 1e-30)


def margins(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's top-1 margin over the runner-up, relative to the row's norm, and its top-1 index."""
    top = rows.argmax(-1)
    others = rows.copy()
    others[np.arange(len(rows)), top] = -np.inf
    margin = rows[np.arange(len(rows)), top] - others.max(-1)
    return margin / np.maximum(np.linalg.norm(rows, axis=-1), 1e-300), top


def pairwise_flips(sorted_margins: np.ndarray, reference: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """Each row's estimated chance of changing its answer: the share of all reference rows whose
    margin (relative to its norm) is smaller than this row's loss of margin.

    A row's own answer changes when its margin ``m`` plus the change ``δ`` of the same difference
    goes below 0, a rare event counted once per row. Taking margins and changes as independent,
    the chance is ``P(m < −δ)``, estimated here from all ``n`` margins for each of the ``n``
    changes seen: ``n²`` comparisons instead of ``n``.
    """
    margin, top = margins(reference)
    others = outputs.copy()
    others[np.arange(len(outputs)), top] = -np.inf
    scale = np.maximum(np.linalg.norm(reference, axis=-1), 1e-300)
    change = (outputs[np.arange(len(outputs)), top] - others.max(-1)) / scale - margin
    return np.searchsorted(sorted_margins, -change, side="left") / len(sorted_margins)


# ----------------------------------------------------------------------------------- tolerance


@dataclass(frozen=True)
class Tolerance:
    """Pass/fail thresholds on a backend's outputs against the reference (``validate``'s bar).

    Attributes:
        max_abs: largest absolute difference; None: not checked (INT8 moves logits by design).
        min_cosine: worst per-row cosine similarity.
        min_mean_cosine: mean per-row cosine similarity.
        min_top1: share of real inputs' rows whose arg-max agrees with the reference.
        min_top5: mean overlap of the two top-5 sets on the real inputs' rows.
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

    def start(self, reference: Reference) -> ToleranceCriterion:
        return ToleranceCriterion(self, reference.top_k, reference.num_real > 0)

    def looser(self, other: Tolerance) -> Tolerance:
        """The tolerance that accepts what either accepts, bound by bound (a graph's own plan run by
        a runtime that lowers its precision further is held to the looser of the two)."""
        return Tolerance(
            max_abs=None if self.max_abs is None or other.max_abs is None else max(self.max_abs, other.max_abs),
            min_cosine=min(self.min_cosine, other.min_cosine),
            min_mean_cosine=min(self.min_mean_cosine, other.min_mean_cosine),
            min_top1=min(self.min_top1, other.min_top1),
            min_top5=min(self.min_top5, other.min_top5),
            real_only=self.real_only or other.real_only,
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ToleranceCriterion:
    """``Tolerance`` on a stream of rows: max / mean abs error, max relative error, worst and mean
    per-row cosine, top-1 / top-5 agreement (on the real rows when there are any), NaN/Inf counts.

    Cosines are per row, over every row or (``real_only``) the real ones; a row holding NaN or Inf
    has no cosine (NaN, which prints as such and fails every bound)."""

    def __init__(self, bar: Tolerance, top_k: bool = True, any_real: bool = False):
        self.bar, self.top_k, self.any_real = bar, top_k, any_real
        self.counts = dict(nan=0, inf=0, ref_nan=0, ref_inf=0, elements=0)
        self.max_abs = self.max_rel = 0.0
        self.sum_abs = 0.0
        self.cosines: list[np.ndarray] = []
        self.finite = True
        self.ranks: dict[bool, list[tuple[np.ndarray, np.ndarray]]] = {True: [], False: []}  # real? → (top-1, top-5) per row

    def update(self, reference: np.ndarray, outputs: np.ndarray, real: np.ndarray) -> None:
        ref, out = reference.astype(np.float64), outputs.astype(np.float64)
        for key, values in (("nan", np.isnan(out)), ("inf", np.isinf(out)), ("ref_nan", np.isnan(ref)), ("ref_inf", np.isinf(ref))):
            self.counts[key] += int(values.sum())
        self.counts["elements"] += ref.size
        diff = np.abs(np.nan_to_num(out, nan=np.inf) - ref)
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.sum_abs += float(diff.sum())
        self.max_rel = max(self.max_rel, float((diff / (np.abs(ref) + 1e-6)).max()))
        judged = real if self.bar.real_only and self.any_real else np.ones(len(ref), bool)
        finite = np.isfinite(ref[judged]).all(-1) & np.isfinite(out[judged]).all(-1)
        self.finite &= bool(finite.all())
        self.cosines.append(np.where(finite, row_cosines(ref[judged], np.nan_to_num(out[judged])), np.nan))
        if self.top_k:
            for is_real in (True, False):
                rows = real == is_real
                self.ranks[is_real].append((top1_matches(ref[rows], out[rows]), top5_overlaps(ref[rows], out[rows])))

    def _top_k(self) -> tuple[float | None, float | None]:
        """Top-1 and top-5 agreement on the real rows, or on every row when none is real."""
        if not self.top_k:
            return None, None
        parts = self.ranks[True] if self.any_real else self.ranks[True] + self.ranks[False]
        top1, top5 = (np.concatenate([p[i] for p in parts]) for i in (0, 1))
        return float(top1.mean()), float(top5.mean())

    def result(self) -> CheckResult:
        bar, counts = self.bar, self.counts
        cosines = np.concatenate(self.cosines)
        top1, top5 = self._top_k()
        metrics = dict(
            max_abs=self.max_abs,
            mean_abs=self.sum_abs / max(counts["elements"], 1),
            max_rel=self.max_rel,
            cosine=float(cosines.min()),
            mean_cosine=float(cosines.mean()),
            top1_agreement=top1,
            top5_agreement=top5,
            nan_count=counts["nan"],
            inf_count=counts["inf"],
        )
        failures = []
        if counts["ref_nan"] or counts["ref_inf"]:
            failures.append(f"the PyTorch reference has {counts['ref_nan']} NaN / {counts['ref_inf']} Inf")
        if counts["nan"] or counts["inf"]:
            failures.append(f"{counts['nan']} NaN / {counts['inf']} Inf")
        if bar.real_only and not self.any_real:
            failures.append("no real inputs to judge on")
        if bar.max_abs is not None and not self.max_abs <= bar.max_abs:
            failures.append(f"max abs {self.max_abs:.3g} > {bar.max_abs:g}")
        if self.finite and not metrics["cosine"] >= bar.min_cosine:  # else the NaN/Inf failure says it
            failures.append(f"cosine {metrics['cosine']:.7f} < {bar.min_cosine}")
        if self.finite and not metrics["mean_cosine"] >= bar.min_mean_cosine:
            failures.append(f"mean cosine {metrics['mean_cosine']:.5f} < {bar.min_mean_cosine}")
        if self.top_k and not top1 >= bar.min_top1:
            failures.append(f"top-1 agreement {top1:.1%} < {bar.min_top1:.0%}")
        if self.top_k and not top5 >= bar.min_top5:
            failures.append(f"top-5 overlap {top5:.1%} < {bar.min_top5:.0%}")
        return CheckResult(not failures, metrics, tuple(failures))

    def still_possible(self, total_rows: int) -> bool:
        return True  # a maximum and a minimum: any later row may break them, none can mend them, so a check runs to the end


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


# ----------------------------------------------------------------------------------- agreement


@dataclass(frozen=True)
class Agreement:
    """What a quantized graph must keep of its float graph's outputs on held-out inputs (the INT8
    fallback's target): means over rows, so that many held-out inputs estimate it well.

    A classifier's agreement is judged twice, and both must reach ``min_top1``: counted (the share
    of rows whose arg-max is the reference's) and estimated from all pairs of rows
    (``pairwise_flips``). Counted alone it is a rare event on a few inputs: on the zoo's GeoPE at
    2× its training resolution the fallback stopped where the 1000 val scenes counted 99.5%, and
    the 2000 test scenes then counted 98.95%; the pairwise estimate said 99.1-99.3% on both splits
    there, and asking it for 99.5% too kept 5 matmuls float, after which the test split counted
    99.35%.

    Attributes:
        min_top1: classifiers: share of rows whose arg-max matches the reference's (None: not judged).
        min_cosine: features: mean cosine of the rows with the reference (None: not judged).
        max_relative_error: features: mean ``‖y − y_ref‖ / ‖y_ref‖`` of the rows (None: not judged).
    """

    min_top1: float | None = None
    min_cosine: float | None = None
    max_relative_error: float | None = None

    def start(self, reference: Reference) -> AgreementCriterion:
        return AgreementCriterion(self, reference.rows, reference.top_k)

    def looser(self, other: Agreement) -> Agreement:
        lower = lambda a, b: None if a is None or b is None else min(a, b)
        higher = lambda a, b: None if a is None or b is None else max(a, b)
        return Agreement(
            lower(self.min_top1, other.min_top1),
            lower(self.min_cosine, other.min_cosine),
            higher(self.max_relative_error, other.max_relative_error),
        )

    def describe(self) -> str:
        """``top-1 agreement >= 99.50%`` / ``mean cosine >= 0.995 and mean relative error <= 0.05``."""
        parts = []
        if self.min_top1 is not None:
            parts.append(f"top-1 agreement >= {self.min_top1:.2%}")
        if self.min_cosine is not None:
            parts.append(f"mean cosine >= {self.min_cosine:g}")
        if self.max_relative_error is not None:
            parts.append(f"mean relative error <= {self.max_relative_error:g}")
        return " and ".join(parts) or "no target"

    def to_dict(self) -> dict[str, Any]:
        """The keys a quantization record keeps (``min_agreement`` for ``min_top1``)."""
        return {"min_agreement": self.min_top1, "min_cosine": self.min_cosine, "max_relative_error": self.max_relative_error}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Agreement:
        return cls(record.get("min_agreement"), record.get("min_cosine"), record.get("max_relative_error"))


class AgreementCriterion:
    """``Agreement`` on a stream of rows. Every metric is a mean of non-negative per-row shortfalls,
    so ``still_possible`` can tell early that the bar will be missed."""

    def __init__(self, bar: Agreement, reference_rows: np.ndarray, top_k: bool = True):
        self.bar = bar
        self.sorted_margins = np.sort(margins(reference_rows)[0]) if top_k else None  # logits: answers to agree on
        self.sums = {"disagree": 0.0, "estimated_disagree": 0.0, "cosine_gap": 0.0, "relative_error": 0.0}
        self.rows = 0

    def update(self, reference: np.ndarray, outputs: np.ndarray, real: np.ndarray) -> None:
        self.rows += len(reference)
        if self.sorted_margins is not None:
            self.sums["disagree"] += float(np.sum(~top1_matches(reference, outputs)))
            self.sums["estimated_disagree"] += float(np.sum(pairwise_flips(self.sorted_margins, reference, outputs)))
        self.sums["cosine_gap"] += float(np.sum(1 - row_cosines(reference, outputs)))
        self.sums["relative_error"] += float(np.sum(relative_errors(reference, outputs)))

    def still_possible(self, total_rows: int) -> bool:
        bar = self.bar
        limits = {
            "disagree": None if bar.min_top1 is None else (1 - bar.min_top1) * total_rows,
            "estimated_disagree": None if bar.min_top1 is None else (1 - bar.min_top1) * total_rows,
            "cosine_gap": None if bar.min_cosine is None else (1 - bar.min_cosine) * total_rows,
            "relative_error": None if bar.max_relative_error is None else bar.max_relative_error * total_rows,
        }
        return all(limit is None or self.sums[key] <= limit + 1e-9 for key, limit in limits.items())

    def result(self) -> CheckResult:
        """Top-1 agreement (counted and estimated) for logits; mean cosine and relative error always
        (for features, where there are no answers, they are the bar)."""
        bar, rows = self.bar, max(self.rows, 1)
        metrics: dict[str, Any] = {}
        if self.sorted_margins is not None:
            metrics.update(
                top1_agreement=1 - self.sums["disagree"] / rows, top1_agreement_estimate=1 - self.sums["estimated_disagree"] / rows
            )
        metrics.update(mean_cosine=1 - self.sums["cosine_gap"] / rows, mean_relative_error=self.sums["relative_error"] / rows)
        failures = []
        if bar.min_top1 is not None and self.sorted_margins is None:
            failures.append("no answers to agree on: the outputs are features, not logits")
        elif bar.min_top1 is not None and not min(metrics["top1_agreement"], metrics["top1_agreement_estimate"]) >= bar.min_top1:
            failures.append(
                f"top-1 agreement {metrics['top1_agreement']:.2%} (pairwise estimate {metrics['top1_agreement_estimate']:.2%}) < {bar.min_top1:.2%}"
            )
        if bar.min_cosine is not None and not metrics["mean_cosine"] >= bar.min_cosine:
            failures.append(f"mean cosine {metrics['mean_cosine']:.5f} < {bar.min_cosine:g}")
        if bar.max_relative_error is not None and not metrics["mean_relative_error"] <= bar.max_relative_error:
            failures.append(f"mean relative error {metrics['mean_relative_error']:.4f} > {bar.max_relative_error:g}")
        return CheckResult(not failures, metrics, tuple(failures))
