"""The worst CPU cost of decoding one image the server accepts, after the decode-work bounds.

    python benchmarks/decode_bounds.py            # every case at the limits: 40 MP, 32 MiB, 64 scans, 20,000 chunks
    python benchmarks/decode_bounds.py --quick    # smoke: the same cases at 1 MP

Each case is an image at the limits of ``deploykit.inputs.imaging`` (``MAX_PIXELS``, ``MAX_BYTES``,
``MAX_SCANS``, ``MAX_CHUNKS``) built to cost as much as the bounds allow: a progressive JPEG with
each of libjpeg's ten scans in turn repeated up to 64 scans, a noisy baseline JPEG of nearly 32
MiB, 16-bit RGBA PNGs (the most bytes a pixel inflates to; Paeth filters, Adam7 interlacing) in
20,000 chunks, lossless and lossy WebP, BMPs. Each is decoded once by ``imaging.decode`` (the
container walk, Pillow's decode and the RGB copy) and timed in CPU seconds of this process
(``time.process_time``: the machine may be shared; CPU time is what another request waits for).

Writes ``benchmarks/results/decode-bounds.json`` (``decode-bounds-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import io
import math
import re
import struct
import time
import zlib
from pathlib import Path

import numpy as np
from PIL import Image, features
from results_file import write_results

from deploykit.inputs import imaging


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_rgba16(side: int, interlaced: bool) -> bytes:
    """A ``side``² 16-bit RGBA PNG of zeros, every row Paeth-filtered, its data in ``MAX_CHUNKS - 3`` IDAT chunks."""
    passes = (
        [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)] if interlaced else [(0, 0, 1, 1)]
    )
    zipper, parts = zlib.compressobj(6), []
    for x0, y0, dx, dy in passes:
        width, height = math.ceil((side - x0) / dx), math.ceil((side - y0) / dy)
        if width and height:
            row = b"\x04" + bytes(8 * width)
            parts += [zipper.compress(row * 64) for _ in range(height // 64)] + [zipper.compress(row * (height % 64))]
    stream = b"".join(parts) + zipper.flush()
    count = imaging.MAX_CHUNKS - 3
    step = math.ceil(len(stream) / count)
    idat = b"".join(_chunk(b"IDAT", stream[i : i + step]) for i in range(0, len(stream), step))
    ihdr = struct.pack(">IIBBBBB", side, side, 16, 6, 0, 0, int(interlaced))
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + idat + _chunk(b"IEND", b"")


def _saved(image: Image.Image, fmt: str, **save) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def _noisy(side: int, rows: int, seed: int = 0) -> Image.Image:
    """Random pixels in the first ``rows`` rows, a smooth gradient below (what fits in 32 MiB)."""
    pixels = np.tile(np.linspace(0, 255, side, dtype=np.uint8)[None, :, None], (side, 1, 3))
    pixels[:rows] = np.random.default_rng(seed).integers(0, 256, (rows, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")  # any marker but a restart: where a scan's data ends


def repeated_scans(jpeg: bytes, index: int) -> bytes:
    """``jpeg`` with its scan ``index`` repeated until it holds ``MAX_SCANS`` scans."""
    scans = []
    for sos in re.finditer(rb"\xff\xda", jpeg):
        header_end = sos.end() + int.from_bytes(jpeg[sos.end() : sos.end() + 2], "big")
        scans.append((sos.start(), _MARKER.search(jpeg, header_end).start()))
    start, end = scans[index]
    last = scans[-1][1]
    return jpeg[:last] + jpeg[start:end] * (imaging.MAX_SCANS - len(scans)) + jpeg[last:]


def fit(make, limit: int = imaging.MAX_BYTES) -> bytes:
    """The first of ``make(i)`` for i = 0, 1, ... at most ``limit`` bytes (noisier first) that encodes
    (libwebp's lossy encoder refuses a first partition over 512 KiB: too much noise)."""
    for i in range(10):
        try:
            data = make(i)
        except ValueError:
            continue
        if len(data) <= limit:
            return data
    raise RuntimeError("no variant fits the byte limit")


def cases(side: int) -> dict[str, bytes]:
    flat = Image.fromarray(np.tile(np.linspace(0, 255, side, dtype=np.uint8)[None, :, None], (side, 1, 3)))
    progressive = _saved(flat, "JPEG", progressive=True, quality=90)
    built = {f"jpeg progressive, scan {i} repeated to {imaging.MAX_SCANS}": repeated_scans(progressive, i) for i in range(10)}
    # noise in the first rows, as many as fit in 32 MiB (a tenth fewer per try)
    built["jpeg baseline, noise, quality 95"] = fit(lambda i: _saved(_noisy(side, side * (10 - i) // 16), "JPEG", quality=95))
    built["jpeg progressive, noise"] = fit(lambda i: _saved(_noisy(side, side * (10 - i) // 16), "JPEG", quality=95, progressive=True))
    built["png rgba16 paeth"] = png_rgba16(side, interlaced=False)
    built["png rgba16 paeth adam7"] = png_rgba16(side, interlaced=True)
    built["png rgb8 noise"] = fit(lambda i: _saved(_noisy(side, side * (10 - i) // 40), "PNG", compress_level=1))
    built["webp lossless, noise"] = fit(lambda i: _saved(_noisy(side, side * (10 - i) // 40), "WEBP", lossless=True, method=0))
    built["webp lossy, noise, quality 100"] = fit(lambda i: _saved(_noisy(side, side * (10 - i) // 25), "WEBP", quality=100, method=0))
    built["bmp 1-bit"] = _saved(flat.convert("1"), "BMP")
    bmp_side = math.isqrt(imaging.MAX_BYTES // 3) if side * side * 3 > imaging.MAX_BYTES else side
    built["bmp 24-bit at 32 MiB"] = _saved(flat.resize((bmp_side, bmp_side)), "BMP")
    return built


def measure(quick: bool) -> dict:
    side = 1000 if quick else math.isqrt(imaging.MAX_PIXELS)
    records = []
    for name, data in cases(side).items():
        start = time.process_time()
        image = imaging.decode(data)
        cpu_s = time.process_time() - start
        records.append(dict(case=name, bytes=len(data), height=image.shape[0], width=image.shape[1], cpu_s=round(cpu_s, 3)))
        print(f"{cpu_s:7.3f} s CPU  {len(data) / 2**20:6.1f} MiB  {image.shape[1]}x{image.shape[0]}  {name}", flush=True)
    worst = max(records, key=lambda r: r["cpu_s"])
    codecs = {"pillow": features.version("pil"), "libjpeg-turbo": features.version_feature("libjpeg_turbo")}
    codecs |= {"zlib": features.version("zlib"), "libwebp": features.version("webp")}
    return dict(
        codecs=codecs,
        limits=dict(pixels=imaging.MAX_PIXELS, bytes=imaging.MAX_BYTES, scans=imaging.MAX_SCANS, chunks=imaging.MAX_CHUNKS),
        worst=worst,
        records=records,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same cases at 1 MP (smoke)")
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    write_results(__file__, argv, args.output_dir, args.quick, lambda: measure(args.quick))


if __name__ == "__main__":
    main()
