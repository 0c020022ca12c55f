"""GeoPE: the identities of spec ``geope.md`` §7.7 in float64, plus export to ONNX."""

import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper

import deploykit.encodings
from deploykit.encodings import get_config
from deploykit.encodings.base import TrunkDims
from deploykit.encodings.geope import (  # importing registers "geope"
    PAPER_MODELS,
    GeoPE,
    GeoPEConfig,
    apply_geope,
    apply_geope_blocked,
    build_geope_table,
    geope_frequencies,
    geope_quaternion,
    geope_rotation,
    partner_indices,
    split_blocked_tables,
    triplet_dims,
)

F64 = torch.float64
TOL = 1e-12
SWAP = torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, 1, 0]], dtype=F64)  # P of spec T7: y <-> z


def phases(count=500, scale=300.0, seed=0):
    """Random phase pairs in [-scale, scale], with the origin and the axes included."""
    g = torch.Generator().manual_seed(seed)
    th, tw = (torch.rand(2, count, generator=g, dtype=F64) * 2 - 1) * scale
    extra = torch.tensor([[0.0, 0.0], [7.0, 0.0], [0.0, -7.0], [1e-9, 2e-9]], dtype=F64)
    return torch.cat([th, extra[:, 0]]), torch.cat([tw, extra[:, 1]])


def hamilton(p, q):
    """Quaternion product ``pq`` (App. A Eq. 17) of ``[..., 4]`` tensors ``(w, x, y, z)``."""
    pw, pv, qw, qv = p[..., :1], p[..., 1:], q[..., :1], q[..., 1:]
    w = pw * qw - (pv * qv).sum(-1, keepdim=True)
    return torch.cat([w, pw * qv + qw * pv + torch.linalg.cross(pv, qv)], dim=-1)


def skew(w):
    """``[w]×`` ``[..., 3, 3]`` from rotation vectors ``[..., 3]``."""
    zero = torch.zeros_like(w[..., 0])
    x, y, z = w.unbind(-1)
    return torch.stack([torch.stack(r, -1) for r in [[zero, -z, y], [z, zero, -x], [-y, x, zero]]], -2)


def axis_rotation(axis, angle):
    """Rotation by ``angle`` about coordinate axis 1 (y) or 2 (z), ``[3, 3]``."""
    w = torch.zeros(3, dtype=F64)
    w[axis] = angle
    return torch.linalg.matrix_exp(skew(w))


def make(head_dim=64, prefix=1, depth=3, **options):
    dims = TrunkDims(embed_dim=2 * head_dim, num_heads=2, depth=depth, num_prefix_tokens=prefix, grid=(4, 4))
    return GeoPE(get_config("geope", **options), dims)


def rotate_with_matrices(x, grid, head_dim, config, prefix):
    """Reference: apply blockdiag(R_g) per patch with explicit 3×3 matmuls; prefix and tail untouched."""
    ys, xs = torch.meshgrid(torch.arange(grid[0], dtype=F64), torch.arange(grid[1], dtype=F64), indexing="ij")
    if config.coords == "center":
        ys, xs = ys - (grid[0] - 1) / 2, xs - (grid[1] - 1) / 2
    omega = geope_frequencies(head_dim, config.base, config.freq_schedule)
    rot = geope_rotation(ys.reshape(-1, 1) * omega * config.pos_scale, xs.reshape(-1, 1) * omega * config.pos_scale)
    dims = triplet_dims(head_dim, config.grouping)  # [G, 3]
    out = x.clone()
    v = x[..., prefix:, :][..., dims]  # [B, H, N, G, 3]
    out[..., prefix:, dims] = (rot @ v[..., None])[..., 0]
    return out


# --- the rotation itself (T1-T4) ------------------------------------------------------------


def test_rotations_are_orthogonal_with_det_one():
    th, tw = phases()
    rot = geope_rotation(th, tw)
    eye = torch.eye(3, dtype=F64).expand_as(rot)
    assert torch.allclose(rot.transpose(-1, -2) @ rot, eye, atol=TOL, rtol=0)
    assert torch.allclose(torch.linalg.det(rot), torch.ones_like(th), atol=TOL, rtol=0)


