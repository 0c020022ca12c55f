"""The ``deploykit`` command end to end: bad input gives one ``error:`` line, exit 1, and writes nothing.

Commands run in-process through ``deploykit.cli.main`` (what the console script calls), with
stdout/stderr captured by ``capsys``; one test runs ``python -m deploykit`` in a subprocess.
Models are tiny (depth 1, 32x32 input, patch 16 → 2x2 grid) so every export takes about a second.
"""

from __future__ import annotations

import collections
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploykit.cli import main
from deploykit.nn import create_model, save_model

RES = 32  # the small model's native resolution (multiple of patch 16)
RECORD_KEYS = {
    "backend",
    "resolution",
    "max_abs",
    "mean_abs",
    "max_rel",
    "cosine",
    "top1_agreement",
    "top5_agreement",
    "nan_count",
    "inf_count",
    "passed",
}


# ----------------------------------------------------------------------------------------------
# helpers


def small_model(depth: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    return create_model("vit_tiny_patch16", encoding="ape", depth=depth, img_size=RES, num_classes=10).eval()


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """Run ``deploykit ARGS`` in-process; return (exit code, stdout, stderr)."""
    capsys.readouterr()  # drop anything captured before
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> str:
    """Exit 1 and stderr exactly one non-empty ``error: ...`` line containing every needle."""
    assert code == 1, f"exit code {code}, stderr: {err!r}"
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}: {err!r}"
    line = lines[0]
    assert line.startswith("error: ") and line[len("error: ") :].strip(), line
    assert "Traceback" not in err
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def assert_usage_error(code: int, err: str, *needles: str) -> str:
    """Exit 2 and stderr exactly one ``error: ...`` line containing every needle and where the usage is."""
    assert code == 2, f"exit code {code}, stderr: {err!r}"
    assert err.count("\n") == 1 and err.startswith("error: ") and "Usage:" not in err and "Traceback" not in err, err
    line = err.splitlines()[0]
    for needle in (*needles, "--help'"):
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def snapshot(path: Path) -> dict[str, bytes | None]:
    """Every entry under ``path`` (hidden/temporary files included) → bytes (None for dirs)."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


# ----------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture
def export_copy(good_export, tmp_path) -> Path:
    dest = tmp_path / "export_copy"
    shutil.copytree(good_export, dest)
    return dest


# ----------------------------------------------------------------------------------------------
# list / entry points


def test_python_dash_m_deploykit_list():
    proc = subprocess.run([sys.executable, "-m", "deploykit", "list"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ape" in proc.stdout
    assert "vit_tiny_patch16" in proc.stdout


def test_list_in_process(capsys):
    code, out, err = run_cli(capsys, "list")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("encodings:") and "ape" in lines[0]
    assert lines[1].startswith("models:") and "vit_tiny_patch16" in lines[1]


# ----------------------------------------------------------------------------------------------
# the successful export (shared fixture)


def test_good_export_layout(good_export):
    names = {p.name for p in good_export.iterdir()}
    assert names == {"manifest.json", "config.json", "model.safetensors", f"model_{RES}.onnx"}, names
    manifest = json.loads((good_export / "manifest.json").read_text())
    assert manifest["encoding"] == "ape"
    assert [g["resolution"] for g in manifest["graphs"]] == [[RES, RES]]
    assert manifest["graphs"][0]["file"] == f"model_{RES}.onnx"


# ----------------------------------------------------------------------------------------------
# 1. missing checkpoint


def test_missing_checkpoint(capsys, tmp_path):
    out = tmp_path / "out"
    missing = tmp_path / "nope" / "model.safetensors"
    code, _, err = run_cli(capsys, "export", "--checkpoint", missing, "-r", RES, "--output", out)
    assert_one_line_error(code, err, "checkpoint not found", "nope")
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# 2. corrupt safetensors


@pytest.mark.parametrize("garbage", [b"", b"\x00" * 7, b"not a safetensors file at all" * 10, b"\xff" * 64])
def test_corrupt_safetensors(capsys, tmp_path, ckpt_dir, garbage):
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(ckpt_dir / "config.json", bad / "config.json")
    (bad / "model.safetensors").write_bytes(garbage)
    before = snapshot(bad)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", bad, "-r", RES, "-o", out)
    assert_one_line_error(code, err, "model.safetensors")
    assert "corrupt" in err or "checkpoint" in err
    assert not out.exists()
    assert snapshot(bad) == before  # the checkpoint itself is not touched


def test_checkpoint_dir_without_weights(capsys, tmp_path, ckpt_dir):
    bad = tmp_path / "noweights"
    bad.mkdir()
    shutil.copy(ckpt_dir / "config.json", bad / "config.json")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", bad, "-o", out)
    assert_one_line_error(code, err, "model.safetensors")
    assert not out.exists()


@pytest.mark.parametrize("config_text", ["{not json", "[1, 2]", '{"depth": 1, "bogus_field": 3}', "null"])
def test_invalid_config_json(capsys, tmp_path, ckpt_dir, config_text):
    bad = tmp_path / "badcfg"
    bad.mkdir()
    shutil.copy(ckpt_dir / "model.safetensors", bad / "model.safetensors")
    (bad / "config.json").write_text(config_text)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", bad, "-o", out)
    assert_one_line_error(code, err, "config")
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# 3. pickled code in a .pt file is refused and never runs


class _RunsCodeOnLoad:
    """Unpickling calls ``open(marker, "w")``, creating the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _MarkingOrderedDict(collections.OrderedDict):
    """An OrderedDict subclass whose item restore (on unpickling) creates a marker file."""

    def __setitem__(self, key, value):
        if key == "__marker__":
            Path(value).touch()
        super().__setitem__(key, value)


