"""1-D MoPE + EGA: sequence length plays the role of resolution for export, validate and build."""

import json

import numpy as np
import onnx
import pytest
import torch

from deploykit.export import export
from deploykit.nn import create_model
from deploykit.runners.onnxrt import OnnxrtRunner
from deploykit.validation.run import validate

LENGTHS = [(128,), (256,), (1024,)]  # the lengths (the paper trains at 256)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The paper's char model (EGA-MORLET) cut to 2 blocks, exported at every length."""
    torch.manual_seed(0)
    model = create_model("char_gpt_ega", depth=2).eval()
    out = tmp_path_factory.mktemp("seq")
    manifest = export(model, LENGTHS, out)
    return model, out, manifest


@pytest.mark.slow
def test_one_graph_per_length_with_token_input(exported):
    model, out, manifest = exported
    assert [tuple(g.resolution) for g in manifest.graphs] == LENGTHS
    for entry in manifest.graphs:
        proto = onnx.load(str(out / entry.file))
        (inp,) = proto.graph.input
        assert inp.name == "tokens" and inp.type.tensor_type.elem_type == onnx.TensorProto.INT64
        dims = [d.dim_value or d.dim_param for d in inp.type.tensor_type.shape.dim]
        assert dims[1] == entry.resolution[0] and isinstance(dims[0], str)  # batch dynamic, length static
        meta = {p.key: p.value for p in proto.metadata_props}
        assert json.loads(meta["deploykit.resolution"]) == list(entry.resolution)
        assert len(json.loads(meta["deploykit.block_outputs"])) == 2  # bisection works for sequences too
        # The MoPE table and the causal mask are fp32 constants, never computed in the graph.
        tables = {i.name: i for i in proto.graph.initializer if i.name.startswith("pe_tables.")}
        assert set(tables) == {"pe_tables.pos_embed", "pe_tables.causal_mask"}
        assert all(t.data_type == onnx.TensorProto.FLOAT for t in tables.values())
        assert not {"Cos", "Sin", "Exp", "Trilu"} & {n.op_type for n in proto.graph.node}


def test_validate_passes_at_every_length(exported):
    _, out, _ = exported
    report = validate(out, num_random=2, num_real=2)
    assert report and len(report.records) == len(LENGTHS)
    for record in report.records:
        assert record.max_abs <= 1e-4 and record.top1_agreement == 1.0


def test_baked_table_is_the_float64_table_rounded_to_fp32(exported):
    model, out, manifest = exported
    proto = onnx.load(str(out / manifest.graph((256,)).file))
    table = next(i for i in proto.graph.initializer if i.name == "pe_tables.pos_embed")
    expected = model.shape_tables((256,)).model["pos_embed"].detach().float().numpy()
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(table), expected)


def test_exported_graph_runs_any_batch(exported):
    model, out, manifest = exported
    tokens = np.random.default_rng(1).integers(0, 65, (3, 128), dtype=np.int64)
    with OnnxrtRunner(out / manifest.graph((128,)).file) as runner:
        logits = runner.infer({"tokens": tokens})["logits"]
    with torch.no_grad():
        expected = model(torch.from_numpy(tokens)).numpy()
    assert logits.shape == (3, 128, 65)
    np.testing.assert_allclose(logits, expected, atol=2e-5, rtol=0)


def test_rtx_builds_sequence_graph(exported):
    from deploykit.backends.tensorrt import BuildOptions, EngineFromOnnx

    _, out, manifest = exported
    for entry in manifest.graphs:
        engine = EngineFromOnnx((out / entry.file).read_bytes(), BuildOptions(module="tensorrt_rtx", max_batch=4))()
        assert isinstance(engine, bytes) and len(engine) > 1000
