"""Run by ``test_ray_serve.py`` in its own process: a two-node Ray cluster on 127.0.0.1, the
deploykit app with one replica per node, a burst of requests; prints one JSON line with what
happened. A separate process keeps Ray's process-wide state (signal handlers, atexit hooks,
the global worker) out of the pytest process.

Usage: python ray_two_nodes.py EXPORT_DIR REQUESTS
"""

from __future__ import annotations

import io
import json
import os
import socket
import sys
import urllib.error
import urllib.request

import numpy as np
import ray
from ray import serve
from ray.cluster_utils import Cluster
from server_process import free_ports, listening_addresses, process_tree

from deploykit.inputs.builtin import sample_images
from deploykit.serve.ray_serve import RayOptions, build_app


def main(export_dir: str, requests: int) -> dict:
    # One "replica_slot" per node: one replica lands on each node, whatever the scheduler prefers.
    node = dict(num_cpus=1, resources={"replica_slot": 1}, node_ip_address="127.0.0.1")
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        options = RayOptions(
            num_replicas=2,
            max_batch_size=4,
            batch_wait_timeout_s=0.05,
            backend="ort",
            top_k=3,
            ray_actor_options={"num_cpus": 0, "resources": {"replica_slot": 1}},
        )
        (port,) = free_ports(1)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        handle = serve.run(build_app(export_dir, options), name="deploykit", route_prefix="/")
        _wait_for_route(port)
        astronaut, chelsea = sample_images(2)
        images = [astronaut, np.ascontiguousarray(chelsea[:32, :32])]
        pending = [handle.classify.remote(images[i % 2]) for i in range(requests)]
        results, errors = [], []
        for response in pending:
            try:
                results.append(response.result(timeout_s=120))
            except Exception as err:  # reported, then asserted on by the test
                errors.append(repr(err))
        http = [_post(port, _png(images[1])), _post(port, b"not an image")]
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        # while everything runs: what the cluster listens on, and which processes it has
        listening = sorted(list(a) for a in listening_addresses(os.getpid()))
        tree = [list(p) for p in process_tree(os.getpid())[1:]]
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    interfaces = sorted(name for _, name in socket.if_nameindex())  # of this network namespace
    return dict(results=results, errors=errors, nodes=nodes, listening=listening, tree=tree, interfaces=interfaces, http=http)


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _wait_for_route(port: int, bound_s: float = 300) -> None:
    """Poll the Serve proxy's route table until it serves ``/``: serve.run returns when the
    replicas run, and the proxy learns the route after that (seconds on a busy machine). The bound
    is a guard against a proxy that never starts, not a timing."""
    import time

    deadline = time.monotonic() + bound_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/routes", timeout=30) as response:
                if "/" in json.loads(response.read()):
                    return
        except (OSError, ValueError):  # not listening yet, or not answering JSON yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray Serve's proxy on port {port} did not route / within {bound_s:.0f} s")
        time.sleep(0.5)


def _post(port: int, body: bytes) -> list:
    """``[status, JSON body]`` of ``POST /`` on the Serve proxy."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return [response.status, json.loads(response.read())]
    except urllib.error.HTTPError as err:
        return [err.code, json.loads(err.read())]


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))), flush=True)
