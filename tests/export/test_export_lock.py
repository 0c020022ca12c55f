"""Two exports cannot clobber one directory, a killed export leaves nothing that lasts, and a
re-export never deletes a file deploykit did not write without being told to (issue 23).

No race is timed: the first export is paused at a known step (its progress callback) while the
second runs, in-process or in a child process that is then killed.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from deploykit.export import export
from deploykit.export.directory import BUILD_FILES, ENGINE_SUFFIXES, TIMING_CACHE_FILE, refit_graph_file, shared_weights_file
from deploykit.export.manifest import Manifest
from tests.export.test_staged_export import tiny
from tests.test_cli import RES, assert_one_line_error, run_cli, snapshot

ROOT = Path(__file__).resolve().parents[2]


def _beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


def test_a_second_export_into_the_same_directory_is_refused_while_the_first_runs(capsys, ckpt_dir, tmp_path):
    out, second = tmp_path / "out", []

    def progress(message):  # the first export, holding its directory: the second starts now
        if not second:
            second.append(run_cli(capsys, "export", "-c", ckpt_dir, "-r", "48", "-o", out))

    export(tiny(0), [(RES, RES)], out, progress=progress)
    code, _, err = second[0]
    assert_one_line_error(code, err, f"{out} is being written by deploykit process {os.getpid()}", "choose another --output")
    assert [g.file for g in Manifest.read(out).graphs] == [f"model_{RES}.onnx"]  # the first export, whole
    assert _beside(out) == []  # no lock file or staging directory left


# A child process exports two resolutions and stops before the second one, holding the output
# directory, until the test kills it.
CHILD = """
import sys
import torch
from deploykit.export import export
from deploykit.nn import create_model

def pause(message):
    if "48" in message:
        print("paused", flush=True)
        sys.stdin.read()

torch.manual_seed(0)
model = create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=10).eval()
export(model, [(32, 32), (48, 48)], sys.argv[1], progress=pause)
"""


@pytest.mark.slow
def test_a_killed_export_holds_nothing_and_its_staging_directory_is_removed(capsys, ckpt_dir, tmp_path):
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 900)  # only a guard against a hung child; no timing
        assert ready and child.stdout.readline().strip() == "paused", "the child export did not reach its second resolution"
        code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", RES, "-o", out)
        assert_one_line_error(code, err, f"is being written by deploykit process {child.pid}")
    finally:
        child.kill()
        child.wait(timeout=60)
    (staging,) = [name for name in _beside(out) if name.endswith(".staging")]  # what kill -9 left
    assert not out.exists()
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", RES, "-o", out)
    assert code == 0, err
    assert f"warning: removed {staging}, left by an export that did not finish" in err.splitlines(), err
    assert _beside(out) == [] and [g.file for g in Manifest.read(out).graphs] == [f"model_{RES}.onnx"]


def test_an_export_killed_inside_its_swap_is_put_back(tmp_path, caplog):
    """Killed between the swap's two renames: the previous export sits aside and ``out`` is gone."""
    out = tmp_path / "out"
    export(tiny(0), [(RES, RES)], out)
    aside = tmp_path / ".out.k3j9x2ab.staging.previous"
    out.rename(aside)
    with caplog.at_level(logging.WARNING, logger="deploykit"):
        export(tiny(0), [(48, 48)], out)  # the same weights: the graph put back is kept
    assert [g.file for g in Manifest.read(out).graphs] == [f"model_{RES}.onnx", "model_48.onnx"]
    assert f"restored {out} from {aside.name}" in caplog.text and _beside(out) == []


def _with_other_files(export_dir: Path) -> None:
    """A user's files, and files deploykit wrote: an engine and fingerprint of the graph, a
    timing cache, an interrupted atomic write's temporary file."""
    (export_dir / "notes.txt").write_text("mine")
    (export_dir / "results").mkdir()
    (export_dir / "results" / "table.csv").write_text("a,b")
    for name in (f"model_{RES}.trt.engine", f"model_{RES}.trt.json", *BUILD_FILES, ".manifest.json.x1y2z3w4.tmp"):
        (export_dir / name).write_text("deploykit's")


def test_a_reexport_refuses_to_delete_files_deploykit_did_not_write(capsys, ckpt_dir, export_copy):
    _with_other_files(export_copy)
    before = snapshot(export_copy)
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", "48", "-o", export_copy)
    assert_one_line_error(code, err, "holds 2 file(s) deploykit did not write: notes.txt, results/;", "--force")
    assert snapshot(export_copy) == before


def test_force_deletes_them_and_names_them(capsys, ckpt_dir, export_copy):
    _with_other_files(export_copy)
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", "48", "-o", export_copy, "--force")
    assert code == 0, err
    assert f"warning: deleting 2 file(s) deploykit did not write from {export_copy} (--force): notes.txt, results/" in err.splitlines()
    assert sorted(p.name for p in export_copy.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
        f"model_{RES}.onnx",
        f"model_{RES}.trt.engine",  # its graph is unchanged: kept
        f"model_{RES}.trt.json",
        "model_48.onnx",
    ]


@pytest.fixture
def export_copy(good_export, tmp_path) -> Path:
    import shutil

    dest = tmp_path / "export"
    shutil.copytree(good_export, dest)
    return dest


def test_the_files_export_knows_as_builds_are_the_ones_build_writes(tmp_path):
    from deploykit.backends.build import BuildSettings, build_options
    from deploykit.backends.engine_cache import engine_paths, runtime_cache_path
    from deploykit.runners.table import FLAVOURS

    written = {
        path.name.removeprefix("model_32") for module in (f.module for f in FLAVOURS) for path in engine_paths("model_32.onnx", module)
    }
    written |= {refit_graph_file("model_32.onnx", f.tag).name.removeprefix("model_32") for f in FLAVOURS}  # build --strip-weights
    written.add(runtime_cache_path("model_32.onnx").name.removeprefix("model_32"))  # TensorRT-RTX's runners write it
    assert written == set(ENGINE_SUFFIXES)
    options = build_options("tensorrt", tmp_path, BuildSettings())
    assert (Path(options.timing_cache).parent, Path(options.timing_cache).name) == (tmp_path, TIMING_CACHE_FILE)
    # and the one weights file of each flavour's weight-stripped engines
    assert set(BUILD_FILES) == {TIMING_CACHE_FILE, *(shared_weights_file(tmp_path, f.tag).name for f in FLAVOURS)}
