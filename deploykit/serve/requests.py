"""Checks on KServe v2 inference requests, made before a request reaches Triton.

Triton 2.51 (PyTriton 0.7's ``tritonserver``) parses HTTP request JSON with RapidJSON's recursive
parser and no size or depth limit: ~400 KB of nested ``[`` exhausts its stack and kills the
process; malformed JSON and ``data`` not matching ``shape`` are answered 500; NaN/Inf pass as
numbers. (Upstream bounded the input size in 2.5x, ``--http-max-input-size``, triton-inference-server/server#8174
and #8432, and made parsing iterative in triton-inference-server/common#156, 2026; neither is in
the binary PyTriton bundles.) ``deploykit serve``'s front (``front.py``) runs every request
through these functions first and forwards the bytes it checked, so Triton only sees
well-formed, bounded, finite requests that it reads as they were checked:

* headers: no request body encoding but ``identity`` in any ``Content-Encoding`` header (415),
  one ``Inference-Header-Content-Length`` of ASCII digits (Triton reads it with ``atoi``);
* JSON: only what Python and RapidJSON read alike (``strict_json.py``: UTF-8, no duplicate keys,
  64-bit integers, finite numbers, a bounded number of values and depth);
* every input: a name, a known datatype, a shape of non-negative integers, and ``data`` (flat or
  nested along ``shape``) or binary data holding exactly ``prod(shape)`` elements; JSON ``data``
  of the type Triton reads for the datatype (``ReadDataFromJsonHelper``: booleans for BOOL,
  integers within the type's range, numbers for FP32/FP64, strings for BYTES; FP16 and BF16
  only as binary data), where Triton would answer 500 or cast silently;
* floating-point inputs (FP16/BF16/FP32/FP64, JSON or binary, and gRPC's raw or typed contents)
  finite at their own precision (``1e39`` is an FP32 infinity) and within ``±MAX_INPUT_MAGNITUDE``
  (``deploykit.inputs.imaging``: far beyond normalised pixels; 3e38 overflowed the model to NaN logits);
  checked in slices, no Python object per element;
* no shared-memory inputs (the region registration endpoints are not served).

A refused request raises ``RequestRejected`` with one line for the client. Pure functions over
bytes and dicts (numpy only; gRPC messages are parsed by the caller), so the fuzz tests call them
directly.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable

import numpy as np

from deploykit.inputs.imaging import MAX_INPUT_MAGNITUDE
from deploykit.serve.defaults import MAX_JSON_VALUES
from deploykit.serve.strict_json import MAX_JSON_DEPTH, RequestRejected, read_json

__all__ = [
    "MAX_JSON_DEPTH",
    "RequestRejected",
    "check_grpc_infer",
    "check_http_infer",
    "check_infer_headers",
    "client_message",
    "holds_path",
    "public_model_config",
]

MAX_RANK = 16  # dimensions per input (Triton's own models here have 4)
# KServe v2 datatypes and their element sizes; BYTES elements are 4-byte-length-prefixed strings.
DATATYPES = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "FP32": 4,
    "FP64": 8,
    "BF16": 2,
    "BYTES": 0,
}
INTEGER_TYPES = {name: np.iinfo(name.lower()) for name in DATATYPES if "INT" in name}
# How binary float data is read: little-endian; BF16 as the top halves of float32s.
FLOAT_LAYOUTS = {"FP16": "<f2", "BF16": "<u2", "FP32": "<f4", "FP64": "<f8"}
# Largest magnitude a JSON number may have as FP32/FP64 data: Triton reads the text with RapidJSON's
# normal precision, a few double ulps from Python's reading, so nothing is let near the edge.
JSON_FLOAT_LIMITS = {"FP32": float(np.finfo(np.float32).max), "FP64": 1e308}
SLICE = 1 << 18  # elements checked at once: at most a few MiB of temporaries
HEADER_LENGTH = "Inference-Header-Content-Length"  # KServe v2 binary extension: JSON, then raw tensors
CONTENT_ENCODING = "Content-Encoding"
_BYTE_COUNT = re.compile(r"[0-9]{1,10}")  # ASCII only: str.isdigit() takes "١٢", which atoi reads as 0


def check_infer_headers(headers: Iterable[tuple[str, str]]) -> str | None:
    """Check the headers of ``POST /v2/models/<m>/infer`` that decide how Triton reads the body.

    Args:
        headers: every ``(name, value)`` as sent, repeats included, in any order.

    Returns:
        The ``Inference-Header-Content-Length`` value, or None when not sent.

    Raises:
        RequestRejected: 415 for any ``Content-Encoding`` but ``identity`` (whatever the order or
            count of those headers: the front reads the body as sent and Triton would inflate it
            unbounded); 400 for more than one header length or one that is not ASCII digits.
    """
    encodings, lengths = [], []
    for name, value in headers:
        if name.lower() == CONTENT_ENCODING.lower():
            encodings += [token.strip().lower() for token in value.split(",")]
        elif name.lower() == HEADER_LENGTH.lower():
            lengths.append(value)
    if any(token != "identity" for token in encodings):
        raise RequestRejected("compressed request bodies are not served; send them uncompressed", status=415)
    if len(lengths) > 1:
        raise RequestRejected(f"{len(lengths)} {HEADER_LENGTH} headers; send one")
    if lengths and not _BYTE_COUNT.fullmatch(lengths[0]):
        raise RequestRejected(f"{HEADER_LENGTH} must be a byte count in ASCII digits, got {lengths[0][:40]!r}")
    return lengths[0] if lengths else None


def check_http_infer(body: bytes | bytearray, header_length: str | None, max_json_values: int = MAX_JSON_VALUES) -> None:
    """Check the body of ``POST /v2/models/<m>/infer`` (JSON, or JSON then binary tensors).

    Args:
        body: the whole request body (already bounded in size by the front).
        header_length: the ``Inference-Header-Content-Length`` header, if sent.
        max_json_values: most values the JSON may hold (each becomes a Python object here).

    Raises:
        RequestRejected: anything the module docstring lists.
    """
    split = len(body)
    if header_length is not None:
        if not _BYTE_COUNT.fullmatch(header_length) or int(header_length) > len(body):
            raise RequestRejected(
                f"{HEADER_LENGTH} must be a byte count in ASCII digits within the body ({len(body)} bytes), got {header_length[:40]!r}"
            )
        split = int(header_length)
    request = read_json(body if split == len(body) else body[:split], max_json_values)
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list) or not request["inputs"]:
        raise RequestRejected('the request must be a JSON object with a non-empty "inputs" list')
    _check_request_fields(request)
    binary, offset = memoryview(body)[split:], 0
    for tensor in request["inputs"]:
        name, datatype, shape = _described(tensor)
        params = _parameters(f"input {name}", tensor)
        if any(str(key).startswith("shared_memory") for key in params):
            raise RequestRejected(f"input {name}: shared-memory inputs are not served; send the data in the request")
        size = params.get("binary_data_size")
        if size is None:
            _check_json_data(name, datatype, shape, tensor.get("data"))
            continue
        if "data" in tensor or not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
            raise RequestRejected(f"input {name}: binary_data_size {size!r} does not fit the {len(binary) - offset} binary bytes left")
        check_raw(name, datatype, shape, binary[offset : offset + size])
        offset += size
    if offset != len(binary):
        raise RequestRejected(f"{len(binary) - offset} bytes after the last input's binary data")


def _check_request_fields(request: dict) -> None:
    """The request's ``id``, ``parameters`` and ``outputs`` of the JSON types Triton reads them as:
    it reads each with ``AsString``/``AsBool``/``AsInt``, which answer a value of another type
    with an internal error (500) where the client sent a malformed request."""
    if "id" in request and not isinstance(request["id"], str):
        raise RequestRejected('"id" must be a string')
    _parameters("the request", request)
    outputs = request.get("outputs", [])
    if not isinstance(outputs, list):
        raise RequestRejected('"outputs" must be a list')
    for output in outputs:
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise RequestRejected('each output must be an object with a "name"')
        params = _parameters(f"output {output['name'][:64]}", output)
        for key, kind in (("binary_data", bool), ("classification", int)):
            if key in params and (type(params[key]) is not kind):
                raise RequestRejected(f"output {output['name'][:64]}: {key} must be {'true or false' if kind is bool else 'an integer'}")


def _parameters(owner: str, holder: dict) -> dict:
    """``holder``'s ``parameters``: an object of KServe v2 parameter values (a string, a number
    or a boolean each), or empty when absent."""
    params = holder.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise RequestRejected(f'{owner}: "parameters" must be an object')
    for key, value in params.items():
        if not isinstance(value, (str, int, float)):  # bool is an int; read_json let only finite floats in
            raise RequestRejected(f"{owner}: parameter {str(key)[:40]!r} must be a string, a number or a boolean")
    return params


def _described(tensor: object) -> tuple[str, str, list[int]]:
    """An input's name, datatype and shape, each checked."""
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise RequestRejected('each input must be an object with a "name"')
    name, datatype, shape = tensor["name"][:64], tensor.get("datatype"), tensor.get("shape")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise RequestRejected(f"input {name}: unknown datatype {str(datatype)[:20]!r}; KServe v2 names one of {', '.join(DATATYPES)}")
    return name, datatype, check_shape(name, shape)


