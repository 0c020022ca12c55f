"""GridPE: the identities of spec ``gridpe.md`` §7.4, checkpoint fidelity, and export."""

import math
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from deploykit.encodings import get_config
from deploykit.encodings.base import TrunkDims
from deploykit.encodings.gridpe import (  # importing registers "gridpe"
    DEFAULT_BASE,
    PAPER_MODEL,
    GridPE,
    GridPEConfig,
    build_gridpe_table,
    grid_positions,
    gridpe_angles,
    gridpe_frequencies,
    gridpe_magnitudes,
    num_directions,
    optimal_base,
    random_orthogonal,
    simplex_directions,
)
from deploykit.encodings.rope import apply_rotary
from deploykit.nn import create_model

# The default base exceeds the paper's bound for these small heads; that warning has its own test.
pytestmark = pytest.mark.filterwarnings("ignore:GridPE scale ratio:UserWarning")

F64 = torch.float64
TOL = 1e-12
DIMS = TrunkDims(embed_dim=48, num_heads=2, depth=3, num_prefix_tokens=1, grid=(4, 4))  # d = 24: S = 4, no tail
TAIL_DIMS = TrunkDims(embed_dim=128, num_heads=2, depth=2, num_prefix_tokens=1, grid=(4, 4))  # d = 64: S = 10, 4 pass


def make(dims=DIMS, seed=0, **options):
    torch.manual_seed(seed)
    return GridPE(GridPEConfig(**{"base": DEFAULT_BASE, **options}), dims)


def rotate(enc, vec, pos, layer=0, head=0):
    """Rotate a ``[d]`` vector as a token at any (row, col) position, from the encoding's omegas."""
    freqs = gridpe_frequencies(enc.omegas[layer, head], enc.magnitudes(), enc.config.layout)
    cos, sin = build_gridpe_table(torch.tensor([pos], dtype=F64), freqs)
    return apply_rotary(vec, cos[0], sin[0])


def canonical_checks(w, n):
    """Unit rows, pairwise cosine -1/n, zero sum, tight frame ((n+1)/n) I, rank n."""
    m = num_directions(n)
    assert w.shape == (m, n)
    assert torch.allclose(w.norm(dim=-1), torch.ones(m, dtype=F64), atol=TOL)
    if n >= 2:
        gram = w @ w.T
        off = gram[~torch.eye(m, dtype=torch.bool)]
        assert torch.allclose(off, torch.full_like(off, -1.0 / n), atol=TOL)
        assert torch.allclose(w.sum(0), torch.zeros(n, dtype=F64), atol=TOL)
        assert torch.allclose(w.T @ w, (n + 1) / n * torch.eye(n, dtype=F64), atol=TOL)
        assert torch.linalg.matrix_rank(w) == n  # rank n, not linearly independent (spec A3)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_simplex_invariants(n):
    canonical_checks(simplex_directions(n), n)


def test_simplex_closed_forms_and_angles():
    s3 = math.sqrt(3) / 2
    expected2 = torch.tensor([[s3, 0.5], [-s3, 0.5], [0.0, -1.0]], dtype=F64)
    assert torch.allclose(simplex_directions(2), expected2, atol=TOL)  # 30°, 150°, 270°
    a, b, c = math.sqrt(2 / 3), math.sqrt(2) / 3, 1 / 3
    expected3 = torch.tensor([[a, b, c], [-a, b, c], [0, -2 * b, c], [0, 0, -1]], dtype=F64)
    assert torch.allclose(simplex_directions(3), expected3, atol=TOL)
    cosines = simplex_directions(3) @ simplex_directions(3).T
    assert math.isclose(math.degrees(math.acos(cosines[0, 1])), 109.47122063449069, abs_tol=1e-9)
    assert torch.equal(simplex_directions(1), torch.ones(1, 1, dtype=F64))  # M = 1, ω = 1 (A17)


