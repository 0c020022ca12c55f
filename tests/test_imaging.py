"""``deploykit.inputs.imaging``: the one preprocessing, checked against PyTorch's antialiased bicubic
resize (the implementation validation used before), and size limits enforced from the header."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import PIL.Image as PIL
import pytest

from deploykit.inputs import imaging
from tests import image_bombs
from tests.serve.serve_reference import torch_preprocess

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.mark.parametrize("shape", [(512, 512), (300, 451), (30, 34), (7, 200), (1000, 37), (48, 48)])
@pytest.mark.parametrize("resolution", [(32, 32), (48, 48), (224, 224), (384, 256), (5, 9)])
def test_preprocess_equals_torch_antialiased_bicubic(shape, resolution):
    """Down- and upscaling, odd aspect ratios, non-square outputs: equal to float32 rounding."""
    image = np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8)
    ours = imaging.preprocess(image, resolution, MEAN, STD, 0.875)
    assert ours.shape == (3, *resolution) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, torch_preprocess(image, resolution, MEAN, STD), rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(300, 451), (451, 300), (40, 40), (7, 200)])
@pytest.mark.parametrize("resolution", [(224, 224), (64, 96)])
@pytest.mark.parametrize(
    "settings",
    [
        dict(crop_pct=1.0, crop_mode="center", interpolation="bilinear"),
        dict(crop_pct=0.95, crop_mode="squash", interpolation="bicubic"),
        dict(crop_pct=0.9, crop_mode="border", interpolation="bicubic"),
        dict(crop_pct=1.0, crop_mode="border", interpolation="bilinear"),
    ],
)
def test_every_crop_mode_and_interpolation_equals_timms_transform_in_torch(shape, resolution, settings):
    """timm's eval transform in each crop mode (``border`` pads in the mean colour), bilinear too."""
    image = np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8)
    ours = imaging.Preprocessing(MEAN, STD, **settings)(image, resolution)
    assert ours.shape == (3, *resolution)
    np.testing.assert_allclose(ours, torch_preprocess(image, resolution, MEAN, STD, **settings), rtol=0, atol=1e-6)


def test_border_mode_pads_in_the_mean_colour():
    wide = np.full((20, 80, 3), 255, np.uint8)
    x = imaging.Preprocessing(MEAN, STD, crop_pct=1.0, crop_mode="border")(wide, (32, 32))
    fill = (np.round(255 * np.asarray(MEAN)) / 255 - np.asarray(MEAN)) / np.asarray(STD)
    np.testing.assert_allclose(x[:, 0, 16], fill, atol=1e-6)  # top rows: padding
    np.testing.assert_allclose(x[:, 16, 16], (1 - np.asarray(MEAN)) / np.asarray(STD), atol=1e-6)  # the image


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(crop_pct=0.0), "crop_pct must be in"),
        (dict(crop_pct=1.5), "crop_pct must be in"),
        (dict(crop_mode="random"), "crop_mode must be one of center, squash, border"),
        (dict(interpolation="lanczos"), "interpolation must be one of bicubic, bilinear"),
    ],
)
def test_unknown_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        imaging.Preprocessing(MEAN, STD, **settings)


def test_grey_and_alpha_images_are_rgb():
    rgb = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    rgba = np.concatenate([rgb, np.full((40, 50, 1), 7, np.uint8)], axis=-1)
    np.testing.assert_array_equal(imaging.preprocess(rgba, (32, 32), MEAN, STD, 0.875), imaging.preprocess(rgb, (32, 32), MEAN, STD, 0.875))
    grey = rgb[..., 0]
    np.testing.assert_array_equal(
        imaging.preprocess(grey, (32, 32), MEAN, STD, 0.875),
        imaging.preprocess(np.repeat(grey[..., None], 3, -1), (32, 32), MEAN, STD, 0.875),
    )


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header says ``width x height`` and whose pixel data is garbage: decoding it
    fails, so a refusal that names the pixel count was made before decoding."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"not zlib data") + chunk(b"IEND", b"")


