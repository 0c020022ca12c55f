"""Images in: decoding with limits, resolution routing, and the preprocessing every deploykit path uses.

One implementation for validation, profiling, the in-process pipeline and the Triton models:
``deploykit.inputs.builtin.preprocess`` calls ``preprocess`` here, and ``deploykit serve`` /
``deploykit package triton`` copy this file beside their Triton Python models (as
``deploykit_imaging.py``), so a served model sees exactly the pixels the validated one saw.
That is why this module depends on numpy and (lazily) Pillow only, and imports nothing from
deploykit.

Decoding is bounded before Pillow reads a byte: the encoded size, then the container walked
without decompressing anything (``read_structure``) and checked (``check_structure``): the
header's pixel count, sides and aspect ratio, and what multiplies decode work beyond the pixels:
chunks and marker segments (``MAX_CHUNKS``), progressive JPEG scans (``MAX_SCANS``), stray bytes
in a JPEG header (``MAX_STRAY_BYTES``), animation frames and RLE-compressed BMPs (refused). Any
failure to decode is the image's ``ImageRejected``, in one line, whatever Pillow raised.

Preprocessing is timm's eval transform (``timm.data.transforms_imagenet_eval``), with the
settings a model records once (``Preprocessing``: from timm's ``pretrained_cfg`` at import, from
``config.json`` otherwise): resize so that the crop is ``crop_pct`` of the resized image
(``scale = floor(size / crop_pct)``), by the short side (``crop_mode="center"``; torchvision's
``Resize(int)`` when the target is square), to exactly ``scale`` (``"squash"``) or by the long
side with the rest padded in the mean colour (``"border"``), then a centre crop (torchvision's
``CenterCrop``: offsets ``int(round((size - crop) / 2))``, zero padding where the image is
smaller), ``(x / 255 - mean) / std``. The antialiased ``bicubic`` (Keys, a = -0.5) and
``bilinear`` (triangle) filters, their support (widened by the downscale factor) and tap
positions are those of PyTorch's ``F.interpolate(..., antialias=True, align_corners=False)``
(``aten/src/ATen/native/cpu/UpSampleKernel.cpp``, ``_compute_weights_aa``), computed in float64
without intermediate rounding, so this matches torch to float32 rounding. timm resizes PIL
images, and Pillow rounds to uint8 between its two passes: it differs by up to a few grey levels.
"""

from __future__ import annotations

import io
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

# The input of a served model that takes encoded images (``classify``, ``preprocess_<res>``): named
# here because this module is the one the Triton models and the code that configures them share.
ENCODED_INPUT = "image"
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
# Decode work, bounded from the container before Pillow reads it: the pixel and byte budgets leave
# room for multipliers: libjpeg passes over every block once per scan, so a small progressive JPEG
# repeating one scan thousands of times costs far more CPU than its pixels, and Pillow walks PNG
# chunks and a JPEG's header segments in Python (``benchmarks/results/decode-bounds.json`` times
# files at these limits).
# 20,000 chunks leave a 32 MiB PNG in libpng's 8 KiB IDAT chunks (4,096) room; libjpeg's own
# progressions write 10 scans (YCbCr) or 18 (CMYK), other encoders about as many, so 64 refuses
# no real encoder's file. Pillow skips stray bytes between a JPEG's header segments one at a
# time, in Python. Animated images are refused (a classifier takes one
# still image, and an APNG or WebP animation's frames each cost a canvas); so are RLE BMPs,
# which Pillow decodes in Python, pixel by pixel.
# Pixels one request's images may hold in all, in largest images (``check_request_pixels``): the
# per-image bounds alone let one request of 32 worst-case images take minutes of decoding, which
# its batch-mates wait for (a batch is answered when its every image is prepared).
REQUEST_IMAGES_OF_MAX = 2
MAX_CHUNKS = 20_000
MAX_SCANS = 64
MAX_STRAY_BYTES = 65_536
_BMP_COMPRESSIONS = {0: "uncompressed", 1: "RLE8", 2: "RLE4", 3: "bitfields"}
_KEYS_A = -0.5  # bicubic convolution parameter used by torch's and Pillow's antialiased resize
# timm's names (``pretrained_cfg["interpolation"]``, ``["crop_mode"]``) this module implements.
INTERPOLATIONS = ("bicubic", "bilinear")
CROP_MODES = ("center", "squash", "border")
DEFAULT_CROP_PCT = 0.875  # timm's DEFAULT_CROP_PCT
# The largest magnitude a model input may have. Normalised pixels, (v - mean) / std for v in [0, 1],
# lie within ±2.7 for ImageNet's mean and std and ±1 for CLIP's or 0.5/0.5; a tensor a client sends
# instead of an image can hold anything, and a finite 3e38 overflows the first layer to NaN logits.
# 1e4 is over 3,000 times any real preprocessing's range, and keeps an fp32 patch
# embedding's 768-term sums far from overflow.
MAX_INPUT_MAGNITUDE = 1e4