@pytest.mark.parametrize("n", [2, 3])
def test_simplex_norm_is_app_b_length(n):
    w = simplex_directions(n, norm="simplex")
    assert torch.allclose(w.norm(dim=-1), torch.full((n + 1,), math.sqrt(n / (n + 1)), dtype=F64), atol=TOL)
    assert torch.allclose((w @ w.T)[0, 1], torch.tensor(-1 / (n + 1), dtype=F64), atol=TOL)
    assert torch.allclose(w.T @ w, torch.eye(n, dtype=F64), atol=TOL)  # Ω^(n)ᵀ Ω^(n) = I_n


def test_random_orientations_are_simplices_distinct_per_layer_and_head():
    omegas = make().omegas  # [L, H, M, 2]
    assert omegas.shape == (3, 2, 3, 2) and omegas.dtype == F64
    for w in omegas.reshape(-1, 3, 2):
        canonical_checks(w, 2)
    flat = omegas.reshape(6, -1)
    assert torch.cdist(flat, flat)[~torch.eye(6, dtype=torch.bool)].min() > 1e-3
    fixed = make(orientation="fixed").omegas
    assert torch.equal(fixed, simplex_directions(2).expand_as(fixed))
    q = random_orthogonal(5, 3)
    assert torch.allclose(q @ q.transpose(-1, -2), torch.eye(3, dtype=F64).expand(5, 3, 3), atol=TOL)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("layout", ["direction_major", "scale_major"])
def test_angles_within_a_scale_sum_to_zero(n, layout):
    m, scales = n + 1, 5
    torch.manual_seed(n)
    omegas = simplex_directions(n) @ random_orthogonal(1, n)[0].T
    mags = gridpe_magnitudes(2 * m * scales, n, 100.0)
    positions = torch.randint(-40, 40, (64, n)).to(F64)
    angles = gridpe_angles(positions, gridpe_frequencies(omegas, mags, layout))  # [T, M·S]
    per_scale = angles.reshape(64, m, scales) if layout == "direction_major" else angles.reshape(64, scales, m).transpose(1, 2)
    assert torch.allclose(per_scale.sum(1), torch.zeros(64, scales, dtype=F64), atol=TOL * 100)  # |θ| ≤ 70
    # ... so the product of the M unit phasors of a scale is 1.
    phasors = torch.polar(torch.ones_like(per_scale), per_scale).prod(1)
    assert torch.allclose(phasors, torch.ones_like(phasors), atol=1e-12)


def test_n1_is_exactly_1d_rope():
    head_dim, base = 32, 10000.0
    rope_freqs = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=F64) / head_dim)  # GPT-J RoPE
    positions = torch.arange(200, dtype=F64)[:, None]
    omegas = simplex_directions(1) @ random_orthogonal(1, 1)[0].T
    angles = gridpe_angles(positions, gridpe_frequencies(omegas, gridpe_magnitudes(head_dim, 1, base), "direction_major"))
    assert torch.equal(angles, positions * rope_freqs)  # bit for bit (spec §7.4 item 3)
    x = torch.randn(200, head_dim, dtype=F64)
    cos, sin = build_gridpe_table(positions, gridpe_frequencies(omegas, gridpe_magnitudes(head_dim, 1, base), "direction_major"))
    ref = torch.view_as_complex(x.reshape(200, -1, 2).contiguous()) * torch.polar(torch.ones_like(angles), positions * rope_freqs)
    assert torch.allclose(apply_rotary(x, cos, sin), torch.view_as_real(ref).reshape(200, head_dim), atol=TOL)


@pytest.mark.parametrize("dims", [DIMS, TAIL_DIMS], ids=["divisible", "tail"])
@pytest.mark.parametrize("layout", ["direction_major", "scale_major"])
def test_relative_position_property(dims, layout):
    """<R(x)q, R(y)k> = <R(x+t)q, R(y+t)k> = <q, R(y-x)k>."""
    enc = make(dims, layout=layout)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(dims.head_dim, generator=g, dtype=F64), torch.randn(dims.head_dim, generator=g, dtype=F64)
    for layer, head in [(0, 0), (dims.depth - 1, 1)]:
        score = rotate(enc, q, (1, 2), layer, head) @ rotate(enc, k, (3, 0), layer, head)
        assert abs(score - q @ rotate(enc, k, (2, -2), layer, head)) < TOL
        for t in [(1, 1), (5, -7), (-1, 0), (30, 31)]:
            shifted = rotate(enc, q, (1 + t[0], 2 + t[1]), layer, head) @ rotate(enc, k, (3 + t[0], t[1]), layer, head)
            assert abs(shifted - score) < TOL


