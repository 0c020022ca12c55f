"""Speed-honest plans: profile validates every ONNX-runner lane before timing it, marks each cell's
fastest validated (backend, plan), says where a reduced-precision plan is slower than fp32, and
writes the choice that ``deploykit serve`` takes on a CPU (only while its graph is unchanged)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from deploykit.export.directory import CHOICE_FILE, ExportDir
from deploykit.export.manifest import MANIFEST_FILE, sha256_file
from deploykit.profile import Budget, Subject, profile
from deploykit.profile.choice import QUICK_BUDGET, chosen_plans, mark_fastest, not_default_lines, read_choice, slower_lines
from deploykit.profile.report import ProfileRecord, Verdict, add_ratios
from deploykit.profile.timing import LatencyStats
from tests.test_cli import RES

BUDGET = Budget(iterations=2, warmup=1, min_iterations=1)


def _record(backend, precision, p50, validated, batch=1, **run):
    """A record of ``backend`` running ``precision`` at 224 in ``p50`` ms; ``validated`` None: not checked."""
    stats = LatencyStats(p50, p50, p50, p50, p50, 0.0, p50, p50, 1, 1e3 / p50)
    return ProfileRecord(backend, precision, "ape", "224", batch, stats, run=run, verdict=None if validated is None else Verdict(validated))


def _fastest(records) -> list:
    return [r for r in mark_fastest(add_ratios(records)) if r.fastest_validated]


def test_fastest_is_the_quickest_validated_plan_of_each_cell_and_slower_plans_are_named():
    records = [
        _record("torch", "fp32", 1.0, None),  # the reference, never a deployed choice however fast
        _record("ort", "fp32", 10.0, True),
        _record("ort", "int8", 12.0, True),  # validated but slower than its fp32 graph
        _record("openvino", "fp32", 8.0, True),
        _record("openvino", "int8", 5.0, False),  # fastest of all, but failed validation
        _record("ort", "fp32", 30.0, True, batch=8),
        _record("ort", "int8", 20.0, True, batch=8),
    ]
    marked = mark_fastest(add_ratios(records))
    assert {(r.batch, r.backend, r.precision) for r in marked if r.fastest_validated} == {(1, "openvino", "fp32"), (8, "ort", "int8")}
    assert [r.fastest_validated for r in marked].count(False) == 5
    (line,) = slower_lines(marked)
    assert line.startswith("int8 on ort is 1.20x its fp32 graph for ape @ 224 batch 1: slower than fp32")
    # A tie as printed is no reason to take the plan either, but it is not "slower".
    marked[2] = replace(marked[2], fp32_p50_ms=12.0 / 1.003)
    assert slower_lines(marked) == ["int8 on ort is 1.00x its fp32 graph for ape @ 224 batch 1: no faster than fp32 there, do not use it"]


def test_a_runner_that_lowered_an_encoding_op_is_never_the_default_choice():
    unfaithful = _record("openvino-bf16", "fp32", 2.0, True, lowered_despite_mark={"MVN": 3, "Subgraph": 2})
    records = [_record("ort", "fp32", 10.0, True), _record("ort", "int8", 4.0, True), unfaithful]
    (chosen,) = _fastest(records)
    assert (chosen.backend, chosen.precision) == ("ort", "int8")
    assert not_default_lines(records) == [
        "fp32 on openvino-bf16 at 224 is not chosen by default: the runtime ran encoding ops the plan keeps in f32 (tables, "
        "rotations, LayerNorm, Softmax) below it (MVN, Subgraph); ask for it by name to use it"
    ]
    records[2] = replace(unfaithful, run={"lowered_despite_mark": {}})  # a runtime that keeps them is chosen on speed
    assert [(r.backend, r.precision) for r in _fastest(records)] == [("openvino-bf16", "fp32")] and not_default_lines(records) == []


def test_an_int8_plan_whose_float_remainder_the_runner_lowers_is_chosen_only_if_it_met_its_target_again():
    """The int8 plan's quality target was checked at export with an f32 remainder; OpenVINO's bf16
    hint lowers it, so profile checks the target again on that runner (``quality_check``)."""
    bf16_int8 = _record("openvino-bf16", "int8", 1.0, True, lowered_despite_mark={}, computes_in="bf16")
    bf16_fp32 = _record("openvino-bf16", "fp32", 2.0, True, lowered_despite_mark={}, computes_in="bf16")
    f32_int8 = _record("openvino", "int8", 3.0, True, computes_in=None)
    records = [_record("ort", "fp32", 10.0, True), f32_int8, bf16_fp32, bf16_int8]
    lane = lambda r: (r.backend, r.precision)
    assert [lane(r) for r in _fastest(records)] == [lane(bf16_fp32)]  # not checked: never the default
    (line,) = not_default_lines(records)
    assert line.startswith("int8 on openvino-bf16 at 224 is not chosen by default: its calibration was checked with a float32 remainder")
    missed = dict(top1_agreement=0.988, top1_agreement_estimate=0.991, mean_cosine=0.9991, rows=1000, complete=True)
    check = dict(missed, met=False, held_out=1000, min_agreement=0.995, min_cosine=None, max_relative_error=None)
    records[3] = replace(bf16_int8, verdict=Verdict(True, quality_check=check))
    assert [lane(r) for r in _fastest(records)] == [lane(bf16_fp32)]
    (line,) = not_default_lines(records)
    assert "missed the plan's own target" in line and "on 1000 held-out inputs: top-1 agreement 98.80%" in line, line
    met = dict(check, top1_agreement=0.997, top1_agreement_estimate=0.996, met=True)
    records[3] = replace(bf16_int8, verdict=Verdict(True, quality_check=met))
    assert [lane(r) for r in _fastest(records)] == [lane(bf16_int8)] and not_default_lines(records) == []
    records[2:] = [replace(r, verdict=Verdict(False)) for r in records[2:]]  # then the int8 plan with its remainder in f32
    assert [lane(r) for r in _fastest(records)] == [lane(f32_int8)]


def test_a_reduced_plan_slower_than_the_fused_float_plan_is_named_unless_that_plan_failed():
    records = [
        _record("ort", "fp32", 10.0, True),
        _record("ort", "fp32-mha", 6.0, True),
        _record("ort", "int8-mha", 7.2, True),  # beats fp32, loses to fp32-mha
        _record("ort", "int8", 5.0, True),
        _record("ort", "fp32", 10.0, True, batch=8),
        _record("ort", "fp32-mha", 6.0, False, batch=8),  # refused by validation: not a plan to use
        _record("ort", "int8-mha", 7.2, True, batch=8),
    ]
    assert slower_lines(add_ratios(records)) == [
        "int8-mha on ort is 1.20x fp32-mha for ape @ 224 batch 1: fp32-mha is faster there, use it"
    ]


def _planted(src, dst, precision: str):
    """A copy of an export whose ``precision`` graph has one MLP weight scaled (manifest updated)."""
    out = shutil.copytree(src, dst)
    path = out / f"model_{RES}_{precision}.onnx"
    proto = onnx.load(str(path))
    init = next(i for i in proto.graph.initializer if i.dims and len(i.dims) == 2 and i.dims[0] * 4 == i.dims[1])
    init.CopyFrom(
        numpy_helper.from_array((numpy_helper.to_array(init).astype(np.float32) * 3).astype(numpy_helper.to_array(init).dtype), init.name)
    )
    onnx.save(proto, str(path))
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    for graph in manifest["graphs"]:
        graph["sha256"] = sha256_file(out / graph["file"])
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="module")
def two_plans(tmp_path_factory, ckpt_dir):
    from deploykit.cli import main

    out = tmp_path_factory.mktemp("plans") / "exp"
    try:
        main(["export", "-c", str(ckpt_dir), "-r", str(RES), "--precision", "fp32", "--precision", "fp16", "-o", str(out)])
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"export failed with {exit_.code}"
    return out


def test_profile_validates_each_lane_and_never_picks_a_failing_plan(two_plans, tmp_path):
    broken = _planted(two_plans, tmp_path / "exp", "fp16")
    subject = Subject.from_export_dir(broken, ("fp32", "fp16"))
    report = profile(
        subject,
        resolutions=[(RES, RES)],
        batches=[1],
        backends=["ort", "openvino"],
        precisions=["fp32", "fp16"],
        budget=BUDGET,
        compare_ape=False,
        end_to_end=False,
    )
    verdicts = {(r.backend, r.precision): r.validated for r in report.records}
    assert verdicts == {("ort", "fp32"): True, ("ort", "fp16"): False, ("openvino", "fp32"): True, ("openvino", "fp16"): False}
    (fastest,) = [r for r in report.records if r.fastest_validated]
    assert fastest.precision == "fp32" and fastest.p50_ms == min(r.p50_ms for r in report.records if r.validated)
    assert any(line.startswith(f"fastest validated for ape @ {RES} batch 1: {fastest.backend} fp32") for line in report.advice)
    assert "INFERENCE_PRECISION_HINT f32" in next(r.run["provider"] for r in report.records if r.backend == "openvino")


def test_profile_writes_its_choice_once_with_the_streams_it_measured(two_plans, tmp_path, monkeypatch):
    """Streams are decided in memory before the choice is written, in one write."""
    from deploykit.profile import streams

    out = shutil.copytree(two_plans, tmp_path / "exp")
    monkeypatch.setattr(streams, "machine_streams", lambda: 2)
    monkeypatch.setattr(streams, "measure_streams", lambda factory, graph, batch, round_s: {1: 10.0, 2: 25.0})
    written, write = [], ExportDir.write_choices
    monkeypatch.setattr(ExportDir, "write_choices", lambda directory, choices: written.append(choices) or write(directory, choices))
    report = profile(
        out,
        resolutions=[(RES, RES)],
        batches=[1],
        backends=["ort"],
        precisions=["fp32"],
        budget=BUDGET,
        compare_ape=False,
        end_to_end=False,
    )
    (choice,) = ExportDir(out).choices()[str(RES)]
    assert len(written) == 1 and report.choice_file == out / CHOICE_FILE
    assert (choice.backend, choice.precision, choice.streams, choice.streams_gain) == ("ort", "fp32", 2, 2.5)


def test_openvino_bf16_without_bf16_is_a_note_not_a_traceback(two_plans, tmp_path):
    from deploykit.backends.openvino import best_hint

    if best_hint() == "bf16":
        pytest.skip("this CPU has bf16")
    subject = Subject.from_export_dir(shutil.copytree(two_plans, tmp_path / "exp"))  # profile writes its choice there
    report = profile(
        subject, resolutions=[(RES, RES)], backends=["ort", "openvino-bf16"], budget=BUDGET, compare_ape=False, end_to_end=False
    )
    assert [r.backend for r in report.records] == ["ort"]
    assert any("openvino-bf16" in note and "no native bf16" in note for note in report.notes)


def test_openvino_bf16_is_chosen_only_where_openvino_kept_the_plan_s_f32_nodes(two_plans, tmp_path):
    """Across the seam: the real runner's report (what OpenVINO compiled) decides the choice."""
    from deploykit.backends.openvino import best_hint

    if best_hint() != "bf16":
        pytest.skip("this CPU has no native bf16")
    subject = Subject.from_export_dir(shutil.copytree(two_plans, tmp_path / "exp"), ("fp32",))  # profile writes its choice there
    report = profile(
        subject, resolutions=[(RES, RES)], backends=["ort", "openvino-bf16"], budget=BUDGET, compare_ape=False, end_to_end=False
    )
    (bf16,) = [r for r in report.records if r.backend == "openvino-bf16"]
    assert bf16.validated and bf16.run["provider"].endswith("INFERENCE_PRECISION_HINT bf16")
    lowered = bool(bf16.run["lowered_despite_mark"])  # OpenVINO 2026.4 keeps APE's encoding ops in f32; not SaPE²'s
    others = [r for r in report.records if r is not bf16 and r.validated]
    assert bf16.fastest_validated == (not lowered and all(bf16.p50_ms < r.p50_ms for r in others))
    assert any(line.startswith(f"fp32 on openvino-bf16 at {RES} is not chosen by default") for line in report.advice) == lowered