def _payload(kind: str, marker: Path):
    if kind == "reduce":
        return {"w": torch.zeros(1), "obj": _RunsCodeOnLoad(marker)}
    od = _MarkingOrderedDict()
    od["w"] = torch.zeros(1)
    od["__marker__"] = str(marker)
    marker.unlink()  # building the payload above touched it
    return od


@pytest.mark.parametrize("kind", ["reduce", "ordereddict_subclass"])
def test_pickled_code_in_pt_is_refused(capsys, tmp_path, ckpt_dir, kind):
    # Control: the payload really runs code under a plain (unsafe) load...
    control_marker = tmp_path / "control_marker"
    control = tmp_path / "control.pt"
    torch.save(_payload(kind, control_marker), control)
    assert not control_marker.exists()
    torch.load(control, weights_only=False)
    assert control_marker.exists(), "payload does not run code on load; the test would prove nothing"
    # ...and torch itself refuses it with weights_only=True.
    marker = tmp_path / "marker"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(ckpt_dir / "config.json", ckpt / "config.json")
    pt = ckpt / "weights.pt"
    torch.save(_payload(kind, marker), pt)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(pt, weights_only=True)
    assert not marker.exists()

    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "--checkpoint", pt, "-r", RES, "--output", out)
    assert_one_line_error(code, err, "weights.pt", "weights_only")
    assert not marker.exists(), "the checkpoint's pickled code ran"
    assert not out.exists()


@pytest.mark.parametrize("content", ["tensor", "list", "empty"])
def test_pt_without_a_state_dict(capsys, tmp_path, ckpt_dir, content):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(ckpt_dir / "config.json", ckpt / "config.json")
    pt = ckpt / "weights.pt"
    if content == "tensor":
        torch.save(torch.zeros(3), pt)
    elif content == "list":
        torch.save([torch.zeros(3)], pt)
    else:
        pt.write_bytes(b"")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", pt, "-r", RES, "-o", out)
    assert_one_line_error(code, err, "weights.pt")
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# 4. a valid .pt state dict with config.json beside it


@pytest.mark.slow
@pytest.mark.parametrize("wrap", [None, "state_dict"])
def test_valid_pt_state_dict_exports(capsys, tmp_path, ckpt_dir, wrap):
    from safetensors.torch import load_file

    model = small_model(seed=1)
    ckpt = tmp_path / "ckpt"
    save_model(model, ckpt)
    (ckpt / "model.safetensors").unlink()  # only config.json + the .pt remain
    state = model.state_dict()
    pt = ckpt / "weights.pt"
    torch.save({wrap: state} if wrap else state, pt)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "--checkpoint", pt, "-r", RES, "--output", out)
    assert code == 0, err
    assert (out / f"model_{RES}.onnx").is_file()
    assert json.loads((out / "manifest.json").read_text())["graphs"][0]["resolution"] == [RES, RES]
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in state)


