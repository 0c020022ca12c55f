"""Ray Serve on a two-node local cluster (127.0.0.1): every request succeeds, answers equal a
direct ONNX Runtime run, replicas on both nodes did the work, and nothing is left running.

The cluster runs in a child process (``ray_two_nodes.py``), inside a network namespace of its
own whose only interface is ``lo`` when ``unshare`` is allowed (root, as on CI): Ray Serve
2.60 replicas bind their inter-deployment gRPC server to ``[::]:0`` with no option to change
it (``ray/serve/_private/replica.py``), so only the namespace keeps that socket on loopback.
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is Ray's switch for single-machine clusters: without
it Ray "resolves" 127.0.0.1 to the machine's outward address when a driver connects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serve_reference import ort_logits, preprocessed, softmax_top_k
from server_process import stop_leftovers

from deploykit.inputs.builtin import sample_images
from deploykit.serve.ray_serve import PROXY_CHECK_TIMEOUT_S, PROXY_CHECK_TIMEOUTS, serve_ray

REQUESTS = 48
HERE = Path(__file__).parent
GUARD_S = 1200  # against a hang only: beside two busy loops on 2 cores the two-node run took 4 minutes


def _ray_env(**extra: str) -> dict[str, str]:
    """The scripts' environment: this checkout importable, and Ray Serve's proxy readiness and
    health checks given a generous bound instead of Ray's 5 and 10 seconds, which a busy 2-core
    machine misses (the controller then kills the proxy it is starting). Ray's processes inherit it."""
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent)]),
        **dict.fromkeys(PROXY_CHECK_TIMEOUTS, str(PROXY_CHECK_TIMEOUT_S)),
        **extra,
    )


class _StopAtInit(Exception):
    pass


def test_a_local_cluster_gives_the_serve_proxy_a_generous_readiness_bound(monkeypatch, export_dir):
    """``serve --ray`` without an address starts a local cluster whose processes inherit the
    environment at ``ray.init``: the proxy bounds are set there, and a user's own setting wins."""
    import ray

    seen = []

    def init(*args, **kwargs):
        seen.append({key: os.environ.get(key) for key in PROXY_CHECK_TIMEOUTS})
        raise _StopAtInit

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv(PROXY_CHECK_TIMEOUTS[0], raising=False)
    monkeypatch.setenv(PROXY_CHECK_TIMEOUTS[1], "7")
    with pytest.raises(_StopAtInit):
        serve_ray(export_dir)
    assert seen == [{PROXY_CHECK_TIMEOUTS[0]: str(PROXY_CHECK_TIMEOUT_S), PROXY_CHECK_TIMEOUTS[1]: "7"}]
    monkeypatch.delenv(PROXY_CHECK_TIMEOUTS[0])
    with pytest.raises(_StopAtInit):  # a cluster of the user's: its processes are already running
        serve_ray(export_dir, address="ray://example:10001")
    assert seen[-1][PROXY_CHECK_TIMEOUTS[0]] is None


def test_a_sequence_models_export_is_refused_in_one_line_before_ray_starts(monkeypatch, tmp_path):
    """The replicas would each refuse it inside Ray's logs, and the user would see a Ray traceback."""
    import ray

    from deploykit.errors import ConfigError
    from deploykit.export import export
    from deploykit.nn import create_model

    export(create_model("seq_tiny_ega", depth=1).eval(), [(8,)], tmp_path / "seq")
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    with pytest.raises(ConfigError, match="holds a sequence model; serving takes image classifiers") as err:
        serve_ray(tmp_path / "seq")
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_two_node_cluster_spreads_requests_over_both_nodes(export_dir):
    env = _ray_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    command = [sys.executable, str(HERE / "ray_two_nodes.py"), str(export_dir), str(REQUESTS)]
    isolated = _can_isolate_network()
    if isolated:
        command = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL)
    try:  # a guard against a hung cluster, not a timing: two nodes on a busy 2-core machine take minutes
        out, err = proc.communicate(timeout=GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the two-node script did not finish within {GUARD_S} s; its stderr ends: {err[-2000:]}")
    assert proc.returncode == 0, err[-4000:]
    report = json.loads(out.strip().splitlines()[-1])
    stop_leftovers([tuple(p) for p in report["tree"]])  # every Ray process is gone (fails the test otherwise)

    assert report["errors"] == []
    results = report["results"]
    assert len(results) == REQUESTS
    assert len(report["nodes"]) == 2
    assert {r["node_id"] for r in results} == set(report["nodes"]), "requests did not reach replicas on both nodes"
    assert len({r["replica"] for r in results}) == 2
    assert max(r["batch_size"] for r in results) > 1, "no replica ever merged requests"
    assert report["listening"], "found no listening socket: the check would prove nothing"
    if isolated:
        assert report["interfaces"] == ["lo"], report["interfaces"]  # so every socket is loopback-only
    else:  # everything but Ray Serve's hard-wired [::]:0 replica servers
        assert {ip for ip, _ in report["listening"]} <= {"127.0.0.1", "::ffff:127.0.0.1", "::"}, report["listening"]

    astronaut, chelsea = sample_images(2)
    images = [astronaut, np.ascontiguousarray(chelsea[:32, :32])]
    (ok_status, ok_body), (bad_status, bad_body) = report["http"]
    assert ok_status == 200 and ok_body["classes"] == results[1]["classes"]  # PNG is lossless: same pixels
    assert bad_status == 400 and "cannot decode" in bad_body["error"]
    for i, result in enumerate(results):
        res = (48, 48) if i % 2 == 0 else (32, 32)
        top = softmax_top_k(ort_logits(export_dir, preprocessed(export_dir, images[i % 2], res)[None]), 3)[0]
        assert result["resolution"] == list(res)
        assert result["classes"] == [c for c, _ in top]
        np.testing.assert_allclose(result["scores"], [p for _, p in top], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_a_replica_keeps_receiving_requests_while_its_pipeline_computes(export_dir):
    """The pipeline runs in a worker thread: while one batch computes, the replica's event loop
    receives the next request (``ray_event_loop.py`` holds the first call until one arrives)."""
    command = [sys.executable, str(HERE / "ray_event_loop.py"), str(export_dir)]
    if _can_isolate_network():
        command = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]
    proc = subprocess.run(command, capture_output=True, text=True, env=_ray_env(), stdin=subprocess.DEVNULL, timeout=GUARD_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["first_call"] == {"received_during_call": True}, "the replica's event loop was blocked by the pipeline"
    assert report["answers"] == report["received"] >= 2
    top = softmax_top_k(ort_logits(export_dir, preprocessed(export_dir, np.zeros((32, 32, 3), np.uint8), (32, 32))[None]), 3)[0]
    assert report["classes"][0] == [c for c, _ in top]


def _can_isolate_network() -> bool:
    """Whether this machine lets us run a command in a new network namespace with ``lo`` up."""
    try:
        probe = subprocess.run(["unshare", "--net", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0