def test_origin_is_identity_without_nan():
    zero = torch.zeros(1, dtype=F64)
    assert torch.equal(geope_rotation(zero, zero)[0], torch.eye(3, dtype=F64))
    assert torch.equal(geope_quaternion(zero, zero)[0], torch.tensor([1.0, 0, 0, 0], dtype=F64))


def test_closed_form_equals_quaternion_sandwich_product():
    """Eq. 2 with r from Eq. 4: vec(r (0, v) r*) = R v for the paper's matrix R (§3.2)."""
    th, tw = phases()
    r = geope_quaternion(th, tw)
    assert torch.allclose(r.norm(dim=-1), torch.ones_like(th), atol=TOL, rtol=0)
    conj = r * torch.tensor([1.0, -1, -1, -1], dtype=F64)
    rot = geope_rotation(th, tw)
    for basis in torch.eye(3, dtype=F64):
        p = torch.cat([torch.zeros(1, dtype=F64), basis]).expand_as(r)
        image = hamilton(hamilton(r, p), conj)
        assert torch.allclose(image[..., 0], torch.zeros_like(th), atol=TOL, rtol=0)  # stays pure
        assert torch.allclose(image[..., 1:], rot @ basis, atol=TOL, rtol=0)


def test_closed_form_equals_matrix_exponential():
    """R = expm([ω]×) with ω = (0, θ_h/2, θ_w/2): twice the Lie mean u = (0, θ_h/4, θ_w/4) (Eq. 32)."""
    th, tw = phases()
    omega = torch.stack([torch.zeros_like(th), th / 2, tw / 2], dim=-1)
    assert torch.allclose(torch.linalg.matrix_exp(skew(omega)), geope_rotation(th, tw), atol=TOL, rtol=0)


def test_rotation_angle_and_axis_are_recovered_below_pi():
    """The principal log of R is the rotation vector ω when Θ < π (spec T3)."""
    g = torch.Generator().manual_seed(3)
    angle = 0.1 + torch.rand(200, generator=g, dtype=F64) * 3.0  # Θ in [0.1, 3.1]
    direction = torch.rand(200, generator=g, dtype=F64) * 2 * math.pi
    th, tw = 2 * angle * direction.cos(), 2 * angle * direction.sin()
    rot = geope_rotation(th, tw)
    recovered = torch.acos(((rot.diagonal(dim1=-2, dim2=-1).sum(-1) - 1) / 2).clamp(-1, 1))
    assert torch.allclose(recovered, angle, atol=1e-10, rtol=0)
    vee = torch.stack([rot[:, 2, 1] - rot[:, 1, 2], rot[:, 0, 2] - rot[:, 2, 0], rot[:, 1, 0] - rot[:, 0, 1]], -1)
    axis = vee / (2 * torch.sin(angle))[:, None]
    assert torch.allclose(axis, torch.stack([torch.zeros_like(th), th, tw], -1) / (2 * angle)[:, None], atol=1e-10, rtol=0)


def test_averaging_principal_logs_is_wrong_past_pi():
    """Why the closed form: principal log r_h(7) is -2.783 j, not 3.5 j (spec §1.5, A12)."""

    def principal_log_mean(th, tw):
        logs = []
        for angle, axis in [(th, 2), (tw, 3)]:
            q = torch.zeros(4, dtype=F64)
            q[0], q[axis] = math.cos(angle / 2), math.sin(angle / 2)
            vec = q[1:]
            logs.append(torch.atan2(vec.norm(), q[0]) * vec / vec.norm())  # principal branch
        u = (logs[0] + logs[1]) / 2
        return torch.linalg.matrix_exp(skew(2 * u))  # quaternion exp(u) as a matrix rotates by 2|u|

    small, large = (1.0, 0.5), (7.0, 2.0)
    t = lambda v: torch.tensor([v], dtype=F64)
    assert torch.allclose(principal_log_mean(*small), geope_rotation(t(small[0]), t(small[1]))[0], atol=TOL)
    assert (principal_log_mean(*large) - geope_rotation(t(large[0]), t(large[1]))[0]).abs().max() > 0.5


