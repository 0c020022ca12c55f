"""Staged exports: written beside the output directory and swapped in at the end, so an
interrupted export leaves the previous one byte for byte, and a finished one leaves no stale file.

Interruptions are simulated by a step raising ``KeyboardInterrupt`` part-way: the progress
callback (before the second graph is traced), the write of the second graph, or the write of the
manifest (the last step). Models are tiny (depth 1, 32 px, patch 16) so each export takes a second.
"""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
import torch

from deploykit.errors import DeployKitError
from deploykit.export import bundle, export
from deploykit.export.manifest import Manifest
from deploykit.nn import create_model
from tests.test_cli import assert_one_line_error, run_cli, snapshot


def graph_opset(proto) -> int:
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def tiny(seed: int = 0):
    torch.manual_seed(seed)
    return create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=10).eval()


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    """An export of weights A at 32 px, plus what later steps leave beside it: an engine and its
    fingerprint for model_32.onnx, a validation report (written there by the user: not
    deploykit's to delete without --force), a timing cache."""
    out = tmp_path_factory.mktemp("previous") / "out"
    export(tiny(0), [(32, 32)], out)
    for name, text in (("model_32.trt.engine", "engine"), ("model_32.trt.json", "{}"), ("report.json", "[]"), ("timing.cache", "c")):
        (out / name).write_text(text)
    return out


@pytest.fixture
def existing(previous, tmp_path):
    dest = tmp_path / "work" / "out"
    shutil.copytree(previous, dest)
    return dest


def _interrupt_at(where: str, monkeypatch):
    """A progress callback, after patching the step ``where`` to raise KeyboardInterrupt."""
    if where == "progress":  # before tracing the second resolution

        def progress(message):
            if "48" in message:
                raise KeyboardInterrupt

        return progress
    target = {"second graph": "save_onnx", "manifest": "write_json_atomic"}[where]
    real, calls = getattr(bundle, target), []

    def interrupted(*args, **kwargs):
        calls.append(args)
        if target == "write_json_atomic" or len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bundle, target, interrupted)
    return None


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["progress", "second graph", "manifest"])
def test_interrupted_reexport_leaves_the_previous_export_byte_for_byte(existing, monkeypatch, where):
    before = snapshot(existing)
    progress = _interrupt_at(where, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        export(tiny(1), [(32, 32), (48, 48)], existing, progress=progress, force=True)  # other weights; --force: its report may go
    assert snapshot(existing) == before
    assert _leftovers(existing.parent) == []  # no staging directory left beside it


@pytest.mark.slow
@pytest.mark.parametrize("where", ["second graph", "manifest"])
def test_interrupted_fresh_export_leaves_nothing(tmp_path, monkeypatch, where):
    out = tmp_path / "fresh"
    progress = _interrupt_at(where, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        export(tiny(0), [(32, 32), (48, 48)], out, progress=progress)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_reexport_of_other_weights_leaves_only_the_new_export(existing):
    export(tiny(1), [(48, 48)], existing, force=True)  # the report is not deploykit's to delete unasked
    assert sorted(p.name for p in existing.iterdir()) == ["config.json", "manifest.json", "model.safetensors", "model_48.onnx"]
    assert _leftovers(existing.parent) == []  # neither the staging directory nor the previous export
    assert [g.file for g in Manifest.read(existing).graphs] == ["model_48.onnx"]


def test_reexport_of_the_same_weights_adds_resolutions_and_keeps_engines_of_unchanged_graphs(existing):
    graph_before = (existing / "model_32.onnx").read_bytes()
    export(tiny(0), [(48, 48)], existing, force=True)
    manifest = Manifest.read(existing)
    assert [g.file for g in manifest.graphs] == ["model_32.onnx", "model_48.onnx"]
    assert (existing / "model_32.onnx").read_bytes() == graph_before
    # the engine of the unchanged graph stays; the report and the timing cache do not
    assert sorted(p.name for p in existing.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
        "model_32.onnx",
        "model_32.trt.engine",
        "model_32.trt.json",
        "model_48.onnx",
    ]


def test_engines_of_a_graph_that_changed_do_not_survive(existing):
    export(tiny(0), [(32, 32)], existing, opset=17, force=True)  # same weights, same file name, other bytes
    assert graph_opset(onnx.load(str(existing / "model_32.onnx"))) == 17
    assert not (existing / "model_32.trt.engine").exists() and not (existing / "model_32.trt.json").exists()
    assert Manifest.read(existing).graphs[0].opset == 17


def test_a_directory_that_is_not_an_export_is_refused_untouched(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    before = snapshot(home)
    with pytest.raises(DeployKitError, match="not a deploykit export directory"):
        export(tiny(0), [(32, 32)], home)
    assert snapshot(home) == before


def test_interruption_inside_the_exporter_is_an_interruption_not_an_export_failure(capsys, monkeypatch, tmp_path):
    """torch.onnx.export turns a Ctrl-C caught mid-trace into its own error (seen: an
    AttributeError raised while handling the KeyboardInterrupt, wrapped in TorchExportError)."""

    def exporter_interrupted(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            try:
                raise AttributeError("'NoneType' object has no attribute 'graph'")
            except AttributeError as err:
                raise RuntimeError("Failed to export the model with torch.export.") from err

    monkeypatch.setattr(torch.onnx, "export", exporter_interrupted)
    code, _, err = run_cli(capsys, "-q", "export", "--model", "vit_tiny_patch16", "-r", "32", "-o", tmp_path / "out")
    assert code == 130 and err.strip() == "aborted", err
    assert not (tmp_path / "out").exists()


def test_a_real_export_failure_is_still_one_line(capsys, monkeypatch, tmp_path):
    """Control for the test above: an exporter error that no interrupt caused stays an error."""

    def exporter_fails(*args, **kwargs):
        raise RuntimeError("Failed to export the model with torch.export.")

    monkeypatch.setattr(torch.onnx, "export", exporter_fails)
    code, _, err = run_cli(capsys, "export", "--model", "vit_tiny_patch16", "-r", "32", "-o", tmp_path / "out")
    # the step already shown, then the error in one line
    assert err.splitlines()[0].startswith("export: exporting 32")
    assert_one_line_error(code, "\n".join(err.splitlines()[1:]), "torch.onnx.export failed")


def test_manifest_records_what_the_graph_is(tmp_path):
    manifest = export(tiny(0), [(32, 32)], tmp_path / "out", opset=17)
    graph = onnx.load(str(tmp_path / "out" / "model_32.onnx"))
    recorded = json.loads((tmp_path / "out" / "manifest.json").read_text())["graphs"][0]
    assert recorded["opset"] == graph_opset(graph) == manifest.graphs[0].opset == 17
