"""Inputs for validation, profiling and calibration when the user gives none: real images that
ship inside a package, seeded noise, a zoo model's own dataset, text for sequence models.

Real images come from scikit-image's bundled samples (installed with the ``images`` extra), so
nothing is downloaded and top-1 agreement is measured on natural-image statistics. They are
preprocessed as the model's config says (``ViTConfig.preprocessing``: the one preprocessing of
``deploykit.inputs.imaging``, which serving applies too). A user's own inputs: ``deploykit.inputs.user``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deploykit._lazy import lazy_import
from deploykit.errors import ConfigError
from deploykit.inputs import imaging

# RGB samples bundled inside scikit-image's wheel (no pooch download).
SAMPLE_IMAGES = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina", "colorwheel")

# What ``deploykit validate`` checks each graph on by default: seeded noise and real inputs per
# resolution (all the bundled images), the noise's seed.
VALIDATION_NOISE = 4
VALIDATION_REAL = len(SAMPLE_IMAGES)
VALIDATION_SEED = 0


def sample_images(count: int = len(SAMPLE_IMAGES)) -> list[np.ndarray]:
    """Up to ``len(SAMPLE_IMAGES)`` bundled natural images as uint8 arrays."""
    skdata = lazy_import("skimage").data
    return [getattr(skdata, name)() for name in SAMPLE_IMAGES[:count]]


def real_inputs(resolution: tuple[int, int], preprocessing: imaging.Preprocessing, count: int = len(SAMPLE_IMAGES)) -> np.ndarray:
    """``[count, 3, H, W]`` float32 from the bundled images, preprocessed as the model's config says."""
    return np.stack([preprocessing(img, resolution) for img in sample_images(count)])


def random_inputs(count: int, resolution: tuple[int, int], seed: int = 0, channels: int = 3) -> np.ndarray:
    """``[count, C, H, W]`` float32 standard-normal inputs from ``seed`` (about the range of
    normalised images)."""
    return np.random.default_rng(seed).standard_normal((count, channels, *resolution), dtype=np.float32)


# The 65 characters of the TinyShakespeare vocabulary MoPE's paper trains on (sorted, as the
# authors' script builds it): newline, space, "!$&',-.3:;?", A-Z, a-z.
CHAR_VOCAB = "\n !$&',-.3:;?" + "".join(map(chr, range(65, 91))) + "".join(map(chr, range(97, 123)))


def sample_text() -> str:
    """English text that ships with Python itself (the Zen of Python, stored rot13 in ``this``),
    read without importing ``this`` (which prints it)."""
    import ast
    import codecs
    import importlib.util

    source = open(importlib.util.find_spec("this").origin, encoding="utf-8").read()
    encoded = next(
        node.value.value for node in ast.parse(source).body if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "s"
    )
    return codecs.decode(encoded, "rot13")


def encode_chars(text: str, vocab_size: int = len(CHAR_VOCAB)) -> np.ndarray:
    """Character ids in ``CHAR_VOCAB`` (unknown characters become spaces), folded into ``vocab_size``."""
    index = {c: i for i, c in enumerate(CHAR_VOCAB)}
    return np.array([index.get(c, 1) for c in text], dtype=np.int64) % vocab_size