def test_symmetrized_half_angle_product_agrees_to_third_order():
    """Spec T4: the naive products do not commute; GeoPE is their symmetrized mean up to O(s³)."""
    ry, rz = lambda a: axis_rotation(1, a), lambda a: axis_rotation(2, a)
    assert (ry(1.1) @ rz(0.7) - rz(0.7) @ ry(1.1)).abs().max() > 0.5
    errors, single = [], []
    for s in (0.1, 0.01, 0.001):
        th, tw = 1.1 * s, 0.7 * s
        geo = geope_rotation(torch.tensor(th, dtype=F64), torch.tensor(tw, dtype=F64))
        sym = (ry(th / 2) @ rz(tw / 2) + rz(tw / 2) @ ry(th / 2)) / 2
        errors.append((geo - sym).abs().max().item())
        single.append((geo - ry(th / 2) @ rz(tw / 2)).abs().max().item())
    assert errors[0] / errors[1] == pytest.approx(1e3, rel=0.05)  # third order
    assert single[0] / single[1] == pytest.approx(1e2, rel=0.05)  # one ordering: second order
    assert errors[2] < 1e-10


def test_height_width_swap_identities():
    """Spec T7 with P swapping y and z: R(θ_w, θ_h) = P Rᵀ P, R(-θ_w, -θ_h) = P R P, R(-θ_h, -θ_w) = Rᵀ."""
    th, tw = phases()
    rot = geope_rotation(th, tw)
    assert torch.allclose(geope_rotation(tw, th), SWAP @ rot.transpose(-1, -2) @ SWAP, atol=TOL, rtol=0)
    assert torch.allclose(geope_rotation(-tw, -th), SWAP @ rot @ SWAP, atol=TOL, rtol=0)
    assert torch.allclose(geope_rotation(-th, -tw), rot.transpose(-1, -2), atol=TOL, rtol=0)


def test_transposed_grid_table_is_p_rt_p():
    """The rotation table of a gw×gh grid at (c, r) is P R(r, c)ᵀ P of the gh×gw grid."""
    omega = geope_frequencies(64)
    gh, gw = 3, 5
    ys, xs = torch.meshgrid(torch.arange(gh, dtype=F64), torch.arange(gw, dtype=F64), indexing="ij")
    rot = geope_rotation(ys[..., None] * omega, xs[..., None] * omega)  # [gh, gw, G, 3, 3]
    rot_t = geope_rotation(xs.T[..., None] * omega, ys.T[..., None] * omega)  # [gw, gh, G, 3, 3]
    assert torch.allclose(rot_t, SWAP @ rot.transpose(0, 1).transpose(-1, -2) @ SWAP, atol=TOL, rtol=0)


def test_relative_property_holds_only_for_collinear_positions():
    """Spec T6: R_mᵀ R_n = R(p_n - p_m) for p_m, p_n on one ray through the origin, not in general."""
    w = 1.7
    rot = lambda p: geope_rotation(torch.tensor(p[0] * w, dtype=F64), torch.tensor(p[1] * w, dtype=F64))
    m, n = (2.0, 3.0), (6.0, 9.0)
    assert torch.allclose(rot(m).T @ rot(n), rot((n[0] - m[0], n[1] - m[1])), atol=TOL, rtol=0)
    m, n = (0.0, 3.0), (2.0, 5.0)
    assert (rot(m).T @ rot(n) - rot((2.0, 2.0))).abs().max() > 0.5
    shifted = rot((1.0, 4.0)).T @ rot((3.0, 6.0))
    assert (shifted - rot(m).T @ rot(n)).abs().max() > 0.1  # not translation invariant


# --- frequencies, layout and the three-term form (T2, T5, T8) -------------------------------


def test_frequency_schedules():
    """Spec §1.3: rope_neg 100^(-2i/64), i = 0..20; paper_literal 100^(+2i/64), i = 1..21."""
    neg = geope_frequencies(64)
    assert neg.shape == (21,) and neg[0] == 1.0
    assert torch.allclose(neg[[1, 2, 20]], torch.tensor([0.86596, 0.74989, 0.05623], dtype=F64), atol=1e-5)
    assert torch.allclose(neg, torch.tensor([100.0 ** (-2 * i / 64) for i in range(21)], dtype=F64), rtol=1e-15)
    lit = geope_frequencies(64, 100.0, "paper_literal")
    assert torch.allclose(lit[[0, 20]], torch.tensor([1.1548, 20.5353], dtype=F64), atol=1e-4)


