"""``deploykit debug-precision``: for an fp16 plan that fails validation, the smallest set of
products to keep fp32, found by bisection and reduction, named by module, and usable as
``--keep-float`` so the re-exported plan passes."""

from __future__ import annotations

import torch

from deploykit.nn import create_model, save_model
from deploykit.validation.precision_debug import debug_precision

RES = 32


def _overflowing_model():
    """A seeded two-block ViT whose ``blocks.1.mlp.fc1`` weights and bias are scaled by 1e6: its
    fp16 product overflows fp16's 65504, so the fp16 plan fails there."""
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=2, img_size=RES, num_classes=10)
    with torch.no_grad():
        fc1 = model.blocks[1].mlp.fc1
        fc1.weight.mul_(1e6)
        fc1.bias.mul_(1e6)
    return model


def test_the_smallest_fp32_set_is_found_and_passes_as_keep_float(tmp_path, deploykit_cli):
    checkpoint = save_model(_overflowing_model(), tmp_path / "ckpt")
    out = tmp_path / "exp"
    code, err = deploykit_cli("export", "-c", checkpoint, "-r", RES, "--precision", "fp16", "-o", out)
    assert code == 0, err
    code, _ = deploykit_cli("validate", out, "--precision", "fp16")
    assert code == 1  # the planted overflow
    found = debug_precision(out, "fp16")
    assert [module for module, _ in found.kept] == ["blocks.1.mlp.fc1"]  # the planted layer, alone
    assert found.patterns == ("blocks.1.mlp.fc1",)
    # Two end checks, the bisection over graph order, one reduction check per product of the prefix.
    assert found.checks <= 2 + (found.products - 1).bit_length() + found.products
    code, err = deploykit_cli("debug-precision", out)
    assert code == 0 and "export with: --keep-float blocks.1.mlp.fc1" in err, err
    fixed = tmp_path / "fixed"
    code, err = deploykit_cli("export", "-c", checkpoint, "-r", RES, "--precision", "fp16", *found.keep_float_args(), "-o", fixed)
    assert code == 0, err
    code, err = deploykit_cli("validate", fixed, "--precision", "fp16")
    assert code == 0, err


def test_a_healthy_plan_needs_nothing_kept(encoding_export):
    found = debug_precision(encoding_export("ape"), "fp16", (64, 64))
    assert found.kept == () and found.checks == 1
