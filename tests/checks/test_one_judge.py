"""One judge: a precision plan's criteria live in its row of the plan table, and the export's plan
check, ``validate`` and ``profile``'s check before timing all read them there."""

import dataclasses

import onnx
import pytest

from deploykit.checks import Tolerance
from deploykit.errors import ExportError
from deploykit.export.precision import PLANS
from tests.test_cli import RES


def _verdicts(export_dir) -> dict[str, tuple[bool, str]]:
    """Each judge's verdict on the fp32 graph of ``export_dir``, with its failures as one line."""
    from deploykit.export.bundle import _QuantizedPlans, load_reference
    from deploykit.export.int8_static import CalibrationOptions
    from deploykit.profile.choice import References, check_target
    from deploykit.profile.targets import RunnerTarget
    from deploykit.runners.onnxrt import OnnxrtRunner
    from deploykit.validation.run import validate

    model = load_reference(export_dir)
    path = export_dir / f"model_{RES}.onnx"
    proto = onnx.load(str(path))
    verdicts = {}
    plans = _QuantizedPlans(proto, model, (RES, RES), CalibrationOptions(samples=2, held_out=4), None)
    try:
        plans.checked(proto, "fp32")  # the export's check of a plan against the fp32 graph
        verdicts["export"] = (True, "")
    except ExportError as err:
        verdicts["export"] = (False, str(err))
    report = validate(export_dir, precision="fp32", num_random=2, num_real=2)
    verdicts["validate"] = (bool(report), "; ".join(f for r in report.records for f in r.failures))
    target = RunnerTarget(OnnxrtRunner(path))
    try:
        verdict = check_target(target, model, (RES, RES), "fp32", References())
    finally:
        target.runner.deactivate()
    verdicts["profile"] = (verdict.validated, "; ".join(verdict.validation_failures))
    return verdicts


def test_changing_a_plan_s_criteria_changes_export_validate_and_profile_together(good_export, monkeypatch):
    assert {judge: passed for judge, (passed, _) in _verdicts(good_export).items()} == dict(export=True, validate=True, profile=True)
    # A bar no output can meet (a cosine above 1), set in the plan table's row only.
    monkeypatch.setitem(PLANS, "fp32", dataclasses.replace(PLANS["fp32"], criteria=(Tolerance(max_abs=None, min_cosine=1.5),)))
    verdicts = _verdicts(good_export)
    for judge, (passed, failures) in verdicts.items():
        assert not passed and "< 1.5" in failures, (judge, failures)


@pytest.mark.parametrize("precision", list(PLANS))
def test_every_plan_names_a_tolerance(precision):
    """``validate``'s record reports the plan's tolerance: every row has one."""
    assert isinstance(PLANS[precision].tolerance, Tolerance)
