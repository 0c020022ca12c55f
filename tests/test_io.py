"""Where deploykit's files go: a file the user named (``output_file``) lands where the user asked
(a symlink's target, a FIFO, a character device) or is refused in one line; a regular file that
was there is replaced with a warning, keeping its permissions; the export lock never follows a
planted link or truncates what is behind it."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deploykit._io import directory_lock, write_json_atomic, write_output_text
from deploykit.errors import DeployKitError


def test_a_new_name_and_a_symlinks_target_get_the_bytes_and_the_link_stays(tmp_path):
    assert write_output_text(tmp_path / "new.json", "{}\n") == tmp_path / "new.json"
    assert (tmp_path / "new.json").read_text() == "{}\n"
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    link.symlink_to(target)  # dangling: the target is created
    write_output_text(link, "first")
    write_output_text(link, "second")
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == "second"


def test_an_existing_file_is_replaced_with_a_warning_and_keeps_its_permissions(tmp_path, caplog):
    path = tmp_path / "report.json"
    path.write_text("someone's notes")
    path.chmod(0o640)
    with caplog.at_level(logging.WARNING, logger="deploykit._io"):
        write_output_text(path, "{}")
    assert path.read_text() == "{}" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [r.getMessage() for r in caplog.records] == [f"replacing {path}, which existed before this command"]


def test_a_fifo_is_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_output_text(fifo, "streamed")
    reader.join(timeout=60)  # a guard against a hang, not a timing
    assert received == [b"streamed"] and stat.S_ISFIFO(fifo.stat().st_mode)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_a_character_device_is_written_in_place_and_a_failed_write_is_one_line():
    with pytest.raises(DeployKitError, match=r"^cannot write /dev/full: No space left on device$"):
        write_output_text("/dev/full", "x" * 100_000)
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # still the device, not a regular file


def test_a_directory_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(DeployKitError, match="it is a directory; give a file name"):
        write_output_text(tmp_path, "x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_the_cli_writes_its_json_into_a_device_without_replacing_it(tmp_path):
    from deploykit.export import export
    from deploykit.nn import create_model

    export(create_model("vit_tiny_patch16", depth=1, img_size=32, num_classes=4), [(32, 32)], tmp_path / "out")
    graph = next((tmp_path / "out").glob("*.onnx"))
    proc = subprocess.run([sys.executable, "-m", "deploykit", "inspect", str(graph), "--json", "/dev/full"], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == "error: cannot write /dev/full: No space left on device"
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_files_inside_deploykits_own_directories_replace_a_planted_link_instead_of_following_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").symlink_to(victim)
    write_json_atomic(tmp_path / "out" / "manifest.json", {"ok": True})
    assert victim.read_text() == "precious" and not (tmp_path / "out" / "manifest.json").is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's link takes root (lchown)")
@pytest.mark.parametrize("through", ["file", "directory"])
def test_a_link_another_user_planted_in_a_sticky_shared_directory_is_refused_as_the_kernel_would(tmp_path, through):
    """fs.protected_symlinks: root does not follow a link in a sticky world-writable directory
    (``/tmp``) that neither root nor the directory's owner made; a path deploykit resolves itself
    must not either, whether the link is the file or a directory on the way."""
    victim_dir = tmp_path / "root-only"
    victim_dir.mkdir()
    victim = victim_dir / "passwd"
    victim.write_text("root's file")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    link = shared / ("report.json" if through == "file" else "reports")
    link.symlink_to(victim if through == "file" else victim_dir)
    dest = link if through == "file" else link / "passwd"
    write_output_text(dest, "root's own link is followed")  # the control: the same link, root's own
    assert victim.read_text() == "root's own link is followed"
    os.lchown(link, 4242, 4242)  # now planted by another user
    with pytest.raises(
        DeployKitError, match=r"^cannot write .*owned by uid 4242 in the sticky world-writable directory .*protected_symlinks"
    ):
        write_output_text(dest, "overwritten by root")
    assert victim.read_text() == "root's own link is followed"
    shared.chmod(0o777)  # not sticky: the kernel would follow it, and so does deploykit
    write_output_text(dest, "not sticky")
    assert victim.read_text() == "not sticky"


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_the_export_lock_refuses_a_planted_file_and_leaves_its_target_alone(tmp_path, planted):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    lock = tmp_path / ".out.lock"
    if planted == "symlink":
        lock.symlink_to(victim)
        expected = "is a symbolic link; remove it"
    else:
        os.mkfifo(lock)
        expected = "is not a regular file; remove it"
    with pytest.raises(DeployKitError, match=expected):
        with directory_lock(tmp_path / "out"):
            pass
    assert victim.read_text() == "precious"
