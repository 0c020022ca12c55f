"""The front's request checks (``deploykit.serve.requests``, ``strict_json``) where Python and
Triton could read one request two ways, what checking costs in memory, and what clients see of
server errors. Each case here passed the checks before (issue 41: the front checked one request
and Triton ran another) or cost memory in proportion to the body."""

from __future__ import annotations

import json
import traceback
import tracemalloc

import numpy as np
import pytest

from deploykit.serve.requests import RequestRejected, check_http_infer, check_infer_headers, client_message, public_model_config


def refusal(body: bytes, header_length: str | None = None, **limits) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        check_http_infer(body, header_length, **limits)
    message = str(info.value)
    assert message and "\n" not in message and len(message) < 400, message
    return info.value


def tensor(datatype: str, shape: list, data: str) -> bytes:
    """A one-input request with ``data`` spelled as given (JSON text, not a Python value)."""
    return f'{{"inputs": [{{"name": "images", "datatype": "{datatype}", "shape": {json.dumps(shape)}, "data": {data}}}]}}'.encode()


def binary_request(header_length_digits: str) -> tuple[bytes, str]:
    raw = np.ones(4, np.float32).tobytes()
    head = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 16}}]}).encode()
    return head + raw, "".join(header_length_digits[int(d)] for d in str(len(head)))


ARABIC_INDIC = "٠١٢٣٤٥٦٧٨٩"  # str.isdigit() and int() take them; Triton's atoi reads 0


def test_a_binary_request_with_an_ascii_header_length_passes():
    """The control of the next case: the same request, its length in ASCII digits."""
    body, length = binary_request("0123456789")
    check_http_infer(body, length)


def test_a_header_length_in_non_ascii_digits_is_refused():
    body, length = binary_request(ARABIC_INDIC)
    assert "ASCII digits" in str(refusal(body, length))


READ_TWO_WAYS = {  # name: (body, what the refusal says); each passed the checks before
    # Python keeps the last of duplicate keys, RapidJSON's FindMember the first: the check saw 0.5, Triton ran 1e39 (Inf as FP32)
    "duplicate_data_key": (
        b'{"inputs": [{"name": "images", "datatype": "FP32", "shape": [1], "data": [1e39], "data": [0.5]}]}',
        "key 'data'",
    ),
    "duplicate_datatype_key": (
        b'{"inputs": [{"name": "images", "datatype": "BOOL", "datatype": "FP32", "shape": [1], "data": [1.5]}]}',
        "key",
    ),
    "duplicate_inputs_key": (b'{"inputs": [], ' + tensor("FP32", [1], "[0.5]")[1:], "key 'inputs'"),
    "utf16_body": (tensor("FP32", [1], "[0.5]").decode().encode("utf-16"), "UTF-8"),  # Python's json detects UTF-16; Triton reads bytes
    "utf8_bom": (b"\xef\xbb\xbf" + tensor("FP32", [1], "[0.5]"), "byte-order mark"),  # Python skips it; RapidJSON refuses
    "lone_surrogate": (b'{"inputs": [{"name": "\\ud800", "datatype": "FP32", "shape": [1], "data": [0.5]}]}', "surrogate"),
    "int_over_64_bits": (tensor("INT64", [1], f"[{2**64}]"), "64 bits"),  # RapidJSON: a rounded double, which AsInt refuses (500)
    "int_of_5000_digits": (tensor("INT64", [1], "[" + "9" * 5000 + "]"), "64 bits"),  # Python's int() raised ValueError: 500 from the front
    "exponent_over_308": (tensor("INT64", [1], "[1e400]"), "exponent"),  # Python: inf; RapidJSON: parse error
    "zero_with_big_exponent": (tensor("FP32", [1], "[0e400]"), "exponent"),  # Python: 0.0; RapidJSON: parse error
    "int_over_the_datatype": (tensor("UINT8", [1], "[300]"), "UINT8"),  # Triton casts: 300 runs as 44
    "negative_unsigned": (tensor("UINT32", [1], "[-1]"), "UINT32"),
    "bool_as_number": (tensor("BOOL", [1], "[2]"), "BOOL"),  # Triton: AsBool fails, 500
    "bytes_as_number": (tensor("BYTES", [1], "[7]"), "BYTES"),
    "fp16_as_json": (tensor("FP16", [1], "[0.5]"), "binary"),  # Triton reads FP16 only as binary data
}