def _choose(export_dir, backend: str, precision: str) -> None:
    """Write a choice file as ``deploykit profile`` would, naming ``backend`` on ``precision``."""
    records = [replace(_record(backend, precision, 1.0, True), resolution=str(RES), fastest_validated=True)]
    graphs = Subject.from_export_dir(export_dir, ("fp32", "fp16")).graph_hashes()
    assert ExportDir(export_dir).write_choices(chosen_plans(records, "ape", graphs)) == export_dir / CHOICE_FILE


def test_serve_on_cpu_takes_the_profiled_choice_and_says_so(two_plans, tmp_path):
    import deploykit

    out = shutil.copytree(two_plans, tmp_path / "exp")
    _choose(out, "openvino", "fp16")
    assert read_choice(out, str(RES), batch=8).backend == "openvino"  # the nearest profiled batch
    with deploykit.load(out) as pipe:
        assert pipe.backends[(RES, RES)] == "openvino" and pipe.plans[(RES, RES)] == "fp16"
        (line,) = pipe.describe_backends()
        assert line.startswith(f"backend openvino fp16 at {RES} (fastest validated plan at batch 1 in deploykit profile")
        with deploykit.load(two_plans) as reference:  # no choice: ONNX Runtime on fp32, as before
            assert reference.backends[(RES, RES)] == "ort"
            image = np.random.default_rng(0).integers(0, 256, (RES, RES, 3), dtype=np.uint8)
            assert pipe(image).classes[0] == reference(image).classes[0]


