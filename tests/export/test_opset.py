"""A requested opset is honoured or refused in one line, and the manifest records the opset of
the graph it wrote, read from the graph."""

from __future__ import annotations

import json

import onnx
import pytest

from tests.test_cli import assert_one_line_error, run_cli


def _graph_opset(path) -> int:
    return next(o.version for o in onnx.load(str(path)).opset_import if o.domain in ("", "ai.onnx"))


@pytest.mark.parametrize("opset", [16, 12, 26, 99, -1])
def test_unsupported_opset_is_refused_with_the_range(capsys, tmp_path, opset):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "--model", "vit_tiny_patch16", "-r", "32", "--opset", opset, "-o", out)
    assert_one_line_error(code, err, f"opset {opset} is not supported", "17 to 25", "LayerNormalization")
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("opset", [17, 25])  # the ends of the documented range
def test_supported_opset_is_what_the_graph_and_the_manifest_say(capsys, tmp_path, opset):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "--model", "vit_tiny_patch16", "-r", "32", "--opset", opset, "-o", out)
    assert code == 0, err
    assert f"opset {opset})" in err
    assert "Traceback" not in err and "version converter" not in err  # the exporter's fallback chatter stays quiet
    assert _graph_opset(out / "model_32.onnx") == opset
    assert json.loads((out / "manifest.json").read_text())["graphs"][0]["opset"] == opset


@pytest.mark.slow
def test_sape2_needs_the_opset_of_its_function(capsys, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "-q", "export", "--model", "vit_tiny_patch16", "-e", "sape2", "-r", "32", "--opset", "19", "-o", out)
    assert_one_line_error(code, err, "deploykit::SaPE2Bias", "--opset 18", "not 19")
    assert not out.exists()
