"""Inputs that used to end in a traceback, a silent fallback or a wrong "pass": each is one
``error:`` line, a non-zero exit and nothing written (issue 18).

Commands run in-process through ``deploykit.cli.main`` with the helpers of ``test_cli``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from deploykit.checks import Reference, judge
from deploykit.errors import ConfigError
from deploykit.export.precision import PLANS
from deploykit.nn import save_model
from tests.test_cli import RES, assert_one_line_error, assert_usage_error, run_cli, small_model, snapshot


@pytest.fixture
def ckpt_copy(ckpt_dir, tmp_path):
    dest = tmp_path / "ckpt"
    shutil.copytree(ckpt_dir, dest)
    return dest


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# ----------------------------------------------------------------------------------------------
# sizes


def test_an_absurd_resolution_is_refused_with_the_bound(capsys, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "--model", "vit_tiny_patch16", "-r", "100000", "-o", out)
    # 6250 x 6250 patches + the class token, 3 heads: the bound is sqrt((2^31 - 1) / 3) tokens
    assert_one_line_error(code, err, "39,062,501 tokens", "2^31-1", "at most 26,754 tokens")
    assert not out.exists()


def test_the_largest_resolution_under_the_bound_is_not_refused():
    """Control: the bound is a bound, not a blanket refusal of large inputs."""
    from deploykit.export.onnx_export import check_export_shape
    from deploykit.nn import create_model

    model = create_model("vit_tiny_patch16", depth=1)
    # 163 x 163 patches + 1 = 26,570 tokens <= 26,754; 164 x 164 + 1 = 26,897 > 26,754
    assert check_export_shape(model, (163 * 16, 163 * 16)) == (2608, 2608)
    with pytest.raises(Exception, match="26,897 tokens"):
        check_export_shape(model, (164 * 16, 164 * 16))


@pytest.mark.parametrize(
    "changes, words",
    [
        # within the config's ranges but not these weights: refused by shape, on the meta device
        (dict(embed_dim=19_200, num_heads=3), ("does not fit", "19200")),
        (dict(img_size=16 * 1000), ("does not fit", "pos_embed")),
        (dict(num_classes=10**6), ("does not fit", "head")),
        (dict(depth=1000), ("1,000 blocks", "does not describe these weights")),
        # past the ranges: refused from the config alone, before any module exists (issue 23: an
        # embed_dim of 10^9 overflowed PyTorch's storage size with a traceback)
        (dict(embed_dim=10**9), ("embed_dim must be an integer from 1 to 65,536, got 1000000000",)),
        (dict(img_size=16 * 62_500), ("img_size must be an integer from 1 to 65,536",)),
        (dict(num_classes=10**9), ("num_classes must be an integer from 0 to",)),
        (dict(depth=10**7), ("depth must be an integer from 1 to 1,024",)),
        (dict(mlp_ratio=64.0, embed_dim=65_535, num_heads=3), ("mlp_ratio 64 makes the MLP 4,194,240 wide",)),
    ],
)
def test_a_config_with_huge_sizes_is_one_line(capsys, ckpt_copy, tmp_path, changes, words):
    _edit_json(ckpt_copy / "config.json", **changes)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt_copy, "-o", out)
    assert_one_line_error(code, err, *words)
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# config.json fields


@pytest.mark.parametrize("drop", [("encoding",), ("embed_dim",), ("encoding", "depth")])
def test_a_config_missing_required_fields_names_them(capsys, ckpt_copy, tmp_path, drop):
    data = json.loads((ckpt_copy / "config.json").read_text())
    for name in drop:
        del data[name]
    (ckpt_copy / "config.json").write_text(json.dumps(data))
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt_copy, "-o", out)
    line = assert_one_line_error(code, err, "missing required field")
    assert all(repr(name) in line for name in drop), line
    assert not out.exists()


def test_a_zero_std_is_refused_naming_the_field(capsys, ckpt_copy, tmp_path):
    _edit_json(ckpt_copy / "config.json", std=[0.229, 0.0, 0.225])
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt_copy, "-o", out)
    assert_one_line_error(code, err, "std must be a list of finite numbers, each > 0, got [0.229, 0.0, 0.225]")
    assert not out.exists()


@pytest.mark.parametrize(
    "changes, words",
    [
        # issue 23: a traceback
        (dict(mlp_ratio=-1.0), ("mlp_ratio must be a finite number > 0", "got -1.0")),
        (dict(mean=5), ("mean must be a list of finite numbers, got 5",)),
        (dict(encoding=["ape"]), ("encoding must be an object naming the encoding", "got ['ape']")),
        # issue 23: exported, then crashing in validate or ONNX Runtime
        (dict(norm_eps=float("nan")), ("norm_eps must be a finite number", "got nan")),
        (dict(norm_eps=-1e-6), ("norm_eps must be a finite number from", "got -1e-06")),
        (dict(mean=[0.485, 0.456]), ("mean and std need one value per input channel (in_chans 3), got 2 and 3",)),
        (dict(in_chans=1), ("in_chans 1", "got 3 and 3")),
        (dict(dataset="imagenet"), ("dataset must be null or one of shape-relations", "got 'imagenet'")),
        (dict(std=[1e-30] * 3), ("mean[0] 0.485 and std[0] 1e-30 take [0, 1] pixels to 5.15e+29",)),
        (dict(mean=[1e38, 0.456, 0.406]), ("mean[0] 1e+38",)),
        # issue 23: a bool is not an int (accepted as 1), nor an int a bool
        (dict(depth=True), ("depth must be an integer from 1 to 1,024, got true",)),
        (dict(qkv_bias=1), ("qkv_bias must be true or false, got 1",)),
        (dict(class_token="yes"), ("class_token must be true or false, got 'yes'",)),
        (dict(encoding={"name": "ape", "antialias": "no"}), ("encoding 'ape' option antialias must be true or false, got 'no'",)),
        (dict(encoding={"name": ["ape"]}), ("encoding must be an object naming the encoding", "got an object with 1 key")),
    ],
)
def test_a_config_value_is_refused_naming_the_field(capsys, ckpt_copy, tmp_path, changes, words):
    _edit_json(ckpt_copy / "config.json", **changes)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt_copy, "-o", out)
    assert_one_line_error(code, err, "invalid model config", *words)
    assert not out.exists()


@pytest.mark.parametrize("depth", [50, 100_000])  # under and over what Python's JSON reader recurses to
def test_a_deeply_nested_config_is_one_line(capsys, ckpt_copy, tmp_path, depth):
    text = (ckpt_copy / "config.json").read_text().rstrip().removesuffix("}")
    (ckpt_copy / "config.json").write_text(f'{text}, "std": {"[" * depth}{"]" * depth}}}')
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt_copy, "-o", out)
    assert_one_line_error(code, err, "invalid model config", f"std nests {depth + 1:,} levels deep; a model config nests 8 at most")
    assert not out.exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(capsys, ckpt_copy, tmp_path, value):
    weights = load_file(str(ckpt_copy / "model.safetensors"))
    weights["blocks.0.attn.qkv.weight"][0, :3] = value
    save_file(weights, str(ckpt_copy / "model.safetensors"))
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt_copy, "-o", out)
    kind = "3 NaN" if np.isnan(value) else "3 Inf"
    assert_one_line_error(code, err, "not finite", "blocks.0.attn.qkv.weight", kind)
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# validate


def test_validate_a_file(capsys, good_export):
    code, _, err = run_cli(capsys, "validate", good_export / "manifest.json")
    assert_one_line_error(code, err, "is a file", "not a deploykit export directory")


def test_validate_with_nothing_to_compare(capsys, good_export):
    code, _, err = run_cli(capsys, "validate", good_export, "--num-random", "0", "--num-real", "0")
    assert_one_line_error(code, err, "nothing to compare")


@pytest.mark.parametrize("option, value", [("--num-random", "-3"), ("--num-real", "-1"), ("--seed", "-1"), ("--seed", "x")])
def test_validate_negative_counts_and_seeds_are_usage_errors(capsys, good_export, option, value):
    code, _, err = run_cli(capsys, "validate", good_export, option, value)
    assert_usage_error(code, err, option, value)


def test_validate_more_real_inputs_than_exist_is_refused_before_any_run(capsys, good_export):
    """The small model names no dataset: its real inputs are the 8 bundled images."""
    code, _, err = run_cli(capsys, "validate", good_export, "--num-real", "9")
    assert_one_line_error(code, err, "--num-real 9", "8 bundled sample images", "at most 8")  # one line: no run started
    code, _, err = run_cli(capsys, "validate", good_export, "--num-real", "8", "--num-random", "0", "-q")
    assert code == 0, err  # control: all of them is fine


def test_real_input_limits_follow_the_models_data():
    from deploykit.inputs.builtin import check_real_count

    zoo_like = small_model()
    zoo_like.cfg = dataclasses.replace(zoo_like.cfg, dataset="shape-relations")
    check_real_count(zoo_like, 2000, "test", "--num-real")  # the test split holds 2000
    with pytest.raises(ConfigError, match=r"--num-real 2001 .*2000 images in shape-relations's test split"):
        check_real_count(zoo_like, 2001, "test", "--num-real")
    with pytest.raises(ConfigError, match=r"--held-out 1001 .*1000 images in shape-relations's val split"):
        check_real_count(zoo_like, 1001, "val", "--held-out")
    check_real_count(zoo_like, 10**6, "train", "--calibration-samples")  # a stream
    check_real_count(small_model(), 10**6, "val", "--held-out")  # seeded crops of the bundled images


def test_held_out_beyond_the_val_split_is_refused_not_capped(capsys, ckpt_copy, tmp_path):
    _edit_json(ckpt_copy / "config.json", dataset="shape-relations")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt_copy, "--precision", "int8", "--held-out", "1001", "-o", out)
    assert_one_line_error(code, err, "--held-out 1001", "val split", "at most 1000")  # one line: before the first graph
    assert not out.exists()


def test_validate_report_into_a_directory_is_refused_before_the_work(capsys, good_export, tmp_path):
    report = tmp_path / "reports"
    report.mkdir()
    code, _, err = run_cli(capsys, "validate", good_export, "--report", report)
    assert_one_line_error(code, err, "is a directory")  # one line: no check ran before it
    assert list(report.iterdir()) == []


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("resolution", [48, 48], ("resolution (48, 48) in the manifest", f"({RES}, {RES}) in the graph")),
        ("resolution", [48, RES], ("resolution",)),
        ("opset", 16, ("opset 16 in the manifest", "18 in the graph")),
        ("precision", "fp16", ("precision fp16 in the manifest",)),
    ],
)
def test_a_manifest_entry_edited_away_from_its_graph(capsys, good_export, tmp_path, field, value, words):
    export_dir = tmp_path / "export"
    shutil.copytree(good_export, export_dir)
    manifest = json.loads((export_dir / "manifest.json").read_text())
    manifest["graphs"][0][field] = value
    (export_dir / "manifest.json").write_text(json.dumps(manifest))
    args = ["--precision", "fp16"] if field == "precision" else []
    code, _, err = run_cli(capsys, "validate", export_dir, *args)
    assert_one_line_error(code, err, "disagrees with", *words)


def test_cosine_of_a_nan_output_is_not_one():
    reference = np.array([[1.0, 2.0, 3.0], [3.0, 1.0, 2.0]])
    actual = reference.copy()
    actual[1] = np.nan
    result = _fp32(reference, actual)
    assert np.isnan(result.metrics["cosine"]) and f"{result.metrics['cosine']:.8f}" == "nan"
    assert not result.passed and "3 NaN / 0 Inf" in result.failures


def test_cosine_of_a_zero_output_against_a_non_zero_reference_is_zero():
    reference = np.array([[1.0, 2.0, 3.0]])
    assert _fp32(reference, np.zeros_like(reference)).metrics["cosine"] == 0.0
    assert _fp32(np.zeros((1, 3)), np.zeros((1, 3))).metrics["cosine"] == 1.0


def test_a_nan_reference_is_named():
    reference = np.array([[np.nan, 2.0, 3.0]])
    result = _fp32(reference, np.array([[1.0, 2.0, 3.0]]))
    assert "the PyTorch reference has 1 NaN / 0 Inf" in result.failures and not result.passed


def _fp32(reference, actual):
    """``actual`` judged against ``reference`` by the fp32 plan's criteria, every input noise."""
    return judge(Reference.of_outputs(reference), actual, PLANS["fp32"].criteria).result