def test_score_equals_complex_form():
    """(R(x)q)ᵀ(R(y)k) = Re Σ_p c(q)_p c(k)_p* e^{j(θ_p(x) - θ_p(y))} (spec §7.4 item 2)."""
    enc = make()
    q, k = torch.randn(24, dtype=F64), torch.randn(24, dtype=F64)
    freqs = gridpe_frequencies(enc.omegas[1, 0], enc.magnitudes(), "direction_major")
    theta = gridpe_angles(torch.tensor([[2.0, 5.0], [7.0, 1.0]], dtype=F64), freqs)
    cq, ck = (torch.view_as_complex(v.reshape(-1, 2).contiguous()) for v in (q, k))
    ref = (cq * ck.conj() * torch.polar(torch.ones(12, dtype=F64), theta[0] - theta[1])).sum().real
    assert abs(rotate(enc, q, (2, 5), 1, 0) @ rotate(enc, k, (7, 1), 1, 0) - ref) < TOL


def test_norm_preserved_and_prefix_and_origin_rows_identity():
    enc = make(TAIL_DIMS)
    tables = enc.tables((5, 6)).layers[1]
    cos, sin = tables["cos"], tables["sin"]
    assert cos.shape == (2, 1 + 30, 30) and cos.dtype == F64
    assert torch.allclose(cos**2 + sin**2, torch.ones_like(cos), atol=TOL)
    assert torch.equal(cos[:, :2], torch.ones_like(cos[:, :2])) and torch.equal(sin[:, :2], torch.zeros_like(sin[:, :2]))
    x = torch.randn(3, 2, 31, 64, dtype=F64)
    out = apply_rotary(x, cos, sin)
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=TOL)
    assert torch.equal(out[:, :, :2], x[:, :, :2])  # class token and patch (0, 0): R(0) = I
    assert torch.equal(out[..., 60:], x[..., 60:])  # the 64 mod 6 = 4 tail dims pass unrotated


def test_group_property_and_inverse():
    enc = make()
    freqs = gridpe_frequencies(enc.omegas[2, 1], enc.magnitudes(), "direction_major")
    x, y = torch.tensor([[3.0, -4.0]], dtype=F64), torch.tensor([[-6.0, 11.0]], dtype=F64)
    assert torch.allclose(gridpe_angles(x + y, freqs), gridpe_angles(x, freqs) + gridpe_angles(y, freqs), atol=TOL)
    v = torch.randn(24, dtype=F64)
    assert torch.allclose(rotate(enc, rotate(enc, v, (3, -4), 2, 1), (-6, 11), 2, 1), rotate(enc, v, (-3, 7), 2, 1), atol=TOL)
    cos, sin = build_gridpe_table(x, freqs)
    assert torch.allclose(apply_rotary(apply_rotary(v, cos[0], sin[0]), cos[0], -sin[0]), v, atol=TOL)  # R(x)ᵀ = R(-x)
    assert torch.allclose(rotate(enc, v, (-3, 4), 2, 1), apply_rotary(v, cos[0], -sin[0]), atol=TOL)


@pytest.mark.parametrize("small,large", [((14, 14), (24, 24)), ((3, 5), (6, 7))])
def test_smaller_grid_table_is_exact_subgrid(small, large):
    enc = make()
    for a, b in zip(enc.tables(small).layers, enc.tables(large).layers):
        for key in ("cos", "sin"):
            sub = b[key][:, 1:].reshape(2, *large, -1)[:, : small[0], : small[1]].reshape(2, -1, 12)
            assert torch.equal(a[key][:, 1:], sub)
            assert torch.equal(a[key][:, :1], b[key][:, :1])