# ----------------------------------------------------------------------------------------------
# 5. resolution not a multiple of the patch size


def test_resolution_not_multiple_small_model(capsys, tmp_path, ckpt_dir):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", "40", "-o", out)
    assert_one_line_error(code, err, "multiple", "40")
    assert not out.exists()


def test_resolution_not_multiple_default_model(capsys, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-r", "225", "-o", out)
    assert_one_line_error(code, err, "multiple", "225")
    assert not out.exists()


def test_one_bad_resolution_among_good_ones_writes_nothing(capsys, tmp_path, ckpt_dir):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", RES, "-r", "48x40", "-o", out)
    assert_one_line_error(code, err, "multiple")
    assert not out.exists()


@pytest.mark.parametrize("value", ["abc", "32x", "1x2x3", "", "32,abc", "32,"])
def test_malformed_resolution_is_a_usage_error(capsys, tmp_path, value):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-r", value, "-o", out)
    assert_usage_error(code, err, "--resolution", "invalid resolution")
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# 6. unknown encoding


def test_unknown_encoding_lists_choices(capsys, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "--encoding", "no-such-pe", "-o", out)
    line = assert_one_line_error(code, err, "no-such-pe", "ape")
    assert "choose" in line or "valid" in line
    assert not out.exists()


def test_encoding_disagreeing_with_checkpoint(capsys, tmp_path, ckpt_dir):
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "--encoding", "rope-axial", "-o", out)
    assert_one_line_error(code, err, "rope-axial", "ape")
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# 7. unwritable output path


@pytest.mark.parametrize("where", ["inside_file", "is_file"])
def test_unwritable_output(capsys, tmp_path, ckpt_dir, where):
    afile = tmp_path / "afile"
    afile.write_bytes(b"precious contents\n")
    out = afile / "out" if where == "inside_file" else afile
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", RES, "--output", out)
    assert_one_line_error(code, err, "afile")
    assert afile.read_bytes() == b"precious contents\n"
    assert snapshot(tmp_path) == before  # no stray temporary files beside it either


# ----------------------------------------------------------------------------------------------
# 8. a failed export into an existing export directory leaves it byte-identical


@pytest.mark.parametrize(
    "case",
    ["bad_resolution", "good_and_bad_resolution", "unknown_encoding", "missing_checkpoint", "corrupt_checkpoint", "misfit_weights"],
)
def test_failed_export_leaves_existing_dir_untouched(capsys, tmp_path, ckpt_dir, export_copy, case):
    args = ["export", "-o", export_copy]
    if case == "bad_resolution":
        args += ["-c", ckpt_dir, "-r", "40"]
    elif case == "good_and_bad_resolution":
        args += ["-c", ckpt_dir, "-r", "48", "-r", "50"]
    elif case == "unknown_encoding":
        args += ["-e", "no-such-pe", "-r", RES]
    elif case == "missing_checkpoint":
        args += ["-c", tmp_path / "missing", "-r", RES]
    elif case == "corrupt_checkpoint":
        bad = tmp_path / "bad"
        bad.mkdir()
        shutil.copy(ckpt_dir / "config.json", bad / "config.json")
        (bad / "model.safetensors").write_bytes(b"\x13\x37" * 50)
        args += ["-c", bad, "-r", RES]
    else:
        bad = tmp_path / "misfit"
        save_model(small_model(depth=2), bad)
        shutil.copy(ckpt_dir / "config.json", bad / "config.json")
        args += ["-c", bad, "-r", RES]
    before = snapshot(export_copy)
    assert before  # the copy really holds the good export
    code, _, err = run_cli(capsys, *args)
    assert_one_line_error(code, err)
    assert snapshot(export_copy) == before


def test_reexport_same_weights_adds_resolution(capsys, ckpt_dir, export_copy):
    """Control for the test above: a good re-export into the same dir does change it."""
    onnx_before = (export_copy / f"model_{RES}.onnx").read_bytes()
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", "48", "-o", export_copy)
    assert code == 0, err
    manifest = json.loads((export_copy / "manifest.json").read_text())
    assert [g["resolution"] for g in manifest["graphs"]] == [[RES, RES], [48, 48]]
    assert (export_copy / f"model_{RES}.onnx").read_bytes() == onnx_before


