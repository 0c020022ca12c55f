"""Property-based tests over what a client controls: KServe v2 request bodies (``requests.py``,
the checks the front makes before Triton sees a request) and encoded image headers
(``imaging.decode``). Bounded and deterministic: a fixed example budget, derandomized, no
deadline (CI runs on a loaded 2-core machine), no example database."""

from __future__ import annotations

import io
import json
import math
import struct
import zlib

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis comes with the test extra")
from hypothesis import given, settings
from hypothesis import strategies as st

from deploykit import imaging
from deploykit.serve.requests import MAX_JSON_DEPTH, RequestRejected, check_http_infer, client_message

PIL = pytest.importorskip("PIL.Image", reason="pillow comes with the images extra")
# Pillow warns on opening a header over its own pixel budget; decode refuses those right after.
pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")

FUZZ = settings(max_examples=150, derandomize=True, deadline=None, database=None, suppress_health_check=list(hypothesis.HealthCheck))


def outcome(body: bytes, header_length: str | None = None) -> str | None:
    """None when the request passes, else the refusal; anything else raised fails the test."""
    try:
        check_http_infer(body, header_length)
    except RequestRejected as err:
        assert err.status in (400, 413)
        message = str(err)
        assert message and "\n" not in message and len(message) < 400, message
        return message
    return None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=30,
)


@FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_are_refused_in_one_line(body):
    assert outcome(body) is not None


@FUZZ
@given(json_values)
def test_arbitrary_json_never_escapes_the_checks(value):
    outcome(json.dumps(value).encode())


@FUZZ
@given(json_values, st.sampled_from(["FP32", "FP16", "FP64", "INT64", "BYTES", "BOOL"]), st.lists(st.integers(-2, 5), max_size=5))
def test_arbitrary_inputs_never_escape_the_checks(data, datatype, shape):
    outcome(json.dumps({"inputs": [{"name": "images", "datatype": datatype, "shape": shape, "data": data}]}).encode())


@FUZZ
@given(st.integers(MAX_JSON_DEPTH + 1, 500_000), st.sampled_from("[{"))
def test_deep_nesting_is_refused(depth, bracket):
    """400 KB of ``[`` killed tritonserver; here every depth over the limit is one line."""
    body = (bracket + ('"a":' if bracket == "{" else "")) * depth
    assert outcome(body.encode()) is not None


shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4)


def _request(shape, values, binary: bool, datatype: str = "FP32") -> tuple[bytes, str | None]:
    tensor = {"name": "images", "datatype": datatype, "shape": shape}
    if not binary:
        return json.dumps({"inputs": [{**tensor, "data": values}]}, allow_nan=True).encode(), None
    with np.errstate(over="ignore"):  # 1e39 as FP32 is the infinity under test
        raw = np.asarray(values, {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64}[datatype]).tobytes()
    header = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return header + raw, str(len(header))


@FUZZ
@given(shapes, st.booleans(), st.sampled_from(["FP32", "FP16", "FP64"]), st.data())
def test_well_formed_finite_requests_pass(shape, binary, datatype, data):
    binary = binary or datatype == "FP16"  # Triton reads FP16 only as binary data
    bound = {"FP16": 6e4, "FP32": 3e38, "FP64": 1e308}[datatype]
    values = data.draw(st.lists(st.floats(-bound, bound), min_size=math.prod(shape), max_size=math.prod(shape)))
    assert outcome(*_request(shape, values, binary, datatype)) is None


@FUZZ
@given(shapes, st.booleans(), st.sampled_from([math.nan, math.inf, -math.inf, 1e39]), st.data())
def test_a_non_finite_value_anywhere_is_refused(shape, binary, bad, data):
    """NaN/Inf, and 1e39, finite in JSON but infinite as FP32."""
    count = math.prod(shape)
    values = data.draw(st.lists(st.floats(-1e3, 1e3), min_size=count, max_size=count))
    values[data.draw(st.integers(0, count - 1))] = bad
    assert outcome(*_request(shape, values, binary)).endswith("; send finite numbers")


@FUZZ
@given(shapes, st.booleans(), st.integers(-3, 3).filter(bool))
def test_data_not_matching_the_shape_is_refused(shape, binary, extra):
    count = max(0, math.prod(shape) + extra)
    assert outcome(*_request(shape, [0.5] * count, binary)) is not None


@FUZZ
@given(st.text(max_size=300), st.lists(st.sampled_from(["/usr/lib/python3/x.py", "/tmp/a b/c", "/root/.cache/w/m.onnx"]), max_size=3))
def test_client_messages_carry_no_traceback_and_no_path(text, paths):
    message = "Traceback (most recent call last):\n  File " + " ".join(paths) + "\n" + text + " " + " ".join(paths)
    cleaned = client_message(message)
    assert "\n" not in cleaned and "Traceback" not in cleaned
    assert not any(p.split(" ")[0] in cleaned for p in paths)


# -- image headers ---------------------------------------------------------------------------------


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(width: int, height: int, depth: int, colour: int, body: bytes) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def _bmp(width: int, height: int, bits: int, body: bytes) -> bytes:
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, bits, 0, len(body), 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + len(info) + len(body), 0, 0, 14 + len(info)) + info + body


LIMITS = dict(max_pixels=4096, max_bytes=1 << 16, max_side=256, max_aspect=4.0)
sizes = st.integers(0, 2**31 - 1) | st.integers(0, 300)


def decoded_within_limits(data: bytes) -> None:
    """``decode`` either refuses in one line or returns an image within every limit."""
    try:
        image = imaging.decode(data, **LIMITS)
    except imaging.ImageRejected as err:
        assert "\n" not in str(err)
        return
    h, w = image.shape[:2]
    assert image.dtype == np.uint8 and image.shape[2] == 3
    assert h * w <= LIMITS["max_pixels"] and max(h, w) <= LIMITS["max_side"] and max(h, w) <= LIMITS["max_aspect"] * min(h, w)


@FUZZ
@given(sizes, sizes, st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([0, 2, 3, 4, 6]), st.binary(max_size=64))
def test_png_headers(width, height, depth, colour, body):
    decoded_within_limits(_png(width, height, depth, colour, body))
    decoded_within_limits(_png(width, height, depth, colour, zlib.compress(body * 64)))


@FUZZ
@given(
    st.integers(-(2**31), 2**31 - 1) | st.integers(-300, 300),
    st.integers(-(2**31), 2**31 - 1) | st.integers(-300, 300),
    st.sampled_from([1, 4, 8, 16, 24, 32]),
    st.binary(max_size=256),
)
def test_bmp_headers(width, height, bits, body):
    decoded_within_limits(_bmp(width, height, bits, body))


@FUZZ
@given(st.sampled_from(["PNG", "JPEG", "WEBP", "BMP"]), st.integers(1, 40), st.integers(1, 40), st.data())
def test_mutated_real_images(fmt, width, height, data):
    """A real image with bytes overwritten or cut: refused in one line, or decoded within the limits."""
    buf = io.BytesIO()
    PIL.new("RGB", (width, height), (10, 200, 30)).save(buf, format=fmt)
    raw = bytearray(buf.getvalue())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    decoded_within_limits(bytes(raw[: data.draw(st.integers(1, len(raw)))]))
