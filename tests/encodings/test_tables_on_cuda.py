"""A model on a GPU builds the same float64 tables as on the host. GridPE, MoPE and mixed RoPE
built from a CUDA model's parameters failed there (their grids are made on the host), found by
``benchmarks/gpu_lent.py`` on an H200; that run checks every zoo model on CUDA against float64,
and these run wherever the test suite meets a GPU."""

from __future__ import annotations

import pytest
import torch

from deploykit.encodings import list_encodings
from deploykit.nn import create_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_lent.py runs this on a lent one)")


@pytest.mark.parametrize("encoding", list_encodings())
def test_a_cuda_model_builds_the_tables_of_its_host_copy(encoding):
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding=encoding, depth=2, img_size=32).eval()
    expected = model.shape_tables((64, 48))
    got = model.cuda().shape_tables((64, 48)).map(lambda t: t.cpu())
    assert got.model.keys() == expected.model.keys() and len(got.layers) == len(expected.layers)
    for name in expected.model:
        torch.testing.assert_close(got.model[name], expected.model[name])
    for got_layer, layer in zip(got.layers, expected.layers):
        for name in layer:
            torch.testing.assert_close(got_layer[name], layer[name])
    images = torch.randn(2, 3, 64, 48, device="cuda")
    assert torch.isfinite(model(images)).all()
