"""Images whose decoding costs more than their pixels (issue 41), small enough for a test: each
multiplier ``deploykit.inputs.imaging.check_structure`` bounds, built from a real Pillow-encoded image."""

from __future__ import annotations

import io
import re
import struct
import zlib

import numpy as np


def encoded(fmt: str, size: tuple[int, int] = (48, 48), seed: int = 0, **save) -> bytes:
    """A ``size = (height, width)`` image of random pixels, as Pillow encodes it."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **save)
    return buf.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk with its CRC."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_with_chunks(count: int) -> bytes:
    """A real PNG with ``count`` empty private chunks before its end: Pillow walks each in Python."""
    png = encoded("PNG")
    end = png.rindex(b"IEND") - 4
    return png[:end] + png_chunk(b"prVt", b"") * count + png[end:]


def jpeg_scans(jpeg: bytes) -> list[tuple[int, int]]:
    """``(start, end)`` of each scan of ``jpeg``: its SOS segment and entropy-coded data."""
    spans = []
    for sos in re.finditer(rb"\xff\xda", jpeg):
        end = re.compile(rb"\xff[^\x00\xd0-\xd7]").search(jpeg, sos.start() + 2 + int.from_bytes(jpeg[sos.end() : sos.end() + 2], "big"))
        spans.append((sos.start(), end.start()))
    return spans


def progressive_jpeg(scans: int, size: tuple[int, int] = (48, 48), repeated: int = -1) -> bytes:
    """A progressive JPEG whose scan number ``repeated`` (an AC refinement, the last, by default)
    is repeated until the file holds ``scans`` scans: libjpeg passes over every block once per scan."""
    jpeg = encoded("JPEG", size, progressive=True)
    spans = jpeg_scans(jpeg)
    start, end = spans[repeated]
    last = spans[-1][1]
    return jpeg[:last] + jpeg[start:end] * (scans - len(spans)) + jpeg[last:]


def jpeg_with_segments(count: int) -> bytes:
    """A real JPEG with ``count`` empty comment segments after SOI: Pillow parses each in Python."""
    jpeg = encoded("JPEG")
    return jpeg[:2] + b"\xff\xfe\x00\x02" * count + jpeg[2:]


def jpeg_with_stray_bytes(count: int, byte: bytes = b"\0") -> bytes:
    """A real JPEG with ``count`` stray bytes (zeros, or 0xFF fill bytes) after its first segment,
    which Pillow steps over one at a time."""
    jpeg = encoded("JPEG")
    first = 4 + int.from_bytes(jpeg[4:6], "big")  # SOI, then APP0's marker and length
    return jpeg[:first] + byte * count + jpeg[first:]


def animated(fmt: str, frames: int) -> bytes:
    """An animated PNG or WebP of ``frames`` different frames."""
    from PIL import Image

    images = [Image.new("RGB", (16, 16), (40 * i % 256, 0, 0)) for i in range(frames)]
    buf = io.BytesIO()
    images[0].save(buf, format=fmt, save_all=True, append_images=images[1:], **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def webp_with_chunks(count: int) -> bytes:
    """A real WebP with ``count`` empty unknown chunks after its image (RIFF size updated)."""
    webp = encoded("WEBP", lossless=True) + b"JUNK\0\0\0\0" * count
    return webp[:4] + struct.pack("<I", len(webp) - 8) + webp[8:]


def bmp_rle8(width: int = 16, height: int = 16) -> bytes:
    """An 8-bit RLE-compressed BMP (one run of colour 1 per row), which Pillow decodes in Python."""
    rows = (bytes([width, 1]) + b"\0\0") * height + b"\0\1"  # run, end of line...; end of bitmap
    palette = b"".join(bytes([i, i, i, 0]) for i in range(256))
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(rows), 2835, 2835, 256, 0)
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(rows), 0, 0, offset) + info + palette + rows