@pytest.mark.parametrize("case", list(READ_TWO_WAYS))
def test_requests_python_and_triton_would_read_differently_are_refused(case):
    body, said = READ_TWO_WAYS[case]
    error = refusal(body)
    assert error.status == 400 and said in str(error), str(error)


def test_the_same_requests_spelled_one_way_pass():
    """Controls: each of the cases above with its ambiguity removed is accepted."""
    for body in (
        tensor("FP32", [1], "[0.5]"),
        tensor("INT64", [2], f"[{2**63 - 1}, {-(2**63)}]"),
        tensor("UINT64", [1], f"[{2**64 - 1}]"),
        tensor("FP32", [2], "[0e308, 2.2e-309]"),
        tensor("UINT8", [2], "[0, 255]"),
        tensor("BOOL", [2], "[true, false]"),
        tensor("BYTES", [1], '["\\ud83d\\ude00"]'),  # an escaped surrogate pair is one character to both
        tensor("FP64", [2], "[1e4, -1e4]"),
    ):
        check_http_infer(body, None)


@pytest.mark.parametrize(
    "headers, status",
    [
        ([("Content-Encoding", "identity"), ("Content-Encoding", "gzip")], 415),
        ([("content-encoding", "gzip"), ("Content-Encoding", "identity")], 415),
        ([("Content-Encoding", "identity, deflate")], 415),
        ([("Content-Encoding", "")], 415),
        ([("Inference-Header-Content-Length", "12"), ("Inference-Header-Content-Length", "12")], 400),
        ([("Inference-Header-Content-Length", "+12")], 400),
        ([("Inference-Header-Content-Length", "12abc")], 400),
    ],
)
def test_one_content_encoding_rule_and_one_ascii_header_length(headers, status):
    with pytest.raises(RequestRejected) as info:
        check_infer_headers(headers)
    assert info.value.status == status and "\n" not in str(info.value)


def test_identity_headers_pass():
    assert (
        check_infer_headers([("Content-Encoding", "identity"), ("CONTENT-ENCODING", "Identity"), ("Inference-Header-Content-Length", "42")])
        == "42"
    )
    assert check_infer_headers([("Content-Type", "application/json")]) is None


def _peak_bytes(check) -> int:
    tracemalloc.start()
    try:
        check()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_json_values_are_counted_before_any_is_built():
    """63 MiB of JSON numbers cost 2.9 GB: one Python object per value. Over the default limit
    (2**20 values), the body is refused before ``json.loads`` builds anything."""
    count = 2**20 + 1
    body = tensor("FP32", [count], "[" + ",".join(["0.5"] * count) + "]")

    def check():
        assert refusal(body).status == 413

    assert _peak_bytes(check) < len(body) // 8


def test_checking_json_costs_a_bounded_amount_per_value():
    """Within the limit, checking a flat FP32 request and a nested one costs at most 128 bytes per
    value (the whole request of 2**20 values: at most 128 MiB)."""
    count = 20_000
    flat = tensor("FP32", [count], "[" + ",".join(["0.123456789"] * count) + "]")
    nested = tensor("FP32", [count, 1], "[" + ",".join(["[0.5]"] * count) + "]")
    for body, values in ((flat, count + 16), (nested, 2 * count + 16)):
        assert _peak_bytes(lambda body=body: check_http_infer(body, None)) < 128 * values