def unusable_values(images: np.ndarray) -> str | None:
    """Why preprocessed pixels cannot be classified (NaN/Inf, or values beyond
    ``±MAX_INPUT_MAGNITUDE``: the logits would be NaN and their ranking meaningless), or None."""
    if not images.size or float(np.abs(images).max()) <= MAX_INPUT_MAGNITUDE:  # one pass: NaN compares False too
        return None
    if not np.isfinite(images).all():
        return f"images hold {int(np.size(images) - np.isfinite(images).sum())} NaN/Inf values; send finite numbers"
    outside = int(np.count_nonzero(np.abs(images) > MAX_INPUT_MAGNITUDE))
    return f"images hold {outside} values beyond ±{MAX_INPUT_MAGNITUDE:g}; send normalised pixels"


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
    """Encoded image bytes (PNG, JPEG, WebP, BMP) → ``[H, W, 3]`` uint8, size and decode work
    checked before decoding.

    The container is walked first (``read_structure``: size, chunks, scans, frames, compression,
    without decompressing anything) and checked (``check_structure``) before Pillow sees the
    bytes. Pillow then reads the header on ``open`` and decodes pixels only on ``convert``; the
    size is checked again in between. Only ``formats`` are tried (Pillow's format names). Any
    failure is this image's ``ImageRejected``, one line: Pillow's decoders raise ``SyntaxError``,
    ``EOFError``, ``struct.error``... on corrupt bytes, and a server must answer those as the
    client's error without failing anything else.

    Raises:
        ImageRejected: more than ``max_bytes``, not one of ``formats``, unreadable, over a size
            limit (``check_size``) or a decode-work limit (``check_structure``).
    """
    from PIL import Image

    if len(data) > max_bytes:
        raise ImageRejected(f"image is {len(data)} bytes; this server takes at most {max_bytes}")
    try:
        structure = read_structure(data)
        if structure is not None and structure.format in formats:
            check_structure(structure, max_pixels, max_side, max_aspect)
        with Image.open(io.BytesIO(data), formats=list(formats)) as img:
            check_size(img.height, img.width, max_pixels, max_side, max_aspect)
            return np.array(img.convert("RGB"))  # a writable copy
    except ImageRejected:
        raise
    except Image.UnidentifiedImageError as err:
        raise ImageRejected(f"cannot decode image bytes: not a {', '.join(formats)} image") from err
    except Image.DecompressionBombError as err:  # Pillow's own header check, at twice its MAX_IMAGE_PIXELS
        raise ImageRejected(f"image is too large: {_first_line(err)}; this server takes at most {max_pixels} pixels") from err
    except Exception as err:  # any other failure to decode these bytes is theirs (docstring)
        raise ImageRejected(f"cannot decode image bytes: {_first_line(err)}") from err


def check_request_pixels(images: Sequence[bytes], max_request_pixels: int) -> None:
    """Refuse a request of several images whose headers hold more than ``max_request_pixels``
    pixels in all, before any is decoded (a lone image is judged by its own limits in ``decode``,
    as is an image whose size cannot be read, which counts nothing here).

    Raises:
        ImageRejected: naming the request's pixels and the bound.
    """
    if len(images) < 2:
        return
    total = 0
    for data in images:
        structure = read_structure(bytes(data))
        if structure is not None and structure.size is not None:
            total += structure.size[0] * structure.size[1]
    if total > max_request_pixels:
        raise ImageRejected(
            f"this request's {len(images)} images hold {total:,} pixels; this server decodes at most "
            f"{max_request_pixels:,} per request: send them in several requests"
        )


