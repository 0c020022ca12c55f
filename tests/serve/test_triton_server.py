"""``deploykit serve`` end to end: a real tritonserver (PyTriton's bundled binary, on CPU)
serving the zoo's trained APE model, answered over KServe v2 HTTP and gRPC with
``tritonclient``, checked against ONNX Runtime run directly. One server for the module: started
on 127.0.0.1 at free ports with the default ``--backend auto``, watched from its first moment,
stopped by its pid."""

from __future__ import annotations

import io
import ipaddress
import json
import math
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import PIL.Image as PIL
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serve_reference import ort_logits, png, preprocessed, softmax_top_k, zoo_test_images
from server_process import command_line_argument, free_ports, listening_addresses, process_tree, stop, tritonserver_pid
from tritonclient.utils import InferenceServerException

from deploykit.inputs.builtin import sample_images
from deploykit.runners.table import auto_order
from tests import image_bombs

MAX_BATCH = 8
QUEUE_DELAY_US = 20_000  # long enough that concurrent requests reliably meet in the queue
TOP_K = 3
MODELS = ["logits_32", "logits_48", "classify"]
MAX_PIXELS, MAX_BYTES = 4_000_000, 1_000_000  # set on the command line: the limits are options
MAX_REQUEST_BYTES = 4 * 2**20


@pytest.fixture(scope="module")
def served_dir(zoo_export_dir):
    return zoo_export_dir


