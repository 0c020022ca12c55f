"""Export reorders q/k head channels so rotary pairs and GeoPE triplets are contiguous slices:
the same function (float64: equal to rounding), the caller's model untouched, and graphs without
strided slices or channel gathers."""

import json

import numpy as np
import pytest
import torch
from onnx import numpy_helper

from deploykit.encodings import get_config, list_encodings
from deploykit.export import onnx_from_model
from deploykit.export.qk_channels import with_contiguous_qk_channels
from deploykit.nn import create_model

QK_ENCODINGS = ["rope-axial", "rope-mixed", "gridpe", "geope"]


def small(encoding):
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding=encoding, depth=2, img_size=64, num_classes=10, reg_tokens=2).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # far from init, so every channel matters
    return model


# timm's conventions (deploykit import timm): DINOv3's centred coordinates in turns, RoPE-ViT + APE.
TIMM_FORMS = [
    get_config("rope-axial", coords="centered", axis_order="yx", angle_scale=6.283185307179586),
    get_config("rope-mixed", axis_order="yx", ape=True, no_embed_class=True),
]


@pytest.mark.parametrize("encoding", QK_ENCODINGS + TIMM_FORMS)
def test_reordered_model_computes_the_same_function(encoding):
    model = small(encoding).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reordered, order = with_contiguous_qk_channels(model)
    assert reordered is not model and reordered.pos_enc.contiguous_qk_form() is None
    assert torch.equal(order, model.pos_enc.contiguous_qk_form().order)
    x = torch.randn(2, 3, 96, 64, dtype=torch.float64)
    with torch.no_grad():
        ref, out = model(x), reordered(x)
    assert ref.abs().max() > 1  # a real signal
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    # the caller's model is unchanged, and only the q/k rows of qkv moved
    assert model.pos_enc.contiguous_qk_form() is not None
    after = reordered.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
        if key.endswith("qkv.weight") or key.endswith("qkv.bias"):
            heads = model.cfg.num_heads
            q_k_v = value.view(3, heads, -1, *value.shape[1:])
            moved = after[key].view(3, heads, -1, *value.shape[1:])
            assert torch.equal(moved[2], q_k_v[2]) and not torch.equal(moved[:2], q_k_v[:2]), key
        elif key in after:
            assert torch.equal(after[key], value), key


@pytest.mark.parametrize("encoding", ["rope-axial", "geope"])
def test_qk_norms_follow_the_reordered_channels(encoding):
    """timm's qk_norm normalises a head before the rotation: its weights move with the channels."""
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding=encoding, depth=2, img_size=64, num_classes=10, qk_norm=True).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    reordered, order = with_contiguous_qk_channels(model)
    assert order is not None
    x = torch.randn(2, 3, 64, 96, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(reordered(x), model(x), atol=1e-12, rtol=0)
        assert torch.equal(reordered.blocks[0].attn.q_norm.weight, model.blocks[0].attn.q_norm.weight[order])


@pytest.mark.parametrize("encoding", sorted(set(list_encodings()) - set(QK_ENCODINGS)))
def test_encodings_without_channel_mixing_export_the_model_as_is(encoding):
    model = small(encoding)
    reordered, order = with_contiguous_qk_channels(model)
    assert reordered is model and order is None
    if encoding == "ape":  # one export is enough to see the order is not recorded
        meta = {p.key for p in onnx_from_model(model, (64, 64)).metadata_props}
        assert "deploykit.qk_channel_order" not in meta and "deploykit.encoding" in meta


def _constant(proto, name):
    for t in proto.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in proto.graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            return numpy_helper.to_array(n.attribute[0].t)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("encoding", QK_ENCODINGS)
def test_graph_reads_channels_as_contiguous_slices(encoding):
    model = small(encoding)
    proto = onnx_from_model(model, (96, 64))
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["deploykit.qk_channel_order"]) == model.pos_enc.contiguous_qk_form().order.tolist()
    steps = [_constant(proto, n.input[4]) for n in proto.graph.node if n.op_type == "Slice" and len(n.input) > 4]
    assert all(s is not None and np.all(s == 1) for s in steps)  # no every-other-channel slice
    gathers = [_constant(proto, n.input[1]) for n in proto.graph.node if n.op_type == "Gather"]
    assert [g.size for g in gathers] == [1]  # only the class token is picked; no channel gather


def test_sequence_models_export_as_is():
    from deploykit.nn.sequence import create_sequence_model

    model = create_sequence_model("seq_tiny_ega")
    reordered, order = with_contiguous_qk_channels(model)
    assert reordered is model and order is None