def _first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of ``err``'s message (its type when empty), cut at ``limit`` characters:
    Pillow quotes client bytes in some messages (chunk names, keywords)."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


@dataclass(frozen=True)
class Structure:
    """What an encoded image's container says, read before any pixel is decoded (``read_structure``).

    Attributes:
        format: Pillow's name of the format (``PNG``, ``JPEG``, ``WEBP``, ``BMP``).
        size: ``(height, width)`` from the header; None where the bytes end before it.
        chunks: PNG chunks, JPEG marker segments or WebP RIFF chunks (the walk stops past ``MAX_CHUNKS``).
        scans: JPEG scans (SOS markers) before the end of the image (the walk stops past ``MAX_SCANS``).
        frames: frames an APNG (``acTL``) or a WebP animation (``ANMF`` chunks) holds; 1 when still.
        stray: bytes between a JPEG's header segments (before its first scan), where Pillow steps one at a time.
        compression: a BMP's compression (``uncompressed``, ``RLE8``, ...); empty for other formats.
    """

    format: str
    size: tuple[int, int] | None
    chunks: int = 0
    scans: int = 0
    frames: int = 1
    stray: int = 0
    compression: str = ""


def read_structure(data: bytes) -> Structure | None:
    """Walk the container of PNG, JPEG, WebP or BMP ``data`` without decoding it; None for other bytes.

    Linear in ``len(data)``, with at most ``MAX_CHUNKS + 1`` steps in Python: chunks are skipped
    by their lengths, and a JPEG's entropy-coded data is searched for its next marker by ``re``.
    Bytes that end early give what was read so far (Pillow then refuses them).
    """
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return _png_structure(data)
    if data.startswith(b"\xff\xd8\xff"):
        return _jpeg_structure(data)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp_structure(data)
    if data.startswith(b"BM"):
        return _bmp_structure(data)
    return None


def check_structure(structure: Structure, max_pixels: int = MAX_PIXELS, max_side: int = MAX_SIDE, max_aspect: float = MAX_ASPECT) -> None:
    """Refuse a container whose decoding would cost more than its pixels: the header's size over
    the limits (``check_size``), too many chunks, scans or stray bytes, frames, or RLE (module constants).

    Raises:
        ImageRejected: naming the limit.
    """
    s, name = structure, structure.format
    if s.size is not None:
        check_size(*s.size, max_pixels, max_side, max_aspect)
    if s.chunks > MAX_CHUNKS:
        kind = "marker segments" if name == "JPEG" else "chunks"
        raise ImageRejected(f"{name} image has more than {MAX_CHUNKS} {kind}; this server takes at most {MAX_CHUNKS}")
    if s.scans > MAX_SCANS:
        raise ImageRejected(f"JPEG image has more than {MAX_SCANS} scans; this server takes at most {MAX_SCANS} (encoders write about 10)")
    if s.stray > MAX_STRAY_BYTES:
        raise ImageRejected(
            f"JPEG image has {s.stray} stray bytes between its header segments; this server takes at most {MAX_STRAY_BYTES}"
        )
    if s.frames > 1:
        raise ImageRejected(f"{name} image is animated ({s.frames} frames); this server takes still images")
    if s.compression.startswith("RLE"):
        raise ImageRejected(f"BMP image is {s.compression}-compressed; this server takes uncompressed or bitfields BMP")


def _png_structure(data: bytes) -> Structure:
    """Chunks (4-byte length, type, data, CRC) from the signature to ``IEND``, as Pillow reads them."""
    size, frames, chunks, pos = None, 1, 0, 8
    while pos + 8 <= len(data) and chunks <= MAX_CHUNKS:
        length, kind = struct.unpack_from(">I4s", data, pos)
        chunks += 1
        if kind in (b"IHDR", b"acTL") and length >= 8 and pos + 16 <= len(data):
            first, second = struct.unpack_from(">II", data, pos + 8)
            if kind == b"IHDR" and size is None:
                size = (second, first)  # width, then height
            elif kind == b"acTL":
                frames = first  # num_frames, then num_plays
        if kind == b"IEND":
            break
        pos += 12 + length
    return Structure("PNG", size, chunks, frames=frames)