def test_oversized_image_is_refused_from_its_header():
    with pytest.raises(imaging.ImageRejected, match="12000x12000 = 144000000 pixels; this server takes at most 40000000"):
        imaging.decode(png_header_only(12000, 12000))
    # past Pillow's own bomb check (179 MP): refused from the header before Pillow opens it
    with pytest.raises(imaging.ImageRejected, match="20000x20000 = 400000000 pixels; this server takes at most 40000000"):
        imaging.decode(png_header_only(20000, 20000))
    with pytest.raises(imaging.ImageRejected, match="cannot decode"):  # the same garbage, under the limit: decoding fails
        imaging.decode(png_header_only(100, 100))


def test_limits_are_arguments():
    buf = io.BytesIO()
    PIL.new("RGB", (40, 30)).save(buf, format="PNG")
    data = buf.getvalue()
    assert imaging.decode(data, max_pixels=1200, max_bytes=len(data)).shape == (30, 40, 3)
    with pytest.raises(imaging.ImageRejected, match="40x30 = 1200 pixels; this server takes at most 1199$"):
        imaging.decode(data, max_pixels=1199)
    with pytest.raises(imaging.ImageRejected, match=f"{len(data)} bytes; this server takes at most {len(data) - 1}"):
        imaging.decode(data, max_bytes=len(data) - 1)


@pytest.mark.parametrize("data", [b"", b"definitely not an image", b"\x89PNG\r\n\x1a\n"])
def test_undecodable_bytes_are_one_line(data):
    with pytest.raises(imaging.ImageRejected, match="^cannot decode image bytes: ") as info:
        imaging.decode(data)
    assert "\n" not in str(info.value)


def _encoded(image, fmt: str, **save) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\nnewpath 0 0 moveto 8 8 lineto stroke\n%%EOF\n"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP"])
def test_the_allowed_formats_decode(fmt):
    pixels = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    decoded = imaging.decode(_encoded(PIL.fromarray(pixels), fmt, **({"lossless": True} if fmt == "WEBP" else {})))
    assert decoded.shape == (20, 30, 3)
    if fmt != "JPEG":  # lossless: the same pixels
        np.testing.assert_array_equal(decoded, pixels)


@pytest.mark.parametrize("fmt", ["EPS", "GIF", "TIFF", "ICO", "PPM"])
def test_other_formats_are_refused_before_their_decoder_runs(fmt):
    """Formats Pillow reads but the server does not take: EPS would go to Ghostscript where it is installed."""
    data = EPS if fmt == "EPS" else _encoded(PIL.new("RGB", (8, 8)), fmt)
    assert PIL.open(io.BytesIO(data)).format == fmt  # Pillow itself would open it
    with pytest.raises(imaging.ImageRejected, match=r"^cannot decode image bytes: not a PNG, JPEG, WEBP, BMP image$"):
        imaging.decode(data)


@pytest.mark.parametrize(
    "size, message",
    [
        ((1, 10_000), "image is 10000x1; this server takes an aspect ratio of at most 16:1"),
        ((3_000, 100), "image is 100x3000; this server takes an aspect ratio of at most 16:1"),
        ((17, 1), "image is 1x17; this server takes an aspect ratio of at most 16:1"),
    ],
)
def test_extreme_aspect_ratios_are_refused_from_the_header(size, message):
    """A few hundred bytes of real PNG, far under the pixel budget: refused before any resize is planned."""
    data = _encoded(PIL.new("L", size[::-1]), "PNG")
    assert len(data) < 2_000
    with pytest.raises(imaging.ImageRejected, match=f"^{message}$"):
        imaging.decode(data)
    assert imaging.decode(_encoded(PIL.new("L", (16, 1)), "PNG")).shape == (1, 16, 3)  # 16:1 is accepted


def test_a_side_over_the_limit_is_refused_from_the_header():
    with pytest.raises(imaging.ImageRejected, match="^image is 17000x2000; this server takes at most 16384 pixels on a side$"):
        imaging.decode(png_header_only(17_000, 2_000), max_pixels=10**9)
    with pytest.raises(imaging.ImageRejected, match="at most 1000 pixels on a side"):
        imaging.decode(png_header_only(1_001, 100), max_side=1_000)


