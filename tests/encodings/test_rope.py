import json
import math

import pytest
import torch

from deploykit.encodings import get_config
from deploykit.encodings.base import TrunkDims
from deploykit.encodings.rope import Rope2d, apply_rotary, axial_angles, rope_magnitudes
from deploykit.errors import ConfigError

F64 = torch.float64
DIMS = TrunkDims(embed_dim=32, num_heads=2, depth=3, num_prefix_tokens=1, grid=(4, 4))


def make(mode):
    torch.manual_seed(0)
    return Rope2d(get_config(f"rope-{mode}"), DIMS)


def rotate_at(rope, vec, pos, layer=0, head=0):
    """Rotate a [d] vector as the token at patch position pos=(y, x) of a 6x7 grid."""
    grid = (6, 7)
    tables = rope.tables(grid).layers[layer]
    idx = DIMS.num_prefix_tokens + pos[0] * grid[1] + pos[1]
    cos, sin = tables["cos"], tables["sin"]
    cos, sin = cos[min(head, cos.shape[0] - 1), idx], sin[min(head, sin.shape[0] - 1), idx]
    return apply_rotary(vec, cos, sin)


@pytest.mark.parametrize("mode", ["axial", "mixed"])
def test_relative_position_property(mode):
    """<R(x)q, R(y)k> depends only on x - y."""
    rope = make(mode)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(16, generator=g, dtype=F64), torch.randn(16, generator=g, dtype=F64)
    for layer, head in [(0, 0), (2, 1)]:
        base = rotate_at(rope, q, (1, 2), layer, head) @ rotate_at(rope, k, (3, 0), layer, head)
        for shift in [(1, 1), (2, 4), (-1, 0)]:
            x, y = (1 + shift[0], 2 + shift[1]), (3 + shift[0], 0 + shift[1])
            shifted = rotate_at(rope, q, x, layer, head) @ rotate_at(rope, k, y, layer, head)
            assert abs(shifted - base) < 1e-12


@pytest.mark.parametrize("mode", ["axial", "mixed"])
def test_rotation_preserves_norm_and_prefix_is_identity(mode):
    rope = make(mode)
    x = torch.randn(2, 2, 1 + 24, 16, dtype=F64)
    tables = rope.tables((4, 6)).layers[1]
    out = apply_rotary(x, tables["cos"], tables["sin"])
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-12)
    assert torch.equal(out[:, :, 0], x[:, :, 0])  # class token unrotated


def test_axial_angles_split_x_then_y():
    angles = axial_angles((3, 5), 16, 100.0)
    mag = rope_magnitudes(16, 100.0)
    # token (y=2, x=4) is index 14
    assert torch.allclose(angles[14], torch.cat([4 * mag, 2 * mag]), atol=0)
    assert torch.allclose(mag, torch.tensor([100.0 ** (-4 * j / 16) for j in range(4)], dtype=F64), rtol=1e-15)


def test_mixed_with_axis_aligned_freqs_equals_axial():
    """Mixed RoPE with f_x = [m, 0], f_y = [0, m] is exactly axial RoPE (paper Eq. 10 vs 11)."""
    axial, mixed = Rope2d(get_config("rope-axial", theta=10.0), DIMS), Rope2d(get_config("rope-mixed"), DIMS)
    mag = rope_magnitudes(DIMS.head_dim, 10.0)
    zero = torch.zeros_like(mag)
    with torch.no_grad():
        mixed.freqs[0] = torch.cat([mag, zero]).float()
        mixed.freqs[1] = torch.cat([zero, mag]).float()
    # freqs are stored fp32; compare against axial tables built from the same rounded magnitudes
    mag32 = mag.float().double()
    a = axial_angles((4, 4), DIMS.head_dim, 10.0)
    ref = torch.cat([a[:, :4] / mag * mag32, a[:, 4:] / mag * mag32], dim=-1)
    tables = mixed.tables((4, 4)).layers[2]
    assert torch.allclose(tables["cos"][1, 1:], ref.cos(), atol=1e-13)
    assert torch.allclose(axial.tables((4, 4)).layers[0]["cos"][0, 1:], a.cos(), atol=0)