@pytest.fixture(scope="module")
def server(served_dir, tmp_path_factory):
    http_port, grpc_port, metrics_port = free_ports(3)
    log = tmp_path_factory.mktemp("triton") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "deploykit",
        "serve",
        str(served_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        "--max-batch-size",
        str(MAX_BATCH),
        "--max-queue-delay-us",
        str(QUEUE_DELAY_US),
        "--top-k",
        str(TOP_K),
        "--max-image-pixels",
        str(MAX_PIXELS),
        "--max-image-bytes",
        str(MAX_BYTES),
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    tree = [(proc.pid, "")]
    try:
        first_ready = watch_until_ready(httpclient.InferenceServerClient(f"127.0.0.1:{http_port}"), proc, log)
        tree = process_tree(proc.pid)
        yield dict(
            proc=proc,
            http=f"127.0.0.1:{http_port}",
            grpc=f"127.0.0.1:{grpc_port}",
            ports={http_port, grpc_port, metrics_port},
            first_ready=first_ready,
            log=log,
        )
    finally:
        stop(proc, tree)


def watch_until_ready(client, proc, log, timeout_s: float = 180) -> dict:
    """Poll ``/v2/health/ready`` from the server's first moment; at the first 200 ask every model
    whether it is ready and send one ``classify`` request, before anything else can happen."""
    from tritonclient.utils import InferenceServerException

    image = np.array([[png(zoo_test_images(1, 48)[0])]], dtype=object)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            ready = client.is_server_ready()
        except (ConnectionError, OSError, InferenceServerException):  # not listening yet
            ready = False
        if ready:
            models = {m: client.is_model_ready(m) for m in MODELS}
            try:
                answer = infer(client, "classify", image, name="image").as_numpy("classes").tolist()
            except InferenceServerException as err:
                answer = f"{err.status()}: {err.message()}"
            return {"models": models, "classify": answer}
        time.sleep(0.1)
    raise TimeoutError(f"server not ready after {timeout_s} s:\n{log.read_text()[-4000:]}")


def _client_pair(server) -> dict:
    return {"http": httpclient.InferenceServerClient(server["http"]), "grpc": grpcclient.InferenceServerClient(server["grpc"])}


def _thread_clients(server):
    """A callable giving each calling thread its own client pair: tritonclient's HTTP client is
    not thread-safe."""
    local = threading.local()

    def get() -> dict:
        if not hasattr(local, "clients"):
            local.clients = _client_pair(server)
        return local.clients

    return get


@pytest.fixture(scope="module")
def clients(server):
    return _client_pair(server)


def infer(client, model: str, array: np.ndarray, name: str = "images", datatype: str | None = None):
    module = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    tensor = module.InferInput(name, list(array.shape), datatype or ("BYTES" if array.dtype == object else "FP32"))
    if datatype is None or datatype in ("FP32", "BYTES"):
        tensor.set_data_from_numpy(array)
    else:  # a raw payload of another dtype: the client would refuse to build it otherwise
        module_set_raw(tensor, array)
    return client.infer(model, [tensor])


def module_set_raw(tensor, array):
    from tritonclient.utils import np_to_triton_dtype

    tensor._datatype = np_to_triton_dtype(array.dtype)
    tensor.set_data_from_numpy(array)


# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_listens_only_on_loopback(server):
    addresses = listening_addresses(server["proc"].pid)
    assert server["ports"] <= {port for _, port in addresses}, addresses
    # gRPC binds an IPv6 socket for 127.0.0.1, which /proc shows IPv4-mapped (::ffff:127.0.0.1)
    assert {_ipv4(ip) for ip, _ in addresses} == {"127.0.0.1"}, addresses


def _ipv4(ip: str) -> str:
    address = ipaddress.ip_address(ip)
    return str(getattr(address, "ipv4_mapped", None) or address)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_health_readiness_and_batching_config(clients, protocol):
    client = clients[protocol]
    assert client.is_server_live() and client.is_server_ready()
    assert all(client.is_model_ready(m) for m in MODELS)
    assert not client.is_model_ready("no_such_model")
    config = client.get_model_config("logits_32")
    config = (
        config
        if protocol == "http"
        else {
            "max_batch_size": config.config.max_batch_size,
            "dynamic_batching": {"max_queue_delay_microseconds": config.config.dynamic_batching.max_queue_delay_microseconds},
        }
    )
    assert config["max_batch_size"] == MAX_BATCH
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == QUEUE_DELAY_US


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("res", [32, 48])
def test_logits_equal_direct_ort(clients, served_dir, protocol, res):
    x = np.random.default_rng(res).standard_normal((3, 3, res, res), dtype=np.float32)
    result = infer(clients[protocol], f"logits_{res}", x)
    expected = ort_logits(served_dir, x)
    np.testing.assert_array_equal(result.as_numpy("logits"), expected)
    top = softmax_top_k(expected, TOP_K)
    assert result.as_numpy("classes").tolist() == [[c for c, _ in row] for row in top]
    np.testing.assert_allclose(result.as_numpy("scores"), [[p for _, p in row] for row in top], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_classify_encoded_images(clients, served_dir, protocol):
    astronaut, chelsea = sample_images(2)
    small = np.ascontiguousarray(chelsea[:30, :34])
    images = [astronaut, small]
    batch = np.array([[png(img)] for img in images], dtype=object)
    result = infer(clients[protocol], "classify", batch, name="image")
    assert result.as_numpy("resolution").tolist() == [[48, 48], [32, 32]]
    for row, (image, res) in enumerate(zip(images, [(48, 48), (32, 32)])):
        top = softmax_top_k(ort_logits(served_dir, preprocessed(served_dir, image, res)[None]), TOP_K)[0]
        assert result.as_numpy("classes")[row].tolist() == [c for c, _ in top]
        np.testing.assert_allclose(result.as_numpy("scores")[row], [p for _, p in top], rtol=1e-5, atol=1e-7)


def _stats(client, model):
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def test_concurrent_load_is_merged_by_the_dynamic_batcher(server, clients, served_dir):
    requests = 64
    inputs = np.random.default_rng(7).standard_normal((requests, 1, 3, 32, 32), dtype=np.float32)
    expected = ort_logits(served_dir, inputs[:, 0])
    thread_clients = _thread_clients(server)

    def one(i):
        return infer(thread_clients()["http" if i % 2 else "grpc"], "logits_32", inputs[i]).as_numpy("logits")

    before = _stats(clients["http"], "logits_32")
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(requests)))  # raises on the first failed request
    after = _stats(clients["http"], "logits_32")
    inferences, executions = after[0] - before[0], after[1] - before[1]
    assert inferences == requests
    assert executions < inferences, f"{executions} executions for {inferences} requests: nothing was merged"
    for got, want in zip(results, expected):
        # a merged batch changes the GEMM's row count, which may change the last bits
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)