def test_a_corrupt_chunk_is_refused_in_one_line_whatever_pillow_raises():
    """Pillow raises ``SyntaxError`` decoding a PNG whose zTXt chunk after the pixels names an
    unknown compression (issue 41: it escaped and failed a whole Triton batch)."""
    png = image_bombs.encoded("PNG")
    end = png.rindex(b"IEND") - 4
    for kind in (b"zTXt", b"iCCP"):
        with pytest.raises(imaging.ImageRejected, match="^cannot decode image bytes: .*compression") as info:
            imaging.decode(png[:end] + image_bombs.png_chunk(kind, b"key\0\x01data") + png[end:])
        assert "\n" not in str(info.value)


BOMBS = {
    "progressive JPEG, one scan repeated": (
        lambda: image_bombs.progressive_jpeg(imaging.MAX_SCANS + 1),
        f"^JPEG image has more than {imaging.MAX_SCANS} scans; this server takes at most {imaging.MAX_SCANS}",
    ),
    "PNG of empty chunks": (lambda: image_bombs.png_with_chunks(imaging.MAX_CHUNKS), "^PNG image has more than 20000 chunks"),
    "JPEG of empty comments": (
        lambda: image_bombs.jpeg_with_segments(imaging.MAX_CHUNKS),
        "^JPEG image has more than 20000 marker segments",
    ),
    "JPEG padded between segments": (
        lambda: image_bombs.jpeg_with_stray_bytes(imaging.MAX_STRAY_BYTES + 1),
        f"^JPEG image has {imaging.MAX_STRAY_BYTES + 1} stray bytes between its header segments",
    ),
    "JPEG padded with fill bytes": (
        lambda: image_bombs.jpeg_with_stray_bytes(2**20, b"\xff"),
        f"^JPEG image has {2**20} stray bytes between its header segments",
    ),
    "WebP of empty chunks": (lambda: image_bombs.webp_with_chunks(imaging.MAX_CHUNKS), "^WEBP image has more than 20000 chunks"),
    "APNG": (lambda: image_bombs.animated("PNG", 2), r"^PNG image is animated \(2 frames\); this server takes still images$"),
    "animated WebP": (lambda: image_bombs.animated("WEBP", 3), r"^WEBP image is animated \(3 frames\)"),
    "RLE BMP": (image_bombs.bmp_rle8, "^BMP image is RLE8-compressed"),
    "WebP canvas over the pixel limit": (
        lambda: b"RIFF\x16\0\0\0WEBPVP8X\x0a\0\0\0\0\0\0\0" + (9999).to_bytes(3, "little") * 2,
        "^image is 10000x10000 = 100000000 pixels",
    ),
}


@pytest.mark.parametrize("bomb", BOMBS)
def test_decode_bombs_are_refused_before_pillow_reads_them(bomb, monkeypatch):
    """Each multiplier of decode work is refused from the container's structure: Pillow never opens the bytes."""
    opened = []
    real_open = PIL.open
    monkeypatch.setattr(PIL, "open", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    make, reason = BOMBS[bomb]
    with pytest.raises(imaging.ImageRejected, match=reason):
        imaging.decode(make())
    assert opened == []


@pytest.mark.parametrize(
    "make, size",
    [
        (lambda: image_bombs.progressive_jpeg(imaging.MAX_SCANS), 48),
        (lambda: image_bombs.encoded("JPEG", progressive=True), 48),  # libjpeg's own progression: 10 scans
        (lambda: image_bombs.png_with_chunks(imaging.MAX_CHUNKS - 3), 48),  # with IHDR, IDAT and IEND: the limit
        (lambda: image_bombs.jpeg_with_stray_bytes(imaging.MAX_STRAY_BYTES), 48),
        (lambda: image_bombs.jpeg_with_stray_bytes(imaging.MAX_STRAY_BYTES, b"\xff"), 48),
        (lambda: image_bombs.animated("WEBP", 1), 16),
    ],
)
def test_images_at_the_decode_work_limits_decode(make, size):
    assert imaging.decode(make()).shape == (size, size, 3)