@pytest.mark.parametrize("grouping", ["contiguous", "blocked"])
def test_partner_indices_cycle_within_triplets(grouping):
    idx1, idx2 = partner_indices(64, grouping)
    dims = triplet_dims(64, grouping)
    assert torch.equal(idx1[idx1], idx2) and torch.equal(idx1[idx2], torch.arange(64))
    assert torch.equal(idx1[dims], dims.roll(-1, dims=1)) and idx1[63] == 63 == idx2[63]
    assert sorted(dims.flatten().tolist()) == list(range(63))


@pytest.mark.parametrize(
    "options",
    [{}, {"grouping": "blocked"}, {"freq_schedule": "paper_literal"}, {"coords": "center", "pos_scale": 0.5}],
)
@pytest.mark.parametrize("head_dim,prefix", [(64, 1), (32, 2), (30, 0)])
def test_three_term_form_equals_block_diagonal_matrices(options, head_dim, prefix):
    """Spec T8: C0 ⊙ x + C1 ⊙ x[idx1] + C2 ⊙ x[idx2] = blockdiag(R_g) x, prefix and tail untouched."""
    pe, grid = make(head_dim, prefix, **options), (5, 7)
    x = torch.randn(2, 3, prefix + 35, head_dim, dtype=F64)
    c0, c1, c2 = build_geope_table(grid, head_dim, pe.config, prefix)
    out = apply_geope(x, c0, c1, c2, pe.idx1, pe.idx2)
    rq, _ = pe.apply_qk(x, x, pe.tables(grid).layers[0])  # the module's form (slices when blocked)
    assert torch.equal(rq, out)
    assert torch.allclose(out, rotate_with_matrices(x, grid, head_dim, pe.config, prefix), atol=TOL, rtol=0)
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=TOL, rtol=0)  # T1: norm preserved
    assert torch.equal(out[..., :prefix, :], x[..., :prefix, :])  # T2: prefix tokens exactly identity
    tail = head_dim - 3 * (head_dim // 3)
    assert torch.equal(out[..., head_dim - tail :], x[..., head_dim - tail :])  # passthrough dims


def test_tables_layout_identity_rows_and_sharing():
    pe = make(64, prefix=1, depth=3)
    tables = pe.tables((6, 4))
    assert len(tables.layers) == 3 and not tables.model
    first = tables.layers[0]
    assert all(layer[k] is first[k] for layer in tables.layers for k in first)  # stored once on export
    c0, c1, c2 = first["c0"], first["c1"], first["c2"]
    assert c0.shape == c1.shape == c2.shape == (1 + 24, 64) and c0.dtype == F64
    # prefix row, patch (0, 0) and the passthrough dim are the identity
    for row in (c0[:2], c0[:, 63]):
        assert torch.equal(row, torch.ones_like(row))
    for table in (c1, c2):
        assert torch.equal(table[:2], torch.zeros_like(table[:2])) and torch.equal(table[:, 63], torch.zeros(25, dtype=F64))
    # the larger grid's table contains the smaller one as a sub-grid (corner-origin coordinates)
    small = build_geope_table((3, 2), 64, pe.config, 1)[0][1:].reshape(3, 2, 64)
    assert torch.equal(c0[1:].reshape(6, 4, 64)[:3, :2], small)


@pytest.mark.parametrize("grouping", ["contiguous", "blocked"])
def test_row_zero_and_column_zero_reduce_to_half_angle_rope(grouping):
    """Spec T5: on row 0 (v_x, v_y) turn by +p_w ω/2 with v_z fixed; on column 0 (v_x, v_z) turn by
    -p_h ω/2 (App. F's sign) with v_y fixed. A half angle: App. F's own 1-D operator uses the full one."""
    pe, grid = make(64, prefix=0, grouping=grouping), (4, 5)
    x = torch.randn(1, 1, 20, 64, dtype=F64)
    out = pe.apply_qk(x, x, pe.tables(grid).layers[0])[0]
    dims, omega = triplet_dims(64, grouping), geope_frequencies(64)
    v, o = x[0, 0][:, dims], out[0, 0][:, dims]  # [N, G, 3]

    def rope(a, b, angle):  # standard RoPE [[cos, -sin], [sin, cos]] on the pair (a, b)
        return a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()

    for col in range(grid[1]):  # row 0: token col
        angle = col * omega / 2
        ex, ey = rope(v[col, :, 0], v[col, :, 1], angle)
        assert torch.allclose(o[col], torch.stack([ex, ey, v[col, :, 2]], -1), atol=TOL, rtol=0)
    for row in range(grid[0]):  # column 0: token row * gw
        t, angle = row * grid[1], -row * omega / 2
        ex, ez = rope(v[t, :, 0], v[t, :, 2], angle)
        assert torch.allclose(o[t], torch.stack([ex, v[t, :, 1], ez], -1), atol=TOL, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 30])