def test_serve_takes_an_openvino_bf16_choice_and_answers_as_fp32_does(two_plans, tmp_path):
    """openvino-bf16 can now be the default choice: serve opens it (the bf16 hint, the encoding's
    ops marked) and answers as ONNX Runtime's fp32 does."""
    import deploykit
    from deploykit.backends.openvino import best_hint

    if best_hint() != "bf16":
        pytest.skip("this CPU has no native bf16")
    out = shutil.copytree(two_plans, tmp_path / "exp")
    _choose(out, "openvino-bf16", "fp32")
    with deploykit.load(out) as pipe, deploykit.load(two_plans) as reference:
        assert pipe.backends[(RES, RES)] == "openvino-bf16" and pipe.plans[(RES, RES)] == "fp32"
        assert pipe.describe_backends()[0].startswith(f"backend openvino-bf16 at {RES} (fastest validated plan")
        images = list(np.random.default_rng(0).integers(0, 256, (4, RES, RES, 3), dtype=np.uint8))
        assert [p.classes[0] for p in pipe(images)] == [p.classes[0] for p in reference(images)]


def test_a_choice_whose_graph_changed_is_not_taken(two_plans, tmp_path):
    import deploykit

    out = shutil.copytree(two_plans, tmp_path / "exp")
    _choose(out, "openvino", "fp16")
    _planted(out, tmp_path / "changed", "fp16")  # re-exported: same file name, other bytes
    with deploykit.load(tmp_path / "changed") as pipe:
        assert pipe.backends[(RES, RES)] == "ort" and pipe.plans[(RES, RES)] == "fp32"
        assert "profiled choice openvino fp16 not taken" in pipe.describe_backends()[0]
    with deploykit.load(out, backend="ort") as pipe:  # an explicit backend ignores the choice
        assert pipe.backends[(RES, RES)] == "ort" and pipe.plans[(RES, RES)] == "fp32"


