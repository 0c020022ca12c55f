"""``deploykit.profile`` and ``deploykit profile``: statistics, budgets, FLOP counts, the
record schema, the plot, and bad input.

Timings are never asserted (the machines are shared and noisy); what is asserted is what the
numbers are computed from and how they are written. Models are ViT-Tiny cut to one or two
blocks at 32-48 px, and budgets are a couple of calls, so the whole module takes seconds.
"""

from __future__ import annotations

import csv
import json
import statistics

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from deploykit.cli import parse_counts
from deploykit.encodings import encoding_name
from deploykit.errors import ConfigError, ResolutionError
from deploykit.export import BakedModel, export
from deploykit.inputs.resolutions import parse_resolutions
from deploykit.nn import create_model, save_model
from deploykit.profile import (
    RECORD_FIELDS,
    Budget,
    LatencyStats,
    ape_twin,
    denormals_flushed,
    measure,
    model_flops,
    profile,
)
from deploykit.profile.output import plot_latency, write_csv
from deploykit.profile.report import ProfileRecord, add_ratios
from tests.test_cli import assert_usage_error, run_cli

RES = 32
TINY_BUDGET = Budget(iterations=2, warmup=1)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny(encoding: str = "ape", depth: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    return create_model("vit_tiny_patch16", encoding=encoding, depth=depth, img_size=RES, num_classes=10).eval()


# ----------------------------------------------------------------------------------------------
# statistics


@pytest.mark.parametrize("seed", [0, 1])
def test_stats_match_the_statistics_module(seed):
    # An independent implementation: statistics.quantiles(method="inclusive") interpolates linearly
    # between order statistics, as LatencyStats documents.
    rng = np.random.default_rng(seed)
    samples_ns = rng.integers(1_000_000, 50_000_000, size=257)  # 1-50 ms, odd count
    ms = (samples_ns / 1e6).tolist()
    stats = LatencyStats.from_ns(samples_ns.tolist(), batch=8)
    cuts = statistics.quantiles(ms, n=100, method="inclusive")
    for q in (50, 90, 95, 99):
        assert getattr(stats, f"p{q}_ms") == pytest.approx(cuts[q - 1], rel=1e-12)
    assert stats.p50_ms == pytest.approx(statistics.median(ms), rel=1e-12)
    assert stats.mean_ms == pytest.approx(statistics.fmean(ms), rel=1e-12)
    assert stats.std_ms == pytest.approx(statistics.stdev(ms), rel=1e-12)
    assert (stats.min_ms, stats.max_ms, stats.n) == (min(ms), max(ms), 257)


def test_stats_on_hand_computed_samples():
    stats = LatencyStats.from_ns([4_000_000, 1_000_000, 3_000_000, 2_000_000], batch=2)  # 1..4 ms
    assert stats.p50_ms == pytest.approx(2.5)
    assert stats.p90_ms == pytest.approx(3.7)  # 1 + 0.9 * 3 order-statistic steps
    assert stats.mean_ms == pytest.approx(2.5)
    assert stats.std_ms == pytest.approx((5 / 3) ** 0.5)
    assert stats.throughput_per_s == pytest.approx(2 * 4 / 0.010)
    single = LatencyStats.from_ns([7_000_000])
    assert (single.std_ms, single.p99_ms, single.n) == (0.0, 7.0, 1)
    with pytest.raises(ValueError):
        LatencyStats.from_ns([])


class _CountingTimer:
    """Advances a fake clock by 1 ms per timed call and counts calls."""

    def __init__(self):
        self.timed = 0

    def time_ns(self, fn):
        fn()
        self.timed += 1
        return 1_000_000


def test_measure_runs_warmup_then_exactly_the_iterations():
    calls = []
    timer = _CountingTimer()
    samples = measure(lambda: calls.append(1), Budget(iterations=7, warmup=3), timer)
    assert samples == [1_000_000] * 7
    assert (len(calls), timer.timed) == (10, 7)


def test_measure_keeps_min_iterations_when_the_duration_is_spent():
    samples = measure(lambda: None, Budget(duration_s=1e-9, warmup=0, min_iterations=4))
    assert len(samples) == 4


def test_rounds_split_the_budget():
    per_round = Budget(iterations=10, min_iterations=5, rounds=3, duration_s=3.0).per_round()
    assert (per_round.iterations, per_round.min_iterations, per_round.rounds) == (4, 2, 1)
    assert per_round.duration_s == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs", [dict(duration_s=0), dict(iterations=0), dict(rounds=0), dict(warmup=-1)])
def test_bad_budget_is_rejected(kwargs):
    with pytest.raises(ConfigError):
        Budget(**kwargs)


def test_flush_denormal_is_scoped():
    tiny_value = torch.tensor([1e-39], dtype=torch.float32)  # a float32 denormal
    with denormals_flushed() as supported:
        inside = float((tiny_value * 1.0).item())
    after = float((tiny_value * 1.0).item())
    assert after != 0.0
    if supported:
        assert inside == 0.0


# ----------------------------------------------------------------------------------------------
# FLOPs against PyTorch's own counter


@pytest.mark.parametrize(
    "resolution,batch,mlp",
    [
        ((32, 32), 1, {}),
        ((48, 64), 3, {}),
        # timm families the importer reads: an MLP width of their own, and SwiGLU's two inputs.
        ((32, 32), 2, {"mlp_hidden_dim": 200}),
        ((32, 32), 2, {"mlp_layer": "swiglu", "mlp_hidden_dim": 136}),
    ],
)
def test_model_flops_match_torch_flop_counter(resolution, batch, mlp):
    model = create_model("vit_tiny_patch16", encoding="ape", depth=2, img_size=RES, num_classes=10, **mlp).eval()
    baked = BakedModel(model, resolution)
    # The math SDPA backend decomposes attention into bmm's, which the counter sees.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        baked(torch.randn(batch, 3, *resolution))
    assert model_flops(model.cfg, resolution, batch) == counter.get_total_flops()


# ----------------------------------------------------------------------------------------------
# parsing and the APE twin


def test_parse_resolutions_and_counts():
    assert parse_resolutions(["224", "384,512", "384x256", "224"]) == [(224, 224), (384, 384), (512, 512), (384, 256)]
    assert parse_counts(["1,8", "32", "8"], "batch") == [1, 8, 32]
    for bad in ("abc", "384x", "3x4x5"):
        with pytest.raises(ResolutionError, match="invalid resolution"):
            parse_resolutions([bad])
    for bad in ("0", "x", "-2", "1.5"):
        with pytest.raises(ConfigError, match="invalid batch"):
            parse_counts([bad], "batch")


def test_ape_twin_keeps_the_trunk_and_swaps_the_encoding():
    model = tiny("rope-axial", depth=2)
    twin = ape_twin(model)
    assert encoding_name(twin.cfg.encoding) == "ape"
    ours, theirs = model.state_dict(), twin.state_dict()
    trunk = [k for k in ours if k.startswith(("blocks.", "patch_embed.", "norm.", "head.", "cls_token"))]
    assert trunk and all(torch.equal(ours[k], theirs[k]) for k in trunk)
    assert "pos_embed" in theirs and "pos_embed" not in ours


# ----------------------------------------------------------------------------------------------
# the library end to end, and the record schema


@pytest.fixture(scope="module")
def report():
    return profile(
        [tiny("rope-axial")], resolutions=[(32, 32), (48, 48)], batches=[1, 2], backends=["torch", "ort"], budget=TINY_BUDGET, device="cpu"
    )


@pytest.mark.slow
def test_the_ape_twin_gets_no_calibrated_plan_of_its_own():
    """The twin's int8 plan would be a second calibration and fallback search (minutes on a real
    model) for a ×APE ratio no plan is chosen by: it runs the plans that need no calibration."""
    result = profile(
        [tiny("rope-axial")],
        resolutions=[(32, 32)],
        backends=["ort"],
        precisions=["fp32", "int8", "fp32-mha"],
        budget=TINY_BUDGET,
        end_to_end=False,
        validate_plans=False,
    )
    plans = {(r.encoding, r.precision) for r in result.records}
    assert plans == {("rope-axial", "fp32"), ("rope-axial", "int8"), ("rope-axial", "fp32-mha"), ("ape", "fp32"), ("ape", "fp32-mha")}
    (int8,) = [r for r in result.records if r.precision == "int8"]
    assert int8.ratio_vs_ape is None and int8.ratio_vs_fp32 > 0


@pytest.mark.slow
def test_one_record_per_backend_encoding_resolution_batch(report):
    keys = [(r.backend, r.encoding, r.resolution, r.batch) for r in report.records]
    expected = {(b, e, r, n) for b in ("torch", "ort") for e in ("rope-axial", "ape") for r in ("32", "48") for n in (1, 2)}
    assert sorted(keys) == sorted(expected)
    for r in report.to_json()["records"]:
        assert list(r)[: len(RECORD_FIELDS)] == list(RECORD_FIELDS)
        assert r["n"] == 2 and r["e2e_n"] == 2
        assert 0 < r["min_ms"] <= r["p50_ms"] <= r["p90_ms"] <= r["p95_ms"] <= r["p99_ms"] <= r["max_ms"]
        if r["backend"] == "torch":  # the positional step is timed alone in PyTorch eager, a part of its forward
            # (its share is not asserted below 1: two timed calls on a busy machine can put the part above the whole)
            assert r["pe_step_p50_ms"] > 0 and r["pe_share"] == pytest.approx(r["pe_step_p50_ms"] / r["p50_ms"])
        else:  # no ONNX Runtime step time to divide by: not a torch step over an ORT latency
            assert r["pe_step_p50_ms"] is None and r["pe_share"] is None


def _stats(p50_ms: float) -> LatencyStats:
    return LatencyStats(p50_ms, p50_ms, p50_ms, p50_ms, p50_ms, 0.0, p50_ms, p50_ms, 1, 1e3 / p50_ms)


def test_record_pe_share_is_torch_s_own_step_over_its_own_latency():
    torch_record = ProfileRecord("torch", "fp32", "rope-axial", "224", 1, _stats(8.0), None, _stats(2.0), 10**9).to_dict()
    assert (torch_record["pe_step_p50_ms"], torch_record["pe_share"]) == (2.0, 0.25)
    assert torch_record["gflops"] == 1.0 and torch_record["achieved_gflop_per_s"] == 125.0  # 1 GFLOP in 8 ms
    ort_record = ProfileRecord("ort", "fp32", "rope-axial", "224", 1, _stats(4.0), None, None, 10**9).to_dict()
    assert (ort_record["pe_step_p50_ms"], ort_record["pe_share"]) == (None, None)


def test_ratios_pair_records_of_the_same_backend_precision_resolution_batch():
    def rec(backend, precision, encoding, res, p50):
        return ProfileRecord(backend, precision, encoding, res, 1, _stats(p50))

    records = [
        rec("ort", "fp32", "ape", "32", 2.0),
        rec("ort", "fp32", "geope", "32", 3.0),
        rec("ort", "int8", "ape", "32", 1.0),
        rec("ort", "int8", "geope", "32", 1.5),
        rec("torch", "fp32", "geope", "32", 8.0),
        rec("ort", "fp32", "geope", "48", 5.0),
    ]
    records = [r.to_dict() for r in add_ratios(records)]
    ratios = [(r["ratio_vs_ape"], r["ratio_vs_fp32"]) for r in records]
    # geope over ape at the same backend and precision; int8 over the same lane's fp32; none without a partner.
    assert ratios == [(1.0, 1.0), (1.5, 1.0), (1.0, 0.5), (1.5, 0.5), (None, 1.0), (None, 1.0)]
    assert records[1]["ape_p50_ms"] == 2.0 and records[3]["fp32_p50_ms"] == 3.0 and records[4]["ape_p50_ms"] is None


def test_environment_is_what_this_process_runs_with(monkeypatch):
    """Each recorded value against where it comes from: thread settings changed for the test are
    the ones recorded, versions are the installed distributions', and the line says them."""
    import importlib.metadata
    import os

    from deploykit.backends.environment import capture_environment, environment_line

    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(1)
    try:
        env = capture_environment(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert env["threads"]["torch_intra_op"] == 1 and env["threads"]["OMP_NUM_THREADS"] == "3"
    assert env["logical_cores"] == os.cpu_count() and env["gpu"] is None
    assert env["versions"]["onnxruntime"] == importlib.metadata.version("onnxruntime")
    line = environment_line(env)
    assert "no GPU" in line and "torch threads 1" in line and f"onnxruntime {env['versions']['onnxruntime']}" in line


def test_instruction_sets_are_read_from_the_cpu_flags():
    from deploykit.backends.environment import cpu_instruction_sets

    x86 = {"flags": "fpu sse4_2 avx avx2 fma avx512f avx512_vnni avx512_bf16 ht"}
    assert cpu_instruction_sets(x86) == ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"]
    assert cpu_instruction_sets({"Features": "fp asimd asimddp sve"}) == ["asimd", "asimddp", "sve"]
    assert cpu_instruction_sets({}) == []


@pytest.mark.slow  # the profile run of the fixture
def test_the_report_records_its_environment(report):
    assert report.environment["threads"]["torch_intra_op"] == torch.get_num_threads()
    assert report.settings["flush_denormal"] is True and report.environment_line.startswith(str(report.environment["cpu"]))


@pytest.mark.slow  # a profile run of its own
def test_json_csv_and_plot_files(report, tmp_path):
    data = json.loads(report.write_json(tmp_path / "p.json").read_text())
    assert set(data) == {"environment_line", "environment", "settings", "records", "notes", "advice"}
    assert data["records"] == json.loads(json.dumps([r.to_dict() for r in report.records]))
    with open(write_csv(tmp_path / "p.csv", report.records), newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0][: len(RECORD_FIELDS)]) == RECORD_FIELDS
    assert len(rows) == 1 + len(report.records)
    first = dict(zip(rows[0], rows[1]))
    assert float(first["p50_ms"]) == pytest.approx(report.records[0].p50_ms)
    png = plot_latency(tmp_path / "p.png", report.records).read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_bad_inputs_fail_before_any_work():
    model = tiny()
    with pytest.raises(ResolutionError, match="not a positive multiple of the patch size 16"):
        profile(model, resolutions=[(40, 40)], budget=TINY_BUDGET)
    with pytest.raises(ConfigError, match="unknown backend 'nope'; choose one of: torch, ort"):
        profile(model, resolutions=[(32, 32)], backends=["nope"], budget=TINY_BUDGET)
    with pytest.raises(ConfigError, match="own encoding"):
        profile([model, tiny()], resolutions=[(32, 32)], budget=TINY_BUDGET)


def test_cuda_device_is_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="no CUDA device"):
        profile(tiny(), resolutions=[(32, 32)], budget=TINY_BUDGET, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA-event timing path)")