# ----------------------------------------------------------------------------------------------
# 9. validate on something that is not an export directory


def test_validate_not_an_export_dir(capsys, tmp_path, ckpt_dir):
    code, _, err = run_cli(capsys, "validate", ckpt_dir)  # a model dir, but no manifest.json
    assert_one_line_error(code, err, "manifest.json", "not a deploykit export directory")


def test_validate_missing_dir(capsys, tmp_path):
    missing = tmp_path / "does_not_exist"
    code, _, err = run_cli(capsys, "validate", missing)
    assert_one_line_error(code, err, "does_not_exist")
    assert not missing.exists()


@pytest.mark.parametrize("text", ["{oops", "{}", '{"graphs": [{"file": "x.onnx"}]}'])
def test_validate_corrupt_manifest(capsys, export_copy, text):
    (export_copy / "manifest.json").write_text(text)
    code, _, err = run_cli(capsys, "validate", export_copy)
    assert_one_line_error(code, err, "manifest")


def test_validate_resolution_not_exported(capsys, good_export):
    code, _, err = run_cli(capsys, "validate", good_export, "-r", "48")
    assert_one_line_error(code, err, "48", str(RES))


def test_validate_unknown_backend(capsys, good_export):
    code, _, err = run_cli(capsys, "validate", good_export, "--backend", "no-such-backend")
    assert_one_line_error(code, err, "no-such-backend")


def test_validate_unknown_precision_is_a_usage_error(capsys, good_export):
    code, _, err = run_cli(capsys, "validate", good_export, "--precision", "fp7")
    assert_usage_error(code, err, "'fp7' is not one of", "int8")


# ----------------------------------------------------------------------------------------------
# 10. validate passes on the good export and writes a JSON report


def test_validate_good_export_and_report(capsys, tmp_path, good_export):
    before = snapshot(good_export)
    report = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "validate", good_export, "-r", RES, "--backend", "ort", "--report", report)
    assert code == 0, err
    assert "error:" not in err
    records = json.loads(report.read_text())
    assert isinstance(records, list) and len(records) == 1
    for record in records:
        assert RECORD_KEYS <= record.keys(), RECORD_KEYS - record.keys()
        assert record["backend"] == "ort"
        assert record["resolution"] == [RES, RES]
        assert record["passed"] is True
        assert record["nan_count"] == 0 and record["inf_count"] == 0
        assert record["cosine"] > 0.9999
    assert snapshot(good_export) == before  # validation never writes into the export dir


def test_validate_default_resolutions(capsys, good_export, tmp_path):
    """Without -r, every graph the manifest lists is checked, each once."""
    report = tmp_path / "report.json"
    code, _, err = run_cli(capsys, "validate", good_export, "--report", report)
    assert code == 0, err
    exported = [g["resolution"] for g in json.loads((good_export / "manifest.json").read_text())["graphs"]]
    assert [r["resolution"] for r in json.loads(report.read_text())] == exported
    assert f"{len(exported)}/{len(exported)} checks passed" in err.splitlines()


def test_validate_report_unwritable(capsys, tmp_path, good_export):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    code, _, err = run_cli(capsys, "validate", good_export, "--report", afile / "r.json")
    # the checks print first; the failure to write the report is the last stderr line
    last = err.splitlines()[-1]
    assert code == 1, err
    assert last.startswith("error:") and "afile" in last
    assert afile.read_text() == "keep"


# ----------------------------------------------------------------------------------------------
# 11. a graph that changed since export is refused


def test_validate_tampered_onnx(capsys, tmp_path, export_copy):
    graph = export_copy / f"model_{RES}.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    report = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "validate", export_copy, "--report", report)
    assert_one_line_error(code, err, "changed since export", graph.name)
    assert not report.exists()


def test_validate_missing_onnx(capsys, export_copy):
    (export_copy / f"model_{RES}.onnx").unlink()
    code, _, err = run_cli(capsys, "validate", export_copy)
    assert_one_line_error(code, err, f"model_{RES}.onnx")


# ----------------------------------------------------------------------------------------------
# 12. weights that do not fit the config


