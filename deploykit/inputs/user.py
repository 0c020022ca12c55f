"""A user's own inputs: ``export --calibration-data PATH`` and ``validate --inputs PATH``.

``PATH`` may be, as ModelOpt's, Polygraphy's and ONNX Runtime's quantization tools take data:

* a folder of images, searched recursively (``IMAGE_SUFFIXES``; hidden files and folders are
  skipped), in sorted path order;
* a text file listing image paths, one per line (relative paths are relative to the list;
  blank lines and lines starting with ``#`` are skipped);
* a ``.npy`` of already preprocessed inputs, ``[N, C, H, W]`` float (``[N, T]`` integer token
  ids for a sequence model), or a ``.npz`` holding one such array, or one per resolution named
  by its tag (``224``, ``384x256``).

Images are decoded with Pillow and preprocessed at each resolution by the model's own
``deploykit.inputs.imaging.Preprocessing`` (what ``config.json`` records; what serving applies), so
calibration, validation and serving see the same pixels. Arrays are taken as they are, and must
match the model's input at that resolution.

Bad data is refused in one line naming the file: an empty folder, a file that does not decode,
an image that is not 8-bit (16-bit or float pixels), arrays of the wrong rank, channel count,
size or dtype, or holding NaN/Inf.

numpy and Pillow only, like ``deploykit.inputs.builtin``: the model is read through its
``input_kind`` (``deploykit.inputs.kinds``: what an array must be) and ``cfg.preprocessing``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deploykit.errors import InputError, one_line
from deploykit.inputs import imaging
from deploykit.inputs.resolutions import resolution_tag

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")
# Pillow's format names for those suffixes: no other decoder is tried.
_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF")
ARRAY_SUFFIXES = (".npy", ".npz")
# 8-bit modes Pillow converts to RGB as timm's loader does (grey, palette, alpha, CMYK, YCbCr).
_RGB_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")
# Local files are the user's own: larger than a server takes, still bounded (Pillow's bomb limit).
_MAX_PIXELS = 178_956_970
_MAX_SIDE = 65_500
# Which inputs go to calibration and which are held out: a fixed shuffle, so a folder sorted by
# class does not calibrate on its first classes only.
_SPLIT_SEED = 0


@dataclass(frozen=True)
class InputData:
    """Inputs read from ``path`` (module docstring): image files, or arrays.

    Attributes:
        path: what the user gave.
        images: image files, in order (empty for arrays).
        arrays: for ``.npy``/``.npz``: ``""`` → the one array, or resolution tag → array.
    """

    path: Path
    images: tuple[Path, ...] = ()
    arrays: dict[str, np.ndarray] | None = None

    @property
    def kind(self) -> str:
        return "arrays" if self.arrays is not None else "images"

    def __len__(self) -> int:
        if self.arrays is None:
            return len(self.images)
        return min(len(a) for a in self.arrays.values())

    def inputs(self, model, shape: tuple[int, ...], indices: Sequence[int] | None = None) -> np.ndarray:
        """The model's inputs at ``shape`` (``[N, C, H, W]`` float32, or ``[N, T]`` int64 token ids),
        all or those at ``indices``.

        Raises:
            InputError: a file that does not decode, or arrays that do not fit the model at ``shape``.
        """
        indices = range(len(self)) if indices is None else indices
        if self.arrays is not None:
            return model.input_kind.checked_arrays(self._array_at(shape), self.path, shape)[list(indices)]
        model.input_kind.check_takes_images(self.path)
        preprocessing = model.cfg.preprocessing
        return np.stack([preprocessing(read_image(self.images[i]), shape) for i in indices])

    def check(self, model, shapes: Sequence[tuple[int, ...]]) -> None:
        """Refuse, before any work, inputs the model cannot take at ``shapes``: every image is
        decoded once, and arrays are checked against each shape.

        Raises:
            InputError: the first file or array that does not fit, named.
        """
        if self.arrays is not None:
            for shape in shapes:
                model.input_kind.checked_arrays(self._array_at(shape), self.path, shape)
            return
        model.input_kind.check_takes_images(self.path)
        for image in self.images:
            read_image(image)

    def fingerprint(self, indices: Sequence[int] | None = None) -> str:
        """sha256 over the inputs at ``indices`` (default all), in order: each image file's bytes,
        or each array row's bytes (every resolution's, for a ``.npz`` per resolution)."""
        indices = range(len(self)) if indices is None else indices
        digest = hashlib.sha256()
        for i in indices:
            if self.arrays is None:
                digest.update(hashlib.sha256(self.images[i].read_bytes()).digest())
            else:
                for key in sorted(self.arrays):
                    digest.update(np.ascontiguousarray(self.arrays[key][i]).tobytes())
        return digest.hexdigest()

    def record(self, indices: Sequence[int] | None = None) -> dict:
        """What the manifest says of the inputs at ``indices``: source, kind, count, fingerprint
        and a description for the terminal."""
        count = len(self) if indices is None else len(indices)
        what = "images" if self.arrays is None else "arrays"
        return {
            "source": str(self.path),
            "kind": self.kind,
            "count": count,
            "sha256": self.fingerprint(indices),
            "description": f"{count} of the {len(self)} {what} in {self.path}",
        }

    def _array_at(self, shape: tuple[int, ...]) -> np.ndarray:
        if "" in self.arrays:
            return self.arrays[""]
        tag = resolution_tag(tuple(shape))
        if tag not in self.arrays:
            raise InputError(f"{self.path} holds arrays for {', '.join(sorted(self.arrays))}, none for {tag}; add one named {tag!r}")
        return self.arrays[tag]


def read_inputs(path: str | os.PathLike) -> InputData:
    """The inputs at ``path`` (module docstring), listed and checked for presence; images are
    decoded only when used.

    Raises:
        InputError: a missing path, an empty folder or list, a listed file that is missing, a
            single image (give a folder), or arrays that cannot be read.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    if path.is_dir():
        images = tuple(sorted(p for p in path.rglob("*") if _is_image_file(p, path)))
        if not images:
            raise InputError(f"{path}: no images found (looked recursively for {', '.join(IMAGE_SUFFIXES)})")
        return InputData(path, images=images)
    if path.suffix.lower() in ARRAY_SUFFIXES:
        return InputData(path, arrays=_read_arrays(path))
    if path.suffix.lower() in IMAGE_SUFFIXES:
        raise InputError(f"{path} is one image; give a folder of images, a text file listing image paths, or a .npy/.npz of arrays")
    return InputData(path, images=_read_list(path))