# A marker, as libjpeg's next_marker finds it: 0xFF and a code (0x00 after 0xFF is stuffing; any
# 0xFF fill bytes before are skipped). Two fixed bytes, never ``\xff+``: that backtracks over a
# run of 0xFF bytes from each of its positions, quadratic in the run.
_JPEG_MARKER = re.compile(rb"\xff([^\x00\xff])")
# Where a scan's entropy-coded data ends: the first marker other than a restart marker (RST0-7).
_JPEG_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xD9)}  # TEM, RST0-7, SOI: no length follows
_JPEG_SOF = {*range(0xC0, 0xD0)} - {0xC4, 0xC8, 0xCC}  # frame headers (DHT, JPG and DAC excluded)


def _jpeg_structure(data: bytes) -> Structure:
    """Marker segments from SOI to EOI (libjpeg reads no further), scans skipped by searching
    their entropy-coded data for the next marker."""
    size, segments, scans, stray, pos = None, 0, 0, 0, 2
    while segments <= MAX_CHUNKS and scans <= MAX_SCANS:  # past either limit the answer is known
        found = _JPEG_MARKER.search(data, pos)
        if found is None:
            break
        if scans == 0:
            stray += found.start() - pos  # before the first scan, Pillow's parser steps over these one by one
        marker, pos, segments = found[1][0], found.end(), segments + 1
        if marker == 0xD9:  # EOI
            break
        if marker in _JPEG_STANDALONE:
            continue
        if pos + 2 > len(data):
            break
        if marker in _JPEG_SOF and size is None and pos + 7 <= len(data):
            size = struct.unpack_from(">HH", data, pos + 3)  # after length and sample precision: lines, then samples per line
        pos += int.from_bytes(data[pos : pos + 2], "big")
        if marker == 0xDA:  # SOS: the scan header, then entropy-coded data up to the next marker
            scans += 1
            end = _JPEG_SCAN_END.search(data, pos)
            if end is None:
                break
            pos = end.start()
    return Structure("JPEG", size, segments, scans=scans, stray=stray)


def _webp_structure(data: bytes) -> Structure:
    """RIFF chunks (fourcc, little-endian size, data padded to even): the canvas from the first
    (``VP8X``, ``VP8 `` or ``VP8L``), and the frames of an animation (``ANMF``)."""
    size, chunks, frames, pos = None, 0, 0, 12
    while pos + 8 <= len(data) and chunks <= MAX_CHUNKS:
        fourcc, length = struct.unpack_from("<4sI", data, pos)
        body, chunks = data[pos + 8 : pos + 8 + min(length, 10)], chunks + 1
        if chunks == 1:
            size = _webp_canvas(fourcc, body)
        frames += fourcc == b"ANMF"
        pos += 8 + length + (length & 1)
    return Structure("WEBP", size, chunks, frames=max(frames, 1))


def _webp_canvas(fourcc: bytes, body: bytes) -> tuple[int, int] | None:
    """``(height, width)`` from the first chunk's first bytes, as libwebp reads them."""
    if fourcc == b"VP8X" and len(body) >= 10:  # flags, reserved, then width - 1 and height - 1 (24 bits each)
        return int.from_bytes(body[7:10], "little") + 1, int.from_bytes(body[4:7], "little") + 1
    if fourcc == b"VP8 " and len(body) >= 10 and body[3:6] == b"\x9d\x01\x2a":  # frame tag, start code, 14-bit sizes
        width, height = struct.unpack_from("<HH", body, 6)
        return height & 0x3FFF, width & 0x3FFF
    if fourcc == b"VP8L" and len(body) >= 5 and body[0] == 0x2F:  # signature, then 14-bit width - 1 and height - 1
        bits = int.from_bytes(body[1:5], "little")
        return ((bits >> 14) & 0x3FFF) + 1, (bits & 0x3FFF) + 1
    return None


