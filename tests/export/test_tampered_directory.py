"""A tampered export directory is refused in one line by every reader, whatever was planted:
``manifest.json`` a FIFO (read, it blocks forever) or a link to ``/dev/zero`` (read, it never
ends), wrong types or deep nesting in the manifest, and ``profile_choice.json`` nested deep or
asking for more inference streams than there are cores."""

from __future__ import annotations

import json
import os

import pytest

from deploykit.errors import ConfigError, DeployKitError
from deploykit.export.directory import CHOICE_FILE, ExportDir
from deploykit.export.manifest import MANIFEST_FILE, Manifest
from deploykit.runners.streams import check_streams, usable_cores

ENTRY = {"resolution": [48, 48], "file": "model_48.onnx", "sha256": "0" * 64, "opset": 18}
MANIFEST = {"encoding": "ape", "weights_sha256": "0" * 64, "source": "default", "graphs": [ENTRY]}


def _manifest(tmp_path, data) -> None:
    (tmp_path / MANIFEST_FILE).write_text(data if isinstance(data, str) else json.dumps(data))


def test_the_well_formed_manifest_reads(tmp_path):  # the control for every refusal below
    _manifest(tmp_path, MANIFEST)
    assert Manifest.read(tmp_path).graphs[0].resolution == (48, 48)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_manifest_that_is_no_regular_file_is_refused_without_reading_it(tmp_path, kind):
    if kind == "fifo":
        os.mkfifo(tmp_path / MANIFEST_FILE)
    else:
        (tmp_path / MANIFEST_FILE).symlink_to(kind)
    with pytest.raises(DeployKitError, match=r"manifest\.json is not a regular file"):
        Manifest.read(tmp_path)


TAMPERED = {
    "encoding a number": {**MANIFEST, "encoding": 5},
    "graphs of strings": {**MANIFEST, "graphs": ["x"]},
    "resolution zero": {**MANIFEST, "graphs": [{**ENTRY, "resolution": [0, 0]}]},
    "resolution a fraction": {**MANIFEST, "graphs": [{**ENTRY, "resolution": [48.5, 48]}]},
    "opset a string": {**MANIFEST, "graphs": [{**ENTRY, "opset": "18"}]},
    "a list": [MANIFEST],
}


@pytest.mark.parametrize("case", TAMPERED)
def test_a_manifest_with_wrong_types_is_refused_in_one_line(tmp_path, case):
    _manifest(tmp_path, TAMPERED[case])
    with pytest.raises(DeployKitError, match=r"^corrupt manifest .*manifest\.json: ") as err:
        Manifest.read(tmp_path)
    assert "\n" not in str(err.value)


def test_a_manifest_nested_deep_is_refused_before_it_is_parsed(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    _manifest(tmp_path, json.dumps(MANIFEST)[:-1] + f', "preprocessing": {deep}}}')
    with pytest.raises(DeployKitError, match=r"preprocessing nests 100,001 levels deep; deploykit writes 12 at most"):
        Manifest.read(tmp_path)


CHOICE = {"backend": "ort", "precision": "fp32", "batch": 1, "p50_ms": 1.0, "graph_sha256": "0" * 64}


@pytest.mark.parametrize(
    ("choices", "expected"),
    [
        ({"48": [{**CHOICE, "streams": 1 + usable_cores()}]}, r"streams \d+: expected an integer from 1 to the \d+ usable cores"),
        ({"48": [{**CHOICE, "streams": "2"}]}, r"streams '2'"),
        ({"48": [{**CHOICE, "batch": [1]}]}, r"batch \[1\]"),
        ({"48": [[[[[[[[[[[[[[CHOICE]]]]]]]]]]]]]]}, r"choices nests 17 levels deep"),
    ],
)
def test_a_tampered_choice_is_refused_in_one_line(tmp_path, choices, expected):
    (tmp_path / CHOICE_FILE).write_text(json.dumps({"choices": choices}))
    with pytest.raises(DeployKitError, match=rf"profile_choice\.json is unreadable \(.*{expected}"):
        ExportDir(tmp_path).choices()
    (tmp_path / CHOICE_FILE).write_text(json.dumps({"choices": {"48": [CHOICE]}}))  # control
    assert ExportDir(tmp_path).choices()["48"][0].streams == 1


def test_a_choice_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / CHOICE_FILE)
    with pytest.raises(DeployKitError, match=r"profile_choice\.json is not a regular file"):
        ExportDir(tmp_path).choices()


def test_streams_are_bounded_by_the_cores():
    assert check_streams(usable_cores()) == usable_cores()
    with pytest.raises(ConfigError, match=r"streams must be an integer from 1 to the \d+ usable cores, got \d+"):
        check_streams(usable_cores() + 1)
