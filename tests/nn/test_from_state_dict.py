"""``deploykit import vit``: how a model trained elsewhere with an encoding that has no public
training code (SaPE², GeoPE) comes in: a state dict in timm's ViT/DeiT-III names plus the
encoding's parameters, read for every size it holds, the rest from ``--model``, ``--encoding`` and
``--set``; a file that is not such a state dict is refused naming its first key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from deploykit.cli.importers import get_importer
from deploykit.encodings import get_config
from deploykit.errors import CheckpointError, ConfigError
from deploykit.nn import create_model

VIT = get_importer("vit")


def trained(encoding, seed: int, **sizes):
    """A DeiT-III-shaped model (LayerScale) with every weight drawn, as if trained elsewhere."""
    torch.manual_seed(seed)
    model = create_model("vit_tiny_patch16", encoding=encoding, init_values=1e-5, **sizes).eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn_like(tensor) * 0.2)
    return model


def deit_checkpoint(path: Path, model) -> Path:
    """As DeiT's main.py saves: the weights under ``model``, the EMA copy, the script's Namespace."""
    state = model.state_dict()
    torch.save({"model": state, "model_ema": state, "epoch": 3, "args": argparse.Namespace(model="deit_tiny_sape2", input_size=32)}, path)
    return path


def outputs(model, *shapes):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return [model(torch.randn(2, 3, *shape, generator=g)) for shape in shapes]


def test_a_sape2_deit_comes_in_with_its_options_and_the_table_size_its_weights_hold(tmp_path):
    sape2 = get_config("sape2", mode="k", npos_max=9)
    original = trained(sape2, 0, depth=2, img_size=32, num_classes=7, patch_size=8)
    path = deit_checkpoint(tmp_path / "best_checkpoint.pth", original)
    imported = VIT.convert(path, options=("mode=k",), model="vit_tiny_patch16", encoding="sape2", img_size=32)
    model = imported.model
    assert model.cfg.encoding == sape2 and (model.cfg.depth, model.cfg.patch_size, model.cfg.num_classes) == (2, 8, 7)
    assert imported.read == {"depth": 2, "embed_dim": 192, "num_classes": 7}
    assert imported.assumed == {"num_heads": 3, "encoding": "sape2", "img_size": 32}
    for got, expected in zip(outputs(model, (32, 32), (48, 40)), outputs(original, (32, 32), (48, 40))):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # Control: the option matters; the paper's code default (mode q) computes something else.
    other = VIT.convert(path, options=("mode=q",), model="vit_tiny_patch16", encoding="sape2", img_size=32).model
    assert (outputs(other, (32, 32))[0] - outputs(original, (32, 32))[0]).abs().max() > 1e-4  # the match above is exact


def test_a_geope_vit_and_an_ape_deit3_take_their_sizes_from_the_weights(tmp_path):
    geope = trained("geope", 1, depth=3, img_size=32, num_classes=5)
    path = tmp_path / "geope.pth"
    torch.save(geope.state_dict(), path)
    model = VIT.convert(path, model="vit_tiny_patch16", encoding="geope", img_size=32).model
    assert model.cfg.depth == 3 and model.cfg.img_size == 32
    torch.testing.assert_close(outputs(model, (32, 48))[0], outputs(geope, (32, 48))[0], rtol=0, atol=0)

    # DeiT-III's APE covers the patches only (timm's no_embed_class): the grid, hence the image size, is read from it.
    deit3 = trained(get_config("ape", no_embed_class=True), 2, depth=1, img_size=48, num_classes=3)
    torch.save({"model": deit3.state_dict()}, tmp_path / "deit3.pth")
    imported = VIT.convert(tmp_path / "deit3.pth", model="vit_tiny_patch16", encoding="ape")
    assert imported.model.cfg.img_size == 48 and imported.model.cfg.encoding.no_embed_class and "img_size" not in imported.assumed
    torch.testing.assert_close(outputs(imported.model, (48, 48))[0], outputs(deit3, (48, 48))[0], rtol=0, atol=0)


def test_a_file_that_is_not_a_timm_named_vit_is_refused_naming_its_first_key(tmp_path):
    gpt = {"tok_emb.weight": torch.zeros(11, 12), "blocks.0.heads.0.query.weight": torch.zeros(4, 12)}
    torch.save({"model_state": gpt, "step": 2}, tmp_path / "gpt.pt")
    with pytest.raises(
        CheckpointError, match=r"is not a ViT state dict in timm's names: its first key is 'tok_emb.weight' and it has no"
    ) as err:
        VIT.convert(tmp_path / "gpt.pt", encoding="sape2")
    assert "\n" not in str(err.value)
    torch.save(trained("geope", 3, depth=1, img_size=32, num_classes=5, embed_dim=80, num_heads=4).state_dict(), tmp_path / "geope.pth")
    with pytest.raises(ConfigError, match="width 80 does not split into --model vit_base_patch16's 12 heads") as err:
        VIT.convert(tmp_path / "geope.pth", model="vit_base_patch16", encoding="geope")
    assert "\n" not in str(err.value)
    torch.save(trained("geope", 4, depth=1, img_size=32, num_classes=5).state_dict(), tmp_path / "geope192.pth")
    with pytest.raises(CheckpointError, match="does not fit the model: missing pos_enc.blocks.0.sape_x.pos_emb"):  # no SaPE² tables
        VIT.convert(tmp_path / "geope192.pth", model="vit_tiny_patch16", encoding="sape2", img_size=32)
