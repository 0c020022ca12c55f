"""Checks on KServe v2 inference requests, made before a request reaches Triton.

Triton 2.51 (PyTriton 0.7's ``tritonserver``) parses HTTP request JSON with RapidJSON's recursive
parser and no size or depth limit: ~400 KB of nested ``[`` exhausts its stack and kills the
process; malformed JSON and ``data`` not matching ``shape`` are answered 500; NaN/Inf pass as
numbers. (Upstream bounded the input size in 2.5x, ``--http-max-input-size``, triton-inference-server/server#8174
and #8432, and made parsing iterative in triton-inference-server/common#156, 2026; neither is in
the binary PyTriton bundles.) ``deploykit serve``'s front (``front.py``) runs every request
through these functions first, so Triton only sees well-formed, bounded, finite requests:

* JSON: Python's ``json`` (its C scanner raises ``RecursionError`` at the interpreter's recursion
  limit instead of overflowing the stack), objects nested at most ``MAX_JSON_DEPTH`` deep, no
  ``NaN``/``Infinity`` literals;
* every input: a name, a known datatype, a shape of non-negative integers, and ``data`` (flat or
  nested along ``shape``) or binary data holding exactly ``prod(shape)`` elements;
* floating-point inputs (FP16/FP32/FP64, JSON or binary, and gRPC's raw or typed contents) finite
  at their own precision (``1e39`` is an FP32 infinity) and within ``±MAX_INPUT_MAGNITUDE``
  (``deploykit.imaging``: far beyond normalised pixels; 3e38 overflowed the model to NaN logits);
* no shared-memory inputs (the region registration endpoints are not served).

A refused request raises ``RequestRejected`` with one line for the client. Pure functions over
bytes and dicts (numpy only; gRPC messages are parsed by the caller), so the fuzz tests call them
directly.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np

from deploykit.imaging import MAX_INPUT_MAGNITUDE

MAX_JSON_DEPTH = 32  # a request is 3 deep ({"inputs": [{...}]}) plus its data's rank; 32 leaves room
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
FLOAT_TYPES = {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
HEADER_LENGTH = "Inference-Header-Content-Length"  # KServe v2 binary extension: JSON, then raw tensors


class RequestRejected(ValueError):
    """A request the server does not pass on: the client's error, one line.

    Attributes:
        status: the HTTP status to answer with (400, or 413 for a body over the size limit).
    """

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check_http_infer(body: bytes, header_length: str | None) -> None:
    """Check the body of ``POST /v2/models/<m>/infer`` (JSON, or JSON then binary tensors).

    Args:
        body: the whole request body (already bounded in size by the front).
        header_length: the ``Inference-Header-Content-Length`` header, if sent.

    Raises:
        RequestRejected: anything the module docstring lists.
    """
    split = len(body)
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise RequestRejected(f"{HEADER_LENGTH} must be a byte count within the body ({len(body)} bytes), got {header_length[:40]!r}")
        split = int(header_length)
    request = parse_json(body[:split])
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list) or not request["inputs"]:
        raise RequestRejected('the request must be a JSON object with a non-empty "inputs" list')
    binary, offset = memoryview(body)[split:], 0
    for tensor in request["inputs"]:
        name, datatype, shape = _described(tensor)
        params = tensor.get("parameters") or {}
        if not isinstance(params, dict):
            raise RequestRejected(f'input {name}: "parameters" must be an object')
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


def parse_json(text: bytes) -> object:
    """``json.loads`` with the limits of the module docstring.

    Raises:
        RequestRejected: not UTF-8 JSON, a ``NaN``/``Infinity`` literal, or nested too deeply.
    """

    def no_constants(name: str):
        raise RequestRejected(f"non-finite number {name} in the request; send finite numbers")

    try:
        value = json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise RequestRejected(f"request JSON is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except UnicodeDecodeError as err:
        raise RequestRejected(f"request JSON is not UTF-8 ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise RequestRejected(f"malformed request JSON: {err.msg} at byte {err.pos}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise RequestRejected(f"request JSON is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    return value


def _depth(value: object) -> int:
    """Nesting depth of parsed JSON, iteratively (no recursion on client data)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                todo += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest


def _described(tensor: object) -> tuple[str, str, list[int]]:
    """An input's name, datatype and shape, each checked."""
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise RequestRejected('each input must be an object with a "name"')
    name, datatype, shape = tensor["name"][:64], tensor.get("datatype"), tensor.get("shape")
    if datatype not in DATATYPES:
        raise RequestRejected(f"input {name}: unknown datatype {str(datatype)[:20]!r}; KServe v2 names one of {', '.join(DATATYPES)}")
    return name, datatype, check_shape(name, shape)


def check_shape(name: str, shape: object) -> list[int]:
    """``shape`` as a list of non-negative integers, at most ``MAX_RANK`` of them."""
    ok = isinstance(shape, (list, tuple)) and len(shape) <= MAX_RANK
    if not ok or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise RequestRejected(f"input {name}: shape must be a list of at most {MAX_RANK} non-negative integers")
    return list(shape)


def _check_json_data(name: str, datatype: str, shape: list[int], data: object) -> None:
    """``data`` flat or nested along ``shape``, with ``prod(shape)`` elements, finite floats."""
    if not isinstance(data, list):
        raise RequestRejected(f'input {name}: "data" (a list) or binary data is needed')
    flat, todo = [], [data]
    while todo:  # depth is bounded by parse_json
        item = todo.pop()
        if isinstance(item, list):
            todo += reversed(item)
        elif isinstance(item, dict):
            raise RequestRejected(f'input {name}: "data" holds an object; expected {datatype} values')
        else:
            flat.append(item)
    if len(flat) != math.prod(shape):
        raise RequestRejected(f"input {name}: data has {len(flat)} elements, shape {shape} needs {math.prod(shape)}")
    if datatype in FLOAT_TYPES or datatype == "BF16":
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
            raise RequestRejected(f"input {name}: {datatype} data must be numbers")
        with np.errstate(over="ignore"):
            values = np.asarray(flat, dtype=FLOAT_TYPES.get(datatype, np.float32))
        _check_finite(name, datatype, values)


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
    if datatype in FLOAT_TYPES:
        _check_finite(name, datatype, np.frombuffer(raw, dtype=np.dtype(FLOAT_TYPES[datatype]).newbyteorder("<")))
    elif datatype == "BF16":  # bfloat16 is the top half of a float32
        _check_finite(name, datatype, (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32))


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


def _check_finite(name: str, datatype: str, values: np.ndarray) -> None:
    bad = int(values.size - np.count_nonzero(np.isfinite(values)))
    if bad:
        raise RequestRejected(f"input {name}: {bad} NaN/Inf values in {datatype} data; send finite numbers")
    # A finite 3e38 overflows the model to NaN logits, and Triton's batcher would run it beside other clients' inputs.
    large = int(np.count_nonzero(np.abs(values) > MAX_INPUT_MAGNITUDE))
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
        contents = tensor.contents
        typed = {"FP32": contents.fp32_contents, "FP64": contents.fp64_contents}.get(tensor.datatype)
        if typed is not None:
            values = np.asarray(typed, dtype=FLOAT_TYPES[tensor.datatype])
            if values.size != math.prod(shape):
                raise RequestRejected(f"input {name}: {values.size} {tensor.datatype} contents, shape {shape} needs {math.prod(shape)}")
            _check_finite(name, tensor.datatype, values)


_TRACEBACK = "Traceback (most recent call last)"
_QUALIFIED = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\w*: ")
_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s/'\"<>,;()\[\]]+/)+[^\s/'\"<>,;()\[\]]*")


def client_message(message: str, fallback: str = "internal server error") -> str:
    """What a client may see of a server-side error message: one line, no traceback, no path.

    A Python traceback (PyTriton's answer to any exception of a bound function) becomes its
    exception's message without the exception's module and class; file-system paths become
    ``<path>``. The caller logs the original at debug level.
    """
    text = str(message).strip()
    if _TRACEBACK in text:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        text = _QUALIFIED.sub("", lines[-1]) if lines else ""
    text = " ".join(_PATH.sub("<path>", text).split())
    if not text:
        return fallback
    return text if len(text) <= 300 else text[:297] + "..."