def test_scale_ratio_and_optimal_base():
    mags = gridpe_magnitudes(96, 2, 10000.0)
    assert mags.shape == (16,) and mags[0] == 1.0
    assert torch.allclose(mags[1:] / mags[:-1], torch.full((15,), 10000.0 ** (-6 / 96), dtype=F64), rtol=TOL)
    for n, d in [(2, 96), (3, 256), (1, 64)]:
        mags = gridpe_magnitudes(d, n, optimal_base(d, n))
        assert torch.allclose(mags[:-1] / mags[1:], torch.full_like(mags[1:], math.exp(1 / n)), rtol=TOL)
    assert math.isclose(optimal_base(96, 2), 2980.957987041728, rel_tol=TOL)  # spec §2.4 table


def test_line_restriction_is_1d_rope():
    """On x = t·u, GridPE is 1-D RoPE with frequencies mag_s (ω̂_iᵀ u) (spec §7.4 item 4)."""
    enc = make()
    u = torch.tensor([0.6, 0.8], dtype=F64)
    t = torch.arange(-10, 20, dtype=F64)
    freqs = gridpe_frequencies(enc.omegas[0, 1], enc.magnitudes(), "direction_major")  # [12, 2]
    assert torch.allclose(gridpe_angles(t[:, None] * u, freqs), t[:, None] * (freqs @ u), atol=TOL)


def _permute_qk_channels(model, perm):
    """Reorder the q and k output channels of every head by ``perm`` (indices into a head's dims)."""
    dim, heads = model.cfg.embed_dim, model.cfg.num_heads
    per_head = torch.arange(dim).reshape(heads, -1)[:, perm].reshape(-1)  # [D], head-major
    index = torch.cat([per_head, per_head + dim, torch.arange(2 * dim, 3 * dim)])  # q, k permuted; v kept
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[index])
            block.attn.qkv.bias.copy_(block.attn.qkv.bias[index])


