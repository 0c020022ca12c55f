"""The serving commands fail like every other command: one ``error:`` line, exit 1, nothing written."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deploykit.cli import main


def run_cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def test_serve_refuses_a_directory_that_is_not_an_export(tmp_path):
    # a subprocess: `deploykit serve` installs a SIGTERM handler in its process
    proc = subprocess.run([sys.executable, "-m", "deploykit", "serve", str(tmp_path), "--port", "1", "--grpc-port", "2",
                           "--metrics-port", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error: ")
    assert "not a deploykit export directory" in proc.stderr


def test_package_triton_refuses_a_non_empty_output(capsys, export_dir, tmp_path):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "precious").write_text("keep")
    code, err = run_cli(capsys, "package", "triton", export_dir, "--output", out)
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "already exists" in err
    assert [p.name for p in out.iterdir()] == ["precious"]


@pytest.mark.parametrize("option", [("--preferred-batch-size", "64"), ("--gpu-instances", "0")])
def test_package_triton_bad_options(capsys, export_dir, tmp_path, option):
    code, err = run_cli(capsys, "package", "triton", export_dir, "--output", tmp_path / "repo", *option)
    assert code == 1 and err.startswith("error: "), err
    assert not (tmp_path / "repo").exists()
