"""A procedurally rendered image-classification task where only spatial structure tells the class.

Each scene holds a circle and a square in random colours on a random background; the class is
where the square lies relative to the circle (left, right, above, below). Colours, sizes and
absolute positions are independent of the class, so a colour histogram (or any other statistic
that ignores where pixels are) carries no information: mirroring a scene keeps its histogram and
swaps left and right.

Scenes live in continuous coordinates on the unit square (x to the right, y down) and are
rendered analytically (each pixel holds the area the shapes cover), so one scene can be drawn at
any resolution: the resolution-extrapolation evaluation renders the same test scenes at 1.5× and
2× the training size. Sample ``i`` of a split comes from ``np.random.default_rng([seed, split, i])``,
so splits never share a random stream and any sample can be drawn alone, in any order.
numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deploykit.errors import unknown_choice

CLASSES = ("left", "right", "above", "below")  # where the square lies relative to the circle
SPLITS = {"train": 0, "val": 1, "test": 2}
# val and test are fixed sets; train is an unbounded stream (index it as far as training needs).
SPLIT_SIZES = {"val": 1000, "test": 2000}

# Class directions (dx, dy) in image coordinates (y grows downwards).
_DIRECTIONS = np.array([(-1.0, 0.0), (1.0, 0.0), (0.0, -1.0), (0.0, 1.0)])
_MAX_ANGLE = np.deg2rad(35.0)  # the square lies within ±35° of its class's axis: never ambiguous
_DISTANCE = (0.32, 0.6)  # centre-to-centre, in image widths
_RADIUS = (0.1, 0.14)  # circle radius: always the larger shape (area ≥ 0.031 > 0.0256)
_HALF_SIDE = (0.05, 0.08)  # square half side (the pair never overlaps: 0.14 + 0.08·√2 < 0.32)
# Colours per channel: dark backgrounds, light shapes (finding the shapes is not the puzzle).
_BACKGROUND = (0.0, 0.35)
_FOREGROUND = (0.5, 1.0)


@dataclass(frozen=True)
class Scene:
    """One image's geometry and colours; coordinates in [0, 1] (x right, y down), colours RGB in [0, 1]."""

    label: int
    circle: tuple[float, float, float]  # cx, cy, radius
    square: tuple[float, float, float]  # cx, cy, half side
    circle_colour: tuple[float, float, float]
    square_colour: tuple[float, float, float]
    background: tuple[float, float, float]

    def mirrored(self) -> Scene:
        """The scene reflected left-right (label left ↔ right)."""
        (cx, cy, r), (sx, sy, h) = self.circle, self.square
        label = {0: 1, 1: 0}.get(self.label, self.label)
        return Scene(label, (1.0 - cx, cy, r), (1.0 - sx, sy, h), self.circle_colour, self.square_colour, self.background)


