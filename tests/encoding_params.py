"""Every encoding as a fixture parameter, with the quick test set (``pytest -q``) keeping a
representative two and the rest marked ``slow``: each parameter costs an export, and the whole
suite (``-m ""``, what CI runs) still checks every encoding."""

from __future__ import annotations

import pytest

from deploykit.encodings import list_encodings

# A learned table added to the tokens, and a content-dependent attention bias exported as a custom op.
QUICK_ENCODINGS = ("ape", "sape2")


def encoding_params() -> list:
    return [name if name in QUICK_ENCODINGS else pytest.param(name, marks=pytest.mark.slow) for name in list_encodings()]


# Every encoding exported once for the whole suite (``encoding_export`` in conftest.py): a seeded
# two-block vit_tiny trained at 64 px, at 1x, 2x and a 32x32 patch grid, in the cast plans.
# validate, the precision plans and OpenVINO check these same graphs instead of each exporting
# every encoding again.
EXPORT_BASE = 64
EXPORT_RESOLUTIONS = ((EXPORT_BASE, EXPORT_BASE), (2 * EXPORT_BASE, 2 * EXPORT_BASE), (512, 512))
EXPORT_PLANS = ("fp32", "fp16", "bf16")


def encoding_model(name: str):
    import torch

    from deploykit.nn import create_model

    torch.manual_seed(0)
    return create_model("vit_tiny_patch16", encoding=name, depth=2, img_size=EXPORT_BASE, num_classes=10)
