"""Where ONNX Runtime runs each node (defect 7): ``ort-cuda`` refuses compute nodes on the CPU
unless allowed, and says where every node ran. The placement is read from ONNX Runtime's own
profiler, checked here on its CPU provider (no GPU in CI)."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest

from deploykit.errors import DeployKitError
from deploykit.runtime.onnxrt import CPU, OnnxrtCudaRunner, Placement, _zero_feed, check_placement, profiled_placement, session_options


@pytest.fixture(scope="module")
def placement(good_export, tmp_path_factory) -> tuple[Placement, onnx.ModelProto]:
    (graph,) = sorted(good_export.glob("model_*.onnx"))
    options = session_options()
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path_factory.mktemp("profile") / "p")
    session = ort.InferenceSession(str(graph), sess_options=options, providers=[CPU])
    session.run(None, _zero_feed(session))
    return profiled_placement(session.end_profiling()), onnx.load(str(graph))


def test_every_node_s_provider_is_read_from_the_profile(placement):
    found, model = placement
    assert set(found.providers) == {CPU} and found.providers[CPU] >= len(model.graph.node) // 2  # ORT fuses some nodes
    ops = {entry.rsplit(" (", 1)[1].rstrip(")") for entry in found.cpu_compute}
    assert {"Gemm", "Softmax"} <= ops or {"MatMul", "Softmax"} <= ops  # compute on the CPU is named
    assert "Shape" not in ops  # shape arithmetic (int64) is where ORT puts it on purpose, not a fallback
    assert found.to_dict()["providers"] == found.providers


def test_compute_on_the_cpu_is_refused_unless_allowed(placement):
    found, _ = placement
    with pytest.raises(
        DeployKitError,
        match=rf"^ort-cuda: ONNX Runtime runs {len(found.cpu_compute)} node\(s\) on the CPU, not the GPU: .*--allow-cpu-fallback",
    ) as err:
        check_placement(found, "ort-cuda", allow_cpu_fallback=False)
    assert "\n" not in str(err.value)
    assert check_placement(found, "ort-cuda", allow_cpu_fallback=True).startswith(f"{len(found.cpu_compute)} node(s) ran on the CPU: ")
    assert check_placement(Placement({"CUDAExecutionProvider": 40, CPU: 3}), "ort-cuda", allow_cpu_fallback=False) == ""  # shape nodes only


def test_ort_cuda_refuses_a_session_without_the_cuda_provider(good_export, monkeypatch):
    """A CPU-only onnxruntime told CUDA exists (as a broken CUDA install looks) drops the provider
    silently; ort-cuda says so instead of running on the CPU."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed")
    (graph,) = sorted(good_export.glob("model_*.onnx"))
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", CPU])
    runner = OnnxrtCudaRunner(graph)
    with pytest.raises(DeployKitError, match=r"^ort-cuda: onnxruntime could not use the CUDA provider"):
        runner.activate()
    assert runner.placement is None and not runner.is_active
