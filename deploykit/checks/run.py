"""Running a backend and judging it against the reference: the one place that does both.

``check_runner`` is what ``deploykit.validate``, the export's plan check and INT8 fallback,
``profile``'s check before timing and the zoo cards call: it runs a runner over the reference's
inputs batch by batch, reshapes each output to rows, marks the real inputs' rows, loosens a
plan's bars to what the runner computes in, and feeds every criterion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from deploykit.checks.criteria import Bar, CheckResult, Criterion, Reference
from deploykit.runners.base import Runner, output_rows, run_rows


@runtime_checkable
class JudgedPlan(Protocol):
    """A precision plan's row (``export.precision.PrecisionPlan``): its bars, loosened to the plan
    a runner computes in when it lowers the graph itself."""

    def criteria_for(self, computes_in: str | None) -> tuple[Bar, ...]: ...


@dataclass(frozen=True)
class Checked:
    """A runner's outputs on a reference and what the criteria said of them.

    Attributes:
        result: the criteria's verdict, joined (``bool(checked)`` is ``result.passed``).
        criteria: the bars it was judged by (a plan's, loosened to the runner).
        outputs: the runner's output rows, as many as ran.
        complete: every input ran (a check that may stop early stopped where its bar was lost).
    """

    result: CheckResult
    criteria: tuple[Bar, ...]
    outputs: np.ndarray
    complete: bool = True

    def __bool__(self) -> bool:
        return self.result.passed


def check_runner(
    runner: Runner,
    reference: Reference,
    criteria: Sequence[Bar] | JudgedPlan,
    *,
    batch: int = 4,
    exact: bool = False,
    stop_early: bool = False,
    done: Callable[[int], None] | None = None,
) -> Checked:
    """Run the reference's inputs through an active runner and judge its outputs.

    Args:
        runner: an active runner of one input; its first output is judged.
        reference: the inputs and the reference's outputs on them.
        criteria: bars, or a precision plan whose bars (``criteria_for(runner.computes_in)``) apply.
        batch: inputs per call.
        exact: every call gets exactly ``batch`` inputs (an engine's profile shape): the last call
            is filled up by cycling through the inputs, the extra rows dropped.
        stop_early: stop as soon as a criterion can no longer be met (``complete`` is then False,
            and the result covers the rows that ran).
        done: called with the number of inputs run so far, after each call.
    """
    bars = _bars(criteria, runner.computes_in)
    judges = [bar.start(reference) for bar in bars]
    count, per, total = len(reference.inputs), reference.rows_per_input, len(reference.rows)
    ran: list[np.ndarray] = []
    for start in range(0, count, batch):
        stop = min(start + batch, count)
        chunk = reference.inputs[np.arange(start, start + batch) % count] if exact else reference.inputs[start:stop]
        rows = run_rows(runner, chunk, len(chunk))[: (stop - start) * per]
        _update(judges, reference, rows, slice(start * per, stop * per))
        ran.append(rows)
        if done:
            done(stop)
        if stop_early and stop < count and not all(j.still_possible(total) for j in judges):
            break
    outputs = np.concatenate(ran)
    return Checked(CheckResult.combined([j.result() for j in judges]), bars, outputs, complete=len(outputs) == total)


def judge(reference: Reference, outputs: np.ndarray, criteria: Sequence[Bar] | JudgedPlan) -> Checked:
    """``check_runner``'s verdict on outputs already computed (``outputs``: every input's, by a
    runner that runs the graph's types as written)."""
    rows, bars = output_rows(outputs), _bars(criteria, None)
    judges = [bar.start(reference) for bar in bars]
    _update(judges, reference, rows, slice(None))
    return Checked(CheckResult.combined([j.result() for j in judges]), bars, rows)


def _bars(criteria: Sequence[Bar] | JudgedPlan, computes_in: str | None) -> tuple[Bar, ...]:
    return criteria.criteria_for(computes_in) if isinstance(criteria, JudgedPlan) else tuple(criteria)


def _update(judges: Sequence[Criterion], reference: Reference, rows: np.ndarray, where: slice) -> None:
    for judge_ in judges:
        judge_.update(reference.rows[where], rows, reference.real[where])
