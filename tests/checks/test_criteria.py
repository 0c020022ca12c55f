"""The criteria against numbers worked out by hand, and ``check_runner``'s batching, real rows and
early stop on a real ONNX Runtime runner (an Identity graph: its outputs are its inputs)."""

import math

import numpy as np
import onnx
import pytest

from deploykit.checks import Agreement, Reference, Tolerance, check_runner, judge
from deploykit.runners.onnxrt import cpu_runner

# Two rows. Row 0: reference (3, 4), output (4, 3): |Δ| = 1 in both, cosine 24/25 = 0.96, and the
# arg-max moves from 1 to 0. Row 1: equal, cosine 1, same arg-max.
REFERENCE = np.array([[3.0, 4.0], [1.0, 0.0]])
OUTPUT = np.array([[4.0, 3.0], [1.0, 0.0]])


def test_tolerance_metrics_by_hand():
    result = judge(Reference.of_outputs(REFERENCE), OUTPUT, [Tolerance(max_abs=2.0, min_cosine=0.9)]).result
    assert result.passed and not result.failures
    m = result.metrics
    assert m["max_abs"] == 1.0 and m["mean_abs"] == 0.5  # 2 of 4 elements off by 1
    assert m["max_rel"] == pytest.approx(1 / 3, rel=1e-5)  # 1 against |3|
    assert m["cosine"] == pytest.approx(0.96) and m["mean_cosine"] == pytest.approx(0.98)
    assert m["top1_agreement"] == 0.5 and m["top5_agreement"] == 1.0  # two classes: the top-2 sets are equal
    assert m["nan_count"] == 0 and m["inf_count"] == 0


def test_tolerance_failures_name_each_missed_bound():
    bar = Tolerance(max_abs=0.5, min_cosine=0.97, min_mean_cosine=0.99, min_top1=0.75)
    result = judge(Reference.of_outputs(REFERENCE), OUTPUT, [bar]).result
    assert not result and result.failures == (
        "max abs 1 > 0.5",
        "cosine 0.9600000 < 0.97",
        "mean cosine 0.98000 < 0.99",
        "top-1 agreement 50.0% < 75%",
    )


def test_top_k_and_real_only_cosine_judge_the_real_rows():
    """Row 1 is the one real input: top-1 is judged there (agreeing), and a ``real_only`` bar takes
    the cosine of that row alone (1, not row 0's 0.96)."""
    real = Reference.of_outputs(REFERENCE, num_real=1)
    assert judge(real, OUTPUT, [Tolerance(max_abs=None, min_cosine=0.99)]).result.metrics["top1_agreement"] == 1.0
    assert not judge(real, OUTPUT, [Tolerance(max_abs=None, min_cosine=0.99)])  # every row's cosine: 0.96
    assert judge(real, OUTPUT, [Tolerance(max_abs=None, min_cosine=0.99, real_only=True)]).result.metrics["cosine"] == 1.0
    none_real = judge(Reference.of_outputs(REFERENCE), OUTPUT, [Tolerance(max_abs=None, min_cosine=0.0, real_only=True)]).result
    assert "no real inputs to judge on" in none_real.failures


def test_features_have_no_top_k():
    result = judge(Reference.of_outputs(REFERENCE, top_k=False), OUTPUT, [Tolerance(max_abs=None, min_cosine=0.0, min_top1=1.0)]).result
    assert result.passed and result.metrics["top1_agreement"] is None


def test_looser_takes_each_bound_from_the_more_accepting_bar():
    assert Tolerance(max_abs=0.1, min_cosine=0.9, min_top1=0.8).looser(
        Tolerance(max_abs=0.3, min_cosine=0.95, real_only=True)
    ) == Tolerance(max_abs=0.3, min_cosine=0.9, min_top1=0.0, real_only=True)
    assert Tolerance(max_abs=0.1, min_cosine=0.9).looser(Tolerance(max_abs=None, min_cosine=0.9)).max_abs is None
    assert Agreement(0.99, None, 0.1).looser(Agreement(0.9, None, 0.2)) == Agreement(0.9, None, 0.2)


# Four rows, each of margin 1 over the runner-up relative to its norm; the last output flips its
# answer: its margin falls by 2, more than every row's margin, so the pairwise estimate also
# counts one flip in four.
AGREE_REFERENCE = np.array([[2.0, 0.0], [0.0, 2.0], [1.0, 0.0], [0.0, 1.0]])
AGREE_OUTPUT = np.array([[2.0, 0.0], [0.0, 2.0], [1.0, 0.0], [1.0, 0.0]])