def check_shape(name: str, shape: object) -> list[int]:
    """``shape`` as a list of non-negative integers, at most ``MAX_RANK`` of them."""
    ok = isinstance(shape, (list, tuple)) and len(shape) <= MAX_RANK
    if not ok or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise RequestRejected(f"input {name}: shape must be a list of at most {MAX_RANK} non-negative integers")
    return list(shape)


def _check_json_data(name: str, datatype: str, shape: list[int], data: object) -> None:
    """``data`` flat or nested along ``shape``, ``prod(shape)`` elements of the JSON type Triton
    reads for ``datatype``, integers within its range, floats finite at its precision."""
    if not isinstance(data, list):
        raise RequestRejected(f'input {name}: "data" (a list) or binary data is needed')
    if datatype in ("FP16", "BF16"):  # Triton's own answer, without the round trip
        raise RequestRejected(f"input {name}: {datatype} data is not read from JSON; send it as binary data")
    flat = data
    while any(isinstance(v, (list, dict)) for v in flat):  # one level a pass, in order; read_json bounded the depth
        if any(isinstance(v, dict) for v in flat):
            raise RequestRejected(f'input {name}: "data" holds an object; expected {datatype} values')
        flat = [x for v in flat for x in (v if isinstance(v, list) else (v,))]
    if len(flat) != math.prod(shape):
        raise RequestRejected(f"input {name}: data has {len(flat)} elements, shape {shape} needs {math.prod(shape)}")
    if not flat:
        return
    kinds = {type(v) for v in flat}
    if datatype == "BOOL" and kinds != {bool}:
        raise RequestRejected(f"input {name}: BOOL data must be true/false")
    if datatype == "BYTES" and kinds != {str}:
        raise RequestRejected(f"input {name}: BYTES data must be strings")
    if datatype in INTEGER_TYPES:
        limits = INTEGER_TYPES[datatype]
        if kinds != {int} or min(flat) < limits.min or max(flat) > limits.max:
            raise RequestRejected(f"input {name}: {datatype} data must be integers in [{limits.min}, {limits.max}]")
    if datatype in JSON_FLOAT_LIMITS:
        if not kinds <= {int, float}:
            raise RequestRejected(f"input {name}: {datatype} data must be numbers")
        magnitudes = np.abs(np.asarray(flat, dtype=np.float64))  # finite: read_json refused NaN/Inf spelled out
        infinite_here = int(np.count_nonzero(magnitudes > JSON_FLOAT_LIMITS[datatype]))  # 1e39 is an FP32 infinity
        _refuse_values(name, datatype, infinite_here, int(np.count_nonzero(magnitudes > MAX_INPUT_MAGNITUDE)))


