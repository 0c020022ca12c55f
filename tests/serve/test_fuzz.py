"""Property-based tests over what a client controls: KServe v2 request bodies (``requests.py``,
the checks the front makes before Triton sees a request) and encoded image headers
(``imaging.decode``). Bounded and deterministic: a fixed example budget, derandomized, no
deadline (CI runs on a loaded 2-core machine), no example database."""

from __future__ import annotations

import io
import json
import math
import re
import struct
import zlib

import hypothesis
import numpy as np
import PIL.Image as PIL
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploykit.inputs import imaging
from deploykit.inputs.imaging import MAX_INPUT_MAGNITUDE
from deploykit.serve.requests import MAX_JSON_DEPTH, RequestRejected, check_grpc_infer, check_http_infer, client_message

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
    values = data.draw(st.lists(st.floats(-MAX_INPUT_MAGNITUDE, MAX_INPUT_MAGNITUDE), min_size=math.prod(shape), max_size=math.prod(shape)))
    assert outcome(*_request(shape, values, binary, datatype)) is None


@FUZZ
@given(shapes, st.booleans(), st.sampled_from(["FP16", "FP32", "FP64"]), st.data())
def test_a_value_beyond_the_input_bound_anywhere_is_refused(shape, binary, datatype, data):
    """A finite 3e38 overflowed the model to NaN logits, answered with a ranking (issue 41)."""
    binary = binary or datatype == "FP16"  # Triton reads FP16 only as binary data
    top = {"FP16": 6e4, "FP32": 3e38, "FP64": 1e308}[datatype]
    count = math.prod(shape)
    values = data.draw(st.lists(st.floats(-1e3, 1e3), min_size=count, max_size=count))
    bad = data.draw(st.floats(MAX_INPUT_MAGNITUDE * 1.01, top)) * data.draw(st.sampled_from([1, -1]))
    values[data.draw(st.integers(0, count - 1))] = bad
    assert outcome(*_request(shape, values, binary, datatype)) == (
        f"input images: 1 values beyond ±10000 in {datatype} data; send normalised pixels"
    )


def test_grpc_values_beyond_the_input_bound_are_refused():
    """gRPC's raw and typed contents: the same bound as HTTP's."""
    import tritonclient.grpc.service_pb2 as service_pb2

    values = np.array([0.5, -3e38, 1.0], np.float32)
    raw = service_pb2.ModelInferRequest(model_name="logits_32", raw_input_contents=[values.tobytes()])
    raw.inputs.add(name="images", datatype="FP32", shape=[3])
    typed = service_pb2.ModelInferRequest(model_name="logits_32")
    typed.inputs.add(name="images", datatype="FP32", shape=[3]).contents.fp32_contents.extend(values.tolist())
    for request in (raw, typed):
        with pytest.raises(RequestRejected, match="^input images: 1 values beyond ±10000 in FP32 data"):
            check_grpc_infer(request)
    typed.inputs[0].contents.fp32_contents[1] = -1e4
    check_grpc_infer(typed)


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


PATH = re.compile(r"/\w+/|\.py\b|site-packages")


def decoded_within_limits(data: bytes) -> None:
    """``decode`` either refuses in one line (short, no path) or returns an image within every
    limit; any other exception fails the test."""
    try:
        image = imaging.decode(data, **LIMITS)
    except imaging.ImageRejected as err:
        message = str(err)
        assert message and "\n" not in message and len(message) < 400 and not PATH.search(message), message
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


# -- corrupt chunks and segments in every accepted format -----------------------------------------


