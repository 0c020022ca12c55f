"""TensorRT-RTX's ONNX parser and builder (CPU-capable) accept every graph deploykit exports."""

import pytest

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx not installed (pip install 'deploykit[rtx]')")

import torch  # noqa: E402

from deploykit.backends.tensorrt import BuildOptions, EngineFromOnnx  # noqa: E402
from deploykit.encodings import list_encodings  # noqa: E402
from deploykit.export import onnx_from_model  # noqa: E402
from deploykit.nn import create_model  # noqa: E402


@pytest.mark.parametrize("encoding", list_encodings())
def test_rtx_builds_exported_graph(encoding):
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding=encoding, depth=2, img_size=64, num_classes=10)
    proto = onnx_from_model(model, (96, 64))
    engine = EngineFromOnnx(proto.SerializeToString(), BuildOptions(module="tensorrt_rtx", max_batch=4))()
    assert isinstance(engine, bytes) and len(engine) > 1000
