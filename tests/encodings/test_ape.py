import numpy as np
import pytest
import torch

from deploykit.encodings.ape import resample_pos_embed
from deploykit.nn import create_model


def test_same_grid_is_identity():
    model = create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=64)
    table = model.pos_enc.tables((4, 4)).model["pos_embed"]
    assert torch.equal(table, model.pos_enc.pos_embed.double())


def test_prefix_rows_kept_and_shape():
    pe = torch.randn(1, 1 + 4 * 4, 8, dtype=torch.float64)
    out = resample_pos_embed(pe, (4, 4), (6, 8), num_prefix_tokens=1)
    assert out.shape == (1, 1 + 48, 8)
    assert torch.equal(out[:, :1], pe[:, :1])


def keys_cubic(t: float, a: float) -> float:
    t = abs(t)
    return (a + 2) * t**3 - (a + 3) * t**2 + 1 if t <= 1 else a * t**3 - 5 * a * t**2 + 8 * a * t - 4 * a if t < 2 else 0.0


def pil_bicubic_weights(n_in: int, n_out: int) -> np.ndarray:
    """PIL's resampling (what timm's default ``antialias=True`` runs): Keys a = -0.5, the kernel
    stretched by the downscale factor, taps cut at the edges and renormalised (not clamped)."""
    scale = n_in / n_out
    stretch = max(scale, 1.0)
    w = np.zeros((n_out, n_in))
    for i in range(n_out):
        centre = (i + 0.5) * scale
        lo, hi = max(int(centre - 2 * stretch + 0.5), 0), min(int(centre + 2 * stretch + 0.5), n_in)
        for j in range(lo, hi):
            w[i, j] = keys_cubic((j - centre + 0.5) / stretch, -0.5)
        w[i] /= w[i].sum()
    return w


@pytest.mark.parametrize("new", [(6, 7), (3, 2), (7, 3)])  # up, down, mixed
def test_default_resize_is_timms_antialiased_bicubic(new):
    # timm's resample_abs_pos_embed defaults to antialias=True (deploykit used to resize without).
    grid = np.random.default_rng(1).standard_normal((4, 5))
    pe = torch.from_numpy(np.concatenate([[[9.0]], grid.reshape(20, 1)]).reshape(1, 21, 1))
    out = resample_pos_embed(pe, (4, 5), new, num_prefix_tokens=1).numpy().reshape(-1)
    assert out[0] == 9.0
    expected = pil_bicubic_weights(4, new[0]) @ grid @ pil_bicubic_weights(5, new[1]).T
    np.testing.assert_allclose(out[1:].reshape(new), expected, atol=1e-12)


def test_plain_bicubic_keeps_constant_and_matches_separable_reference():
    # A constant field stays constant (cubic weights sum to 1).
    pe = torch.full((1, 16, 3), 2.5, dtype=torch.float64)
    plain = torch.full((1, 35, 3), 2.5, dtype=torch.float64)
    assert torch.allclose(resample_pos_embed(pe, (4, 4), (7, 5), 0, antialias=False), plain, atol=1e-12)
    # Independent reference: Keys cubic kernel (a = -0.75, as PyTorch), half-pixel centres, edge clamp.
    rng = np.random.default_rng(0)
    grid = rng.standard_normal((4, 4))
    out = resample_pos_embed(torch.from_numpy(grid.reshape(1, 16, 1)), (4, 4), (6, 6), 0, antialias=False).numpy().reshape(6, 6)

    def weights(n_in, n_out):
        w = np.zeros((n_out, n_in))
        for i in range(n_out):
            src = (i + 0.5) * n_in / n_out - 0.5
            base = int(np.floor(src))
            for k in range(-1, 3):
                t = abs(src - (base + k))
                a = -0.75
                c = (a + 2) * t**3 - (a + 3) * t**2 + 1 if t <= 1 else a * t**3 - 5 * a * t**2 + 8 * a * t - 4 * a if t < 2 else 0
                w[i, min(max(base + k, 0), n_in - 1)] += c
        return w

    wy, wx = weights(4, 6), weights(4, 6)
    np.testing.assert_allclose(out, wy @ grid @ wx.T, atol=1e-12)


@pytest.mark.parametrize("resolution", [(32, 32), (96, 64)])
def test_model_runs_at_other_resolutions(resolution):
    model = create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=64, num_classes=5)
    out = model(torch.randn(2, 3, *resolution))
    assert out.shape == (2, 5) and torch.isfinite(out).all()