def check_raw(name: str, datatype: str, shape: list[int], raw: bytes | memoryview) -> None:
    """Binary tensor data (HTTP binary extension, gRPC ``raw_input_contents``): exactly
    ``prod(shape)`` elements of ``datatype``, floats finite.

    Raises:
        RequestRejected: a size that does not match, or NaN/Inf.
    """
    count, itemsize = math.prod(shape), DATATYPES[datatype]
    if datatype == "BYTES":
        _check_bytes_elements(name, raw, count)
        return
    if len(raw) != count * itemsize:
        raise RequestRejected(f"input {name}: {len(raw)} bytes of {datatype} data, shape {shape} needs {count * itemsize}")
    if datatype in FLOAT_LAYOUTS:
        _check_finite(name, datatype, raw)


def _check_bytes_elements(name: str, raw: bytes | memoryview, count: int) -> None:
    """BYTES: ``count`` elements, each a little-endian uint32 length then that many bytes."""
    position, found = 0, 0
    while position < len(raw) and found <= count:
        if position + 4 > len(raw):
            break
        position += 4 + int.from_bytes(raw[position : position + 4], "little")
        found += 1
    if position != len(raw) or found != count:
        raise RequestRejected(f"input {name}: BYTES data does not hold {count} length-prefixed elements")


