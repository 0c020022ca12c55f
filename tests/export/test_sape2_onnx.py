"""SaPE² in ONNX: one ``deploykit::SaPE2Bias`` node per block, defined by a plain-ONNX function
that ONNX Runtime runs and TensorRT-RTX parses (as is, and inlined)."""

import json

import numpy as np
import onnx
import onnx.inliner
import pytest
import torch

from deploykit.encodings.sape2 import MODES, sape2_bias_reference
from deploykit.export import onnx_from_model
from deploykit.export.custom_ops import CUSTOM_TRANSLATIONS, attach_functions
from deploykit.nn import create_model
from deploykit.runners.onnxrt import OnnxrtRunner

F64 = torch.float64


class _BiasOnly(torch.nn.Module):
    """Just the op, so the function body is compared with the float64 reference on its own."""

    def __init__(self, grid, prefix, scale, mode):
        super().__init__()
        self.attrs = (*grid, prefix, scale, mode)

    def forward(self, q, k, table_x, table_y):
        return torch.ops.deploykit.sape2_bias(q, k, table_x, table_y, *self.attrs)


def _bias_graph(grid, prefix, scale, mode, example):
    with torch.no_grad():
        program = torch.onnx.export(
            _BiasOnly(grid, prefix, scale, mode).eval(),
            example,
            dynamo=True,
            opset_version=18,
            input_names=["q", "k", "table_x", "table_y"],
            output_names=["bias"],
            custom_translation_table=CUSTOM_TRANSLATIONS,
        )
    proto = program.model_proto
    attach_functions(proto)
    onnx.checker.check_model(proto, full_check=True)
    return proto


@pytest.mark.parametrize("mode", range(len(MODES)))
def test_function_body_matches_float64_reference(mode):
    g = torch.Generator().manual_seed(mode)
    grid, prefix, M = (3, 5), 2, 4  # non-square, prefix tokens, M < W so positions clamp
    q, k = (torch.randn(2, 3, prefix + 15, 8, generator=g, dtype=F64) for _ in range(2))
    ex, ey = (torch.randn(8, M, generator=g, dtype=F64) for _ in range(2))
    proto = _bias_graph(grid, prefix, 0.4, mode, tuple(t.float() for t in (q, k, ex, ey)))
    nodes = [n for n in proto.graph.node if n.domain == "deploykit"]
    assert [n.op_type for n in nodes] == ["SaPE2Bias"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs == {"grid_h": 3, "grid_w": 5, "num_prefix_tokens": 2, "scale": pytest.approx(0.4), "mode": mode}
    functions = {(f.domain, f.name): f for f in proto.functions}
    assert sorted(functions) == [("deploykit", "SaPE2AxisSignatures"), ("deploykit", "SaPE2Bias")]
    # plain ONNX only (TensorRT's parser loses attribute references through nested functions);
    # the bias's body begins with the signature stage TensorRT's plugin form keeps
    signatures, bias = functions["deploykit", "SaPE2AxisSignatures"].node, functions["deploykit", "SaPE2Bias"].node
    assert {n.domain for n in (*signatures, *bias)} <= {""}
    assert [n.op_type for n in bias[: len(signatures)]] == [n.op_type for n in signatures]
    feeds = {"q": q.float().numpy(), "k": k.float().numpy(), "table_x": ex.float().numpy(), "table_y": ey.float().numpy()}
    with OnnxrtRunner(proto.SerializeToString()) as runner:
        out = runner.infer(feeds)["bias"]
    ref = sape2_bias_reference(*(t.float().double() for t in (q, k, ex, ey)), grid, 0.4, MODES[mode], prefix).numpy()
    np.testing.assert_allclose(out, ref, atol=2e-6 * np.abs(ref).max(), rtol=0)
    assert (out[..., :prefix, :] == 0).all() and (out[..., :, :prefix] == 0).all()
    assert (np.diagonal(out, axis1=-2, axis2=-1) == 0).all()  # exactly 0, as Eq. 15


def test_function_computes_half_inputs_in_fp32():
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(1, 2, 1 + 24, 8, generator=g).half() for _ in range(2))
    ex, ey = (torch.randn(8, 5, generator=g).half() for _ in range(2))
    proto = _bias_graph((4, 6), 1, 0.35, 1, (q, k, ex, ey))
    feeds = {"q": q.numpy(), "k": k.numpy(), "table_x": ex.numpy(), "table_y": ey.numpy()}
    with OnnxrtRunner(proto.SerializeToString()) as runner:
        out = runner.infer(feeds)["bias"]
    assert out.dtype == np.float16
    ref = sape2_bias_reference(*(t.double() for t in (q, k, ex, ey)), (4, 6), 0.35, "k", 1).numpy()
    # fp32 inside: only the final rounding to fp16 (≤ 2⁻¹¹ relative) plus fp32 noise; an fp16
    # cumsum would be off by up to 0.005 in the positions alone (spec §8.7).
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=2**-11, atol=1e-5 * np.abs(ref).max())


