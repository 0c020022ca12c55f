"""Images in: decoding with limits, resolution routing, and the preprocessing every deploykit path uses.

One implementation for validation, profiling, the in-process pipeline and the Triton models:
``deploykit.data.preprocess`` calls ``preprocess`` here, and ``deploykit serve`` /
``deploykit package triton`` copy this file beside their Triton Python models (as
``deploykit_imaging.py``), so a served model sees exactly the pixels the validated one saw.
That is why this module depends on numpy and (lazily) Pillow only, and imports nothing from
deploykit.

Preprocessing follows timm's eval transform: resize the short side to ``max(h, w) / crop_pct``
with an antialiased bicubic filter (Keys, a = -0.5, widened by the downscale factor), centre
crop, ``(x / 255 - mean) / std``. The filter, its support and the tap positions are those of
PyTorch's ``F.interpolate(mode="bicubic", antialias=True, align_corners=False)``
(``aten/src/ATen/native/cpu/UpSampleKernel.cpp``, ``_compute_weights_aa``), computed in float64
without intermediate rounding, so this matches torch to float32 rounding. Pillow's own resize
rounds to uint8 between its two passes and differs by up to a few grey levels.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np

# Defaults for what one request may cost before any pixel is decoded: 40 megapixels (a 48 MP
# phone photo is refused, a 7680x4320 frame is not), 32 MiB of encoded bytes, 16384 pixels on
# either side (WebP's own limit is 16383) and an aspect ratio of at most 16:1. The pixel budget
# alone is not enough: preprocessing scales the short side to the model's resolution, so a
# 1 x 40,000,000 image asks for a 40,000,000 x 55 resize (gigabytes); with the ratio bounded the
# long side after scaling is at most 16x the resolution / crop_pct.
MAX_PIXELS = 40_000_000
MAX_BYTES = 32 * 2**20
MAX_SIDE = 16_384
MAX_ASPECT = 16.0
# The formats Pillow may open: ``Image.open(formats=...)`` tries no other plugin, so an EPS upload
# never reaches Ghostscript and a TIFF/ICNS/... never reaches its decoder.
FORMATS = ("PNG", "JPEG", "WEBP", "BMP")
_KEYS_A = -0.5  # bicubic convolution parameter used by torch's and Pillow's antialiased resize


class ImageRejected(ValueError):
    """Bytes that are not an image, or an image over a size limit: the client's error."""


def check_size(height: int, width: int, max_pixels: int = MAX_PIXELS, max_side: int = MAX_SIDE, max_aspect: float = MAX_ASPECT) -> None:
    """Refuse an image of ``height x width`` above ``max_pixels``, with a side over ``max_side``
    or a long side more than ``max_aspect`` times the short one.

    Raises:
        ImageRejected: over a limit, or an empty image.
    """
    if height < 1 or width < 1:
        raise ImageRejected(f"image has no pixels ({height}x{width})")
    if height * width > max_pixels:
        raise ImageRejected(f"image is {width}x{height} = {height * width} pixels; this server takes at most {max_pixels}")
    if max(height, width) > max_side:
        raise ImageRejected(f"image is {width}x{height}; this server takes at most {max_side} pixels on a side")
    if max(height, width) > max_aspect * min(height, width):
        raise ImageRejected(f"image is {width}x{height}; this server takes an aspect ratio of at most {max_aspect:g}:1")