def _check_finite(name: str, datatype: str, raw: bytes | memoryview) -> None:
    """No NaN/Inf, and nothing beyond ``±MAX_INPUT_MAGNITUDE``, among little-endian floats; a
    slice at a time, so checking a 64 MiB tensor takes a few MiB (a BF16 tensor was widened to
    4x its size)."""
    everything = np.frombuffer(raw, dtype=FLOAT_LAYOUTS[datatype])
    non_finite = large = 0
    for start in range(0, everything.size, SLICE):
        values = everything[start : start + SLICE]
        if datatype == "BF16":  # bfloat16 is the top half of a float32
            wide = values.astype(np.uint32)
            wide <<= 16
            values = wide.view(np.float32)
        non_finite += values.size - int(np.count_nonzero(np.isfinite(values)))
        large += int(np.count_nonzero(np.abs(values) > MAX_INPUT_MAGNITUDE))  # Inf counts here too; NaN does not
    _refuse_values(name, datatype, non_finite, large)


def _refuse_values(name: str, datatype: str, non_finite: int, large: int) -> None:
    if non_finite:
        raise RequestRejected(f"input {name}: {non_finite} NaN/Inf values in {datatype} data; send finite numbers")
    # A finite 3e38 overflows the model to NaN logits, and Triton's batcher would run it beside other clients' inputs.
    if large:
        raise RequestRejected(f"input {name}: {large} values beyond ±{MAX_INPUT_MAGNITUDE:g} in {datatype} data; send normalised pixels")