MALFORMED = {
    "wrong_dtype": ("logits_32", np.zeros((1, 3, 32, 32), np.float64), "images", "FP64", "data-type"),
    "wrong_rank": ("logits_32", np.zeros((3, 32, 32), np.float32), "images", None, "unexpected shape"),
    "wrong_resolution": ("logits_32", np.zeros((1, 3, 48, 48), np.float32), "images", None, "unexpected shape"),
    "empty_batch": ("logits_32", np.zeros((0, 3, 32, 32), np.float32), "images", None, ""),
    "oversized_batch": ("logits_32", np.zeros((MAX_BATCH + 1, 3, 32, 32), np.float32), "images", None, "batch-size must be <="),
    "non_image_bytes": ("classify", np.array([[b"\x89PNG but not really"]], dtype=object), "image", None, "cannot decode image bytes"),
    "empty_bytes_batch": ("classify", np.zeros((0, 1), dtype=object), "image", None, ""),
}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_request_is_rejected_and_server_keeps_serving(clients, served_dir, protocol, case):
    model, array, name, datatype, needle = MALFORMED[case]
    client = clients[protocol]
    with pytest.raises(InferenceServerException) as info:
        infer(client, model, array, name=name, datatype=datatype)
    status = str(info.value.status())
    # KServe v2: an HTTP error status with an "error" message, or a gRPC error status code
    if protocol == "http":
        assert status.isdigit() and 400 <= int(status) < 600, status
    else:
        assert status.startswith("StatusCode.") and status != "StatusCode.OK", status
    assert status in ("400", "StatusCode.INVALID_ARGUMENT"), status  # Triton's checks, or classify's: a client error
    assert needle in info.value.message()
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32), dtype=np.float32)
    np.testing.assert_array_equal(infer(client, "logits_32", x).as_numpy("logits"), ort_logits(served_dir, x))


def test_libpython_of_this_interpreter_is_first_only_while_triton_starts(monkeypatch):
    import sysconfig

    from deploykit.serve.triton_server import interpreter_libpython_first

    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/before")
    with interpreter_libpython_first():
        inside = os.environ["LD_LIBRARY_PATH"]
    assert os.environ["LD_LIBRARY_PATH"] == "/opt/before"
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        assert inside == f"{sysconfig.get_config_var('LIBDIR')}:/opt/before"
    else:
        assert inside == "/opt/before"


# ----------------------------------------------------------------------------------------------
# startup, client errors, limits, answers under load


def test_ready_means_every_model_is_ready(server):
    """At the very first 200 of ``/v2/health/ready`` every model is ready and ``classify`` answers."""
    first = server["first_ready"]
    assert first["models"] == {m: True for m in MODELS}, first
    assert isinstance(first["classify"], list) and len(first["classify"][0]) == TOP_K, first


def test_backend_choice_and_skips_are_said_once(server):
    lines = [line.strip() for line in server["log"].read_text().splitlines()]
    said = [line for line in lines if line.startswith(("backend ", "skipped "))]
    assert said.count("backend ort at 32, 48") == 1, said
    for name in auto_order()[: auto_order().index("ort")]:  # tried before ONNX Runtime: each says why not
        assert any(line.startswith(f"skipped {name} at ") for line in said), said
    assert len(said) == len(set(said)), f"repeated: {said}"


def _png_header_only(width: int, height: int) -> bytes:
    from tests.test_imaging import png_header_only

    return png_header_only(width, height)


CLIENT_ERRORS = {
    "not_an_image": (b"\x89PNG but not really", "cannot decode image bytes: not a PNG, JPEG, WEBP, BMP image"),
    "too_many_pixels": (_png_header_only(2001, 2000), f"image is 2001x2000 = 4002000 pixels; this server takes at most {MAX_PIXELS}"),
    "too_many_bytes": (b"\0" * (MAX_BYTES + 1), f"image is {MAX_BYTES + 1} bytes; this server takes at most {MAX_BYTES}"),
}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("case", list(CLIENT_ERRORS))
def test_bad_images_are_the_clients_error_in_one_line(clients, protocol, case):
    data, message = CLIENT_ERRORS[case]
    start = time.perf_counter()
    with pytest.raises(InferenceServerException) as info:
        infer(clients[protocol], "classify", np.array([[data]], dtype=object), name="image")
    assert str(info.value.status()) == {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}[protocol]
    assert info.value.message() == message  # one line: no traceback, no server paths
    assert time.perf_counter() - start < 30  # a header read, not a 4-megapixel decode (a bound against hangs, not a benchmark)