def _is_image_file(p: Path, root: Path) -> bool:
    hidden = any(part.startswith(".") for part in p.relative_to(root).parts)
    return not hidden and p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()


def _read_list(path: Path) -> tuple[Path, ...]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise InputError(f"{path} is not a text file listing image paths (nor a folder, .npy or .npz); give one of those") from None
    except OSError as err:
        raise InputError(f"{path}: cannot read it ({err.strerror or err})") from err
    images = []
    for number, line in enumerate(lines, 1):
        name = line.strip()
        if not name or name.startswith("#"):
            continue
        image = Path(name) if Path(name).is_absolute() else path.parent / name
        if not image.is_file():
            raise InputError(f"{path}, line {number}: {name}: no such image file")
        images.append(image)
    if not images:
        raise InputError(f"{path} lists no image paths (one per line expected)")
    return tuple(images)


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
        arrays = {"": loaded} if isinstance(loaded, np.ndarray) else {key: loaded[key] for key in loaded.files}
    except (OSError, ValueError, EOFError) as err:
        raise InputError(f"{path}: cannot read it as {path.suffix} arrays ({one_line(err)})") from err
    if not arrays:
        raise InputError(f"{path} holds no arrays")
    if len(arrays) == 1:
        arrays = {"": next(iter(arrays.values()))}
    for key, array in arrays.items():
        if array.ndim < 1 or len(array) == 0:
            raise InputError(f"{path}{f'[{key}]' if key else ''} holds no inputs (shape {list(array.shape)})")
    return arrays


def read_image(path: Path) -> np.ndarray:
    """One image file → ``[H, W, 3]`` uint8, as timm's loader makes it (``convert("RGB")``).

    Raises:
        InputError: not a readable image of ``IMAGE_SUFFIXES``' formats, not 8-bit, or too large.
    """
    from PIL import Image

    try:
        with Image.open(path, formats=list(_FORMATS)) as image:
            imaging.check_size(image.height, image.width, _MAX_PIXELS, _MAX_SIDE, imaging.MAX_ASPECT)
            if image.mode not in _RGB_MODES:
                raise InputError(
                    f"{path}: a {image.mode} image (16-bit or float pixels); give 8-bit images, or preprocessed arrays in a .npy"
                )
            return np.array(image.convert("RGB"))
    except InputError:
        raise
    except Exception as err:  # Pillow's decoders raise SyntaxError, EOFError, struct.error... on corrupt files
        raise InputError(f"{path}: cannot read it as an image ({one_line(err, 200) or type(err).__name__})") from err


def split(count: int, samples: int, held_out: int) -> tuple[list[int], list[int]]:
    """Indices of ``count`` inputs for calibration and for the held-out check, disjoint, after a
    fixed shuffle: ``samples`` to calibrate on and up to ``held_out`` of the rest; when there are
    not more than ``samples``, half (rounded up) calibrates and the rest is held out.

    Raises:
        InputError: fewer than two inputs.
    """
    if count < 2:
        raise InputError(f"{count} input given; calibration needs at least 2 (some to calibrate on, others held out to check the plan)")
    order = np.random.default_rng(_SPLIT_SEED).permutation(count).tolist()
    calibrate = samples if count > samples else -(-count // 2)
    return order[:calibrate], order[calibrate : calibrate + held_out]


class UserCalibration:
    """``deploykit.export.int8_static.CalibrationSource`` over a user's ``InputData``: calibration
    and held-out inputs at each resolution, drawn from it (``split``)."""

    def __init__(self, data: InputData):
        self.data = data

    def check(self, model, shapes: Sequence[tuple[int, ...]]) -> None:
        """``InputData.check``, and at least two inputs (``split``)."""
        split(len(self.data), 1, 1)
        self.data.check(model, shapes)

    def inputs(self, model, shape: tuple[int, ...], samples: int, held_out: int) -> tuple[np.ndarray, np.ndarray, dict]:
        calibrate, _ = split(len(self.data), samples, held_out)
        check, check_record = self.held_out(model, shape, samples, held_out)
        return self.data.inputs(model, shape, calibrate), check, {"calibration": self.data.record(calibrate), "held_out": check_record}

    def held_out(self, model, shape: tuple[int, ...], samples: int, held_out: int) -> tuple[np.ndarray, dict]:
        _, check = split(len(self.data), samples, held_out)
        return self.data.inputs(model, shape, check), self.data.record(check)