def check_grpc_infer(request) -> None:
    """Check a parsed gRPC ``ModelInferRequest`` (``tritonclient.grpc.service_pb2``).

    Raises:
        RequestRejected: a bad shape or datatype, contents not matching the shape, NaN/Inf, or
            shared-memory inputs.
    """
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise RequestRejected(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    if not request.inputs:
        raise RequestRejected("the request has no inputs")
    for i, tensor in enumerate(request.inputs):
        name = tensor.name[:64]
        if tensor.datatype not in DATATYPES:
            raise RequestRejected(f"input {name}: unknown datatype {tensor.datatype[:20]!r}")
        shape = check_shape(name, list(tensor.shape))
        if any(key.startswith("shared_memory") for key in tensor.parameters):
            raise RequestRejected(f"input {name}: shared-memory inputs are not served; send the data in the request")
        if raw:
            check_raw(name, tensor.datatype, shape, raw[i])
            continue
        field = {"FP32": ("fp32_contents", 6), "FP64": ("fp64_contents", 7)}.get(tensor.datatype)
        if field is not None:
            count = len(getattr(tensor.contents, field[0]))
            if count != math.prod(shape):
                raise RequestRejected(f"input {name}: {count} {tensor.datatype} contents, shape {shape} needs {math.prod(shape)}")
            _check_finite(name, tensor.datatype, _packed_field(tensor.contents.SerializeToString(), field[1]))


def _packed_field(message: bytes, number: int) -> bytes:
    """The payload of repeated scalar field ``number`` in a serialized protobuf message: protobuf
    writes repeated scalars packed (one tag, one length, the values' bytes), so the values are
    read with numpy instead of one Python float each."""
    position = 0
    while position < len(message):
        tag, position = _varint(message, position)
        wire = tag & 7
        if wire == 2:
            length, position = _varint(message, position)
            if tag >> 3 == number:
                return message[position : position + length]
            position += length
        elif wire == 0:
            position = _varint(message, position)[1]
        else:  # 1: 64-bit, 5: 32-bit (a re-serialized message has no groups)
            position += 8 if wire == 1 else 4
    return b""


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[position]
        value |= (byte & 0x7F) << shift
        position, shift = position + 1, shift + 7
        if byte < 0x80:
            return value, position


_TRACEBACK = "Traceback (most recent call last)"
_QUALIFIED = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\w*: ")
_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s/'\"<>,;()\[\]]+/)+[^\s/'\"<>,;()\[\]]*")
# An exception in a Python-backend model (``classify``) reaches Triton's answer as "Failed to process the
# request(s) for model 'classify_0_0', message: " + pybind11's text: the exception, then "\n\nAt:\n" and its frames.
_BACKEND_PREFIX = re.compile(r"^Failed to process the request\(s\) for model (?:instance )?'[^']*', message: ")
_FRAMES = re.compile(r"\n\s*At:\s*\n.*", re.DOTALL)
_PATH_ANYWHERE = re.compile(r"/[^\s/]+/")


def client_message(message: str, fallback: str = "internal server error") -> str:
    """What a client may see of a server-side error message: the exception's message, one line,
    no traceback, no frame list, no path.

    A Python traceback (PyTriton's answer to any exception of a bound function) becomes its last
    line; a Python-backend error loses Triton's prefix and pybind11's frame list; either loses the
    exception's module and class. File-system paths left become ``<path>``. The caller logs the
    original at debug level.
    """
    text = str(message).strip()
    if _TRACEBACK in text:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    text = _QUALIFIED.sub("", _FRAMES.sub("", _BACKEND_PREFIX.sub("", text)).strip())
    text = " ".join(_PATH.sub("<path>", text).split())
    if not text:
        return fallback
    return text if len(text) <= 300 else text[:297] + "..."


def holds_path(text: str) -> bool:
    """Whether ``text`` holds something like an absolute file-system path, alone or in a URL
    (``/tmp/pytriton_workspace_x``, ``ipc:///tmp/...``)."""
    return bool(_PATH_ANYWHERE.search(text))


def public_model_config(config: object) -> object:
    """A model config (Triton's JSON) as clients may see it: without the parameters whose value
    holds a file-system path (PyTriton's ``workspace-path`` names its workspace directory)."""
    if not isinstance(config, dict) or not isinstance(config.get("parameters"), dict):
        return config
    kept = {key: value for key, value in config["parameters"].items() if not holds_path(json.dumps(value))}
    return {**config, "parameters": kept}
