"""A user's own inputs (``deploykit.inputs.user``): a folder of images, a list of image paths, a
``.npy``/``.npz`` of preprocessed arrays, each read as the model takes it; bad data of each kind
is one line naming the file, on the library and from the command line (exit 1, nothing written)."""

from __future__ import annotations

import numpy as np
import PIL.Image as PIL
import pytest
import torch

from deploykit.errors import InputError
from deploykit.inputs.user import UserCalibration, read_inputs, split
from deploykit.nn import create_model
from tests import image_bombs
from tests.serve.serve_reference import torch_preprocess
from tests.test_cli import assert_one_line_error, run_cli

RES = (32, 32)
# A preprocessing unlike deploykit's default, so reading it from the config is what is tested.
SETTINGS = dict(crop_pct=0.95, crop_mode="squash", interpolation="bilinear")
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=10, mean=MEAN, std=STD, **SETTINGS).eval()


def _pixels(seed: int, shape=(40, 56)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def _save(path, pixels, **kwargs):
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.fromarray(pixels).save(path, **kwargs)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Nested images in three formats, plus files that are not inputs (a note, a hidden image)."""
    root = tmp_path_factory.mktemp("imgs")
    _save(root / "b" / "cat.png", _pixels(0))
    _save(root / "a" / "dog.webp", _pixels(1, (60, 30)), lossless=True)
    _save(root / "zebra.bmp", _pixels(2, (33, 33)))
    _save(root / ".thumbnails" / "cat.png", _pixels(3))
    (root / "notes.txt").write_text("not an image")
    return root


def _expected(paths, resolution=RES) -> np.ndarray:
    """timm's eval transform in torch (the test oracle) with the model's settings."""
    return np.stack([torch_preprocess(np.array(PIL.open(p).convert("RGB")), resolution, MEAN, STD, **SETTINGS) for p in paths])


def test_a_folder_is_read_recursively_in_path_order_and_preprocessed_as_the_model_says(folder, model):
    data = read_inputs(folder)
    assert [p.relative_to(folder).as_posix() for p in data.images] == ["a/dog.webp", "b/cat.png", "zebra.bmp"]
    inputs = data.inputs(model, RES)
    assert inputs.shape == (3, 3, 32, 32) and inputs.dtype == np.float32
    np.testing.assert_allclose(inputs, _expected(data.images), rtol=0, atol=1e-6)
    # each resolution is resized the model's way, not from the 32 px inputs
    np.testing.assert_allclose(data.inputs(model, (48, 64), [2]), _expected(data.images[2:], (48, 64)), rtol=0, atol=1e-6)


def test_a_list_file_names_images_relative_to_itself(folder, model, tmp_path):
    listing = folder / "val.txt"
    listing.write_text(f"# validation images\nzebra.bmp\n\n{(folder / 'b' / 'cat.png').resolve()}\n")
    data = read_inputs(listing)
    assert [p.name for p in data.images] == ["zebra.bmp", "cat.png"]
    np.testing.assert_allclose(data.inputs(model, RES), _expected(data.images), rtol=0, atol=1e-6)


def test_arrays_are_taken_as_they_are_and_npz_per_resolution(model, tmp_path):
    small, large = (np.random.default_rng(i).standard_normal((5, 3, *r)).astype(np.float64) for i, r in enumerate([RES, (48, 48)]))
    np.save(tmp_path / "x.npy", small)
    np.testing.assert_array_equal(read_inputs(tmp_path / "x.npy").inputs(model, RES), small.astype(np.float32))
    np.savez(tmp_path / "x.npz", **{"32": small, "48": large})
    data = read_inputs(tmp_path / "x.npz")
    np.testing.assert_array_equal(data.inputs(model, (48, 48), [1, 3]), large[[1, 3]].astype(np.float32))
    with pytest.raises(InputError, match=r"holds arrays for 32, 48, none for 64; add one named '64'"):
        data.inputs(model, (64, 64))


def test_token_ids_for_a_sequence_model(tmp_path):
    seq = create_model("seq_tiny_ega")
    ids = np.random.default_rng(0).integers(0, seq.cfg.vocab_size, (4, 16))
    np.save(tmp_path / "ids.npy", ids)
    np.testing.assert_array_equal(read_inputs(tmp_path / "ids.npy").inputs(seq, (16,)), ids)
    np.save(tmp_path / "big.npy", ids + seq.cfg.vocab_size)
    with pytest.raises(InputError, match="ids outside"):
        read_inputs(tmp_path / "big.npy").inputs(seq, (16,))


def test_the_fingerprint_follows_the_bytes(folder, tmp_path):
    data = read_inputs(folder)
    record = data.record([0, 2])
    assert record["count"] == 2 and len(record["sha256"]) == 64 and record["source"] == str(folder)
    assert data.fingerprint([0, 2]) != data.fingerprint([2, 0]) != data.fingerprint([0, 1])
    copy = tmp_path / "copy"
    for p in data.images:
        _save(copy / p.relative_to(folder), np.array(PIL.open(p)), **({"lossless": True} if p.suffix == ".webp" else {}))
    assert read_inputs(copy).fingerprint() == data.fingerprint()
    _save(copy / "zebra.bmp", _pixels(9, (33, 33)))
    assert read_inputs(copy).fingerprint() != data.fingerprint()


def test_calibration_and_held_out_inputs_are_disjoint(folder, model):
    assert split(10, 4, 3)[0] and not set(split(10, 4, 3)[0]) & set(split(10, 4, 3)[1])
    assert [len(part) for part in split(10, 4, 3)] == [4, 3]
    assert [len(part) for part in split(5, 128, 1000)] == [3, 2]  # fewer than asked: half calibrates
    calibration, held_out, record = UserCalibration(read_inputs(folder)).inputs(model, RES, 128, 1000)
    assert len(calibration) + len(held_out) == 3 and record["calibration"]["count"] == 2 and record["held_out"]["count"] == 1
    assert not any(np.array_equal(c, h) for c in calibration for h in held_out)


def _png16(path):
    PIL.fromarray(np.full((20, 20), 40000, np.uint16)).save(path)
    assert PIL.open(path).mode.startswith("I")
    return path


def _written(path, data: bytes | str):
    path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d.mkdir() or d, "no images found"),
        (lambda d: _written(d.with_suffix(".png"), b"\x89PNG garbage"), "is one image; give a folder"),
        (lambda d: _written(d.with_suffix(".txt"), "a.png\nmissing.png\n"), "line 1: a.png: no such image file"),
        (lambda d: _written(d.with_suffix(".txt"), b"\xff\xfe\x00binary"), "is not a text file listing image paths"),
        (lambda d: _written(d.with_suffix(".npy"), b"not numpy"), "cannot read it as .npy arrays"),
        (lambda d: d, "no such file or folder"),
    ],
)
def test_unreadable_data_is_refused_when_read(tmp_path, make, message):
    path = make(tmp_path / "data")
    with pytest.raises(InputError, match=message) as err:
        read_inputs(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda d: _save(d / "ok.png", _pixels(0)) and (d / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg"),
            "broken.jpg: cannot read it as an image",
        ),
        (lambda d: _save(d / "ok.png", _pixels(0)) and _png16(d / "deep.png"), "deep.png: a I;16 image (16-bit or float pixels)"),
    ],
)
def test_undecodable_images_are_refused_naming_the_file(tmp_path, model, make, message):
    make(tmp_path)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_inputs(tmp_path).check(model, [RES])


@pytest.mark.parametrize(
    "array, message",
    [
        (np.zeros((4, 1, 32, 32), np.float32), r"float32 \[4, 1, 32, 32\] arrays: 1 channels, the model takes 3"),
        (np.zeros((4, 3, 48, 48), np.float32), r"48x48, the model is at 32"),
        (np.zeros((4, 32, 32, 3), np.float32), r"\[4, 32, 32, 3\] arrays: 32 channels, the model takes 3"),
        (np.zeros((4, 3, 32, 32), np.uint8), r"preprocessed inputs are float"),
        (np.full((4, 3, 32, 32), np.nan, np.float32), r"input 0 \(and 3 more\) holds NaN or Inf"),
        (np.zeros((0, 3, 32, 32), np.float32), r"holds no inputs"),
    ],
)
def test_arrays_that_do_not_fit_the_model_are_refused(tmp_path, model, array, message):
    np.save(tmp_path / "x.npy", array)
    with pytest.raises(InputError, match=message):
        read_inputs(tmp_path / "x.npy").check(model, [RES])


def test_bad_calibration_data_is_one_line_and_nothing_is_written(ckpt_dir, tmp_path, capsys):
    """From the command line: exit 1, one line naming the file, before any export work."""
    empty = tmp_path / "empty"
    empty.mkdir()
    wrong = tmp_path / "gray.npy"
    np.save(wrong, np.zeros((4, 1, 32, 32), np.float32))
    broken = tmp_path / "imgs"
    _save(broken / "ok.png", _pixels(0))
    (broken / "bad.jpg").write_bytes(b"garbage")
    for data, needle in [(empty, "no images found"), (wrong, "1 channels"), (broken, "bad.jpg: cannot read it as an image")]:
        out = tmp_path / f"out-{data.name}"
        code, _, err = run_cli(capsys, "export", "-c", ckpt_dir, "-r", 32, "--precision", "int8", "--calibration-data", data, "-o", out)
        assert_one_line_error(code, err, str(data.name), needle)
        assert not out.exists()
    code, _, err = run_cli(
        capsys, "export", "-c", ckpt_dir, "-r", 32, "--precision", "int8", "--calibration-data", tmp_path / "x.npy", "-o", tmp_path / "o"
    )
    assert_one_line_error(code, err, "x.npy: no such file or folder")


def test_validate_refuses_bad_inputs_in_one_line(good_export, tmp_path, capsys):
    np.save(tmp_path / "big.npy", np.zeros((2, 3, 64, 64), np.float32))
    code, _, err = run_cli(capsys, "validate", good_export, "--inputs", tmp_path / "big.npy")
    assert_one_line_error(code, err, "big.npy", "64x64, the model is at 32")


def test_validate_refuses_a_corrupt_image_in_one_line(good_export, tmp_path, capsys):
    """Pillow raises ``SyntaxError`` on a PNG whose zTXt chunk names an unknown compression: one
    ``error:`` line naming the file, no traceback (issue 41)."""
    png = image_bombs.encoded("PNG")
    end = png.rindex(b"IEND") - 4
    _save(tmp_path / "imgs" / "ok.png", _pixels(0))
    (tmp_path / "imgs" / "bad.png").write_bytes(png[:end] + image_bombs.png_chunk(b"zTXt", b"key\0\x01data") + png[end:])
    code, _, err = run_cli(capsys, "validate", good_export, "--inputs", tmp_path / "imgs")
    assert_one_line_error(code, err, "bad.png: cannot read it as an image", "compression")
