"""What the CLI prints: whole lines at any width and path length, one line per step of long work
when not on a terminal, units in the profile table, ``-q``/``-v``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deploykit.export.manifest import Manifest
from deploykit.nn import create_model, save_model
from deploykit.profile import ProfileRecord, ProfileReport
from deploykit.profile.output import render_table
from deploykit.profile.timing import LatencyStats
from tests.test_cli import RES, run_cli

LONG = "a_directory_name_long_enough_to_wrap_any_terminal_" * 3


@pytest.fixture
def narrow(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")


def test_export_lines_are_whole_at_40_columns_with_a_long_path(capsys, narrow, ckpt_dir, tmp_path):
    out = tmp_path / LONG / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", RES, "-o", out)
    assert code == 0, err
    assert f"✓ {out / f'model_{RES}.onnx'}  ({RES}, fp32, opset 18)" in err.splitlines()


@pytest.mark.slow
def test_cli_exports_a_range_in_a_line_whole_at_40_columns(capsys, narrow, tmp_path):
    """``export --resolution-range`` from the command line: one graph in the manifest, and its
    line whole on a narrow terminal with a long path (it broke on long temp paths)."""
    torch.manual_seed(0)  # a one-block GeoPE model (ranges are for the rotary encodings)
    checkpoint = save_model(create_model("vit_tiny_patch16", encoding="geope", depth=1, img_size=32, num_classes=10), tmp_path / "geope")
    out = tmp_path / LONG / "g"
    code, _, err = run_cli(capsys, "export", "-c", checkpoint, "--resolution-range", "32:48:64", "-o", out)
    assert code == 0, err
    assert f"✓ {out / 'model_32-64.onnx'}  (32 to 64, tuned for 48, fp32, opset 18)" in err.splitlines()
    assert [g.file for g in Manifest.read(out).graphs] == ["model_32-64.onnx"]


def test_validate_lines_are_whole_at_40_columns(capsys, narrow, good_export, tmp_path):
    report = tmp_path / LONG / "report.json"
    code, _, err = run_cli(capsys, "validate", good_export, "--num-random", "1", "--num-real", "1", "--report", report)
    assert code == 0, err
    lines = err.splitlines()
    assert "1/1 checks passed" in lines and f"report: {report}" in lines
    assert any(line.startswith("✓ ort") and "NaN/Inf 0/0" in line for line in lines), lines


@pytest.mark.slow
def test_one_line_per_step_when_not_a_terminal(capsys, ckpt_dir, good_export, tmp_path):
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", RES, "-r", "48", "-o", tmp_path / "out")
    assert code == 0, err
    steps = [line for line in err.splitlines() if line.startswith("export: ")]
    assert [s.split("  (")[0] for s in steps] == [f"export: exporting {RES}", "export: exporting 48"], err
    code, _, err = run_cli(capsys, "validate", good_export, "--num-random", "1", "--num-real", "1")
    assert [line.split("  (")[0] for line in err.splitlines() if line.startswith("validate: ")] == [
        f"validate: ort @ model_{RES}.onnx",
        f"validate: PyTorch reference at {RES}: 2 of 2 inputs",
    ]


def test_long_steps_count_their_progress(capsys, good_export):
    """Inside a step, n of N: the float64 PyTorch reference over 4 noise + 8 real inputs, 4 a batch."""
    code, _, err = run_cli(capsys, "validate", good_export)
    assert code == 0, err
    counts = [line.split("  (")[0] for line in err.splitlines() if line.startswith(f"validate: PyTorch reference at {RES}: ")]
    assert counts == [f"validate: PyTorch reference at {RES}: {n} of 12 inputs" for n in (4, 8, 12)], err


def test_counts_are_shown_a_few_times_whatever_the_total():
    from deploykit._terminal import counter

    for total, batch in [(128, 8), (1000, 32), (12, 4), (1, 1), (7, 3)]:
        shown = []
        tick = counter(shown.append, "work", total, "inputs")
        for done in range(batch, total + batch, batch):
            tick(min(done, total))
        numbers = [int(line.split(": ")[1].split(" of ")[0]) for line in shown]
        assert len(shown) <= 11 and numbers == sorted(numbers) and numbers[0] == min(batch, total) and numbers[-1] == total, shown
        assert all(line.endswith(f" of {total} inputs") for line in shown)


def test_third_party_root_logging_does_not_print_deploykit_warnings_twice(monkeypatch, capsys):
    """ONNX Runtime's quantizer logs with module-level ``logging.warning``, which installs a root
    handler (``basicConfig``) when the root has none, as outside pytest: the int8 export's later
    warnings then came out twice, the second time as ``WARNING:deploykit.export...:``."""
    import logging

    from deploykit._terminal import configure_logging, quiet_logger

    monkeypatch.setattr(logging.root, "handlers", [])  # as in the console script: no root handler
    with quiet_logger(""):
        logging.warning("Please consider to run pre-processing before quantization.")
    assert logging.root.handlers == []
    configure_logging(0)
    logging.getLogger("deploykit.export.sensitivity").warning("the int8 plan misses its target")
    assert capsys.readouterr().err == "warning: the int8 plan misses its target\n"


def test_quiet_prints_results_only(capsys, ckpt_dir, tmp_path):
    code, _, err = run_cli(capsys, "-q", "export", "-c", ckpt_dir, "-r", RES, "-o", tmp_path / "out")
    assert code == 0, err
    assert err.splitlines() == [f"✓ {tmp_path / 'out' / f'model_{RES}.onnx'}  ({RES}, fp32, opset 18)"]


@pytest.mark.slow
def test_warnings_by_default_info_with_v_nothing_with_q(capsys, ckpt_dir, tmp_path):
    """A re-export of the same weights keeps the previous graphs (info) unless one changed (warning)."""
    out = tmp_path / "out"
    assert run_cli(capsys, "export", "-c", ckpt_dir, "-r", RES, "-r", "48", "-o", out)[0] == 0
    code, _, err = run_cli(capsys, "-v", "export", "-c", ckpt_dir, "-r", "64", "-o", out)
    assert code == 0 and f"info: keeping model_{RES}.onnx of the previous export" in err, err
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", "64", "-o", out)
    assert code == 0 and "keeping" not in err, err
    (out / "model_48.onnx").write_bytes(b"changed")
    code, _, err = run_cli(capsys, "-q", "export", "-c", ckpt_dir, "-r", "64", "-o", out)
    assert code == 0 and "not keeping" not in err, err
    (out / f"model_{RES}.onnx").write_bytes(b"changed too")
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", "64", "-o", out)
    assert code == 0 and any(line.startswith(f"warning: not keeping model_{RES}.onnx") for line in err.splitlines()), err


def test_profile_table_has_units():
    kernel = LatencyStats(
        p50_ms=1.0, p90_ms=1.1, p95_ms=1.15, p99_ms=1.2, mean_ms=1.0, std_ms=0.1, min_ms=0.9, max_ms=1.3, n=5, throughput_per_s=1000.0
    )
    step = dataclasses.replace(kernel, p50_ms=0.1)
    record = ProfileRecord("ort", "fp32", "ape", "32", 1, kernel, pe_step=step, flops=2 * 10**6)  # 2 GFLOP/s
    table = render_table(ProfileReport([record], {}, {}))
    headers = [str(column.header) for column in table.columns]
    for header in ("p50 (ms)", "p90 (ms)", "p99 (ms)", "mean ± std (ms)", "e2e p50 (ms)", "img/s", "GFLOP/s"):
        assert header in headers, headers


def test_profile_shows_its_steps_and_a_whole_table(capsys, narrow, good_export):
    code, out, err = run_cli(capsys, "profile", good_export, "--iterations", 1, "--warmup", 0, "--no-end-to-end", "--no-ape-baseline")
    assert code == 0, err
    steps = [line for line in err.splitlines() if line.startswith("profile: ")]
    assert any(s.startswith("profile: ort ape") and "@ 32" in s for s in steps), err
    assert any(s.startswith("profile: torch ape") and "@ 32" in s for s in steps), err
    assert "p50 (ms)" in out
    rows = [line.replace("│", " ").split() for line in out.splitlines() if " ort " in line]  # one line per row, at 40 columns
    assert rows and all(row[row.index("ort") + 1 : row.index("ort") + 4] == ["fp32", "ape", "32"] for row in rows), out
    assert any("torch " in line and "load avg" in line for line in out.splitlines()), out  # the environment caption, whole