def test_weights_do_not_fit_config(capsys, tmp_path, ckpt_dir):
    ckpt = tmp_path / "misfit"
    save_model(small_model(depth=2), ckpt)  # depth-2 weights...
    shutil.copy(ckpt_dir / "config.json", ckpt / "config.json")  # ...under a depth-1 config
    assert json.loads((ckpt / "config.json").read_text())["depth"] == 1
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "--checkpoint", ckpt, "-r", RES, "--output", out)
    line = assert_one_line_error(code, err, "checkpoint", "does not fit", "blocks.1")
    assert "model.safetensors" in line
    assert not out.exists()


def test_weights_shape_mismatch(capsys, tmp_path, ckpt_dir):
    ckpt = tmp_path / "shape"
    torch.manual_seed(0)
    other = create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=RES, num_classes=7)
    save_model(other, ckpt)
    shutil.copy(ckpt_dir / "config.json", ckpt / "config.json")  # config says 10 classes
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", "-c", ckpt, "-r", RES, "-o", out)
    assert_one_line_error(code, err, "checkpoint", "does not fit")
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# sequence models: a length is a resolution


@pytest.mark.slow
def test_sequence_model_export_and_validate(capsys, tmp_path):
    out = tmp_path / "seq"
    code, _, err = run_cli(capsys, "export", "--model", "seq_tiny_ega", "-r", "32", "-r", "64", "-o", out)
    assert code == 0, err
    code, _, err = run_cli(capsys, "validate", out, "-r", "64", "--num-random", "1", "--num-real", "1")
    assert code == 0 and "1/1 checks passed" in err


@pytest.mark.parametrize("args, words", [(["-r", "64x32"], ("one length", "64x32")), (["-e", "ape", "-r", "512"], ("covers 256", "512"))])
def test_sequence_model_bad_length(capsys, tmp_path, args, words):
    out = tmp_path / "seq"
    code, _, err = run_cli(capsys, "export", "--model", "seq_tiny_ega", *args, "-o", out)
    assert_one_line_error(code, err, *words)
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# INT8: export says what it calibrated on, validate and profile take the plan


@pytest.mark.slow
def test_int8_export_says_what_it_calibrated_on_then_validates_and_profiles(capsys, tmp_path, ckpt_dir):
    """``--precision int8`` alone: the fp32 graph is written beside it (issue 23: it was not, and
    validate and serve refused the directory)."""
    out = tmp_path / "q"
    code, _, err = run_cli(
        capsys,
        "export",
        "-c",
        ckpt_dir,
        "-r",
        RES,
        "--precision",
        "int8",
        "--calibration-samples",
        "8",
        "--calibration-method",
        "percentile",
        "--min-agreement",
        "0",
        "--held-out",
        "64",
        "-o",
        out,
    )
    assert code == 0, err
    # No dataset in the config: the bundled images, and the line says so.
    assert "calibrated (percentile) on 8 random crops" in err and "the model names no dataset" in err
    steps = [line.split("  (")[0] for line in err.splitlines() if line.startswith(f"export: {RES} int8: ")]
    crops = "8 random crops (seed 0) of the 8 bundled sample images: the model names no dataset"
    sensitivity = "output error of each of 5 matmuls int8 alone, one pass on 8 inputs: "
    measured = [int(s.split(sensitivity)[1].split(" of ")[0]) for s in steps if sensitivity in s]
    # the sensitivity pass is said before it starts (0 of 5), then as its groups of nodes finish
    assert measured[0] == 0 and measured[-1] == 5 and measured == sorted(set(measured)) and len(measured) > 2, err
    assert [
        s for s in steps if sensitivity not in s
    ] == [  # n of N inside the long steps: the held-out reference in batches of 32, calibration in batches of 8
        f"export: {RES} int8: {step}"
        for step in (
            "reading 8 calibration and up to 64 held-out inputs",
            "fp32 reference on 64 held-out inputs: 32 of 64 inputs",
            "fp32 reference on 64 held-out inputs: 64 of 64 inputs",
            f"calibrating on {crops} (percentile): 8 of 8 inputs",
            # the plan checked before it is written (silent for minutes on a ViT-S)
            "checking the plan on the 64 held-out inputs: 32 of 64 inputs",
            "checking the plan on the 64 held-out inputs: 64 of 64 inputs",
        )
    ], err
    assert [g["precision"] for g in json.loads((out / "manifest.json").read_text())["graphs"]] == ["fp32", "int8"]
    code, _, err = run_cli(capsys, "validate", out, "--num-random", "1", "--num-real", "1")  # fp32, the default
    assert code == 0 and "1/1 checks passed" in err, err
    code, _, err = run_cli(capsys, "validate", out, "--precision", "int8", "--report", tmp_path / "r.json")
    assert code == 0 and "1/1 checks passed" in err, err
    (record,) = json.loads((tmp_path / "r.json").read_text())
    assert record["precision"] == "int8" and record["tolerance"]["real_only"] and record["max_abs"] > 0
    code, _, err = run_cli(
        capsys,
        "profile",
        out,
        "--precision",
        "fp32",
        "--precision",
        "int8",
        "--backend",
        "ort",
        "--iterations",
        "2",
        "--warmup",
        "0",
        "--no-ape-baseline",
        "--no-end-to-end",
        "--json",
        tmp_path / "p.json",
    )
    assert code == 0, err
    records = json.loads((tmp_path / "p.json").read_text())["records"]
    assert [r["precision"] for r in records] == ["fp32", "int8"]
    assert records[1]["ratio_vs_fp32"] == pytest.approx(records[1]["p50_ms"] / records[0]["p50_ms"])