def _real(fmt: str, mode: str = "RGB", **save) -> bytes:
    """A small real image of ``fmt``, as Pillow encodes it."""
    pixels = np.random.default_rng(0).integers(0, 256, (9, 12, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.fromarray(pixels).convert(mode).save(buf, format=fmt, **save)
    return buf.getvalue()


def _png_chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    chunks, pos = [], 8
    while pos < len(png):
        length, kind = struct.unpack_from(">I4s", png, pos)
        chunks.append((kind, png[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return chunks


PNG_TYPES = [b"IHDR", b"PLTE", b"IDAT", b"IEND", b"tRNS", b"gAMA", b"cHRM", b"sRGB", b"iCCP", b"tEXt", b"zTXt", b"iTXt"]
PNG_TYPES += [b"bKGD", b"pHYs", b"sBIT", b"sPLT", b"hIST", b"tIME", b"acTL", b"fcTL", b"fdAT", b"eXIf"]
payloads = st.binary(max_size=40) | st.binary(max_size=40).map(zlib.compress) | st.binary(max_size=8).map(lambda b: b"key\0" + b)


@FUZZ
@given(
    st.sampled_from([_real("PNG"), _real("PNG", "P"), _real("PNG", "LA")]),
    st.sampled_from(PNG_TYPES) | st.binary(min_size=4, max_size=4),
    payloads,
    st.data(),
)
def test_png_with_a_corrupt_chunk(png, kind, payload, data):
    """A chunk inserted, replaced or given a wrong CRC anywhere, APNG control chunks included."""
    chunks = _png_chunks(png)
    where = data.draw(st.integers(0, len(chunks)))
    if data.draw(st.booleans()):
        chunks.insert(where, (kind, payload))
    else:
        chunks[min(where, len(chunks) - 1)] = (chunks[min(where, len(chunks) - 1)][0], payload)
    body = b"".join(_chunk(k, d) for k, d in chunks)
    if data.draw(st.booleans()):  # one CRC wrong
        flip = data.draw(st.integers(0, len(chunks) - 1))
        end = sum(12 + len(d) for _, d in chunks[: flip + 1])
        body = body[: end - 1] + bytes([body[end - 1] ^ 0x5A]) + body[end:]
    decoded_within_limits(b"\x89PNG\r\n\x1a\n" + body)


def _jpeg_segments(jpeg: bytes) -> list[bytes]:
    """A JPEG cut before each marker outside entropy-coded data: SOI, each segment (a scan with its data), EOI."""
    starts = [0] + [m.start() for m in re.finditer(rb"\xff[^\x00\xd0-\xd7\xff]", jpeg) if m.start() > 0]
    return [jpeg[a:b] for a, b in zip(starts, starts[1:] + [len(jpeg)])]


JPEG_MARKERS = [0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xC9, 0xCC, 0xD8, 0xD9, 0xDA, 0xDB, 0xDC, 0xDD, 0xE0, 0xE1, 0xE2, 0xEE, 0xFE, 0x01]


@FUZZ
@given(
    st.sampled_from([_real("JPEG"), _real("JPEG", progressive=True), _real("JPEG", "L"), _real("JPEG", "CMYK")]),
    st.sampled_from(JPEG_MARKERS) | st.integers(0x01, 0xFE),
    st.binary(max_size=40),
    st.integers(-3, 3),
    st.data(),
)
def test_jpeg_with_a_corrupt_segment(jpeg, marker, payload, length_error, data):
    """A marker segment inserted or replaced anywhere (frame and scan headers, tables, restart
    intervals, a second SOI, EOI too early), its length off by a few bytes."""
    segments = _jpeg_segments(jpeg)
    segment = bytes([0xFF, marker]) + max(0, len(payload) + 2 + length_error).to_bytes(2, "big") + payload
    where = data.draw(st.integers(1, len(segments)))
    if data.draw(st.booleans()):
        segments.insert(where, segment)
    else:
        segments[min(where, len(segments) - 1)] = segment
    decoded_within_limits(b"".join(segments))


def _riff_chunks(webp: bytes) -> list[tuple[bytes, bytes]]:
    chunks, pos = [], 12
    while pos + 8 <= len(webp):
        fourcc, length = struct.unpack_from("<4sI", webp, pos)
        chunks.append((fourcc, webp[pos + 8 : pos + 8 + length]))
        pos += 8 + length + (length & 1)
    return chunks


WEBP_TYPES = [b"VP8X", b"VP8 ", b"VP8L", b"ALPH", b"ANIM", b"ANMF", b"ICCP", b"EXIF", b"XMP "]


@FUZZ
@given(
    st.sampled_from([_real("WEBP"), _real("WEBP", lossless=True), _real("WEBP", "RGBA"), _real("WEBP", "RGBA", lossless=True)]),
    st.sampled_from(WEBP_TYPES) | st.binary(min_size=4, max_size=4),
    st.binary(max_size=40),
    st.booleans(),
    st.data(),
)
def test_webp_with_a_corrupt_chunk(webp, fourcc, payload, riff_size_right, data):
    """A RIFF chunk inserted or replaced anywhere (canvas, animation, alpha, bitstreams), the RIFF size right or not."""
    chunks = _riff_chunks(webp)
    where = data.draw(st.integers(0, len(chunks)))
    if data.draw(st.booleans()):
        chunks.insert(where, (fourcc, payload))
    else:
        chunks[min(where, len(chunks) - 1)] = (fourcc, payload)
    body = b"WEBP" + b"".join(f + struct.pack("<I", len(d)) + d + b"\0" * (len(d) & 1) for f, d in chunks)
    size = len(body) if riff_size_right else data.draw(st.integers(0, 2**32 - 1))
    decoded_within_limits(b"RIFF" + struct.pack("<I", size) + body)


# Offsets of a BMP's header fields: file size, pixel data offset, info header size, width, height,
# planes, bits per pixel, compression, image size, colours used.
BMP_FIELDS = [(2, "<I"), (10, "<I"), (14, "<I"), (18, "<i"), (22, "<i"), (26, "<H"), (28, "<H"), (30, "<I"), (34, "<I"), (46, "<I")]


@FUZZ
@given(
    st.sampled_from([_real("BMP"), _real("BMP", "P"), _real("BMP", "L"), _real("BMP", "1")]),
    st.lists(st.tuples(st.sampled_from(BMP_FIELDS), st.integers(0, 2**16) | st.integers(-(2**31), 2**31 - 1)), min_size=1, max_size=3),
)
def test_bmp_with_corrupt_header_fields(bmp, changes):
    raw = bytearray(bmp)
    for (offset, fmt), value in changes:
        size = struct.calcsize(fmt)
        raw[offset : offset + size] = (value % 2 ** (8 * size)).to_bytes(size, "little")
    decoded_within_limits(bytes(raw))


# -- requests as Triton reads them (issue 41, part B) ----------------------------------------------
# Bodies and headers a client controls: duplicate keys, number spellings, header orders and
# repeats, encodings. Each is refused in one line (400/413/415), or passes as Triton reads it:
# the same request whichever of duplicate keys counts (RapidJSON's FindMember takes the first),
# numbers RapidJSON reads as Python does, data of the JSON type Triton's ReadDataFromJsonHelper
# takes for the datatype, and the first of each header, read by atoi. The oracle below is that
# reading, written from Triton 2.51's http_server.cc, not from deploykit's checks.

import decimal
import gzip

from deploykit.serve.requests import check_infer_headers

INTEGER_RANGES = {
    "UINT8": (0, 2**8 - 1),
    "UINT16": (0, 2**16 - 1),
    "UINT32": (0, 2**32 - 1),
    "UINT64": (0, 2**64 - 1),
    "INT8": (-(2**7), 2**7 - 1),
    "INT16": (-(2**15), 2**15 - 1),
    "INT32": (-(2**31), 2**31 - 1),
    "INT64": (-(2**63), 2**63 - 1),
}
FP32_MAX = float(np.finfo(np.float32).max)


def _first_wins(pairs):
    found = {}
    for key, value in pairs:
        found.setdefault(key, value)
    return found


def assert_triton_reads_it_alike(text: bytes) -> None:
    """A request that passed: what Triton 2.51 reads of it is what Python read."""
    tokens = []

    def number(token: str):
        tokens.append(token)
        return decimal.Decimal(token)

    decoded = text.decode("utf-8")  # RapidJSON reads bytes; only UTF-8 means the same to both
    assert not decoded.startswith("\ufeff")
    last = json.loads(decoded, parse_int=number, parse_float=number)  # Python: the last of duplicate keys
    first = json.loads(decoded, object_pairs_hook=_first_wins, parse_int=number, parse_float=number)  # Triton: the first
    assert first == last, "duplicate keys read two ways"
    for token in tokens:
        value = decimal.Decimal(token)
        if "." not in token and "e" not in token.lower():
            assert -(2**63) <= value <= 2**64 - 1, token  # else RapidJSON reads a rounded double
        else:
            mantissa, _, exponent = token.lower().partition("e")
            assert not exponent or int(exponent) <= 308, token  # RapidJSON: kParseErrorNumberTooBig
            assert math.isfinite(float(value)), token
    for tensor in last["inputs"]:
        if "data" not in tensor:
            continue
        datatype, flat, todo = tensor["datatype"], [], [tensor["data"]]
        while todo:
            item = todo.pop()
            todo += reversed(item) if isinstance(item, list) else []
            flat += [] if isinstance(item, list) else [item]
        assert datatype not in ("FP16", "BF16"), "Triton reads FP16/BF16 only as binary data"
        for v in flat:
            if datatype == "BOOL":
                assert isinstance(v, bool)
            elif datatype == "BYTES":
                assert isinstance(v, str)
            elif datatype in INTEGER_RANGES:  # IsInt64/IsUint64, then a cast to the type
                assert isinstance(v, decimal.Decimal) and v == v.to_integral_value() and "." not in str(v)
                low, high = INTEGER_RANGES[datatype]
                assert low <= v <= high, (datatype, v)
            else:  # FP32/FP64: IsNumber, then a double cast to the type
                assert isinstance(v, decimal.Decimal) and math.isfinite(float(v))
                assert datatype != "FP32" or abs(float(v)) <= FP32_MAX


def digits(low: int, high: int):
    return st.text("0123456789", min_size=low, max_size=high)


integers = st.builds(
    lambda sign, whole: sign + whole,
    st.sampled_from(["", "-"]),
    st.just("0") | st.builds(lambda head, tail: head + tail, st.sampled_from("123456789"), digits(0, 3) | digits(15, 24)),
)
valid_numbers = st.builds(
    lambda whole, fraction, exponent: whole + fraction + exponent,
    integers,
    st.just("") | digits(1, 20).map(lambda d: "." + d),
    st.just("") | st.builds(lambda e, s, d: e + s + d, st.sampled_from("eE"), st.sampled_from(["", "+", "-"]), digits(1, 3)),
)
other_tokens = st.sampled_from(
    ["NaN", "Infinity", "-Infinity", "Inf", "01", "+1", ".5", "1.", "1e", "0x10", "true", "false", '"1"', "null"]
)
number_lists = (
    st.lists(integers, min_size=1, max_size=4)
    | st.lists(valid_numbers, min_size=1, max_size=4)
    | st.lists(valid_numbers | other_tokens, min_size=1, max_size=4)
)
DATATYPE_NAMES = ["BOOL", *INTEGER_RANGES, "FP16", "FP32", "FP64", "BF16", "BYTES"]


def request_outcome(text: bytes, header_length: str | None = None) -> str | None:
    """``outcome`` of the first block, and for a pass, Triton's reading checked."""
    refused = outcome(text, header_length)
    if refused is None:
        assert_triton_reads_it_alike(text if header_length is None else text[: int(header_length)])
    return refused


@FUZZ
@given(st.sampled_from(DATATYPE_NAMES), number_lists)
def test_number_spellings_are_read_alike_or_refused(datatype, numbers):
    data = ", ".join(numbers)
    request_outcome(f'{{"inputs": [{{"name": "images", "datatype": "{datatype}", "shape": [{len(numbers)}], "data": [{data}]}}]}}'.encode())


VALID_TENSORS = [  # members of one valid input
    [("name", '"images"'), ("datatype", '"FP32"'), ("shape", "[1]"), ("data", "[0.5]")],
    [("name", '"images"'), ("datatype", '"INT8"'), ("shape", "[2]"), ("data", "[1, -2]"), ("parameters", "{}")],
    [("name", '"images"'), ("datatype", '"BOOL"'), ("shape", "[1, 1]"), ("data", "[[true]]")],
]
REPEATS = [  # another spelling of a member: with it, a key appears twice
    ("name", '"other"'),
    ("datatype", '"FP16"'),
    ("datatype", '"UINT8"'),
    ("shape", "[2]"),
    ("data", "[1e39]"),
    ("data", "[300]"),
    ("data", "[0.5, 1.5]"),
    ("parameters", '{"binary_data_size": 4}'),
    ("parameters", '{"a": 1, "a": 2}'),
]


@FUZZ
@given(
    st.sampled_from(VALID_TENSORS),
    st.lists(st.sampled_from(REPEATS), max_size=2),
    st.lists(st.sampled_from(['"inputs": []', '"id": "1"', '"id": "2"', '"parameters": {}']), max_size=2),
    st.data(),
)
def test_duplicate_keys_are_read_alike_or_refused(tensor, repeats, outer, data):
    members = data.draw(st.permutations(tensor + repeats))
    fields = ", ".join(f'"{key}": {value}' for key, value in members)
    request = data.draw(st.permutations([f'"inputs": [{{{fields}}}]', *outer]))
    request_outcome(("{" + ", ".join(request) + "}").encode())


def _atoi(text: str) -> int:
    """C's atoi as Triton's evhtp handler calls it: spaces, a sign, ASCII digits, then anything."""
    stripped = text.lstrip(" \t\n\v\f\r")
    sign = -1 if stripped[:1] == "-" else 1
    stripped = stripped[1:] if stripped[:1] in "+-" else stripped
    run = len(stripped) - len(stripped.lstrip("0123456789"))
    return sign * int(stripped[:run]) if run and stripped[:run].isascii() else 0


def _length_spelling(kind: str, length: int) -> str:
    return {
        "ascii": str(length),
        "zeros": "00" + str(length),
        "plus": "+" + str(length),
        "suffix": f"{length}abc",
        "arabic": str(length).translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")),
        "fullwidth": str(length).translate(str.maketrans("0123456789", "０１２３４５６７８９")),
        "other": str(length + 1),
        "empty": "",
    }[kind]


ENCODINGS = ["identity", "IDENTITY", "gzip", "x-gzip", "deflate", "br", "", "identity, gzip", "gzip, identity", " identity"]
LENGTHS = ["ascii", "zeros", "plus", "suffix", "arabic", "fullwidth", "other", "empty"]


def _sent(lines: list[str], name: str) -> list[str]:
    """The values of header ``name`` among ``lines``, as an HTTP parser reads them (spaces stripped)."""
    return [line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0] == name]


@pytest.fixture(scope="module")
def front_and_stub():
    from stub_triton import front_before_stub

    with front_before_stub() as (_, port, stub):
        yield port, stub


@FUZZ
@given(
    st.lists(st.sampled_from(ENCODINGS), max_size=3),
    st.lists(st.sampled_from(LENGTHS), max_size=2),
    st.booleans(),
    st.permutations(range(6)),
)
def test_headers_in_any_order_and_number_are_read_alike_or_refused(front_and_stub, encodings, lengths, compress, order):
    """A binary request (JSON, then a tensor) with Content-Encoding and header-length headers
    drawn, repeated, in any order, the body gzipped or not: refused in one line, or forwarded as
    sent with the one header length Triton reads as the client meant it."""
    from stub_triton import infer_head, raw_request

    port, stub = front_and_stub
    head = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}]}).encode()
    body = head + np.ones(2, np.float32).tobytes()
    body = gzip.compress(body) if compress else body
    drawn = [f"Content-Encoding: {e}" for e in encodings] + [
        f"Inference-Header-Content-Length: {_length_spelling(k, len(head))}" for k in lengths
    ]
    drawn = [drawn[i] for i in order if i < len(drawn)] + drawn[len(order) :]
    seen = len(stub.seen)
    status, _, answer = raw_request(port, infer_head(len(body), *drawn), body)
    if status in (400, 413, 415):
        error = json.loads(answer)["error"]
        assert error and "\n" not in error and len(stub.seen) == seen, error
        return
    assert status == 200, (status, answer[:300])
    forwarded = stub.seen[-1]
    sent_lengths, sent_codings = _sent(drawn, "Inference-Header-Content-Length"), _sent(drawn, "Content-Encoding")
    assert forwarded.body == body and all(t.strip().lower() == "identity" for v in sent_codings for t in v.split(","))
    assert not [n for n, _ in forwarded.headers if n.lower() == "content-encoding"]
    forwarded_lengths = [v for n, v in forwarded.headers if n.lower() == "inference-header-content-length"]
    assert len(sent_lengths) == len(forwarded_lengths) <= 1
    if forwarded_lengths:  # Triton reads the first with atoi: the value the client wrote and the front checked
        assert _atoi(sent_lengths[0]) == _atoi(forwarded_lengths[0]) == int(forwarded_lengths[0])
        assert_triton_reads_it_alike(body[: int(forwarded_lengths[0])])


def test_header_checks_take_every_repeat():
    """The pure check behind the front, on the repeats aiohttp hands it: the last Content-Encoding
    counts as much as the first (aiohttp's C parser inflated by the last)."""
    for codings in (["identity", "gzip"], ["gzip", "identity"], ["identity", "identity, br"]):
        with pytest.raises(RequestRejected):
            check_infer_headers([("Content-Encoding", c) for c in codings])