def real_token_inputs(length: int, vocab_size: int, count: int = 8) -> np.ndarray:
    """``[count, length]`` int64 windows of real text, each starting further in (wrapping)."""
    ids = encode_chars(sample_text(), vocab_size)
    step = max(1, len(ids) // max(count, 1))
    return np.stack([np.take(ids, np.arange(i * step, i * step + length), mode="wrap") for i in range(count)])


def random_token_inputs(count: int, length: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """``[count, length]`` int64 uniformly random token ids from ``seed``."""
    return np.random.default_rng(seed).integers(0, vocab_size, (count, length), dtype=np.int64)


def dataset_inputs(dataset: str, resolution: tuple[int, int], mean, std, count: int, split: str = "test") -> np.ndarray:
    """``[count, 3, H, W]`` float32: the first ``count`` images of a ``deploykit.zoo`` dataset's
    ``split``, rendered at ``resolution`` and normalised."""
    from deploykit.inputs.datasets import get_dataset

    return normalise(get_dataset(dataset).images(split, range(count), resolution), mean, std)


def normalise(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """``[N, C, H, W]`` pixels in [0, 1] → float32 ``(x - mean) / std`` per channel."""
    mean, std = np.asarray(mean, np.float32)[:, None, None], np.asarray(std, np.float32)[:, None, None]
    # One new array, divided in place: the same operations as ``(images - mean) / std``, without
    # two more copies to fault in (most of the time for a large split at 384 px)
    out = np.subtract(images, mean, dtype=np.result_type(images, mean))
    return np.divide(out, std, out=out).astype(np.float32, copy=False)


def validation_inputs(
    model, shape: tuple[int, ...], num_random: int, num_real: int, seed: int = 0, real: np.ndarray | None = None
) -> np.ndarray:
    """Seeded noise followed by ``num_real`` real inputs for ``model`` at ``shape``: ``real`` when
    given (the user's own), else what the model's input kind draws (``deploykit.inputs.kinds``:
    text windows for a sequence model, the test split of the dataset a zoo model was trained on,
    else bundled natural images).

    Raises:
        ConfigError: more real inputs than exist (``check_real_count``; the user's own are
            counted by ``deploykit.inputs.user``).
    """
    if real is None:
        check_real_count(model, num_real, VALIDATION_SPLIT, "--num-real")
    return model.input_kind.validation(shape, num_random, num_real, seed, real)


# INT8 plans calibrate on the train split and check themselves on the val split; the test split
# is left to validation and the zoo cards.
CALIBRATION_SPLIT, HELD_OUT_SPLIT, VALIDATION_SPLIT = "train", "val", "test"


def real_input_limit(model, split: str) -> tuple[int | None, str]:
    """How many distinct real inputs ``model`` has in ``split`` (None: no limit), and what they are.

    A zoo model: its dataset's split (``train`` is an unbounded stream). Any other image model:
    the bundled sample images for validation (``test``), seeded crops of them (no limit) for
    calibration. A sequence model: windows of the bundled text (no limit).
    """
    return model.input_kind.real_limit(split)


def check_real_count(model, count: int, split: str, option: str) -> None:
    """Refuse asking for more real inputs than exist, rather than silently taking fewer.

    Raises:
        ConfigError: ``count`` exceeds ``real_input_limit``; the message names ``option``.
    """
    limit, what = real_input_limit(model, split)
    if limit is not None and count > limit:
        raise ConfigError(f"{option} {count} asks for more real inputs than there are ({limit} {what}); give at most {limit}")


def calibration_inputs(model, shape: tuple[int, ...], count: int, held_out: bool = False) -> tuple[np.ndarray, str]:
    """``count`` real inputs to calibrate INT8 activation ranges on (or, ``held_out``, to check
    the quantized graph on: other inputs from the same source), and where they came from.

    A zoo model: the first ``count`` images of its dataset's train split (held out: val split),
    never the test split. A sequence model: windows of the bundled English text at seeded random
    offsets. Any other model: seeded random crops (scale, aspect, mirror) of the bundled sample
    images, so that more than ``len(SAMPLE_IMAGES)`` distinct inputs exist.

    Returns:
        ``([count, ...] inputs, description)``; the description names the data for the manifest.

    Raises:
        ConfigError: more inputs than the split holds (``check_real_count``).
    """
    split = HELD_OUT_SPLIT if held_out else CALIBRATION_SPLIT
    check_real_count(model, count, split, "--held-out" if held_out else "--calibration-samples")  # the val split is fixed (1000)
    return model.input_kind.calibration(shape, count, int(held_out), split)


class DefaultCalibration:
    """``deploykit.export.int8_static.CalibrationSource`` when the user gives no data: the inputs of
    ``calibration_inputs`` (a zoo model's train split, held out its val split; else bundled
    images or text), each with a fingerprint of the arrays for the manifest."""

    def check(self, model, shapes) -> None:
        """Nothing to refuse: the inputs are made for the model."""

    def inputs(self, model, shape: tuple[int, ...], samples: int, held_out: int) -> tuple[np.ndarray, np.ndarray, dict]:
        calibration, source = calibration_inputs(model, shape, samples)
        check, check_record = self.held_out(model, shape, samples, held_out)
        return calibration, check, {"calibration": _record(calibration, source), "held_out": check_record}

    def held_out(self, model, shape: tuple[int, ...], samples: int, held_out: int) -> tuple[np.ndarray, dict]:
        check, source = calibration_inputs(model, shape, held_out, held_out=True)
        return check, _record(check, source)


def _record(inputs: np.ndarray, source: str) -> dict:
    import hashlib

    digest = hashlib.sha256(memoryview(np.ascontiguousarray(inputs)).cast("B")).hexdigest()  # the bytes, not a copy
    return {"source": source, "kind": "arrays", "count": len(inputs), "sha256": digest, "description": source}


def sample_image_crops(resolution: tuple[int, int], preprocessing: imaging.Preprocessing, count: int, seed: int) -> np.ndarray:
    """Seeded crops covering 35-100% of a bundled image's area, aspect 3:4-4:3, half of them
    mirrored, each preprocessed like a served image (the model's preprocessing of the crop)."""
    rng = np.random.default_rng(seed)
    images = sample_images()
    out = []
    for i in range(count):
        image = images[i % len(images)]
        h, w = image.shape[:2]
        area, aspect = rng.uniform(0.35, 1.0) * h * w, np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        ch, cw = min(h, int(round((area / aspect) ** 0.5))), min(w, int(round((area * aspect) ** 0.5)))
        top, left = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
        crop = image[top : top + ch, left : left + cw]
        out.append(preprocessing(crop[:, ::-1] if rng.random() < 0.5 else crop, resolution))
    return np.stack(out)