def test_cuda_profile_uses_cuda_events():
    model = tiny()
    result = profile(model, resolutions=[(32, 32)], backends=["torch"], budget=TINY_BUDGET, device="cuda")
    assert result.environment["gpu"]["name"] and result.records[0].kernel.n == 2
    assert next(model.parameters()).device.type == "cpu"  # the caller's model stays where it was


# ----------------------------------------------------------------------------------------------
# the command


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_model(tiny("rope-axial"), path)
    return path


def test_cli_smoke_writes_every_output(capsys, tmp_path, ckpt_dir):
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(
        capsys,
        "profile",
        "--checkpoint",
        ckpt_dir,
        "--resolutions",
        "32,48",
        "--batch",
        "1",
        "--backend",
        "torch",
        "--iterations",
        2,
        "--warmup",
        1,
        "--json",
        out / "p.json",
        "--csv",
        out / "p.csv",
        "--plot",
        out / "p.png",
    )
    assert code == 0, stderr
    assert "rope-axial" in stdout and "ape" in stdout and "×APE" in stdout
    records = json.loads((out / "p.json").read_text())["records"]
    assert len(records) == 2 * 2  # encodings × resolutions (ONNX backends: the library tests above)
    assert (out / "p.png").read_bytes().startswith(PNG_MAGIC)
    assert (out / "p.csv").read_text().startswith(",".join(RECORD_FIELDS))