@dataclass(frozen=True)
class ShapeRelations:
    """The dataset: ``scene(split, i)`` for geometry, ``images(split, indices, resolution)`` for pixels.

    Args:
        seed: picks the whole dataset; every split and sample derives from it.
    """

    seed: int = 0
    name: str = "shape-relations"
    num_classes: int = len(CLASSES)

    def size(self, split: str) -> int | None:
        """Number of samples in a fixed split; None for the unbounded train stream."""
        _split_id(split)
        return SPLIT_SIZES.get(split)

    def scene(self, split: str, index: int) -> Scene:
        """Sample ``index`` of ``split``. Labels cycle through the classes, so every prefix of
        a split of length ``k·num_classes`` is exactly balanced."""
        size = self.size(split)
        if index < 0 or (size is not None and index >= size):
            raise IndexError(f"{split} has {size} samples; index {index} is out of range")
        rng = np.random.default_rng([self.seed, _split_id(split), index])
        label = index % len(CLASSES)
        return _draw_scene(rng, label)

    def labels(self, split: str, indices: Sequence[int]) -> np.ndarray:
        return np.array([self.scene(split, int(i)).label for i in indices], dtype=np.int64)

    def images(self, split: str, indices: Sequence[int], resolution: int | tuple[int, int]) -> np.ndarray:
        """``[len(indices), 3, H, W]`` float32 in [0, 1]."""
        return render([self.scene(split, int(i)) for i in indices], resolution)

    def batch(self, split: str, indices: Sequence[int], resolution: int | tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """Images and int64 labels of ``indices`` (each scene drawn once)."""
        scenes = [self.scene(split, int(i)) for i in indices]
        return render(scenes, resolution), np.array([s.label for s in scenes], dtype=np.int64)


def _split_id(split: str) -> int:
    try:
        return SPLITS[split]
    except KeyError:
        raise ValueError(unknown_choice("split", split, SPLITS)) from None


def _draw_scene(rng: np.random.Generator, label: int) -> Scene:
    radius, half = rng.uniform(*_RADIUS), rng.uniform(*_HALF_SIDE)
    angle = rng.uniform(-_MAX_ANGLE, _MAX_ANGLE)
    distance = rng.uniform(*_DISTANCE)
    ax, ay = _DIRECTIONS[label]
    # Rotate the class axis by `angle`: the square's offset from the circle.
    dx = distance * (ax * np.cos(angle) - ay * np.sin(angle))
    dy = distance * (ax * np.sin(angle) + ay * np.cos(angle))
    # Circle centre uniform over the positions that keep both shapes inside the image.
    lo = np.array([max(radius, half - dx), max(radius, half - dy)])
    hi = np.array([min(1 - radius, 1 - half - dx), min(1 - radius, 1 - half - dy)])
    cx, cy = rng.uniform(lo, hi)
    background = rng.uniform(*_BACKGROUND, 3)
    circle_colour, square_colour = (tuple(map(float, rng.uniform(*_FOREGROUND, 3))) for _ in range(2))
    return Scene(
        label,
        (float(cx), float(cy), float(radius)),
        (float(cx + dx), float(cy + dy), float(half)),
        circle_colour,
        square_colour,
        tuple(map(float, background)),
    )


def render(scenes: Sequence[Scene], resolution: int | tuple[int, int]) -> np.ndarray:
    """Render scenes to ``[N, 3, H, W]`` float32 in [0, 1].

    Each pixel holds the fraction of its area each shape covers, so a render at ``k·H``
    box-downsampled by ``k`` approximates the render at ``H``: exact for the square (the area of
    an axis-aligned box is separable into x and y overlaps), and for the circle the signed
    distance from its edge at the pixel centre, in pixel widths, ramped over one pixel (exact
    where the edge is straight at pixel scale).
    """
    h, w = (resolution, resolution) if isinstance(resolution, int) else resolution
    out = np.empty((len(scenes), 3, h, w), np.float32)
    # A few scenes at a time: every value is per scene, and the float64 intermediates of a whole
    # split at once would be several times the size of the output.
    for start in range(0, len(scenes), _RENDER_CHUNK):
        out[start : start + _RENDER_CHUNK] = _render_chunk(scenes[start : start + _RENDER_CHUNK], h, w)
    return out


_RENDER_CHUNK = 4  # small enough that a chunk's float64 arrays stay in cache at 384 px


def _render_chunk(scenes: Sequence[Scene], h: int, w: int) -> np.ndarray:
    geom = np.array([(*sc.circle, *sc.square) for sc in scenes])[:, :, None, None]  # [N, 6, 1, 1]
    cx, cy, r, sx, sy, half = geom.transpose(1, 0, 2, 3)
    # Pixel (i, j) covers [j/W, (j+1)/W) x [i/H, (i+1)/H).
    x0, y0 = (np.arange(w) / w)[None, None, :], (np.arange(h) / h)[None, :, None]
    x1, y1 = x0 + 1 / w, y0 + 1 / h
    overlap_x = np.clip(np.minimum(x1, sx + half) - np.maximum(x0, sx - half), 0, None) * w
    overlap_y = np.clip(np.minimum(y1, sy + half) - np.maximum(y0, sy - half), 0, None) * h
    square = overlap_x * overlap_y  # [N, H, W]
    pixel = np.sqrt(1 / (h * w))  # geometric-mean pixel side, in image widths
    edge = r - np.sqrt(((x0 + x1) / 2 - cx) ** 2 + ((y0 + y1) / 2 - cy) ** 2)  # > 0 inside
    circle = np.clip(0.5 + edge / pixel, 0.0, 1.0)
    colours = np.array([(sc.background, sc.circle_colour, sc.square_colour) for sc in scenes])
    bg, cc, sc_ = (colours[:, k, :, None, None] for k in range(3))  # [N, 3, 1, 1]
    image = bg * (1 - circle - square)[:, None] + cc * circle[:, None] + sc_ * square[:, None]
    return np.clip(image, 0.0, 1.0).astype(np.float32)


DATASETS = {"shape-relations": ShapeRelations}


def get_dataset(name: str, seed: int = 0) -> ShapeRelations:
    """A dataset by the name a model config records."""
    try:
        return DATASETS[name](seed=seed)
    except KeyError:
        raise ValueError(unknown_choice("dataset", name, DATASETS)) from None
