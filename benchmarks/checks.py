"""The checks of an acceptance run (``gpu_acceptance.py``, ``gpu_lent.py``): each passed, failed
(with the reason) or skipped (with the reason), in the order they ran, printed as they finish."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

from deploykit.errors import one_line


class Failed(Exception):
    """A check ran and did not pass; ``details`` go into the report."""

    def __init__(self, reason: str, details: dict | None = None):
        super().__init__(reason)
        self.details = details or {}


class Checks:
    """The report's checks, in the order they ran.

    Args:
        deadline: ``time.perf_counter()`` after which checks are skipped, not run (a lent GPU's
            minutes are few: what did not fit is said, and what ran comes back).
        on_item: called after each check with the list so far (to write the report as it grows,
            so a run stopped at its limit still returns what it measured).
    """

    def __init__(self, deadline: float | None = None, on_item: Callable[[list[dict]], None] | None = None) -> None:
        self.items: list[dict] = []
        self.deadline = deadline
        self.on_item = on_item

    def run(self, name: str, fn, skip: str | None = None, group: str | None = None):
        """Run ``fn`` (returns details) unless ``skip`` says why not; never raises. ``group``
        (``"engine"``) is recorded with the check, so a run can say how many of a kind ran."""
        if not skip and self.deadline is not None and time.perf_counter() > self.deadline:
            skip = "out of time: the run's --budget-s was spent before this check"
        tag = {"group": group} if group else {}
        if skip:
            self.add({"name": name, **tag, "status": "skipped", "reason": skip})
            print(f"- {name}: skipped ({skip})", flush=True)
            return None
        start = time.perf_counter()
        try:
            details = fn()
            item = {"name": name, **tag, "status": "passed", "details": details}
        except Failed as err:
            item = {"name": name, **tag, "status": "failed", "reason": str(err), "details": err.details}
        except Exception as err:  # any failure of the path under test is a finding, not a crash of the run
            traceback.print_exc()
            item = {"name": name, **tag, "status": "failed", "reason": one_line(f"{type(err).__name__}: {err}")}
        item["seconds"] = round(time.perf_counter() - start, 2)
        self.add(item)
        print(f"{'✓' if item['status'] == 'passed' else '✗'} {name}" + (f": {item['reason']}" if "reason" in item else ""), flush=True)
        return item.get("details")

    def add(self, item: dict) -> None:
        """Record a check that ran elsewhere (a child process) as its own report gave it."""
        self.items.append(item)
        if self.on_item:
            self.on_item(self.items)

    def counts(self) -> dict[str, int]:
        return {status: sum(c["status"] == status for c in self.items) for status in ("passed", "failed", "skipped")}

    def ran(self, group: str) -> int:
        """How many checks of ``group`` ran (passed or failed; not skipped)."""
        return sum(c.get("group") == group and c["status"] != "skipped" for c in self.items)
