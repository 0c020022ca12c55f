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
    proc = subprocess.run(
        [sys.executable, "-m", "deploykit", "serve", str(tmp_path), "--port", "1", "--grpc-port", "2", "--metrics-port", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
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


def _serve(export_dir, *options) -> subprocess.CompletedProcess:
    """``deploykit serve`` in its own process; the timeout only guards against the hang this tests."""
    return subprocess.run(
        [sys.executable, "-m", "deploykit", "serve", str(export_dir), *map(str, options)],
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )


def test_serve_exits_with_one_line_when_its_port_is_taken(export_dir):
    import socket

    from server_process import free_ports

    http, grpc, metrics = free_ports(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", grpc))
        taken.listen()
        proc = _serve(export_dir, "--port", http, "--grpc-port", grpc, "--metrics-port", metrics)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip() == f"error: cannot listen on 127.0.0.1:{grpc} (gRPC port): Address already in use"
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "host, reason", [("256.0.0.1", "cannot listen on host '256.0.0.1'"), ("192.0.2.1", "cannot listen on 192.0.2.1:")]
)  # TEST-NET-1: never local
def test_serve_exits_with_one_line_on_a_host_it_cannot_listen_on(export_dir, host, reason):
    from server_process import free_ports

    proc = _serve(
        export_dir, "--host", host, *[x for pair in zip(("--port", "--grpc-port", "--metrics-port"), free_ports(3)) for x in pair]
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {reason}"), proc.stderr[-2000:]


def test_serve_ray_hands_the_library_its_own_defaults(capsys, export_dir, monkeypatch):
    """``serve --ray`` with no options deploys what ``RayOptions()`` deploys from Python: one
    default per setting, for the command line and the library alike."""
    from deploykit.serve import ray_serve

    deployed = []
    monkeypatch.setattr(ray_serve, "serve_ray", lambda directory, options, address=None, on_ready=None: deployed.append(options))
    code, err = run_cli(capsys, "serve", export_dir, "--ray")
    assert code == 0, err
    assert deployed == [ray_serve.RayOptions()]