def _load_requests(count: int) -> list[tuple[str, str, np.ndarray]]:
    """``(protocol, model, input)``: encoded zoo test images of several sizes for ``classify``,
    preprocessed tensors for ``logits_<res>``, and a bad image now and then."""
    rng = np.random.default_rng(11)
    images = [img for size in (48, 40, 30, 64) for img in zoo_test_images(6, size, offset=size)]
    kinds = []
    for i in range(count):
        protocol = ("http", "grpc")[i % 2]
        if i % 10 == 9:
            kinds.append((protocol, "classify", np.array([[b"not an image"]], dtype=object)))
        elif i % 3 == 0:
            res = (32, 48)[i % 2]
            kinds.append((protocol, f"logits_{res}", rng.standard_normal((1, 3, res, res), dtype=np.float32)))
        else:
            kinds.append((protocol, "classify", np.array([[png(images[i % len(images)])]], dtype=object)))
    return kinds


def _send(clients, request):
    protocol, model, x = request
    try:
        result = infer(clients[protocol], model, x, name="image" if model == "classify" else "images")
    except InferenceServerException as err:
        return ("error", str(err.status()), err.message())
    names = ("classes", "scores", "resolution") if model == "classify" else ("logits", "classes", "scores")
    return ("ok", *[result.as_numpy(n) for n in names])


