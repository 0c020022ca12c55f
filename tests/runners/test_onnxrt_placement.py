"""Where ONNX Runtime runs each node (defect 7): ``ort-cuda`` refuses compute nodes on the CPU
unless allowed, and says where every node ran. The placement is read from ONNX Runtime's own
profiler, checked here on its CPU provider (no GPU in CI)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from deploykit.errors import DeployKitError
from deploykit.runners.onnxrt import CPU, OnnxrtCudaRunner, Placement, _zero_feed, check_placement, profiled_placement, session_options


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


@pytest.fixture(scope="module")
def range_graph(tmp_path_factory):
    """A graph over a resolution range (``export --resolution-range``): height and width symbolic,
    the range only in the graph's ``deploykit.resolution_range`` metadata, its smallest 32x48."""
    import torch

    from deploykit.export import export
    from deploykit.nn import create_model

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding="rope-mixed", depth=1, num_classes=10).eval()
    out = tmp_path_factory.mktemp("range") / "exp"
    manifest = export(model, [(48, 48)], out, resolution_range=((32, 48), (48, 48), (64, 64)))
    (graph,) = [g for g in manifest.graphs if g.resolution_range is not None]
    return out / graph.file


@pytest.fixture
def cuda_session_on_the_cpu(monkeypatch):
    """ONNX Runtime told it has the CUDA provider, its sessions answering that they use it (they run
    on the CPU): the ort-cuda runner's activation, placement probe included, runs without a GPU."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed: a real CUDA session would be made")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", CPU])
    monkeypatch.setattr(ort.InferenceSession, "get_providers", lambda self: ["CUDAExecutionProvider", CPU])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider':UserWarning")
def test_ort_cuda_probes_a_resolution_range_graph_inside_its_range(range_graph, cuda_session_on_the_cpu):
    """The probe feeds the range's smallest shape: a 1x1 image is outside it, and ONNX Runtime
    refused the graph with its raw multi-line error (issue 42, item 3). The registry reads the range
    from the export's metadata, as every command opens its runners."""
    from deploykit.backends.registry import create_runner

    with create_runner("ort-cuda", range_graph, allow_cpu_fallback=True) as runner:
        placement = runner.info.placement.placement
        assert placement.providers == {CPU: sum(placement.providers.values())} and placement.cpu_compute
        (name,) = runner.input_names()
        assert runner.zero_feed()[name].shape == (1, 3, 32, 48)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider':UserWarning")
def test_an_onnx_runtime_error_in_the_placement_probe_is_one_line(range_graph, cuda_session_on_the_cpu, monkeypatch, capfd):
    from deploykit.runners import onnxrt

    # A feed outside the graph's shapes, so ONNX Runtime itself fails the probe's run.
    monkeypatch.setattr(onnxrt, "_zero_feed", lambda session, low=None: {"images": np.zeros((1, 3, 1, 1), np.float32)})
    runner = OnnxrtCudaRunner(range_graph, allow_cpu_fallback=True)
    with pytest.raises(DeployKitError, match=r"^ort-cuda: ONNX Runtime could not run .*model_32x48-64\.onnx") as err:
        runner.activate()
    assert "\n" not in str(err.value) and not runner.is_active
    assert "onnxruntime" not in capfd.readouterr().err  # ONNX Runtime's own log of the failure is not printed besides