def _bmp_structure(data: bytes) -> Structure:
    """The info header after the 14-byte file header: size, and compression (BITMAPINFOHEADER and later)."""
    if len(data) < 26:
        return Structure("BMP", None)
    header = int.from_bytes(data[14:18], "little")
    if header == 12:  # BITMAPCOREHEADER: 16-bit sizes, never compressed
        width, height = struct.unpack_from("<HH", data, 18)
        return Structure("BMP", (height, width), compression=_BMP_COMPRESSIONS[0])
    if header not in (40, 52, 56, 64, 108, 124):  # the info headers Pillow reads; it refuses others
        return Structure("BMP", None)
    width, height = struct.unpack_from("<Ii", data, 18)  # a negative height is a top-down bitmap
    compression = int.from_bytes(data[30:34], "little") if len(data) >= 34 else 0
    return Structure("BMP", (abs(height), width), compression=_BMP_COMPRESSIONS.get(compression, str(compression)))


def nearest_resolution(size: tuple[int, int], resolutions: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The resolution an image of ``size = (height, width)`` is routed to.

    The one equal to ``size``, else the nearest in log scale, ``|log(h_r / h)| + |log(w_r / w)|``,
    ties broken towards the larger resolution (more detail).
    """
    h, w = size

    def key(r: tuple[int, int]) -> tuple[float, int]:
        return abs(math.log(r[0] / h)) + abs(math.log(r[1] / w)), -r[0] * r[1]

    return min(resolutions, key=key)


def check_preprocessing(crop_pct: float, crop_mode: str, interpolation: str) -> None:
    """Refuse settings ``preprocess`` does not implement.

    Raises:
        ValueError: ``crop_pct`` not in (0, 1], or an unknown crop mode or interpolation (the
            valid ones are listed).
    """
    if not (isinstance(crop_pct, (int, float)) and 0 < crop_pct <= 1):
        raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct!r}")
    if crop_mode not in CROP_MODES:
        raise ValueError(f"crop_mode must be one of {', '.join(CROP_MODES)}, got {crop_mode!r}")
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")


@dataclass(frozen=True)
class Preprocessing:
    """One model's preprocessing, as timm's data config names it (module docstring).

    Attributes:
        mean, std: per channel, on pixels scaled to [0, 1].
        crop_pct: the centre crop's share of the resized image (1.0: no crop).
        crop_mode: ``center``, ``squash`` or ``border`` (``CROP_MODES``).
        interpolation: ``bicubic`` or ``bilinear`` (``INTERPOLATIONS``).
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_pct: float = DEFAULT_CROP_PCT
    crop_mode: str = "center"
    interpolation: str = "bicubic"

    def __post_init__(self):
        check_preprocessing(self.crop_pct, self.crop_mode, self.interpolation)

    def __call__(self, image: np.ndarray, resolution: tuple[int, int]) -> np.ndarray:
        """``preprocess`` with these settings: ``[H, W, C]`` uint8 → ``[3, h, w]`` float32."""
        return preprocess(image, resolution, self.mean, self.std, self.crop_pct, self.crop_mode, self.interpolation)

    def to_dict(self) -> dict:
        return {**asdict(self), "mean": list(self.mean), "std": list(self.std)}


def preprocess(
    image: np.ndarray,
    resolution: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    crop_pct: float = DEFAULT_CROP_PCT,
    crop_mode: str = "center",
    interpolation: str = "bicubic",
) -> np.ndarray:
    """One ``[H, W, 3]`` (or ``[H, W]``, or ``[H, W, 4]``) uint8 image → ``[3, h, w]`` float32.

    timm's eval transform for ``resolution = (h, w)`` (module docstring): resize (antialiased
    ``interpolation``, float64) as ``crop_mode`` says, clamp to [0, 1], centre-crop (or pad) to
    ``(h, w)``, subtract ``mean`` and divide by ``std``.
    """
    check_preprocessing(crop_pct, crop_mode, interpolation)
    image = np.asarray(image)
    if image.ndim == 2:
        image = image[..., None].repeat(3, axis=-1)
    # Drop alpha; contiguous, because np.take on a strided view (a mirrored crop: image[:, ::-1])
    # falls back to a per-element path about 50x slower.
    image = np.ascontiguousarray(image[..., :3])
    size = _resized_size(image.shape[:2], resolution, crop_pct, crop_mode)
    fill = [round(255 * m) / 255 for m in mean] if crop_mode == "border" else [0.0] * 3
    # Only the rows and columns the crop keeps are computed: each is a weighted sum of input pixels.
    (rows, row_pad), (cols, col_pad) = (_kept(size[i], resolution[i]) for i in (0, 1))
    x = _resize_axis(image, 0, size[0], rows.start, len(rows), interpolation)  # [h', W, 3] float64
    x = _resize_axis(x, 1, size[1], cols.start, len(cols), interpolation)  # [h', w', 3]
    x = np.clip(x / 255.0, 0.0, 1.0)
    if row_pad != (0, 0) or col_pad != (0, 0):
        x = np.stack([np.pad(x[..., c], (row_pad, col_pad), constant_values=fill[c]) for c in range(3)], axis=-1)
    x = (x - np.asarray(mean, np.float64)) / np.asarray(std, np.float64)
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)


