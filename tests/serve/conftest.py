"""One small export shared by the serving tests: ViT-Tiny/16 cut to depth 1, 10 classes, two
resolutions (32 and 48 px: 2x2 and 3x3 grids), so every graph runs in milliseconds on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deploykit.export import export
from deploykit.nn import create_model

RESOLUTIONS = [(32, 32), (48, 48)]
NUM_CLASSES = 10


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=NUM_CLASSES).eval()
    out = tmp_path_factory.mktemp("serve") / "export"
    export(model, RESOLUTIONS, out)
    return out


# Every plan ONNX Runtime runs on CPU (bf16's Gemm has no CPU kernel there); int8 calibrated on a
# few inputs, with no agreement target: what is checked is that each plan is what gets served.
SERVED_PLANS = ("fp32", "fp16", "int8", "int8-dynamic", "fp32-mha")


@pytest.fixture(scope="session")
def plans_export_dir(tmp_path_factory) -> Path:
    """The model of ``export_dir`` exported at 32 and 48 px under every plan of ``SERVED_PLANS``."""
    from deploykit.export.int8_static import CalibrationOptions

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=NUM_CLASSES).eval()
    out = tmp_path_factory.mktemp("serve_plans") / "export"
    export(model, RESOLUTIONS, out, precisions=SERVED_PLANS, calibration=CalibrationOptions(samples=8, held_out=16, min_agreement=None))
    return out


@pytest.fixture(scope="session")
def zoo_export_dir(tmp_path_factory) -> Path:
    """The zoo's trained APE model (``models/shapes-ape``, trained at 48 px) exported at 32 and 48
    px: what a user serves, with answers that mean something on its test split."""
    from deploykit.zoo.resolve import resolve_model

    model, _ = resolve_model(encoding="ape")
    out = tmp_path_factory.mktemp("serve_zoo") / "export"
    export(model, RESOLUTIONS, out)
    return out