@pytest.mark.slow
def test_served_answers_equal_sequential_answers_under_load(server, clients, served_dir):
    """200 requests at concurrency 16 on 127.0.0.1: each answer equals the one the same request
    got alone; ``classify`` equals the in-process pipeline (same pixels, same model)."""
    import deploykit

    requests = _load_requests(200)
    sequential = [_send(clients, r) for r in requests]
    thread_clients = _thread_clients(server)

    def concurrent_send(request):
        return _send(thread_clients(), request)

    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(concurrent_send, requests))
    assert sum(s[0] == "error" for s in sequential) == 20
    for (_, model, _), alone, loaded in zip(requests, sequential, concurrent):
        assert alone[0] == loaded[0], (model, alone, loaded)
        if alone[0] == "error":
            assert alone[1:] == loaded[1:] and alone[1] in ("400", "StatusCode.INVALID_ARGUMENT")
            continue
        if model == "classify":  # one image per request: the classes and where it was routed are exact
            np.testing.assert_array_equal(loaded[1], alone[1])
            np.testing.assert_array_equal(loaded[3], alone[3])
        # merged batches change the GEMMs' row counts, which may change the last bits
        for got, want in zip(loaded[1:], alone[1:]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with deploykit.load(served_dir, backend="ort", top_k=TOP_K) as pipeline:
        for (_, model, x), alone in zip(requests, sequential):
            if model == "classify" and alone[0] == "ok":
                prediction = pipeline(x[0, 0])
                assert list(prediction.classes) == alone[1][0].tolist() and list(prediction.resolution) == alone[3][0].tolist()
                np.testing.assert_allclose(prediction.scores, alone[2][0], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# hostile requests: refused in one line, the server keeps serving


def _post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, str]:
    """A raw HTTP POST on a connection of its own: ``(status, body)``, or ``(0, reason)`` when
    the connection was cut."""
    import http.client

    connection = http.client.HTTPConnection(*server["http"].split(":"), timeout=120)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        answer = connection.getresponse()
        return answer.status, answer.read().decode("utf-8", "replace")
    except (ConnectionError, http.client.HTTPException) as err:
        return 0, repr(err)
    finally:
        connection.close()


def _infer_json(model: str, shape, data, datatype="FP32", name="images") -> bytes:
    return json.dumps({"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}]}, allow_nan=True).encode()


def _binary_infer(array: np.ndarray, name="images") -> tuple[bytes, dict]:
    header = json.dumps(
        {"inputs": [{"name": name, "shape": list(array.shape), "datatype": "FP32", "parameters": {"binary_data_size": array.nbytes}}]}
    ).encode()
    return header + array.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def _nan_image(res=32) -> np.ndarray:
    x = np.random.default_rng(5).standard_normal((1, 3, res, res), dtype=np.float32)
    x[0, 1, 2, 3] = np.nan
    return x


def _corrupt_chunk_png() -> bytes:
    png = image_bombs.encoded("PNG")
    end = png.rindex(b"IEND") - 4
    return png[:end] + image_bombs.png_chunk(b"zTXt", b"key\0\x01data") + png[end:]


def _png_of(size, mode="RGB") -> bytes:
    buf = io.BytesIO()
    PIL.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nnewpath 0 0 moveto 8 8 lineto stroke\n%%EOF\n"
INFER_32 = "/v2/models/logits_32/infer"
HOSTILE_HTTP = {  # name: (path, body, headers, status, message start)
    "nested_brackets_400kb": (INFER_32, b"[" * 400_000, None, 400, "request JSON is nested too deeply"),
    "nested_objects": (INFER_32, b'{"a":' * 50_000, None, 400, "request JSON is nested too deeply"),
    "malformed_json": (INFER_32, b'{"inputs": [', None, 400, "malformed request JSON: "),
    "data_not_matching_shape": (INFER_32, _infer_json("logits_32", [1, 3, 32, 32], [0.5] * 100), None, 400, "input images: data has 100"),
    "nan_json": (INFER_32, _infer_json("logits_32", [1, 3, 32, 32], [0.5] * 3071 + [math.nan]), None, 400, "non-finite number NaN"),
    "fp32_overflow_json": (INFER_32, _infer_json("logits_32", [1, 3, 32, 32], [1e39] + [0.5] * 3071), None, 400, "input images: 1 NaN/Inf"),
    "nan_binary": (INFER_32, *_binary_infer(_nan_image()), 400, "input images: 1 NaN/Inf values in FP32 data"),
    "over_max_request_bytes": (INFER_32, b" " * (MAX_REQUEST_BYTES + 1), None, 413, f"request body over {MAX_REQUEST_BYTES} bytes"),
    "compressed_body": (INFER_32, b"\x1f\x8b" + b"\0" * 20, {"Content-Encoding": "gzip"}, 415, "compressed request bodies are not served"),
    "model_control": ("/v2/repository/models/logits_32/unload", b"{}", None, 404, "not served: POST /v2/repository"),
    "shared_memory": ("/v2/systemsharedmemory/region/r/register", b"{}", None, 404, "not served: POST"),
}


@pytest.mark.parametrize("case", list(HOSTILE_HTTP))
def test_hostile_http_requests_are_refused_in_one_line(server, clients, served_dir, case):
    path, body, headers, status, message = HOSTILE_HTTP[case]
    got_status, text = _post(server, path, body, headers)
    assert got_status == status, (got_status, text[:300])
    error = json.loads(text)["error"]
    assert error.startswith(message) and "\n" not in error and "Traceback" not in error, error
    assert server["proc"].poll() is None and clients["http"].is_server_ready()
    x = np.random.default_rng(2).standard_normal((1, 3, 32, 32), dtype=np.float32)
    np.testing.assert_array_equal(infer(clients["http"], "logits_32", x).as_numpy("logits"), ort_logits(served_dir, x))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_non_finite_inputs_are_the_clients_error(clients, protocol):
    with pytest.raises(InferenceServerException) as info:
        infer(clients[protocol], "logits_32", _nan_image())
    assert str(info.value.status()) == {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}[protocol]
    assert info.value.message() == "input images: 1 NaN/Inf values in FP32 data; send finite numbers"
    huge = _nan_image()
    huge[0, 1, 2, 3] = 3e38  # finite, but it overflowed the model to NaN logits, answered with a ranking (issue 41)
    with pytest.raises(InferenceServerException) as info:
        infer(clients[protocol], "logits_32", huge)
    assert info.value.message() == "input images: 1 values beyond ±10000 in FP32 data; send normalised pixels"


HOSTILE_IMAGES = {
    "eps": (EPS, "cannot decode image bytes: not a PNG, JPEG, WEBP, BMP image"),
    "gif": (b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", "cannot decode image bytes: not a PNG, JPEG, WEBP, BMP image"),
    "extreme_aspect": (_png_of((10_000, 1), "L"), "image is 10000x1; this server takes an aspect ratio of at most 16:1"),
    "side_over_limit": (_png_header_only(16_385, 200), "image is 16385x200; this server takes at most 16384 pixels on a side"),
    # issue 41: Pillow's SyntaxError on this PNG failed every request batched beside it
    "corrupt_chunk": (_corrupt_chunk_png(), "cannot decode image bytes: Unknown compression method 1 in zTXt chunk"),
    "scan_bomb": (
        image_bombs.progressive_jpeg(1_000),
        "JPEG image has more than 64 scans; this server takes at most 64 (encoders write about 10)",
    ),
}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("case", list(HOSTILE_IMAGES))
def test_images_outside_the_allow_list_and_limits_are_refused(clients, protocol, case):
    data, message = HOSTILE_IMAGES[case]
    with pytest.raises(InferenceServerException) as info:
        infer(clients[protocol], "classify", np.array([[data]], dtype=object), name="image")
    assert str(info.value.status()) == {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}[protocol]
    assert info.value.message() == message


def test_fuzzed_http_bodies_never_get_a_server_error(server, clients):
    """Hypothesis over raw bodies sent to the live server: every answer is 2xx or 4xx with a
    one-line JSON error, never a 5xx, a traceback or a cut connection; the server stays up."""
    import hypothesis as hypothesis
    from hypothesis import given, settings
    from hypothesis import strategies as st

    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4)
    values = st.recursive(
        leaves,
        lambda c: (
            st.lists(c, max_size=3)
            | st.dictionaries(st.sampled_from(["inputs", "name", "shape", "datatype", "data", "parameters"]), c, max_size=4)
        ),
        max_leaves=20,
    )
    bodies = (
        st.binary(max_size=512)
        | values.map(lambda v: json.dumps(v, allow_nan=True).encode())
        | st.builds(lambda shape, data: _infer_json("logits_32", shape, data), st.lists(st.integers(-1, 40), max_size=5), values)
    )

    @settings(max_examples=40, derandomize=True, deadline=None, database=None, suppress_health_check=list(hypothesis.HealthCheck))
    @given(bodies, st.sampled_from([INFER_32, "/v2/models/classify/infer", "/v2/models/nope/infer"]))
    def one(body, path):
        status, text = _post(server, path, body)
        assert 200 <= status < 500, (status, body[:200], text[:300])
        if status >= 400:
            error = json.loads(text)["error"]
            assert "\n" not in error and "Traceback" not in error, error

    one()
    assert server["proc"].poll() is None and clients["http"].is_server_ready()


def _mixed_load(count: int) -> list[tuple]:
    """Valid requests (logits and classify, HTTP and gRPC) with every hostile kind above between them."""
    rng = np.random.default_rng(23)
    images = [img for size in (48, 40, 64) for img in zoo_test_images(4, size, offset=size)]
    hostile = [("raw", case) for case in HOSTILE_HTTP] + [("nan", p) for p in ("http", "grpc")]
    hostile += [("image", case) for case in [*HOSTILE_IMAGES, *CLIENT_ERRORS]]
    load = []
    for i in range(count):
        protocol = ("http", "grpc")[i % 2]
        if i % 3 == 2:
            load.append(hostile[(i // 3) % len(hostile)])
        elif i % 4 == 0:
            load.append(("logits", protocol, rng.standard_normal((1, 3, 32, 32), dtype=np.float32)))
        else:
            load.append(("classify", protocol, images[i % len(images)]))
    return load


def _send_mixed(server, clients, request) -> tuple:
    kind, what = request[0], request[1]
    try:
        if kind == "raw":
            path, body, headers, status, message = HOSTILE_HTTP[what]
            got, text = _post(server, path, body, headers)
            return ("answered", got, json.loads(text)["error"]) if got else ("cut", text)
        if kind == "nan":
            infer(clients[what], "logits_32", _nan_image())
        elif kind == "image":
            data = {**HOSTILE_IMAGES, **CLIENT_ERRORS}[what][0]
            infer(clients["http"], "classify", np.array([[data]], dtype=object), name="image")
        elif kind == "logits":
            return ("ok", infer(clients[what], "logits_32", request[2]).as_numpy("logits"))
        else:
            result = infer(clients[what], "classify", np.array([[png(request[2])]], dtype=object), name="image")
            return ("ok", result.as_numpy("classes"), result.as_numpy("scores"), result.as_numpy("resolution"))
    except InferenceServerException as err:
        return ("answered", str(err.status()), err.message())
    return ("accepted", kind, what)


@pytest.mark.slow
def test_mixed_hostile_load_keeps_every_valid_answer(server, served_dir):
    """Done-when of the hardening: 300 requests at concurrency 16 on 127.0.0.1, one in three
    hostile (every kind above); the server stays up, every hostile request gets its 4xx line,
    and every valid one the answer of in-process inference."""
    import deploykit

    load = _mixed_load(300)
    thread_clients = _thread_clients(server)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda r: _send_mixed(server, thread_clients(), r), load))
    counts = {"valid": 0, "valid_equal": 0, "hostile": 0, "hostile_refused_4xx": 0}
    with deploykit.load(served_dir, backend="ort", top_k=TOP_K) as pipeline:
        for request, answer in zip(load, answers):
            if request[0] in ("logits", "classify"):
                counts["valid"] += 1
                assert answer[0] == "ok", (request[:2], answer)
                if request[0] == "logits":
                    np.testing.assert_allclose(answer[1], pipeline.logits(request[2]), rtol=1e-5, atol=1e-6)
                else:
                    prediction = pipeline(request[2])
                    assert answer[1][0].tolist() == list(prediction.classes) and answer[3][0].tolist() == list(prediction.resolution)
                    np.testing.assert_allclose(answer[2][0], prediction.scores, rtol=1e-5, atol=1e-6)
                counts["valid_equal"] += 1
                continue
            counts["hostile"] += 1
            assert answer[0] == "answered", (request[:2], answer)
            status, message = str(answer[1]), answer[2]
            assert status in ("400", "404", "413", "415", "StatusCode.INVALID_ARGUMENT"), (request[:2], answer)
            assert "\n" not in message and "Traceback" not in message, message
            counts["hostile_refused_4xx"] += 1
    print(f"mixed load: {counts}")
    assert counts["valid"] == counts["valid_equal"] == 200 and counts["hostile"] == counts["hostile_refused_4xx"] == 100, counts
    assert server["proc"].poll() is None and httpclient.InferenceServerClient(server["http"]).is_server_ready()


# ----------------------------------------------------------------------------------------------
# Triton's own ports: reachable only through the front (issue 41: 8, 9)


def _triton_argument(server, name: str) -> str:
    return command_line_argument(tritonserver_pid(server["proc"].pid), name)


def _triton_http_port(server) -> int:
    return int(_triton_argument(server, "--http-port"))


def _direct(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, str]:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        answer = connection.getresponse()
        return answer.status, answer.read().decode("utf-8", "replace")
    finally:
        connection.close()


def test_tritons_own_port_answers_only_health_without_the_fronts_token(server, clients):
    """Any local process reached Triton's loopback ports: 400 KB of ``[`` killed it. Every Triton
    endpoint but health (which PyTriton's own start-up check needs without a token) now wants the
    front's token, and refuses before parsing the body; a model config there shows nothing."""
    port = _triton_http_port(server)
    assert _direct(port, "GET", "/v2/health/ready")[0] == 200
    for path in ("/v2", "/v2/models/logits_32", "/v2/models/logits_32/config", "/v2/models/stats"):
        assert _direct(port, "GET", path)[0] == 403, path
    status, text = _direct(port, "POST", "/v2/models/logits_32/infer", b"[" * 400_000, {"Content-Type": "application/json"})
    assert status == 403 and "restricted" in text, text[:300]
    assert server["proc"].poll() is None and clients["http"].is_server_ready()


def _token(server) -> str:
    """The token as any local user can read it: "<apis>:triton-access-token=<token>"."""
    return _triton_argument(server, "--http-restricted-api").rsplit("triton-access-token=", 1)[1]


def test_a_nan_tensor_sent_to_triton_directly_is_that_requests_error_in_one_line(server, clients, served_dir):
    """With the token (read from the process list, as a local user can), a NaN tensor sent to
    Triton itself, past the front's checks, is refused by the logits model with 400 and one line
    (no traceback, no path); the next request is answered. (That other requests batched with it
    are answered: tests/serve/test_python_models.py.)"""
    x = np.concatenate([np.random.default_rng(6).standard_normal((1, 3, 32, 32), dtype=np.float32), _nan_image()])
    # json.dumps spells the NaN "NaN", which RapidJSON reads (kParseNanAndInfFlag)
    body = json.dumps({"inputs": [{"name": "images", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}).encode()
    status, text = _direct(_triton_http_port(server), "POST", "/v2/models/logits_32/infer", body, {"triton-access-token": _token(server)})
    assert status == 400 and json.loads(text) == {"error": "images hold 1 NaN/Inf values; send finite numbers"}, text[:2000]
    np.testing.assert_allclose(
        infer(clients["http"], "logits_32", x[:1]).as_numpy("logits"), ort_logits(served_dir, x[:1]), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_model_configs_show_no_workspace_path(server, clients, protocol):
    """PyTriton's model configs name its workspace (``workspace-path``), where the model store,
    its sockets and Triton's log are; clients see the config without it."""
    from pathlib import Path

    workspace = Path(_triton_argument(server, "--model-repository")).parent
    config = clients[protocol].get_model_config("logits_32", **({"as_json": True} if protocol == "grpc" else {}))
    assert str(workspace) not in json.dumps(config) and int(dict(config.get("config", config))["max_batch_size"]) == MAX_BATCH, config
