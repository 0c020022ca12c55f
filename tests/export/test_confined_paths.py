"""Every path ``manifest.json`` names stays inside the export directory.

Whoever writes the manifest writes the hashes too, so a hash proves nothing about where a file
is: a graph named ``../x``, by an absolute path, or through a symlink leading out is refused in
one line by ``Manifest.read``, before anything is read, copied or run, whichever command asks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from deploykit.errors import DeployKitError
from deploykit.export.bundle import load_reference
from deploykit.export.manifest import Manifest, checked_graph
from tests.test_cli import RES, assert_one_line_error, run_cli, snapshot

GRAPH = f"model_{RES}.onnx"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _point_manifest_at(export_dir: Path, target: str, sha256: str) -> None:
    manifest = json.loads((export_dir / "manifest.json").read_text())
    manifest["graphs"][0].update(file=target, sha256=sha256)
    (export_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def layout(good_export, tmp_path):
    """``tmp/case/export`` (a copy of a good export) and ``tmp/outside/evil.onnx``: the real
    graph, moved out of the export, with its true hash (validating it would pass)."""
    export_dir = tmp_path / "case" / "export"
    shutil.copytree(good_export, export_dir)
    outside = tmp_path / "outside"
    outside.mkdir()
    evil = outside / "evil.onnx"
    shutil.move(export_dir / GRAPH, evil)
    return export_dir, evil


def _escape(kind: str, export_dir: Path, evil: Path) -> str:
    """Make the manifest reach ``evil`` by a relative path, an absolute one, or a symlink."""
    if kind == "relative":
        target = os.path.relpath(evil, export_dir)
    elif kind == "absolute":
        target = str(evil)
    else:
        (export_dir / GRAPH).symlink_to(evil)
        target = GRAPH
    _point_manifest_at(export_dir, target, _sha256(evil))
    return target


@pytest.mark.parametrize("kind", ["relative", "absolute", "symlink"])
def test_validate_refuses_a_graph_outside_the_export(capsys, layout, kind):
    export_dir, evil = layout
    _escape(kind, export_dir, evil)
    code, _, err = run_cli(capsys, "validate", export_dir)
    assert_one_line_error(code, err, "outside the export directory")


@pytest.mark.parametrize("kind", ["relative", "absolute", "symlink"])
def test_package_triton_copies_nothing_from_outside(capsys, layout, tmp_path, kind):
    export_dir, evil = layout
    _escape(kind, export_dir, evil)
    repo = tmp_path / "repo"
    before = snapshot(tmp_path / "case")
    code, _, err = run_cli(capsys, "package", "triton", export_dir, "-o", repo)
    assert_one_line_error(code, err, "outside the export directory")
    assert not repo.exists()
    assert snapshot(tmp_path / "case") == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no half-written repository


def test_package_triton_does_not_copy_etc_passwd(capsys, good_export, tmp_path):
    """The issue's case: a manifest naming ../../../../etc/passwd with its sha256."""
    passwd = Path("/etc/passwd")
    if not passwd.is_file():
        pytest.skip("no /etc/passwd here")
    export_dir = tmp_path / "a" / "b" / "export"
    shutil.copytree(good_export, export_dir)
    _point_manifest_at(export_dir, "../../../../etc/passwd", _sha256(passwd))
    repo = tmp_path / "repo"
    code, _, err = run_cli(capsys, "package", "triton", export_dir, "-o", repo)
    assert_one_line_error(code, err, "etc/passwd", "outside the export directory")
    assert not repo.exists()


@pytest.mark.parametrize("kind", ["relative", "absolute", "symlink"])
def test_every_reader_goes_through_manifest_read(layout, kind):
    """build, profile and serve read graphs through Manifest.read / checked_graph: both refuse."""
    export_dir, evil = layout
    target = _escape(kind, export_dir, evil)
    with pytest.raises(DeployKitError, match="outside the export directory"):
        Manifest.read(export_dir)
    entry = json.loads((export_dir / "manifest.json").read_text())["graphs"][0]
    from deploykit.export.manifest import _graph_entry

    with pytest.raises(DeployKitError, match="outside the export directory"):
        checked_graph(export_dir, _graph_entry(entry))
    assert target  # the manifest really names the outside file


def test_build_refuses_before_building(layout):
    from deploykit.backends.build import build

    export_dir, evil = layout
    _escape("relative", export_dir, evil)
    with pytest.raises(DeployKitError, match="outside the export directory"):
        build(export_dir, "rtx")
    assert sorted(p.name for p in export_dir.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]


def test_reference_weights_through_a_symlink_are_refused(good_export, tmp_path):
    export_dir = tmp_path / "export"
    shutil.copytree(good_export, export_dir)
    outside = tmp_path / "weights.safetensors"
    shutil.move(export_dir / "model.safetensors", outside)
    (export_dir / "model.safetensors").symlink_to(outside)
    with pytest.raises(DeployKitError, match="outside the export directory"):
        load_reference(export_dir)


def test_a_symlink_inside_the_export_is_fine(good_export, tmp_path):
    """Control: confinement is about where a path leads, not about symlinks as such."""
    export_dir = tmp_path / "export"
    shutil.copytree(good_export, export_dir)
    (export_dir / "graphs").mkdir()
    shutil.move(export_dir / GRAPH, export_dir / "graphs" / GRAPH)
    (export_dir / GRAPH).symlink_to(Path("graphs") / GRAPH)
    manifest = Manifest.read(export_dir)
    assert checked_graph(export_dir, manifest.graphs[0]) == export_dir / GRAPH


@pytest.mark.parametrize("edit", ["unknown encoding", "graph listed twice"])
def test_a_manifest_naming_what_deploykit_never_writes_is_refused_in_one_line(good_export, tmp_path, edit):
    """An encoding name outside the registry (its text would reach reports and the packaged README),
    and a graph listed twice (it would be validated twice) are corrupt manifests."""
    export_dir = shutil.copytree(good_export, tmp_path / "export")
    manifest = json.loads((export_dir / "manifest.json").read_text())
    if edit == "unknown encoding":
        manifest["encoding"] = "<script>alert(1)</script>"
        expected = r"encoding '<script>alert\(1\)</script>' is not one deploykit has \(ape, "
    else:
        manifest["graphs"].append(dict(manifest["graphs"][0]))
        expected = rf"it lists {RES} \({GRAPH}\) twice"
    (export_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DeployKitError, match=r"^corrupt manifest .*" + expected) as err:
        Manifest.read(export_dir)
    assert "\n" not in str(err.value)
