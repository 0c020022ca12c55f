"""What serving needs to know of an exported image classifier, read from its files without
PyTorch: the graphs' input name, the fields of ``config.json`` preprocessing and the outputs
need, and how large an image may be.

``deploykit package triton`` writes a model repository from these alone, so it does not load
PyTorch; the in-process pipeline reads the same fields the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from deploykit.catalog import IMAGES_INPUT, SEQUENCE_ARCHITECTURE
from deploykit.errors import ConfigError
from deploykit.export.directory import ExportDir
from deploykit.export.manifest import Manifest
from deploykit.inputs import imaging

INPUT_NAME = IMAGES_INPUT  # serving is for image classifiers


@dataclass(frozen=True)
class ImageLimits:
    """What one image may cost before it is decoded; anything larger is refused.

    Attributes:
        max_pixels: most pixels (height x width), checked from the image header.
        max_bytes: most encoded bytes per image.
        max_side: most pixels on either side.
        max_aspect: largest ratio of the long side to the short one.

    One request's images may hold ``request_pixels`` in all (``imaging.REQUEST_IMAGES_OF_MAX``
    largest images): decode work is bounded per request as well as per image.
    """

    max_pixels: int = imaging.MAX_PIXELS
    max_bytes: int = imaging.MAX_BYTES
    max_side: int = imaging.MAX_SIDE
    max_aspect: float = imaging.MAX_ASPECT

    def __post_init__(self) -> None:
        if min(self.max_pixels, self.max_bytes, self.max_side) < 1 or not self.max_aspect >= 1:
            raise ConfigError(
                f"image limits must be >= 1, got max_pixels={self.max_pixels}, max_bytes={self.max_bytes}, "
                f"max_side={self.max_side}, max_aspect={self.max_aspect}"
            )

    @property
    def request_pixels(self) -> int:
        """Most pixels one request's images may hold in all."""
        return imaging.REQUEST_IMAGES_OF_MAX * self.max_pixels

    def check(self, height: int, width: int) -> None:
        """``imaging.check_size`` with these limits."""
        imaging.check_size(height, width, self.max_pixels, self.max_side, self.max_aspect)

    def decode(self, data: bytes):
        """``imaging.decode`` with these limits: ``[H, W, 3]`` uint8."""
        return imaging.decode(data, self.max_pixels, self.max_bytes, self.max_side, self.max_aspect)


@dataclass(frozen=True)
class ClassifierConfig:
    """The fields of an export's ``config.json`` that serving uses.

    Attributes:
        in_chans: image channels (``[B, in_chans, H, W]`` float32 inputs).
        num_classes: logits per image.
        mean: per-channel mean subtracted after scaling to [0, 1].
        std: per-channel divisor (positive).
        preprocessing: how an image becomes an input (mean and std included): the model's one
            preprocessing, as calibration and validation applied it.
    """

    in_chans: int
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    preprocessing: imaging.Preprocessing


def read_image_config(export_dir: Path, manifest: Manifest) -> ClassifierConfig:
    """The export's classifier fields, from a ``config.json`` checked against ``manifest``; a
    sequence model's export is refused in one line.

    Raises:
        DeployKitError: ``config.json`` is missing, changed since export or not in the manifest.
        ConfigError: an unreadable ``config.json``, a sequence model, or fields that are
            missing or out of range.
    """
    path = ExportDir(export_dir).config(manifest)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise ConfigError(f"invalid model config {path}: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"invalid model config {path}: a JSON object expected")
    if data.get("architecture") == SEQUENCE_ARCHITECTURE:
        raise ConfigError(f"{export_dir} holds a sequence model; serving takes image classifiers (ViT exports)")
    try:
        mean, std = tuple(map(float, data["mean"])), tuple(map(float, data["std"]))
        # configs written before the preprocessing fields: timm's defaults, as the model then took them
        settings = {k: data[k] for k in ("crop_pct", "crop_mode", "interpolation") if k in data}
        config = ClassifierConfig(int(data["in_chans"]), int(data["num_classes"]), mean, std, imaging.Preprocessing(mean, std, **settings))
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"invalid model config {path}: in_chans, num_classes, mean and std are needed ({err!r})") from err
    sizes_ok = config.in_chans >= 1 and config.num_classes >= 1 and len(config.mean) == len(config.std) == config.in_chans
    if not sizes_ok or not all(math.isfinite(s) and s > 0 for s in config.std):
        raise ConfigError(f"invalid model config {path}: {config}")
    return config
