"""Inputs for validation and profiling: real images that ship inside a package, seeded noise,
and the preprocessing (resize, centre crop, normalise) the served pipeline uses too.

Real images come from scikit-image's bundled samples (installed with the ``images`` extra), so
nothing is downloaded and top-1 agreement is measured on natural-image statistics.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from deploykit._lazy import lazy_import

# RGB samples bundled inside scikit-image's wheel (no pooch download).
SAMPLE_IMAGES = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina", "colorwheel")
# timm's default: resize the short side to resolution / crop_pct, then centre-crop.
CROP_PCT = 0.875


def preprocess(
    image: np.ndarray,
    resolution: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    crop_pct: float = CROP_PCT,
) -> np.ndarray:
    """One ``[H, W, 3]`` (or ``[H, W]``) uint8 image → ``[3, h, w]`` float32, normalised.

    Bicubic antialiased resize of the short side to ``max(h, w) / crop_pct``, centre crop to
    ``resolution``, scale to ``[0, 1]``, subtract ``mean`` and divide by ``std`` per channel.
    """
    image = np.asarray(image)
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=-1)
    image = image[..., :3]  # drop alpha
    h, w = resolution
    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].double() / 255.0
    scale = max(h, w) / crop_pct / min(x.shape[-2:])
    size = (max(h, round(x.shape[-2] * scale)), max(w, round(x.shape[-1] * scale)))
    x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True).clamp_(0, 1)
    top, left = (size[0] - h) // 2, (size[1] - w) // 2
    x = x[..., top : top + h, left : left + w]
    x = (x - torch.tensor(mean, dtype=x.dtype)[:, None, None]) / torch.tensor(std, dtype=x.dtype)[:, None, None]
    return x[0].float().numpy()


def sample_images(count: int = len(SAMPLE_IMAGES)) -> list[np.ndarray]:
    """Up to ``len(SAMPLE_IMAGES)`` bundled natural images as uint8 arrays."""
    skdata = lazy_import("skimage").data
    return [getattr(skdata, name)() for name in SAMPLE_IMAGES[:count]]


def real_inputs(resolution: tuple[int, int], mean, std, count: int = len(SAMPLE_IMAGES)) -> np.ndarray:
    """``[count, 3, H, W]`` float32 from the bundled images."""
    return np.stack([preprocess(img, resolution, mean, std) for img in sample_images(count)])


def random_inputs(count: int, resolution: tuple[int, int], seed: int = 0, channels: int = 3) -> np.ndarray:
    """``[count, C, H, W]`` float32 standard-normal inputs from ``seed`` (about the range of
    normalised images)."""
    return np.random.default_rng(seed).standard_normal((count, channels, *resolution), dtype=np.float32)