def test_agreement_metrics_by_hand():
    result = judge(Reference.of_outputs(AGREE_REFERENCE), AGREE_OUTPUT, [Agreement(min_top1=0.75)]).result
    assert result.passed
    m = result.metrics
    assert m["top1_agreement"] == 0.75 and m["top1_agreement_estimate"] == 0.75
    assert m["mean_cosine"] == pytest.approx(0.75)  # three rows at 1, the flipped one at 0
    assert m["mean_relative_error"] == pytest.approx(math.sqrt(2) / 4)  # ‖(1, −1)‖ / ‖(0, 1)‖ on one row in four
    missed = judge(Reference.of_outputs(AGREE_REFERENCE), AGREE_OUTPUT, [Agreement(min_top1=0.8)]).result
    assert not missed and missed.failures == ("top-1 agreement 75.00% (pairwise estimate 75.00%) < 80.00%",)


def test_agreement_on_features_is_judged_by_cosine_and_relative_error():
    features = Reference.of_outputs(AGREE_REFERENCE, top_k=False)
    result = judge(features, AGREE_OUTPUT, [Agreement(min_cosine=0.8, max_relative_error=0.5)]).result
    assert "top1_agreement" not in result.metrics
    assert result.failures == ("mean cosine 0.75000 < 0.8",)
    assert "no answers to agree on" in judge(features, AGREE_OUTPUT, [Agreement(min_top1=0.5)]).result.failures[0]


def _identity_runner(width: int):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, ["n", width])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, ["n", width])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "identity", [x], [y])
    return cpu_runner(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)]))


def test_check_runner_streams_batches_and_matches_the_one_shot_judgement():
    reference = Reference(AGREE_OUTPUT, AGREE_REFERENCE)  # the runner outputs its inputs
    with _identity_runner(2) as runner:
        checked = check_runner(runner, reference, [Agreement(min_top1=0.75), Tolerance(max_abs=None, min_cosine=-1.0)], batch=3)
    assert checked.complete and np.array_equal(checked.outputs, AGREE_OUTPUT)
    assert checked.result == judge(reference, AGREE_OUTPUT, checked.criteria).result


def test_a_batch_without_real_rows_leaves_a_real_only_judgement_as_it_was():
    """One input per call, the real one last: the first call brings no row to judge."""
    reference = Reference(OUTPUT, REFERENCE, num_real=1)
    bar = Tolerance(max_abs=None, min_cosine=0.99, real_only=True)
    with _identity_runner(2) as runner:
        checked = check_runner(runner, reference, [bar], batch=1)
    assert checked.result == judge(reference, OUTPUT, [bar]).result and checked.result.metrics["cosine"] == 1.0


def test_check_runner_exact_batches_fill_the_last_call_and_drop_the_extra_rows(monkeypatch):
    with _identity_runner(2) as runner:
        calls, infer = [], runner.infer
        monkeypatch.setattr(runner, "infer", lambda feed: calls.append(len(feed["x"])) or infer(feed))
        checked = check_runner(runner, Reference(AGREE_OUTPUT, AGREE_REFERENCE), [Agreement()], batch=3, exact=True)
    assert calls == [3, 3] and np.array_equal(checked.outputs, AGREE_OUTPUT)


def test_check_runner_stops_once_the_bar_is_lost():
    """The flipped row first: one disagreement in four already exceeds the 0.8 bar's 0.8 allowed."""
    order = [3, 0, 1, 2]
    reference = Reference(AGREE_OUTPUT[order], AGREE_REFERENCE[order])
    with _identity_runner(2) as runner:
        stopped = check_runner(runner, reference, [Agreement(min_top1=0.8)], batch=1, stop_early=True)
        full = check_runner(runner, reference, [Agreement(min_top1=0.8)], batch=1)
    assert not stopped.complete and len(stopped.outputs) == 1 and not stopped
    assert full.complete and full.result.metrics["top1_agreement"] == 0.75


def test_sequence_rows_mark_every_position_of_a_real_input():
    outputs = np.zeros((2, 3, 5))  # two inputs, three positions each
    reference = Reference(np.zeros((2, 3), np.int64), outputs, num_real=1)
    assert reference.rows_per_input == 3 and reference.real.tolist() == [False] * 3 + [True] * 3