def test_cli_profiles_an_export_directory(capsys, tmp_path):
    export(tiny(), [(32, 32)], tmp_path / "exp", precisions=["fp32-mha", "fp32"])
    code, stdout, stderr = run_cli(
        capsys, "profile", tmp_path / "exp", "--iterations", 1, "--warmup", 0, "--no-end-to-end", "--json", tmp_path / "p.json"
    )
    assert code == 0, stderr
    report = json.loads((tmp_path / "p.json").read_text())
    settings = report["settings"]
    assert settings["resolutions"] == ["32"] and settings["encodings"] == ["ape"]
    # Without --precision, every plan the directory holds is timed (fp32 first): serve's choice is among them all.
    assert settings["precisions"] == ["fp32", "fp32-mha"]
    assert {r["precision"] for r in report["records"] if r["backend"] == "ort"} == {"fp32", "fp32-mha"}
    onnx_file = tmp_path / "exp" / "model_32.onnx"
    onnx_file.write_bytes(onnx_file.read_bytes() + b"\0")
    code, _, stderr = run_cli(capsys, "profile", tmp_path / "exp", "--iterations", 1)
    assert code == 1 and "changed since export" in stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--resolution", "40"], "not a positive multiple of the patch size 16"),
        (["--resolution", "0"], "not a positive multiple"),
        (["--backend", "tensorflow"], "unknown backend 'tensorflow'"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_1(capsys, tmp_path, ckpt_dir, args, message):
    code, stdout, stderr = run_cli(capsys, "profile", "--checkpoint", ckpt_dir, *args, "--json", tmp_path / "p.json")
    assert code == 1
    assert stderr.startswith("error: ") and message in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--resolutions", "32,abc"], "invalid resolution 'abc'"),
        (["--batch", "1,zero"], "invalid count 'zero'; expected positive integers"),
        (["--iterations", "0"], "--iterations"),
    ],
)
def test_cli_malformed_options_are_one_line_and_exit_2(capsys, tmp_path, ckpt_dir, args, message):
    code, stdout, stderr = run_cli(capsys, "profile", "--checkpoint", ckpt_dir, *args, "--json", tmp_path / "p.json")
    assert_usage_error(code, stderr, message)
    assert not (tmp_path / "p.json").exists()