def test_mixed_init_directions_are_orthogonal_pairs():
    """The paper's init: per head, frequencies along φ and φ + π/2 with axial magnitudes."""
    freqs = make("mixed").freqs.double()  # [2, L, H, d/2]
    quarter = DIMS.head_dim // 4
    first, second = freqs[..., :quarter], freqs[..., quarter:]
    assert torch.allclose((first * second).sum(0), torch.zeros_like(first[0]), atol=1e-6)
    mag = rope_magnitudes(DIMS.head_dim, 10.0)
    assert torch.allclose(first.norm(dim=0), mag.expand_as(first[0]), rtol=1e-6)


def test_head_dim_must_be_divisible_by_4():
    with pytest.raises(ValueError, match="divisible by 4"):
        Rope2d(get_config("rope-axial"), TrunkDims(18, 3, 1, 1, (2, 2)))


def test_rotation_matches_complex_multiplication():
    x = torch.randn(5, 8, dtype=F64)
    angles = torch.rand(5, 4, dtype=F64) * 2 * math.pi
    out = apply_rotary(x, angles.cos(), angles.sin())
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(5, 4, 2).contiguous()) * torch.polar(torch.ones_like(angles), angles))
    assert torch.allclose(out, ref.reshape(5, 8), atol=1e-14)


@pytest.mark.parametrize("mode", ["axial", "mixed"])
def test_halves_form_is_interleaved_on_reordered_channels(mode):
    """The exporter's form: channels reordered evens-then-odds, rotated as halves, equal the
    interleaved rotation reordered the same way, bit for bit (same products, same sums)."""
    rope = make(mode)
    form = rope.contiguous_qk_form()
    assert form.encoding.config.pairs == "halves" and rope.config.pairs == "interleaved"
    assert form.encoding.contiguous_qk_form() is None
    assert form.order.tolist() == list(range(0, 16, 2)) + list(range(1, 16, 2))
    tables = rope.tables((3, 5)).layers[1]
    x = torch.randn(2, 2, 16, 16)  # fp32 on purpose: equality, not closeness
    ref = rope.apply_qk(x, x, tables)[0]
    out = form.encoding.apply_qk(x[..., form.order], x[..., form.order], form.encoding.tables((3, 5)).layers[1])[0]
    assert torch.equal(out, ref[..., form.order])


def test_halves_with_an_unrotated_tail():
    x, angles = torch.randn(3, 10, dtype=F64), torch.rand(3, 3, dtype=F64)
    order = torch.tensor([0, 2, 4, 1, 3, 5, 6, 7, 8, 9])
    out = apply_rotary(x[:, order], angles.cos(), angles.sin(), pairs="halves")
    assert torch.equal(out, apply_rotary(x, angles.cos(), angles.sin())[:, order])
    assert torch.equal(out[:, 6:], x[:, 6:])
    with pytest.raises(ValueError, match="pairs must be one of"):
        apply_rotary(x, angles.cos(), angles.sin(), pairs="diagonal")
    with pytest.raises(ConfigError, match="pairs must be one of"):
        get_config("rope-axial", pairs="diagonal")


def test_centered_coordinates_follow_dinov3():
    """timm's RotaryEmbeddingDinoV3: patch centres (i + 0.5) / n mapped to [-1, 1], row first
    (grid_indexing "ij"), angle 2π c / θ^(4j/d)."""
    cfg = get_config("rope-axial", coords="centered", axis_order="yx", angle_scale=2 * math.pi, pairs="halves")
    angles = axial_angles((3, 5), 16, 100.0, cfg)
    y, x = 2, 4  # token 14
    cy, cx = 2 * (y + 0.5) / 3 - 1, 2 * (x + 0.5) / 5 - 1
    periods = torch.tensor([100.0 ** (4 * j / 16) for j in range(4)], dtype=F64)
    torch.testing.assert_close(angles[14], torch.cat([2 * math.pi * cy / periods, 2 * math.pi * cx / periods]), atol=1e-12, rtol=0)
    longest = axial_angles((3, 5), 16, 100.0, get_config("rope-axial", coords="centered", normalize_coords="max"))
    assert torch.allclose(longest[14, :4], torch.full((4,), 2 * (x + 0.5) / 5 - 1, dtype=F64) * rope_magnitudes(16, 100.0))
    assert torch.allclose(longest[14, 4:], torch.full((4,), 2 * (y + 0.5) / 5 - 1, dtype=F64) * rope_magnitudes(16, 100.0))