def _resized_size(shape: tuple[int, int], resolution: tuple[int, int], crop_pct: float, crop_mode: str) -> tuple[int, int]:
    """The ``(height, width)`` timm resizes an image of ``shape`` to before its centre crop."""
    height, width = shape
    scale = (math.floor(resolution[0] / crop_pct), math.floor(resolution[1] / crop_pct))
    if crop_mode == "squash":
        return scale
    if crop_mode == "center" and scale[0] == scale[1]:  # torchvision Resize(int): the short side
        short, long = min(height, width), max(height, width)
        long = int(scale[0] * long / short)
        return (scale[0], long) if height <= width else (long, scale[0])
    # timm's ResizeKeepRatio: the short side (center) or the long side (border) fits
    ratios = (height / scale[0], width / scale[1])
    ratio = max(ratios) if crop_mode == "border" else min(ratios)
    return round(height / ratio), round(width / ratio)


def _kept(size: int, crop: int) -> tuple[range, tuple[int, int]]:
    """Of ``size`` resized rows, those a centre crop of ``crop`` keeps, and the padding
    (before, after) it adds where ``size < crop`` (torchvision's ``CenterCrop``)."""
    before, after = ((crop - size) // 2, (crop - size + 1) // 2) if crop > size else (0, 0)
    start = int(round((size + before + after - crop) / 2.0))
    return range(start, start + crop - before - after), (before, after)


def _resize_axis(x: np.ndarray, axis: int, out_size: int, start: int, count: int, interpolation: str) -> np.ndarray:
    """Outputs ``start .. start + count`` of resizing ``x`` along ``axis`` to ``out_size``, float64."""
    index, weight = _aa_taps(x.shape[axis], out_size, interpolation)
    index, weight = index[start : start + count], weight[start : start + count]  # [count, taps]
    out = None
    for t in range(index.shape[1]):  # one gather per tap keeps memory at O(count x other axis)
        taken = np.take(x, index[:, t], axis=axis).astype(np.float64)
        w = weight[:, t].reshape((-1, 1, 1) if axis == 0 else (1, -1, 1))
        out = taken * w if out is None else out + taken * w
    return out


def _aa_taps(in_size: int, out_size: int, interpolation: str) -> tuple[np.ndarray, np.ndarray]:
    """Input indices ``[out, taps]`` int64 and normalised weights ``[out, taps]`` float64 of the
    antialiased filter (torch's ``_compute_weights_aa``; unused taps get weight 0)."""
    kernel, half_support = (_keys_cubic, 2.0) if interpolation == "bicubic" else (_triangle, 1.0)  # interp_size 4 or 2
    scale = in_size / out_size
    support = half_support * scale if scale >= 1.0 else half_support  # widened when downscaling
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size) + 0.5)
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    xmax = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size)
    taps = int((xmax - xmin).max())
    j = np.arange(taps)
    index = xmin[:, None] + j
    weight = kernel((index - center[:, None] + 0.5) * invscale)
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


def _triangle(x: np.ndarray) -> np.ndarray:
    """The bilinear (triangle) kernel, support [-1, 1]."""
    return np.maximum(1.0 - np.abs(x), 0.0)