# ----------------------------------------------------------------------------------------------
# sequence models: a length is the resolution


def test_sequence_model_flops_match_torch_flop_counter():
    model = create_model("seq_tiny_ega", depth=2).eval()
    baked = BakedModel(model, (24,))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        baked(torch.randint(0, 65, (3, 24)))
    assert model_flops(model.cfg, (24,), 3) == counter.get_total_flops()


@pytest.mark.slow
def test_sequence_model_profiles_lengths_against_its_ape_twin():
    model = create_model("seq_tiny_ega", depth=1).eval()
    result = profile(model, resolutions=[(40, 40), (80,)], batches=[2], backends=["torch", "ort"], budget=TINY_BUDGET, device="cpu")
    keys = sorted((r.backend, r.encoding, r.resolution) for r in result.records)
    assert keys == sorted((b, e, t) for b in ("torch", "ort") for e in ("mope", "ape") for t in ("40", "80"))
    assert all(r.e2e.n == 2 and r.ratio_vs_ape > 0 for r in result.records)
    with pytest.raises(ResolutionError, match="one length"):
        profile(model, resolutions=[(40, 48)], backends=["torch"], budget=TINY_BUDGET, device="cpu")


def test_kernels_are_timed_on_validate_s_real_inputs_filling_the_batch():
    """Seeded noise ran ONNX Runtime's fp32 graph 2.3x slower than images on a Xeon, so profile
    times real inputs: validate's (a zoo model's test split), repeated when the batch is larger."""
    from deploykit.inputs.builtin import VALIDATION_REAL, validation_inputs
    from deploykit.nn import load_model
    from deploykit.profile.targets import inputs, real_rows
    from deploykit.zoo.registry import DEFAULT_ZOO_MODEL, model_dir

    model = load_model(model_dir(DEFAULT_ZOO_MODEL))
    real = validation_inputs(model, (48, 48), 0, VALIDATION_REAL)
    rows = real_rows(model, (48, 48))
    images, frames = inputs(model, (48, 48), VALIDATION_REAL + 2, np.random.default_rng(0), rows)
    assert images.shape == (VALIDATION_REAL + 2, *real.shape[1:]) and len(frames) == VALIDATION_REAL + 2
    np.testing.assert_array_equal(images[:VALIDATION_REAL], real)
    np.testing.assert_array_equal(images[VALIDATION_REAL:], real[:2])
    np.testing.assert_array_equal(inputs(model, (48, 48), 1, np.random.default_rng(0), rows)[0], real[:1])


def test_a_profile_record_reads_back_from_its_json_object():
    """A results file's records come back typed (docs plot the committed sweeps from them): what
    ``to_dict`` wrote reads back into a record that writes the same object, run details included."""
    from deploykit.profile.report import ProfileRecord, Verdict
    from deploykit.profile.timing import LatencyStats

    kernel = LatencyStats.from_ns([1_000_000, 2_000_000, 4_000_000], batch=2)
    e2e = LatencyStats.from_ns([3_000_000, 5_000_000], batch=2)
    record = ProfileRecord(
        "ort", "int8", "rope-mixed", "64x48", 2, kernel, e2e=e2e, flops=3 * 10**9, run={"provider": "CPUExecutionProvider"},
        verdict=Verdict(False, ("top-1 agreement 0.5 < 0.99",)), ape_p50_ms=1.5, fp32_p50_ms=4.0, fastest_validated=False,
    )  # fmt: skip
    written = record.to_dict()
    assert ProfileRecord.from_dict(json.loads(json.dumps(written))).to_dict() == written
    old = {k: v for k, v in written.items() if k not in ("precision", "provider")}  # a sweep written before plans were named
    assert ProfileRecord.from_dict(old).precision == "fp32"