# ----------------------------------------------------------------------------------------------
# profile


@pytest.mark.parametrize(
    "option, value",
    [("--duration", "-1"), ("--duration", "nan"), ("--duration", "inf"), ("--warmup", "-2"), ("--rounds", "0"), ("--batch", "8,0")],
)
def test_profile_budget_is_one_plain_line(capsys, good_export, option, value):
    code, _, err = run_cli(capsys, "profile", good_export, option, value)
    line = assert_usage_error(code, err, option)
    assert "Budget(" not in line and "duration_s" not in line, line


def test_profile_plot_without_matplotlib_is_refused_before_timing(capsys, monkeypatch, good_export, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    plot = tmp_path / "p.png"
    code, _, err = run_cli(capsys, "profile", good_export, "--iterations", "1", "--no-ape-baseline", "--plot", plot)
    assert_one_line_error(code, err, "matplotlib", "deploykit[plot]")  # one line: no "profile:" step ran
    assert not plot.exists()


# ----------------------------------------------------------------------------------------------
# zoo


def test_zoo_train_does_not_overwrite_without_force(capsys, tmp_path):
    trained = tmp_path / "shapes-ape"
    save_model(small_model(), trained)
    before = snapshot(trained)
    code, _, err = run_cli(capsys, "zoo", "train", "shapes-ape", "--steps", "1", "--root", tmp_path)
    assert_one_line_error(code, err, "already holds a trained model", "--force")
    assert snapshot(trained) == before
    code, _, err = run_cli(capsys, "zoo", "train", "shapes-ape", "--steps", "1", "--root", tmp_path, "--force")
    assert code == 0, err
    assert snapshot(trained) != before


def test_no_untrained_model_in_place_of_a_missing_zoo(capsys, monkeypatch, tmp_path):
    """A wheel ships no models/: export without --checkpoint/--model refuses instead of
    exporting a seeded untrained model as if it were the zoo's."""
    from deploykit.zoo import registry

    monkeypatch.setattr(registry, "zoo_dir", lambda: tmp_path / "site-packages" / "models")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-o", out)
    assert_one_line_error(code, err, "no trained zoo model", "--model")
    code, _, err = run_cli(capsys, "export", "-e", "rope-axial", "-o", out)
    assert_one_line_error(code, err, "no trained zoo model for encoding rope-axial")
    assert not out.exists()
