"""One judge of "is this output good enough?": criteria and the check that runs a backend against them.

Torch-free (numpy and the runners' interface, ``deploykit.runners.base``). A bar (``Tolerance``, ``Agreement``) is a
frozen value a precision plan names in its row of ``deploykit.export.precision.PLANS``;
``check_runner`` runs a runner over a ``Reference`` and judges it by those bars, for
``deploykit.validate``, the export's plan check and INT8 fallback, ``profile``'s check before
timing and the zoo cards alike.
"""

from deploykit.checks.criteria import Agreement, Bar, CheckResult, Criterion, Tolerance, bar_of, first_divergent, row_cosines, worst_cosine
from deploykit.checks.run import Checked, Reference, check_runner, judge

__all__ = [
    "Agreement",
    "Bar",
    "CheckResult",
    "Checked",
    "Criterion",
    "Reference",
    "Tolerance",
    "bar_of",
    "check_runner",
    "first_divergent",
    "judge",
    "row_cosines",
    "worst_cosine",
]