def decode(
    data: bytes,
    max_pixels: int = MAX_PIXELS,
    max_bytes: int = MAX_BYTES,
    max_side: int = MAX_SIDE,
    max_aspect: float = MAX_ASPECT,
    formats: Sequence[str] = FORMATS,
) -> np.ndarray:
    """Encoded image bytes (PNG, JPEG, WebP, BMP) → ``[H, W, 3]`` uint8, size checked before decoding.

    Pillow reads the header (format, width, height) on ``open`` and decodes pixels only on
    ``convert``; the limits are checked in between, so an oversized image costs a header read.
    Only ``formats`` are tried (Pillow's format names).

    Raises:
        ImageRejected: more than ``max_bytes``, not one of ``formats``, unreadable, or over a
            size limit (``check_size``).
    """
    from PIL import Image

    if len(data) > max_bytes:
        raise ImageRejected(f"image is {len(data)} bytes; this server takes at most {max_bytes}")
    try:
        with Image.open(io.BytesIO(data), formats=list(formats)) as img:
            check_size(img.height, img.width, max_pixels, max_side, max_aspect)
            return np.array(img.convert("RGB"))  # a writable copy
    except Image.UnidentifiedImageError as err:
        raise ImageRejected(f"cannot decode image bytes: not a {', '.join(formats)} image") from err
    except Image.DecompressionBombError as err:  # Pillow's own header check, at twice its MAX_IMAGE_PIXELS
        raise ImageRejected(f"image is too large: {_first_line(err)}; this server takes at most {max_pixels} pixels") from err
    except (OSError, ValueError) as err:
        if isinstance(err, ImageRejected):
            raise
        raise ImageRejected(f"cannot decode image bytes: {_first_line(err)}") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def nearest_resolution(size: tuple[int, int], resolutions: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The resolution an image of ``size = (height, width)`` is routed to.

    The one equal to ``size``, else the nearest in log scale, ``|log(h_r / h)| + |log(w_r / w)|``,
    ties broken towards the larger resolution (more detail).
    """
    h, w = size

    def key(r: tuple[int, int]) -> tuple[float, int]:
        return abs(math.log(r[0] / h)) + abs(math.log(r[1] / w)), -r[0] * r[1]

    return min(resolutions, key=key)


def preprocess(image: np.ndarray, resolution: tuple[int, int], mean: Sequence[float], std: Sequence[float], crop_pct: float) -> np.ndarray:
    """One ``[H, W, 3]`` (or ``[H, W]``, or ``[H, W, 4]``) uint8 image → ``[3, h, w]`` float32.

    Resize the short side to ``max(h, w) / crop_pct`` (antialiased bicubic, float64), clamp to
    [0, 1], centre-crop to ``resolution = (h, w)``, subtract ``mean`` and divide by ``std``.
    """
    image = np.asarray(image)
    if image.ndim == 2:
        image = image[..., None].repeat(3, axis=-1)
    image = image[..., :3]  # drop alpha
    h, w = resolution
    scale = max(h, w) / crop_pct / min(image.shape[:2])
    size = (max(h, round(image.shape[0] * scale)), max(w, round(image.shape[1] * scale)))
    top, left = (size[0] - h) // 2, (size[1] - w) // 2
    # Only the rows and columns the crop keeps are computed: each is a weighted sum of input pixels.
    rows = _resize_axis(image, 0, size[0], top, h)  # [h, W, 3] float64
    x = _resize_axis(rows, 1, size[1], left, w)  # [h, w, 3]
    x = np.clip(x / 255.0, 0.0, 1.0)
    x = (x - np.asarray(mean, np.float64)) / np.asarray(std, np.float64)
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)


def _resize_axis(x: np.ndarray, axis: int, out_size: int, start: int, count: int) -> np.ndarray:
    """Outputs ``start .. start + count`` of resizing ``x`` along ``axis`` to ``out_size``, float64."""
    index, weight = _aa_taps(x.shape[axis], out_size)
    index, weight = index[start : start + count], weight[start : start + count]  # [count, taps]
    out = None
    for t in range(index.shape[1]):  # one gather per tap keeps memory at O(count x other axis)
        taken = np.take(x, index[:, t], axis=axis).astype(np.float64)
        w = weight[:, t].reshape((-1, 1, 1) if axis == 0 else (1, -1, 1))
        out = taken * w if out is None else out + taken * w
    return out


def _aa_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Input indices ``[out, taps]`` int64 and normalised weights ``[out, taps]`` float64 of the
    antialiased bicubic filter (torch's ``_compute_weights_aa``; unused taps get weight 0)."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0  # interp_size 4, widened when downscaling
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size) + 0.5)
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    xmax = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size)
    taps = int((xmax - xmin).max())
    j = np.arange(taps)
    index = xmin[:, None] + j
    weight = _keys_cubic((index - center[:, None] + 0.5) * invscale)
    weight[index >= xmax[:, None]] = 0.0
    total = weight.sum(axis=1, keepdims=True)
    weight = np.divide(weight, total, out=np.zeros_like(weight), where=total != 0)
    return np.minimum(index, in_size - 1), weight


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution kernel with a = -0.5, support [-2, 2]."""
    a, x = _KEYS_A, np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))
