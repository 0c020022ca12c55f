"""What a model takes, as one object per kind of input: ``ImageInput`` (a ViT's preprocessed
images ``[N, C, H, W]`` float32) and ``TokenInput`` (a sequence model's token ids ``[N, T]``
int64). Each knows where its real inputs come from when the user gives none
(``deploykit.inputs.builtin``) and what a user's arrays must be (``deploykit.inputs.user``), so
neither module asks which kind a model takes: the model hands its kind over
(``VisionTransformer.input_kind``, ``SequenceTransformer.input_kind``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deploykit.errors import InputError
from deploykit.inputs import builtin, imaging
from deploykit.inputs.resolutions import resolution_tag


@dataclass(frozen=True)
class ImageInput:
    """Images, preprocessed as the model's config says.

    Attributes:
        channels: the model's input channels (``in_chans``).
        preprocessing: how an image becomes an input.
        dataset: the ``deploykit.zoo`` dataset the weights were trained on (None: none).
        mean, std: the normalisation a dataset's rendered images take.
    """

    channels: int
    preprocessing: imaging.Preprocessing
    dataset: str | None
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def real_limit(self, split: str) -> tuple[int | None, str]:
        """A zoo model: its dataset's split (``train`` is an unbounded stream). Any other: the
        bundled sample images for validation (``test``), seeded crops of them (no limit) for calibration."""
        if self.dataset:
            from deploykit.inputs.datasets import get_dataset

            return get_dataset(self.dataset).size(split), f"images in {self.dataset}'s {split} split"
        if split == builtin.VALIDATION_SPLIT:
            return len(builtin.SAMPLE_IMAGES), "bundled sample images"
        return None, "random crops of the bundled sample images"

    def validation(self, shape: tuple[int, ...], num_random: int, num_real: int, seed: int, real: np.ndarray | None) -> np.ndarray:
        """Seeded noise, then ``real`` or the dataset's test split or the bundled images."""
        if real is not None:
            return np.concatenate([builtin.random_inputs(num_random, shape, seed, self.channels), real])
        if self.dataset:
            real = builtin.dataset_inputs(self.dataset, shape, self.mean, self.std, num_real)
        else:
            real = builtin.real_inputs(shape, self.preprocessing, num_real)
        return np.concatenate([builtin.random_inputs(num_random, shape, seed), real])

    def calibration(self, shape: tuple[int, ...], count: int, seed: int, split: str) -> tuple[np.ndarray, str]:
        """The dataset's ``split`` (the first ``count`` images), else seeded crops of the bundled images."""
        if self.dataset:
            inputs = builtin.dataset_inputs(self.dataset, shape, self.mean, self.std, count, split=split)
            return inputs, f"{count} images of {self.dataset}'s {split} split"
        return builtin.sample_image_crops(shape, self.preprocessing, count, seed), (
            f"{count} random crops (seed {seed}) of the {len(builtin.SAMPLE_IMAGES)} bundled sample images: the model names no dataset"
        )

    def check_takes_images(self, path: Path) -> None:
        """Image files decode to RGB: refuse them for a model of other channels."""
        if self.channels != 3:
            raise InputError(
                f"{path}: images decode to 3 channels (RGB) but the model takes {self.channels}; give a .npy of "
                f"preprocessed [N, {self.channels}, H, W] arrays"
            )

    def checked_arrays(self, array: np.ndarray, path: Path, shape: tuple[int, ...]) -> np.ndarray:
        """``array`` as preprocessed images at ``shape``, or ``InputError`` saying what does not fit."""
        found = f"{path} holds {array.dtype} {list(array.shape)} arrays"
        expected = f"[N, {self.channels}, {shape[0]}, {shape[1]}]"
        if array.ndim != 4:
            raise InputError(f"{found}; the model at {resolution_tag(tuple(shape))} takes preprocessed {expected}")
        if array.shape[1] != self.channels:
            raise InputError(f"{found}: {array.shape[1]} channels, the model takes {self.channels} ({expected})")
        if array.shape[2:] != tuple(shape):
            raise InputError(f"{found}: {array.shape[2]}x{array.shape[3]}, the model is at {resolution_tag(tuple(shape))} ({expected})")
        if not np.issubdtype(array.dtype, np.floating):
            raise InputError(f"{found}; preprocessed inputs are float (normalised as the model expects), or give the images")
        bad = np.flatnonzero(~np.isfinite(array.reshape(len(array), -1)).all(axis=1))
        if len(bad):
            raise InputError(f"{path}: input {bad[0]} (and {len(bad) - 1} more) holds NaN or Inf")
        return array.astype(np.float32)


@dataclass(frozen=True)
class TokenInput:
    """Token ids of a character vocabulary.

    Attributes:
        vocab_size: ids run over ``[0, vocab_size)``.
    """

    vocab_size: int

    def real_limit(self, split: str) -> tuple[int | None, str]:
        return None, "windows of the bundled text"

    def validation(self, shape: tuple[int, ...], num_random: int, num_real: int, seed: int, real: np.ndarray | None) -> np.ndarray:
        """Seeded random ids, then ``real`` or windows of the bundled text."""
        (length,) = shape
        real = builtin.real_token_inputs(length, self.vocab_size, num_real) if real is None else real
        return np.concatenate([builtin.random_token_inputs(num_random, length, self.vocab_size, seed), real])

    def calibration(self, shape: tuple[int, ...], count: int, seed: int, split: str) -> tuple[np.ndarray, str]:
        """Windows of the bundled English text at seeded random offsets (any split: the text is unbounded)."""
        (length,) = shape
        ids = builtin.encode_chars(builtin.sample_text(), self.vocab_size)
        starts = np.random.default_rng(seed).integers(0, len(ids), count)
        windows = np.stack([np.take(ids, np.arange(s, s + length), mode="wrap") for s in starts])
        return windows, f"{count} windows of the bundled text (seed {seed})"

    def check_takes_images(self, path: Path) -> None:
        raise InputError(f"{path}: a sequence model takes token ids; give a .npy of [N, T] integer arrays, not images")

    def checked_arrays(self, array: np.ndarray, path: Path, shape: tuple[int, ...]) -> np.ndarray:
        """``array`` as token ids at ``shape``, or ``InputError`` saying what does not fit."""
        found = f"{path} holds {array.dtype} {list(array.shape)} arrays"
        if array.shape[1:] != tuple(shape) or not np.issubdtype(array.dtype, np.integer):
            raise InputError(f"{found}; the model at length {shape[0]} takes integer token ids [N, {shape[0]}]")
        if array.min() < 0 or array.max() >= self.vocab_size:
            raise InputError(f"{found} with ids outside [0, {self.vocab_size}), the model's vocabulary")
        return array.astype(np.int64)


InputKind = ImageInput | TokenInput
