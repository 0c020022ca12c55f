"""``deploykit serve`` end to end: a real tritonserver (PyTriton's bundled binary, on CPU),
answered over KServe v2 HTTP and gRPC with ``tritonclient``, checked against ONNX Runtime run
directly. One server for the module: started on 127.0.0.1 at free ports, stopped by its pid."""

from __future__ import annotations

import io
import ipaddress
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from serve_reference import ort_logits, preprocessed, softmax_top_k
from server_process import free_ports, listening_addresses, process_tree, stop, wait_until

pytest.importorskip("pytriton", reason="needs the serve extra: pip install 'deploykit[serve]'")
httpclient = pytest.importorskip("tritonclient.http", reason="needs the serve extra")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extra")
PIL = pytest.importorskip("PIL.Image", reason="needs pillow")
from tritonclient.utils import InferenceServerException  # noqa: E402

from deploykit.data import sample_images  # noqa: E402

MAX_BATCH = 8
QUEUE_DELAY_US = 20_000  # long enough that concurrent requests reliably meet in the queue
TOP_K = 3
MODELS = ["logits_32", "logits_48", "classify"]


@pytest.fixture(scope="module")
def server(export_dir, tmp_path_factory):
    http_port, grpc_port, metrics_port = free_ports(3)
    log = tmp_path_factory.mktemp("triton") / "server.log"
    cmd = [sys.executable, "-m", "deploykit", "serve", str(export_dir), "--host", "127.0.0.1", "--port", str(http_port),
           "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--max-batch-size", str(MAX_BATCH),
           "--max-queue-delay-us", str(QUEUE_DELAY_US), "--backend", "ort", "--top-k", str(TOP_K)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    tree = [(proc.pid, "")]
    try:
        http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        wait_until(lambda: all(http.is_model_ready(m) for m in MODELS), proc, timeout_s=180, log=log)
        tree = process_tree(proc.pid)
        yield dict(proc=proc, http=f"127.0.0.1:{http_port}", grpc=f"127.0.0.1:{grpc_port}", ports={http_port, grpc_port, metrics_port})
    finally:
        stop(proc, tree)


@pytest.fixture(scope="module")
def clients(server):
    return {"http": httpclient.InferenceServerClient(server["http"]), "grpc": grpcclient.InferenceServerClient(server["grpc"])}


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


def png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    PIL.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------


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
    config = config if protocol == "http" else {"max_batch_size": config.config.max_batch_size,
                                                "dynamic_batching": {"max_queue_delay_microseconds": config.config.dynamic_batching.max_queue_delay_microseconds}}
    assert config["max_batch_size"] == MAX_BATCH
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == QUEUE_DELAY_US


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("res", [32, 48])
def test_logits_equal_direct_ort(clients, export_dir, protocol, res):
    x = np.random.default_rng(res).standard_normal((3, 3, res, res), dtype=np.float32)
    result = infer(clients[protocol], f"logits_{res}", x)
    expected = ort_logits(export_dir, x)
    np.testing.assert_array_equal(result.as_numpy("logits"), expected)
    top = softmax_top_k(expected, TOP_K)
    assert result.as_numpy("classes").tolist() == [[c for c, _ in row] for row in top]
    np.testing.assert_allclose(result.as_numpy("scores"), [[p for _, p in row] for row in top], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_classify_encoded_images(clients, export_dir, protocol):
    astronaut, chelsea = sample_images(2)
    small = np.ascontiguousarray(chelsea[:30, :34])
    images = [astronaut, small]
    batch = np.array([[png(img)] for img in images], dtype=object)
    result = infer(clients[protocol], "classify", batch, name="image")
    assert result.as_numpy("resolution").tolist() == [[48, 48], [32, 32]]
    for row, (image, res) in enumerate(zip(images, [(48, 48), (32, 32)])):
        top = softmax_top_k(ort_logits(export_dir, preprocessed(export_dir, image, res)[None]), TOP_K)[0]
        assert result.as_numpy("classes")[row].tolist() == [c for c, _ in top]
        np.testing.assert_allclose(result.as_numpy("scores")[row], [p for _, p in top], rtol=1e-5, atol=1e-7)


def _stats(client, model):
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def test_concurrent_load_is_merged_by_the_dynamic_batcher(server, clients, export_dir):
    requests = 64
    inputs = np.random.default_rng(7).standard_normal((requests, 1, 3, 32, 32), dtype=np.float32)
    expected = ort_logits(export_dir, inputs[:, 0])
    local = threading.local()

    def one(i):
        if not hasattr(local, "clients"):  # tritonclient's HTTP client is not thread-safe: one per thread
            local.clients = {"http": httpclient.InferenceServerClient(server["http"]), "grpc": grpcclient.InferenceServerClient(server["grpc"])}
        return infer(local.clients["http" if i % 2 else "grpc"], "logits_32", inputs[i]).as_numpy("logits")

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
def test_malformed_request_is_rejected_and_server_keeps_serving(clients, export_dir, protocol, case):
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
    if case != "non_image_bytes":  # Triton's own validation: a client error
        assert status in ("400", "StatusCode.INVALID_ARGUMENT"), status
    assert needle in info.value.message()
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32), dtype=np.float32)
    np.testing.assert_array_equal(infer(client, "logits_32", x).as_numpy("logits"), ort_logits(export_dir, x))


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