def _model(name, encoding="sape2", **kw):
    torch.manual_seed(0)
    model = create_model(name, encoding=encoding, num_classes=10, **kw).eval()
    with torch.no_grad():  # std-1 tables: a bias of tens, not the init's ~0.1
        for p in model.pos_enc.blocks.parameters():
            p.normal_()
    return model


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,encoding,resolution,depth",
    [
        ("vit_tiny_patch16", "sape2", 224, 2),
        ("vit_tiny_patch16", "sape2+ape", 384, 1),
        ("vit_small_patch4_32", "sape2+ape", 32, 2),  # the paper's CIFAR setting (8×8 grid, M = 9)
    ],
)
def test_exported_model_matches_pytorch_fp32(name, encoding, resolution, depth):
    model = _model(name, encoding, depth=depth)
    proto = onnx_from_model(model, (resolution, resolution))
    grid = resolution // model.cfg.patch_size
    nodes = [n for n in proto.graph.node if n.domain == "deploykit"]
    assert len(nodes) == depth and all(n.op_type == "SaPE2Bias" for n in nodes)
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["grid_h"], attrs["grid_w"], attrs["num_prefix_tokens"], attrs["mode"]) == (grid, grid, 1, MODES.index("k"))
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["deploykit.encoding_config"])["bias_divided_by_sqrt_d"] is True
    x = np.random.default_rng(resolution).standard_normal((2, 3, resolution, resolution), dtype=np.float32)
    with OnnxrtRunner(proto.SerializeToString()) as runner:
        out = runner.infer({"images": x})["logits"]
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    assert np.abs(out - ref).max() <= 1e-4
    cosine = (out * ref).sum(-1) / np.linalg.norm(out, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cosine.min() >= 0.99999


def test_inlined_graph_parses_and_builds_in_tensorrt_rtx():
    from deploykit.backends.tensorrt import BuildOptions, EngineFromOnnx

    proto = onnx_from_model(_model("vit_tiny_patch16", depth=1, img_size=64), (96, 64))
    inlined = onnx.inliner.inline_local_functions(proto)  # what TensorRT does without the plugin
    assert not inlined.functions and not any(n.domain == "deploykit" for n in inlined.graph.node)
    engine = EngineFromOnnx(inlined.SerializeToString(), BuildOptions(module="tensorrt_rtx", max_batch=2))()
    assert isinstance(engine, bytes) and len(engine) > 1000


@pytest.mark.slow
def test_cli_export_then_validate(tmp_path, capsys):
    from deploykit.cli import main

    out = tmp_path / "sape2"
    main(["export", "-e", "sape2", "-r", "96x64", "-o", str(out)])
    main(["validate", str(out), "--num-real", "2", "--num-random", "2", "--report", str(tmp_path / "report.json")])
    records = json.loads((tmp_path / "report.json").read_text())
    assert len(records) == 1 and all(r["passed"] for r in records)
