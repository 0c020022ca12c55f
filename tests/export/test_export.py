"""Export for every registered encoding: baked tables, lint-clean graphs, dynamic batch."""

import json

import numpy as np
import onnx
import pytest
import torch

from deploykit.encodings import list_encodings
from deploykit.errors import ExportError, ResolutionError
from deploykit.export import export, lint_graph, onnx_from_model
from deploykit.export.manifest import Manifest
from deploykit.inputs.resolutions import parse_resolution
from deploykit.nn import create_model
from deploykit.runners.onnxrt import OnnxrtRunner
from tests.encoding_params import encoding_params

DEPTH = 2


def small(encoding="ape", **kw):
    torch.manual_seed(0)
    return create_model("vit_tiny_patch16", encoding=encoding, depth=DEPTH, img_size=64, num_classes=10, **kw).eval()


@pytest.fixture(scope="module", params=encoding_params())
def exported(request):
    model = small(request.param)
    # a resolution different from the model's native one, non-square
    return model, onnx_from_model(model, (96, 64))


@pytest.mark.slow
def test_graph_is_lint_clean_with_fp32_tables_and_no_resize(exported):
    model, proto = exported
    assert lint_graph(proto) == []
    ops = {n.op_type for n in proto.graph.node}
    assert not ops & {"Resize", "ScatterND", "If", "Loop", "Cos", "Sin"}  # tables are constants
    tables = [t for t in proto.graph.initializer if t.name.startswith("pe_tables.")]
    assert tables and all(t.data_type == onnx.TensorProto.FLOAT for t in tables)


def test_metadata_and_block_outputs(exported):
    model, proto = exported
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["deploykit.resolution"]) == [96, 64]
    assert json.loads(meta["deploykit.encoding_config"])["name"] == meta["deploykit.encoding"]
    assert json.loads(meta["deploykit.model_config"])["depth"] == DEPTH
    blocks = json.loads(meta["deploykit.block_outputs"])
    assert len(blocks) == DEPTH
    produced = {o for n in proto.graph.node for o in n.output}
    assert set(blocks) <= produced


def test_the_graph_holds_no_path_of_the_machine_it_was_exported_on(exported):
    """The exporter writes each node's stack trace, file paths included: two checkouts of the same
    code gave two graphs of the same weights. Module paths still come from the name scopes."""
    from pathlib import Path

    import deploykit
    from deploykit.export.names import module_paths

    _, proto = exported
    text = proto.SerializeToString()
    for package in (deploykit, torch):
        assert str(Path(package.__file__).parent).encode() not in text
    assert "blocks.0.attn.qkv" in module_paths(proto).values()


@pytest.mark.parametrize("batch", [1, 3])
def test_dynamic_batch_matches_torch(exported, batch):
    model, proto = exported
    x = np.random.default_rng(batch).standard_normal((batch, 3, 96, 64), dtype=np.float32)
    with OnnxrtRunner(proto.SerializeToString()) as runner:
        out = runner.infer({"images": x})["logits"]
    with torch.no_grad():
        ref = model.double()(torch.from_numpy(x).double()).numpy()
    model.float()
    assert out.shape == (batch, 10)
    np.testing.assert_allclose(out, ref, atol=1e-4)


# timm's trunk options SigLIP and DeiT use: q/k norms before RoPE, tanh GELU, attention pooling over
# every token (no class token), and DeiT's distillation head averaged with the class token's.
TRUNK_OPTIONS = {
    "siglip_like": dict(encoding="rope-axial", qk_norm=True, act_layer="gelu_tanh", class_token=False, global_pool="map"),
    "distilled": dict(encoding="ape", reg_tokens=1, distilled=True),
}


@pytest.mark.parametrize("options", TRUNK_OPTIONS.values(), ids=TRUNK_OPTIONS)
def test_trunk_options_export_lint_clean_and_match_torch(options):
    model = small(**options)
    with torch.no_grad():
        for p in model.parameters():  # away from init, so that norms, latent and both heads count
            p.add_(0.2 * torch.randn_like(p))
    proto = onnx_from_model(model, (96, 64))
    assert lint_graph(proto) == []
    x = np.random.default_rng(0).standard_normal((2, 3, 96, 64), dtype=np.float32)
    with OnnxrtRunner(proto.SerializeToString()) as runner:
        out = runner.infer({"images": x})["logits"]
    with torch.no_grad():
        ref = model.double()(torch.from_numpy(x).double()).numpy()
    assert out.shape == (2, 10)
    np.testing.assert_allclose(out, ref, atol=1e-4 * np.abs(ref).max())


def test_bad_resolution_raises_before_exporting(tmp_path):
    with pytest.raises(ResolutionError):
        export(small("ape"), [(64, 64), (70, 64)], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_manifest_merges_resolutions_of_the_same_weights(tmp_path):
    model = small("rope-axial")
    export(model, [(64, 64)], tmp_path)
    export(model, [(32, 32)], tmp_path)
    manifest = Manifest.read(tmp_path)
    assert [g.resolution for g in manifest.graphs] == [(32, 32), (64, 64)]
    assert all((tmp_path / g.file).is_file() for g in manifest.graphs)
    export(small("ape"), [(32, 32)], tmp_path)  # other weights: a fresh manifest
    assert [g.resolution for g in Manifest.read(tmp_path).graphs] == [(32, 32)]


@pytest.mark.parametrize("text,expected", [("224", (224, 224)), ("384x256", (384, 256)), (512, (512, 512))])
def test_parse_resolution(text, expected):
    assert parse_resolution(text) == expected


def test_parse_resolution_rejects_garbage():
    with pytest.raises(ExportError, match="invalid resolution"):
        parse_resolution("big")


@pytest.mark.slow
@pytest.mark.parametrize("encoding", list_encodings())
def test_saved_tables_equal_host_float64_tables_rounded_to_fp32(encoding, tmp_path):
    """Load the written ONNX file: every pe_tables.* initializer is fp32 and equals the float64
    host table rounded to fp32, and every host table is in the graph."""
    from onnx import numpy_helper

    from deploykit.export import save_onnx
    from deploykit.export.qk_channels import with_contiguous_qk_channels

    model = small(encoding)
    save_onnx(onnx_from_model(model, (96, 64)), tmp_path / "m.onnx")
    stored = {t.name: t for t in onnx.load(str(tmp_path / "m.onnx")).graph.initializer if t.name.startswith("pe_tables.")}
    with torch.no_grad():  # the tables of the form the graph is built with (q/k channels reordered)
        host = with_contiguous_qk_channels(model)[0].pos_enc.tables(model.grid(96, 64))
    expected = {}
    for key, value in host.model.items():
        expected[key] = value
    for i, layer in enumerate(host.layers):
        for key, value in layer.items():
            shared = all(other[key] is value for other in host.layers)
            expected[key if shared else f"{key}_block{i}"] = value
    assert stored and set(stored) <= {f"pe_tables.{k}" for k in expected}
    for key, value in expected.items():
        assert value.dtype == torch.float64
        if f"pe_tables.{key}" not in stored:  # equal tables are stored once (GeoPE's c1_1 = c2_2)
            assert any(np.array_equal(numpy_helper.to_array(t), value.float().numpy()) for t in stored.values()), key
            continue
        tensor = stored[f"pe_tables.{key}"]
        assert tensor.data_type == onnx.TensorProto.FLOAT
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), value.float().numpy())
