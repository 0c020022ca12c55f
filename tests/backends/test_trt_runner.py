"""Engine runners and the backend registry.

The runners need a CUDA GPU: on machines without one (CI) the GPU tests skip, and what can be
checked without one is: the registry, the fingerprint check before any GPU work, the one-line
refusal, and the batch splitting/padding around a static engine.
"""

import json

import numpy as np
import pytest
import torch

from deploykit.backends import registry
from deploykit.backends.build import build
from deploykit.backends.trt_runner import TrtRunner
from deploykit.errors import ConfigError, DeployKitError
from deploykit.export import export
from deploykit.nn import create_model
from deploykit.profile import backend_names
from deploykit.runners import table
from deploykit.runners.onnxrt import OnnxrtCudaRunner
from deploykit.validation.run import validate

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="engine runners need a CUDA GPU and a CUDA build of torch")


def test_validate_profile_and_build_take_backend_names_from_the_table(stand_in_backend, tmp_path):
    # A backend added to the table once is known to every command; an unknown one is refused by
    # each in the same words, listing the table's.
    made = []
    stand_in_backend("stand-in", lambda path, options: made.append(path) or "runner")
    assert registry.create_runner("stand-in", "model.onnx") == "runner" and made == ["model.onnx"]
    assert backend_names() == ["torch", "ort", "ort-cuda", "openvino", "openvino-bf16", "trt", "rtx", "stand-in"]
    with pytest.raises(DeployKitError, match="not a deploykit export directory"):  # the name passed; the directory did not
        validate(tmp_path, backends=["stand-in"])
    listed = "ort, ort-cuda, openvino, openvino-bf16, trt, rtx, stand-in"
    for refuse in (lambda: registry.create_runner("tpu", "model.onnx"), lambda: validate(tmp_path, backends=["tpu"])):
        with pytest.raises(ConfigError, match=f"unknown backend 'tpu'; choose one of: {listed}$"):
            refuse()
    with pytest.raises(ConfigError, match="unknown backend 'ort'; choose one of: trt, rtx$"):
        build(tmp_path, backend="ort")


def test_available_backends_are_the_ones_that_can_run_here(monkeypatch):
    import onnxruntime

    from deploykit.backends import devices
    from deploykit.backends.devices import Device

    names = registry.available_backends()
    assert names[0] == "ort" and set(names) <= set(table.names((table.GRAPH, table.ENGINE)))
    # Without a GPU (this CI), neither engine runner nor ORT's CUDA provider is offered;
    # openvino-bf16 only on a CPU computing in bf16.
    monkeypatch.setattr(devices, "probe_device", lambda ordinal=0: Device())
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    monkeypatch.setattr(registry, "best_hint", lambda: "f32")
    assert registry.available_backends() == ["ort", "openvino"]
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert registry.available_backends() == ["ort", "ort-cuda", "openvino"]
    # An H100: TensorRT runs there, TensorRT-RTX does not (its package is installed here).
    monkeypatch.setattr(devices, "probe_device", lambda ordinal=0: Device("12.8", "570.1", "NVIDIA H100", "9.0"))
    assert "rtx" not in registry.available_backends()
    monkeypatch.setattr(devices, "probe_device", lambda ordinal=0: Device("12.8", "570.1", "NVIDIA RTX 4090", "8.9"))
    assert "rtx" in registry.available_backends()


class _Echo(TrtRunner):
    """A runner whose "engine" echoes its input, to check batch handling without a GPU."""

    def __init__(self, batch_range):
        super().__init__(b"", module="tensorrt_rtx")
        self.calls = []
        self._range = batch_range

    def _activate(self):
        lo, hi = self._range
        profile = ((lo, 3, 2, 2), (lo, 3, 2, 2), (hi, 3, 2, 2))
        self._state = {"batch_range": self._range, "inputs": ["images"], "profiles": [profile], "profile": 0}

    def _run(self, feed):
        self.calls.append(len(feed["images"]))
        return {"logits": feed["images"].reshape(len(feed["images"]), -1) * 2}


@pytest.mark.parametrize("batch_range, calls", [((4, 4), [4, 4, 4]), ((1, 8), [8, 2]), ((1, 16), [10])])
def test_batches_are_split_and_padded_to_the_profile(batch_range, calls):
    images = np.random.default_rng(0).standard_normal((10, 3, 2, 2)).astype(np.float32)
    with _Echo(batch_range) as runner:
        out = runner.infer({"images": images})["logits"]
    assert runner.calls == calls
    np.testing.assert_array_equal(out, images.reshape(10, -1) * 2)


def test_ort_cuda_refuses_cpu_only_onnxruntime(tmp_path):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed")
    with pytest.raises(DeployKitError, match=r"deploykit\[gpu\]"):
        OnnxrtCudaRunner(b"").activate()


@pytest.fixture(scope="module")
def rtx_dir(tmp_path_factory):
    from deploykit.backends.build import build

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("runner")
    export(
        create_model("vit_tiny_patch16", encoding="rope-axial", depth=1, img_size=32, num_classes=10),
        [(32, 32)],
        out,
        precisions=["fp32", "fp16"],
    )
    build(out, "rtx", dynamic=True, max_batch=4, optimization_level=0)
    return out


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without a GPU")
def test_validate_rtx_without_gpu_is_one_line_error(rtx_dir):
    with pytest.raises(DeployKitError, match="rtx runner needs a CUDA GPU") as err:
        validate(rtx_dir, backends=["rtx"], num_random=1, num_real=1)
    assert "\n" not in str(err.value)