def test_profile_a_plan_that_was_not_exported(capsys, good_export):
    code, _, err = run_cli(capsys, "profile", good_export, "--precision", "int8", "--backend", "ort", "--iterations", "1")
    assert_one_line_error(code, err, "no int8 graph", "--precision int8")


# ----------------------------------------------------------------------------------------------
# --set: encoding options from the command line


def test_export_set_changes_the_encoding_and_is_recorded(capsys, tmp_path, ckpt_dir):
    out = tmp_path / "plain"
    code, _, err = run_cli(
        capsys, "export", "-c", ckpt_dir, "--set", "antialias=false", "--set", "interpolation=bilinear", "-r", 48, "-o", out
    )
    assert code == 0, err
    encoding = json.loads((out / "config.json").read_text())["encoding"]
    assert (encoding["antialias"], encoding["interpolation"]) == (False, "bilinear")
    code, _, err = run_cli(capsys, "validate", out, "--num-random", "1", "--num-real", "1")
    assert code == 0 and "1/1 checks passed" in err  # the reference is the model with the options


def test_export_set_unknown_key_lists_the_valid_ones(capsys, tmp_path, ckpt_dir):
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "--set", "antialiasing=false", "-r", RES, "-o", tmp_path / "o")
    assert_one_line_error(
        code, err, "encoding 'ape' has no option 'antialiasing'", "valid options: antialias, interpolation, no_embed_class"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "value, needle",
    [("antialias=maybe", "not a valid bool"), ("antialias", "is not key=value"), ("interpolation=area", "interpolation must be one of")],
)
def test_export_set_bad_value_is_one_line(capsys, tmp_path, ckpt_dir, value, needle):
    code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "--set", value, "-r", RES, "-o", tmp_path / "o")
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_export_set_on_a_fresh_model_shapes_it(capsys, tmp_path, monkeypatch):
    # Untrained: ape=true gives the seeded RoPE model its learned table too. The size cut to one
    # block (what --set does to the encoding does not depend on depth; twelve blocks' export was most of the test).
    from deploykit.nn import MODEL_CONFIGS

    monkeypatch.setitem(MODEL_CONFIGS, "vit_tiny_patch16", {**MODEL_CONFIGS["vit_tiny_patch16"], "depth": 1})
    out = tmp_path / "rope-ape"
    args = ["export", "--encoding", "rope-axial", "--model", "vit_tiny_patch16", "--set", "ape=true", "--set", "no_embed_class=true"]
    assert run_cli(capsys, *args, "-r", 224, "-o", out)[0] == 0
    config = json.loads((out / "config.json").read_text())
    assert config["depth"] == 1  # the cut size was the one exported
    encoding = config["encoding"]
    assert encoding["ape"] is True and encoding["no_embed_class"] is True


def test_import_timm_where_timm_does_not_import(capsys, tmp_path):
    from deploykit._lazy import is_available

    if is_available("timm"):
        pytest.skip("timm imports here; tests/nn/test_from_timm.py runs it")
    code, _, err = run_cli(capsys, "import", "timm", "vit_tiny_patch16_224", "-o", tmp_path / "m")
    assert_one_line_error(code, err, "timm")
    assert not (tmp_path / "m").exists()