class _PlanTimer:
    """Stands in for the wall clock only: runs the call, and says it took ``factor`` times longer
    when the runner timed is an int8-dynamic graph, and ``fused`` times for the fp32-mha graph
    (the graphs themselves run for real)."""

    def __init__(self, factor: float, fused: float = 1.0):
        self.factor, self.fused, self.calls, self.feeds = factor, fused, [], []

    def time_ns(self, fn) -> int:
        fn()
        runner, feed = fn.__defaults__
        name = runner.model.name
        self.calls.append(name)
        self.feeds.append(feed)
        return int(2_000_000 * (self.factor if "int8-dynamic" in name else self.fused if "fp32-mha" in name else 1.0))


def test_export_says_in_one_line_where_a_cpu_plan_is_slower_than_fp32(capsys, ckpt_dir, tmp_path, monkeypatch):
    """The export command times its CPU plans against fp32 after writing them (the clock replaced,
    the graphs run): a plan 1.5x slower gets one note; at equal times nothing is said."""
    from deploykit.profile import timing
    from deploykit.profile.choice import plans_slower_than_float
    from tests.test_cli import run_cli

    slow = _PlanTimer(1.5)
    monkeypatch.setattr(timing, "CpuTimer", lambda: slow)
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys,
        "export",
        "-c",
        ckpt_dir,
        "-r",
        RES,
        "--precision",
        "int8-dynamic",
        "--precision",
        "fp32-mha",
        "--calibration-samples",
        "8",
        "--held-out",
        "16",
        "-o",
        out,
    )
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert notes == [
        f"note: int8-dynamic on ort is 1.50x its fp32 graph for ape @ {RES} batch 1: slower than fp32 there, do not use it "
        "(deploykit profile measures every batch)"
    ], err
    # interleaved: fp32 first, then each plan, round by round
    graphs = [f"model_{RES}.onnx", f"model_{RES}_int8-dynamic.onnx", f"model_{RES}_fp32-mha.onnx"]
    runs = [name for i, name in enumerate(slow.calls) if i == 0 or name != slow.calls[i - 1]]
    assert runs[0] == graphs[0] and set(runs) == set(graphs) and len(runs) == 3 * QUICK_BUDGET.rounds
    # timed on the model's first real input, as profile times (zeros without a model)
    from deploykit.profile.targets import real_rows
    from deploykit.zoo.resolve import resolve_model

    model, _ = resolve_model(checkpoint=ckpt_dir)
    real = real_rows(model, (RES, RES))[:1]
    assert real.any() and all(np.array_equal(feed["images"], real) for feed in slow.feeds), len(slow.feeds)
    short = Budget(iterations=4, warmup=0, rounds=2)
    assert plans_slower_than_float(out, short, timer=_PlanTimer(1.0)) == []
    assert plans_slower_than_float(out, short, timer=_PlanTimer(1.04)) == []  # within the margin of a short timing
    # Faster than fp32 but slower than the fused float plan: said, naming the plan to use instead.
    assert plans_slower_than_float(out, short, timer=_PlanTimer(0.9, fused=0.6)) == [
        f"int8-dynamic on ort is 1.50x fp32-mha for ape @ {RES} batch 1: fp32-mha is faster there, use it"
    ]


