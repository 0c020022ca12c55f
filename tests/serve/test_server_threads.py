"""Server threads ↔ runner: Triton (PyTriton) calls model functions from several threads; a
runner with one execution context must never see two calls at once. The server runs in this
process (PyTriton's own use) so its runners can be stand-ins that count overlapping calls, under
200 requests at concurrency 16 on 127.0.0.1 to every model, compared with sequential answers."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from serve_reference import png, zoo_test_images
from server_process import descendants, free_ports, process_tree, stop_leftovers
from stand_in_runner import OverlapDetectingRunner
from tritonclient.utils import InferenceServerException

from deploykit.serve import Pipeline
from deploykit.serve.triton_server import ServerOptions, TritonServer

REQUESTS, CONCURRENCY = 200, 16


def _request(i: int, images: list[np.ndarray]) -> tuple[str, str, np.ndarray]:
    protocol = ("http", "grpc")[i % 2]
    if i % 3 == 0:
        res = (32, 48)[(i // 3) % 2]
        return protocol, f"logits_{res}", np.random.default_rng(i).standard_normal((2, 3, res, res), dtype=np.float32)
    return protocol, "classify", np.array([[png(images[i % len(images)])], [png(images[(i + 1) % len(images)])]], dtype=object)


def _send(clients: dict, request) -> tuple[np.ndarray, ...]:
    protocol, model, x = request
    module = httpclient if protocol == "http" else grpcclient
    tensor = module.InferInput("image" if model == "classify" else "images", list(x.shape), "BYTES" if x.dtype == object else "FP32")
    tensor.set_data_from_numpy(x)
    result = clients[protocol].infer(model, [tensor])
    return tuple(result.as_numpy(n) for n in (("classes", "scores", "resolution") if model == "classify" else ("logits", "scores")))


@pytest.mark.slow
def test_concurrent_requests_never_overlap_on_one_runner(zoo_export_dir):
    runners = []

    def factory(path):
        runners.append(OverlapDetectingRunner(path))
        return runners[-1]

    http_port, grpc_port, metrics_port = free_ports(3)
    options = ServerOptions(
        http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, max_batch_size=8, max_queue_delay_us=2000, top_k=3
    )
    images = [img for size in (48, 30, 64) for img in zoo_test_images(4, size)]
    requests = [_request(i, images) for i in range(REQUESTS)]
    before = set(descendants(os.getpid()))
    with Pipeline(zoo_export_dir, backend="one-context", top_k=3, batch_size=8, factories={"one-context": factory}) as pipeline:
        with TritonServer(pipeline, options):
            started = [p for p in process_tree(os.getpid())[1:] if p[0] not in before]
            clients = {
                "http": httpclient.InferenceServerClient(f"127.0.0.1:{http_port}"),
                "grpc": grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}"),
            }
            sequential = [_send(clients, r) for r in requests]
            local = threading.local()

            def concurrent_send(request):
                if not hasattr(local, "clients"):  # tritonclient's HTTP client is not thread-safe: one per thread
                    local.clients = {
                        "http": httpclient.InferenceServerClient(f"127.0.0.1:{http_port}"),
                        "grpc": grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}"),
                    }
                return _send(local.clients, request)

            with ThreadPoolExecutor(CONCURRENCY) as pool:
                try:
                    concurrent = list(pool.map(concurrent_send, requests))
                except InferenceServerException as err:  # a race on shared buffers surfaces as a failed request, too
                    pytest.fail(f"a request failed under load: {err}")
    stop_leftovers(started)  # tritonserver and its stubs are gone
    assert len(runners) == 2 and sum(r.calls for r in runners) >= REQUESTS
    assert [r.overlaps for r in runners] == [0, 0], "two calls were inside one runner at once"
    for (_, model, _), alone, loaded in zip(requests, sequential, concurrent):
        if model == "classify":
            np.testing.assert_array_equal(loaded[0], alone[0])
            np.testing.assert_array_equal(loaded[2], alone[2])
        for got, want in zip(loaded, alone):  # merged batches may change the last bits
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