def test_checking_binary_data_costs_a_fraction_of_it():
    """A BF16 tensor was widened to float32 twice over (4x its bytes) to look for NaN; its
    exponent bits are now read a slice at a time."""
    raw = np.full(4 * 2**20, 0x3F80, np.uint16).tobytes()  # 4 Mi BF16 ones: 8 MiB
    head = json.dumps(
        {"inputs": [{"name": "images", "datatype": "BF16", "shape": [len(raw) // 2], "parameters": {"binary_data_size": len(raw)}}]}
    )
    body = head.encode() + raw
    assert _peak_bytes(lambda: check_http_infer(body, str(len(head)))) < len(raw) // 2


PYTHON_BACKEND_ERROR = (
    "Failed to process the request(s) for model 'classify_0_0', message: ValueError: the image header is cut short\n\n"
    "At:\n  /tmp/pytriton_workspace_ab12/model_store/classify/1/model.py(57): execute\n"
    "  /work/venv/lib/python3.11/site-packages/deploykit/inputs/imaging.py(120): decode\n"
)


def test_a_python_backend_error_reaches_clients_as_its_exception_message():
    """Triton's Python backend sends the exception followed by pybind11's frame list ("At:")."""
    assert client_message(PYTHON_BACKEND_ERROR) == "the image header is cut short"


def test_a_pytriton_traceback_reaches_clients_as_its_exception_message():
    try:
        raise ValueError("images hold 1 NaN/Inf values; send finite numbers")
    except ValueError:
        text = traceback.format_exc()
    assert "File " in text and client_message(text) == "images hold 1 NaN/Inf values; send finite numbers"


def test_a_model_config_loses_the_parameters_holding_a_path():
    config = {
        "name": "logits_32",
        "max_batch_size": 8,
        "parameters": {"workspace-path": {"string_value": "/tmp/pytriton_workspace_ab12"}, "settings": {"string_value": '{"top_k": 5}'}},
    }
    public = public_model_config(config)
    assert "/tmp" not in json.dumps(public)
    assert public["parameters"] == {"settings": {"string_value": '{"top_k": 5}'}} and public["max_batch_size"] == 8


@pytest.mark.parametrize("datatype", ["FP16", "BF16", "FP32", "FP64"])
def test_a_bad_value_is_found_in_any_slice_of_a_long_tensor(datatype):
    """Binary floats are checked a slice at a time: the first, a slice's edges, the last value."""
    from deploykit.serve.requests import SLICE, check_raw

    count = 2 * SLICE + 3
    layout = {"FP16": np.float16, "BF16": np.float32, "FP32": np.float32, "FP64": np.float64}[datatype]
    for where in (0, SLICE - 1, SLICE, count - 1):
        for bad, said in ((np.nan, "NaN/Inf"), (3e4, "beyond")):
            values = np.zeros(count, layout)
            values[where] = bad
            raw = (values.view(np.uint32) >> 16).astype("<u2").tobytes() if datatype == "BF16" else values.tobytes()
            with pytest.raises(RequestRejected, match=said):
                check_raw("images", datatype, [count], raw)


OK_INPUTS = '"inputs": [{"name": "images", "datatype": "FP32", "shape": [1], "data": [0.5]}]'
# Item 10 of issue 52: Triton reads these fields with AsString/AsBool/AsInt, which answer a value
# of another JSON type with 500 (an internal error) for what is the client's malformed request.
WRONG_FIELD_TYPES = {
    "id a number": ('{"id": 5, %s}', '"id" must be a string'),
    "id an object": ('{"id": {"a": 1}, %s}', '"id" must be a string'),
    "parameters a list": ('{"parameters": [1], %s}', 'the request: "parameters" must be an object'),
    "a parameter an object": ('{"parameters": {"priority": {}}, %s}', "parameter 'priority' must be a string, a number or a boolean"),
    "outputs an object": ('{"outputs": {"name": "logits"}, %s}', '"outputs" must be a list'),
    "an output without a name": ('{"outputs": [{"nam": "logits"}], %s}', 'each output must be an object with a "name"'),
    "binary_data a string": (
        '{"outputs": [{"name": "logits", "parameters": {"binary_data": "yes"}}], %s}',
        "binary_data must be true or false",
    ),
    "input parameters a list": (
        '{"inputs": [{"name": "images", "datatype": "FP32", "shape": [1], "data": [0.5], "parameters": []}]}',
        '"parameters" must be an object',
    ),
}


@pytest.mark.parametrize("case", WRONG_FIELD_TYPES)
def test_fields_of_another_type_than_triton_reads_are_the_client_s_400(case):
    template, expected = WRONG_FIELD_TYPES[case]
    body = (template % OK_INPUTS if "%s" in template else template).encode()
    refused = refusal(body)
    assert refused.status == 400 and expected in str(refused)


def test_the_same_fields_of_the_types_triton_reads_pass():
    body = '{"id": "r1", "parameters": {"priority": 1, "tag": "x", "ratio": 0.5, "flag": true}, "outputs": [{"name": "logits", "parameters": {"binary_data": false, "classification": 2}}], %s}'
    check_http_infer((body % OK_INPUTS).encode(), None)