def test_the_int8_plan_s_own_target_is_checked_again_on_the_user_s_held_out_data(capsys, ckpt_dir, tmp_path):
    """Across the seam export -> profile: a plan calibrated on the user's arrays, with their own
    target, is checked again on the same split of those arrays and against that target (not on
    the bundled images at the default target); once the arrays changed, the check is refused and
    the run is not a default choice, saying why."""
    from deploykit.errors import InputError
    from deploykit.inputs.user import UserCalibration, read_inputs
    from deploykit.profile.choice import References, check_target, not_default_because
    from deploykit.profile.targets import RunnerTarget
    from deploykit.runners.onnxrt import OnnxrtRunner
    from deploykit.zoo.resolve import resolve_model
    from tests.test_cli import run_cli

    data = tmp_path / "mine.npy"
    np.save(data, np.random.default_rng(0).standard_normal((24, 3, RES, RES)).astype(np.float32))
    out = tmp_path / "out"
    args = ["--calibration-data", data, "--calibration-samples", 8, "--held-out", 12, "--min-agreement", 0.5]
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", RES, "--precision", "int8", *args, "-o", out)
    assert code == 0, err
    model, _ = resolve_model(checkpoint=ckpt_dir)
    graph = out / f"model_{RES}_int8.onnx"
    target = References().quality_target(model, (RES, RES), graph)
    _, held_out, _ = UserCalibration(read_inputs(data)).inputs(model, (RES, RES), 8, 12)
    assert np.array_equal(target.reference.inputs, held_out) and target.goal.min_top1 == 0.5 and len(target.reference.inputs) == 12

    class _LowersItsRemainder(OnnxrtRunner):  # a real runner, reported as OpenVINO's bf16 hint reports itself
        computes_in = "bf16"

    runner = RunnerTarget(_LowersItsRemainder(graph))
    try:
        verdict = check_target(runner, model, (RES, RES), "int8", References(), graph=graph)
        assert verdict.quality_check["held_out"] == 12 and verdict.quality_check["min_agreement"] == 0.5, verdict
        np.save(data, np.zeros((24, 3, RES, RES), np.float32))  # the user's data changed since the export
        with pytest.raises(InputError, match="not the ones its export checked it on"):
            References().quality_target(model, (RES, RES), graph)
        verdict = check_target(runner, model, (RES, RES), "int8", References(), graph=graph)
    finally:
        runner.runner.deactivate()
    assert verdict.quality_check is None
    record = replace(_record("openvino-bf16", "int8", 1.0, True, computes_in="bf16", lowered_despite_mark={}), verdict=verdict)
    assert "its own target could not be checked again: the plan's held-out inputs (12 of the 24 arrays in" in not_default_because(record)


def test_a_corrupt_choice_is_one_line_and_serve_goes_on_without_it(two_plans, tmp_path):
    import deploykit
    from deploykit.errors import DeployKitError

    out = shutil.copytree(two_plans, tmp_path / "exp")
    (out / CHOICE_FILE).write_text(json.dumps({"choices": {str(RES): [{"batch": 1}]}}))  # an entry missing its fields
    with pytest.raises(DeployKitError, match=rf"{CHOICE_FILE} is unreadable .*; run deploykit profile again, or delete it$") as err:
        read_choice(out, str(RES), 1)
    assert "\n" not in str(err.value)
    (out / CHOICE_FILE).write_text("{not json")
    with deploykit.load(out) as pipe:
        assert pipe.backends[(RES, RES)] == "ort"
        assert f"profiled choice not taken: {out / CHOICE_FILE} is unreadable" in pipe.describe_backends()[0]


def test_an_export_into_a_profiled_directory_replaces_the_choice_as_deploykits_own(two_plans, tmp_path):
    out = shutil.copytree(two_plans, tmp_path / "exp")
    _choose(out, "openvino", "fp16")
    assert ExportDir(out).foreign_files() == []  # profile's choice is deploykit's file: a re-export may replace it