def test_engine_runners_say_what_is_missing_in_order(rtx_dir, tmp_path, monkeypatch):
    """An engine not built is said first (on any machine it has to be built); then the device,
    before anything is read or loaded; then a stale fingerprint."""
    import shutil

    from deploykit.backends import trt_runner
    from deploykit.backends.devices import Device

    out = shutil.copytree(rtx_dir, tmp_path / "x")
    fp_path = out / "model_32.rtx.json"
    record = json.loads(fp_path.read_text())
    record["fingerprint"]["encoding"] = json.dumps({"name": "ape"})
    fp_path.write_text(json.dumps(record))
    with pytest.raises(DeployKitError, match="no trt engine for model_32.onnx; run: deploykit build"):
        validate(out, backends=["trt"], num_random=1, num_real=1)
    monkeypatch.setattr(trt_runner, "probe_device", lambda index=0: Device())  # no GPU
    with pytest.raises(DeployKitError, match=r"^the rtx runner needs a CUDA GPU"):
        validate(out, backends=["rtx"], num_random=1, num_real=1)
    monkeypatch.setattr(trt_runner, "probe_device", lambda index=0: Device("12.8", "570.1", "NVIDIA A100", "8.0"))
    with pytest.raises(DeployKitError, match=r"^NVIDIA A100 \(compute capability 8.0\) is not supported by rtx .*use --backend trt$"):
        validate(out, backends=["rtx"], num_random=1, num_real=1)
    monkeypatch.setattr(trt_runner, "probe_device", lambda index=0: Device("12.8", "570.1", "NVIDIA RTX 4090", "8.9"))
    with pytest.raises(DeployKitError, match=r"model_32.rtx.engine does not match: encoding \(built"):
        validate(out, backends=["rtx"], num_random=1, num_real=1)


@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_rtx_engine_matches_reference_on_gpu(rtx_dir, precision):
    report = validate(rtx_dir, backends=["rtx"], precision=precision, num_random=4, num_real=4)
    assert bool(report), report.to_json()


@needs_gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_tensorrt_engine_matches_onnxruntime(tmp_path, cuda_graph):
    pytest.importorskip("tensorrt", reason="TensorRT not installed (pip install 'deploykit[trt]')")
    import sys

    if "polygraphy.backend.trt" in sys.modules and sys.modules["polygraphy.config"].USE_TENSORRT_RTX:
        pytest.skip(
            "Polygraphy runs one TensorRT flavour per process and is on TensorRT-RTX here; run this test "
            "alone (benchmarks/gpu_acceptance.py runs each flavour in its own process)"
        )
    from deploykit.backends.build import build
    from deploykit.backends.trt_runner import engine_runner
    from deploykit.runners.onnxrt import OnnxrtRunner

    torch.manual_seed(0)
    export(create_model("vit_tiny_patch16", encoding="rope-mixed", depth=2, img_size=32, num_classes=10), [(32, 32)], tmp_path)
    build(tmp_path, "trt", dynamic=True, batch=2, max_batch=4)
    images = np.random.default_rng(0).standard_normal((6, 3, 32, 32)).astype(np.float32)
    with engine_runner(tmp_path / "model_32.onnx", "tensorrt", cuda_graph=cuda_graph) as runner:
        first = runner.infer({"images": images})["logits"]
        again = runner.infer({"images": images})["logits"]  # replays the captured graphs
    with OnnxrtRunner(tmp_path / "model_32.onnx", providers=["CPUExecutionProvider"]) as ort_runner:
        expected = ort_runner.infer({"images": images})["logits"]
    np.testing.assert_allclose(first, expected, atol=1e-3)
    np.testing.assert_array_equal(first, again)


@pytest.mark.parametrize("verbosity", ["layer names only", "detailed"])
def test_an_engine_runner_lists_its_layers_as_the_inspector_names_them(verbosity):
    # The inspector's JSON lists each layer as its name, or (detailed verbosity) as a dict with "Name";
    # deserialising a real engine needs a GPU, so the engine and its inspector are TensorRT-RTX's own classes, specced.
    from unittest.mock import create_autospec

    import tensorrt_rtx as rtx

    names = ["node_MatMul_205 + node_linear_10", "{ForeignNode[node_Mul_26...node_add_251]}"]
    inspector = create_autospec(rtx.EngineInspector, instance=True)
    layers = names if verbosity == "layer names only" else [{"Name": n, "LayerType": "Myelin"} for n in names]
    inspector.get_engine_information.return_value = json.dumps({"Layers": layers, "Bindings": ["images", "logits"]})
    engine = create_autospec(rtx.ICudaEngine, instance=True)
    engine.create_engine_inspector.return_value = inspector
    runner = TrtRunner(b"", module="tensorrt_rtx")
    assert runner.layer_names() == []  # not active: no engine
    runner._state = {"engine": engine}
    assert runner.layer_names() == names
    inspector.get_engine_information.assert_called_once_with(rtx.LayerInformationFormat.JSON)
