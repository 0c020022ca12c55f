"""The export directory has one owner: ``ExportDir`` knows every file deploykit keeps there, so
what an export writes, what ``profile`` adds and what a re-export may replace agree."""

from __future__ import annotations

import re

import pytest

from deploykit.export import export
from deploykit.export.directory import Choice, ExportDir
from deploykit.export.manifest import Manifest
from deploykit.profile import Budget
from tests.export.test_staged_export import tiny
from tests.test_cli import RES, assert_one_line_error, run_cli, snapshot

QUICK = ("--backend", "ort", "--iterations", "1", "--warmup", "0", "--no-ape-baseline", "--no-end-to-end")


def test_it_lists_exactly_the_files_the_export_wrote_and_nothing_of_the_user_s(tmp_path):
    out = tmp_path / "out"
    export(tiny(0), [(RES, RES)], out, precisions=["fp16"])
    directory = ExportDir(out)
    written = sorted(p.name for p in out.iterdir())
    assert written == ["config.json", "manifest.json", "model.safetensors", f"model_{RES}.onnx", f"model_{RES}_fp16.onnx"]
    assert directory.files() == written and directory.foreign_files() == []
    (out / f"model_{RES}_fp16.trt.engine").write_bytes(b"engine")  # build's, beside a graph the manifest names
    (out / "model_96.trt.engine").write_bytes(b"engine")  # beside no graph of this export
    (out / "notes.txt").write_text("mine")
    assert directory.files() == sorted([*written, f"model_{RES}_fp16.trt.engine"])
    assert directory.foreign_files() == ["model_96.trt.engine", "notes.txt"]
    assert directory.derived_files(f"model_{RES}_fp16.onnx") == [out / f"model_{RES}_fp16.trt.engine"]


def test_a_reexport_into_a_directory_with_foreign_files_is_refused_and_changes_nothing(capsys, ckpt_dir, good_export, tmp_path):
    import shutil

    out = shutil.copytree(good_export, tmp_path / "out")
    (out / "report.json").write_text("[]")
    before = snapshot(out)
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", RES, "-o", out)
    assert_one_line_error(code, err, "holds 1 file(s) deploykit did not write: report.json;")
    assert snapshot(out) == before


def test_export_profile_export_keeps_the_choice_of_the_unchanged_graphs_only(capsys, ckpt_dir, tmp_path):
    """A new user's round trip: export, profile, export again into the same directory."""
    out = tmp_path / "out"
    assert run_cli(capsys, "export", "-c", ckpt_dir, "-r", RES, "-o", out)[0] == 0
    code, _, err = run_cli(capsys, "profile", out, *QUICK)
    assert code == 0, err
    directory = ExportDir(out)
    choices = directory.choices()
    assert [(c.backend, c.precision, c.batch) for c in choices[str(RES)]] == [("ort", "fp32", 1)]
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", RES, "-o", out)  # the refused step
    assert code == 0, err
    assert directory.choices() == choices  # its graph is byte-identical: the measurement still holds
    assert directory.foreign_files() == []


def test_a_reexport_drops_the_choices_whose_graph_it_changed(tmp_path):
    out = tmp_path / "out"
    export(tiny(0), [(RES, RES)], out)
    (graph,) = Manifest.read(out).graphs
    kept = Choice("ort", "fp32", 1, 1.0, graph.sha256)
    ExportDir(out).write_choices(
        {str(RES): [kept, Choice("ort", "fp16", 8, 2.0, "0" * 64)], "48": [Choice("ort", "fp32", 1, 3.0, "0" * 64)]}
    )
    export(tiny(0), [(RES, RES)], out)  # the same graph: its choice holds, the others name graphs not there
    assert ExportDir(out).choices() == {str(RES): [kept]}
    export(tiny(1), [(RES, RES)], out)  # other weights, other graph bytes
    assert not ExportDir(out).choice_file.exists()


def test_profile_from_python_writes_the_choice_that_load_takes(good_export, tmp_path):
    import shutil

    import deploykit
    from deploykit.profile import profile

    out = shutil.copytree(good_export, tmp_path / "out")
    report = profile(out, backends=["ort"], budget=Budget(iterations=1, warmup=0), compare_ape=False, end_to_end=False)
    assert report.choice_file == ExportDir(out).choice_file
    (chosen,) = ExportDir(out).choices()[str(RES)]
    assert (chosen.backend, chosen.precision) == ("ort", "fp32")
    assert report.settings["model"] == str(out) and report.settings["resolutions"] == [str(RES)]  # the export's, by default
    with deploykit.load(out) as pipe:
        # "backend ort at 32 (...", or "backend ort with N inference streams (a lone call on all cores) at 32 (..." where
        # profile measured streams paying
        assert re.match(
            rf"backend ort (with \d+ inference streams \(a lone call on all cores\) )?at {RES} \(fastest validated plan at batch 1 in deploykit profile",
            pipe.describe_backends()[0],
        )


def test_profile_of_a_model_writes_no_choice_anywhere(tmp_path, monkeypatch):
    from deploykit.profile import profile

    monkeypatch.chdir(tmp_path)
    report = profile(tiny(0), backends=["torch"], budget=Budget(iterations=1, warmup=0), compare_ape=False, end_to_end=False)
    assert report.choice_file is None and list(tmp_path.iterdir()) == []


def test_an_unknown_profile_option_is_one_clear_error():
    from deploykit.errors import ConfigError
    from deploykit.profile import profile

    with pytest.raises(ConfigError, match="unknown option.*ProfileOptions"):
        profile(tiny(0), resolution=[(RES, RES)])


def test_reading_an_export_directory_needs_no_pytorch():
    """``package triton`` and the CPU servers read export directories; PyTorch is not theirs to load."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, deploykit.export.directory; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