def test_contiguous_form_is_blocked_grouping_on_reordered_channels(head_dim):
    """The exporter's form: q/k channels reordered by ``order`` into the ``blocked`` grouping give
    the contiguous grouping's output reordered the same way, bit for bit (same products and sums)."""
    pe, grid = make(head_dim, prefix=1), (3, 5)
    form = pe.contiguous_qk_form()
    assert form.encoding.config.grouping == "blocked" and form.encoding.contiguous_qk_form() is None
    assert pe.config.grouping == "contiguous"  # the original is unchanged
    assert sorted(form.order.tolist()) == list(range(head_dim))
    x = torch.randn(2, 2, 16, head_dim, dtype=F64)
    ref = pe.apply_qk(x, x, pe.tables(grid).layers[0])[0]
    out = form.encoding.apply_qk(x[..., form.order], x[..., form.order], form.encoding.tables(grid).layers[0])[0]
    assert torch.equal(out, ref[..., form.order])


def test_blocked_tables_are_thirds_and_the_slice_form_equals_the_gather_form():
    pe, grid = make(64, prefix=1, grouping="blocked"), (4, 3)
    full = build_geope_table(grid, 64, pe.config, 1)
    thirds = pe.tables(grid).layers[0]
    assert set(thirds) == {f"c{k}_{a}" for k in range(3) for a in range(3)}
    assert torch.equal(torch.cat([thirds[f"c1_{a}"] for a in range(3)], -1), full[1][:, :63])
    assert torch.equal(full[0][:, 63], torch.ones(13, dtype=F64))  # the tail needs no table: identity
    x = torch.randn(2, 2, 13, 64)  # fp32: bitwise equal, not just close
    idx1, idx2 = partner_indices(64, "blocked")
    expected = apply_geope(x, *(t.float() for t in full), idx1, idx2)
    assert torch.equal(apply_geope_blocked(x, {k: v.float() for k, v in split_blocked_tables(*full).items()}), expected)


def test_app_f_one_d_operator_is_the_two_d_operator_at_double_phase():
    """App. F Eq. 47 R(θ) = [[cos θ, 0, sin θ], [0, 1, 0], [-sin θ, 0, cos θ]] equals R_GeoPE(2θ, 0)."""
    theta = torch.linspace(-20, 20, 101, dtype=F64)
    c, s, z, one = theta.cos(), theta.sin(), torch.zeros_like(theta), torch.ones_like(theta)
    eq47 = torch.stack([torch.stack(r, -1) for r in [[c, z, s], [z, one, z], [-s, z, c]]], -2)
    assert torch.allclose(geope_rotation(2 * theta, z), eq47, atol=TOL, rtol=0)