def test_layouts_equal_after_permuting_qk_channels():
    """Scale-major ≡ direction-major once W_q, W_k output channels are permuted (spec A12, §7.4 item 11)."""
    build = dict(depth=2, img_size=32, embed_dim=64, num_heads=2, num_classes=7)  # d = 32: S = 5, 2 tail dims
    models = {}
    for layout in ("direction_major", "scale_major"):
        torch.manual_seed(0)
        models[layout] = create_model("vit_tiny_patch16", encoding=get_config("gridpe", layout=layout), **build).double().eval()
    m, s = 3, 5
    # scale-major pair s·M + i must hold what direction-major keeps at pair i·S + s
    pairs = [(p % m) * s + p // m for p in range(m * s)]
    _permute_qk_channels(models["scale_major"], torch.tensor([2 * p + r for p in pairs for r in (0, 1)] + [30, 31]))
    x = torch.randn(2, 3, 48, 32, dtype=F64)
    with torch.no_grad():
        assert torch.allclose(models["direction_major"](x), models["scale_major"](x), atol=TOL)


def test_omegas_buffer_round_trips_through_state_dict():
    a, b = make(seed=0), make(seed=1)
    assert "omegas" in a.state_dict() and not list(a.parameters())
    assert not torch.equal(a.tables((3, 4)).layers[1]["cos"], b.tables((3, 4)).layers[1]["cos"])
    b.load_state_dict(a.state_dict())
    for ta, tb in zip(a.tables((3, 4)).layers, b.tables((3, 4)).layers):
        assert torch.equal(ta["cos"], tb["cos"]) and torch.equal(ta["sin"], tb["sin"])
    # tables come from the buffer, never from a fresh draw
    torch.manual_seed(123)
    first = b.tables((3, 4)).layers[2]["sin"]
    torch.manual_seed(456)
    assert torch.equal(first, b.tables((3, 4)).layers[2]["sin"])


def test_model_checkpoint_key_and_loading():
    kw = dict(encoding=get_config("gridpe"), depth=2, img_size=32)
    torch.manual_seed(0)
    a = create_model("vit_tiny_patch16", **kw)
    torch.manual_seed(1)
    b = create_model("vit_tiny_patch16", **kw)
    state = a.state_dict()
    assert state["pos_enc.omegas"].shape == (2, 3, 3, 2)
    b.load_state_dict(state)
    assert torch.equal(a.pos_enc.tables((5, 3)).layers[1]["cos"], b.pos_enc.tables((5, 3)).layers[1]["cos"])


def test_concat_prefix_equals_slice_write():
    """The identity-row table is bit-equal to the authors' ``q_rot[:, :, 1:] = ...`` (spec §7.3)."""
    enc = make()
    tables = enc.tables((4, 5)).layers[0]
    q = torch.randn(2, 2, 21, 24, dtype=F64)
    sliced = q.clone()
    sliced[:, :, 1:] = apply_rotary(q[:, :, 1:], tables["cos"][:, 1:], tables["sin"][:, 1:])
    assert torch.equal(enc.apply_qk(q, q, tables)[0], sliced)


def test_indivisible_head_dim_error_mode():
    with pytest.raises(ValueError, match="not divisible by 2\\(n\\+1\\) = 6"):
        make(TAIL_DIMS, indivisible_head_dim="error")
    assert make(DIMS, indivisible_head_dim="error").num_scales == 4


def test_config_validation():
    assert get_config("gridpe") == GridPEConfig(base=10000.0)
    with pytest.raises(TypeError):
        GridPEConfig()  # base is required
    with pytest.raises(ValueError, match="> 1"):
        GridPEConfig(base=1.0)
    with pytest.raises(ValueError, match="'random', 'fixed'"):
        GridPEConfig(base=100.0, orientation="learned")
    with pytest.raises(ValueError, match="needs a head dim >= 6"):
        make(TrunkDims(8, 2, 1, 1, (2, 2)))


def test_warns_above_the_paper_bound_only():
    with pytest.warns(UserWarning, match="exceeds the paper's bound"):
        make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(base=optimal_base(DIMS.head_dim, 2))


def test_normalized_coords_scale_by_native_over_grid():
    raw, norm = make(), make(coords="normalized")
    assert torch.equal(raw.tables((4, 4)).layers[0]["cos"], norm.tables((4, 4)).layers[0]["cos"])
    positions = grid_positions((8, 2), (4, 4), "normalized")
    assert torch.equal(positions[3], torch.tensor([0.5, 2.0], dtype=F64))  # token 3 = row 1, col 1 → (1·4/8, 1·4/2)


def test_paper_model_setting():
    enc = make(TrunkDims(PAPER_MODEL["embed_dim"], PAPER_MODEL["num_heads"], PAPER_MODEL["depth"], 1, (14, 14)))
    assert enc.num_scales == 16 and enc.omegas.shape == (12, 4, 3, 2)
    assert enc.tables((14, 14)).layers[11]["cos"].shape == (4, 1 + 196, 48)  # all 96 dims rotated
    model = create_model("vit_small_patch16", encoding="gridpe", **{**PAPER_MODEL, "depth": 1})
    assert model.pos_enc.dims.head_dim == 96


def test_non_default_base_builds_through_the_registry():
    model = create_model("vit_tiny_patch16", encoding=get_config("gridpe", base=100.0), depth=1, img_size=32)
    assert model.cfg.to_dict()["encoding"] == {**model.cfg.to_dict()["encoding"], "name": "gridpe", "base": 100.0}


@pytest.mark.slow
def test_export_smoke():
    from deploykit.export import lint_graph, onnx_from_model

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding=get_config("gridpe"), depth=2, img_size=64, num_classes=10).eval()
    proto = onnx_from_model(model, (96, 64))
    assert lint_graph(proto) == []
    tables = {t.name: t for t in proto.graph.initializer if t.name.startswith("pe_tables.")}
    assert set(tables) == {f"pe_tables.{key}_block{i}" for key in ("cos", "sin") for i in range(2)}
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in tables.values())
    host = model.pos_enc.tables((6, 4))  # float64 from the (now fp32) omegas the export used
    for i, layer in enumerate(host.layers):
        for key in ("cos", "sin"):
            np.testing.assert_array_equal(numpy_helper.to_array(tables[f"pe_tables.{key}_block{i}"]), layer[key].float().numpy())
    # ONNX Runtime against float64 torch: tests/export/test_export.py, for every registered encoding.