def test_reference_grid_measures_positions_in_its_units_at_every_resolution():
    """timm's ref_feat_shape (EVA-02): patch i of n sits at i · ref / n, per axis, then the axial
    angles as usual (here row first, as EVA-02's grid_indexing "ij")."""
    cfg = get_config("rope-axial", theta=10000.0, axis_order="yx", ref_grid=(16, 12))
    mag = rope_magnitudes(16, 10000.0)
    for grid in [(4, 4), (3, 5), (8, 6)]:
        angles = axial_angles(grid, 16, 10000.0, cfg)
        y, x = grid[0] - 1, grid[1] - 1  # the last token
        torch.testing.assert_close(angles[-1], torch.cat([y * 16 / grid[0] * mag, x * 12 / grid[1] * mag]), atol=1e-12, rtol=0)
    # the reference grid itself keeps integer positions
    torch.testing.assert_close(
        axial_angles((16, 12), 16, 10000.0, cfg), axial_angles((16, 12), 16, 10000.0, get_config("rope-axial", axis_order="yx"))
    )


def test_reference_grid_is_an_option_of_every_rope():
    from deploykit.encodings import config_from_dict, config_to_dict, parse_options

    assert parse_options("rope-mixed", ["ref_grid=16x16"]) == {"ref_grid": (16, 16)}
    assert parse_options("rope-axial", ["ref_grid=24,32", "ref_grid=none"]) == {"ref_grid": None}
    saved = json.loads(json.dumps(config_to_dict(get_config("rope-axial", ref_grid=(16, 16)))))
    assert saved["ref_grid"] == [16, 16] and config_from_dict(saved) == get_config("rope-axial", ref_grid=(16, 16))
    with pytest.raises(ConfigError, match=r"option ref_grid='16xa' is not a valid grid \(e.g. 16x16\)"):
        parse_options("rope-axial", ["ref_grid=16xa"])
    with pytest.raises(ConfigError, match="ref_grid must be two positive integers"):
        get_config("rope-axial", **parse_options("rope-axial", ["ref_grid=16"]))
    for bad in [(16,), (0, 16), (16, 16, 16)]:
        with pytest.raises(ConfigError, match="ref_grid must be two positive integers"):
            get_config("rope-axial", ref_grid=bad)
    with pytest.raises(ConfigError, match="ref_grid rescales index coordinates"):
        get_config("rope-axial", ref_grid=(16, 16), coords="centered")


def test_only_integer_coordinates_without_an_ape_nest():
    assert Rope2d(get_config("rope-axial"), DIMS).tables_nest
    assert not Rope2d(get_config("rope-axial", coords="centered"), DIMS).tables_nest
    assert not Rope2d(get_config("rope-axial", ref_grid=(4, 4)), DIMS).tables_nest
    rope_ape = Rope2d(get_config("rope-mixed", ape=True, no_embed_class=True), DIMS)
    assert not rope_ape.tables_nest and rope_ape.pos_embed.shape == (1, 16, 32)
    table = rope_ape.tables((2, 3)).model["pos_embed"]
    assert table.shape == (1, 1 + 6, 32) and not table[0, 0].any()  # no position for the class token


def test_unknown_convention_is_refused():
    with pytest.raises(ConfigError, match="axis_order must be one of"):
        get_config("rope-axial", axis_order="zx")