def test_fused_attention_equals_explicit_relative_rotation_logits():
    """Spec T9 / Eq. 8: SDPA on rotated q, k uses logits qᵀ R_mᵀ R_n k."""
    pe, grid = make(30, prefix=1), (3, 4)
    q, k, v = torch.randn(3, 1, 2, 13, 30, dtype=F64)
    rq, rk = pe.apply_qk(q, k, pe.tables(grid).layers[0])
    fused = F.scaled_dot_product_attention(rq, rk, v)
    ys, xs = torch.meshgrid(torch.arange(3, dtype=F64), torch.arange(4, dtype=F64), indexing="ij")
    omega = geope_frequencies(30)
    blocks = geope_rotation(ys.reshape(-1, 1) * omega, xs.reshape(-1, 1) * omega)  # [12, 10, 3, 3]
    rot = torch.stack([torch.eye(30, dtype=F64)] + [torch.block_diag(*b) for b in blocks])  # [13, 30, 30]
    relative = torch.einsum("mji,njk->mnik", rot, rot)  # R_mᵀ R_n
    logits = torch.einsum("hmi,mnik,hnk->hmn", q[0], relative, k[0]) / math.sqrt(30)
    assert torch.allclose(fused[0], logits.softmax(-1) @ v[0], atol=TOL, rtol=0)


# --- config, module, model and export ------------------------------------------------------


def test_config_validation_lists_choices():
    for field, bad in [
        ("freq_schedule", "paper"),
        ("grouping", "strided"),
        ("coords", "middle"),
        ("prefix_rotation", "origin"),
        ("indivisible_head_dim", "drop"),
    ]:
        with pytest.raises(ValueError, match=rf"{field} must be one of \("):
            GeoPEConfig(**{field: bad})
    with pytest.raises(ValueError, match="base"):
        GeoPEConfig(base=1.0)
    with pytest.raises(ValueError, match="divisible by 3"):
        make(64, indivisible_head_dim="error")
    make(30, indivisible_head_dim="error")


def test_registered_defaults_and_no_checkpoint_state():
    assert "geope" in deploykit.encodings.list_encodings()
    config = get_config("geope")
    assert config == GeoPEConfig() and config.freq_schedule == "rope_neg" and config.base == 100.0
    assert deploykit.encodings.config_from_dict(deploykit.encodings.config_to_dict(config)) == config
    assert make(64).state_dict() == {}  # nothing learned, nothing saved (spec A7)


def test_paper_models_build_with_head_dim_64():
    from deploykit.nn import ViTConfig

    for name, settings in PAPER_MODELS.items():
        cfg = ViTConfig(**settings, encoding=get_config("geope"))
        assert cfg.embed_dim // cfg.num_heads == 64, name


@pytest.fixture(scope="module")
def exported():
    from deploykit.export import onnx_from_model
    from deploykit.nn import create_model

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding=get_config("geope"), depth=2, img_size=64, num_classes=10).eval()
    return model, onnx_from_model(model, (96, 64))


def test_export_is_lint_clean_with_fp32_tables_equal_to_host_tables(exported):
    """Exported in the blocked grouping (q/k channels reordered): no channel Gather (the one Gather
    left picks the class token), and the tables are the float64 host thirds rounded to fp32,
    stored once for both blocks."""
    from dataclasses import replace

    from deploykit.export import lint_graph

    model, proto = exported
    assert lint_graph(proto) == []
    ops = {n.op_type for n in proto.graph.node}
    assert not ops & {"Einsum", "ScatterND", "ScatterElements", "If", "Loop", "Cos", "Sin"}
    constants = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in proto.graph.node if n.op_type == "Constant"})
    assert [constants[n.input[1]].size for n in proto.graph.node if n.op_type == "Gather"] == [1]
    tables = {t.name: t for t in proto.graph.initializer if t.name.startswith("pe_tables.")}
    host = split_blocked_tables(*build_geope_table((6, 4), 64, replace(model.cfg.encoding, grouping="blocked"), num_prefix=1))
    assert tables and set(tables) <= {f"pe_tables.{name}" for name in host}
    stored = [numpy_helper.to_array(t) for t in tables.values()]
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in tables.values())
    for name, ref in host.items():
        if f"pe_tables.{name}" in tables:
            np.testing.assert_array_equal(numpy_helper.to_array(tables[f"pe_tables.{name}"]), ref.float().numpy())
        else:  # the optimiser keeps one copy of equal tables (R[1, 2] = R[2, 1]: c1_1 = c2_2)
            assert any(np.array_equal(t, ref.float().numpy()) for t in stored), name


# ONNX Runtime against float64 torch: tests/export/test_export.py, for every registered encoding.
