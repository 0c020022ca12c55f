"""WePE: exact ℘/℘′ against an independent mpmath theta-function oracle, the identities of spec
``wepe.md`` §8.3, the LUT error, gradients, and export."""

import math

import mpmath
import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from deploykit.encodings import get_config
from deploykit.encodings.base import TrunkDims
from deploykit.encodings.wepe import (  # importing registers "wepe"
    LEMNISCATE,
    PAPER_MODEL,
    WePE,
    WePEConfig,
    _WeierstrassFeatures,
    build_wepe_lut,
    lattice_invariants,
    lattice_roots,
    lut_features,
    measure_lut_error,
    patch_centres,
    weierstrass_p,
    wepe_features,
)
from deploykit.errors import ConfigError
from deploykit.nn import create_model

F64 = torch.float64
G2_ONE = 1.8540746773013719  # Γ²(¼)/(4√π): the square lattice with g2 = 1 (spec §1.3)
DIMS = TrunkDims(embed_dim=32, num_heads=2, depth=1, num_prefix_tokens=1, grid=(4, 4))
LATTICES = [(LEMNISCATE, LEMNISCATE), (G2_ONE, G2_ONE), (LEMNISCATE, 0.7549461016), (1.0, 3.0)]
POINTS = [complex(x, y) for x in (-2.3, -0.4, 0.05, 0.9, 1.7, 3.1, 6.0) for y in (-1.9, -0.3, 0.02, 0.6, 1.4, 4.4)]


def mp_wp(z, w1, w3):
    """℘, ℘′ by Jacobi theta functions (DLMF 23.6.2, 23.6.5), mpmath at 30 digits.

    ``℘ = e1 + (c θ3 θ4 θ2(ν)/θ1(ν))²``, ``c = π/2ω1``, ``ν = cz``, ``q = e^{−πω3/ω1}``.
    """
    with mpmath.workdps(30):
        z, w1, w3 = mpmath.mpc(z), mpmath.mpf(w1), mpmath.mpf(w3)
        c, q = mpmath.pi / (2 * w1), mpmath.exp(-mpmath.pi * w3 / w1)
        th = lambda n, x, d=0: mpmath.jtheta(n, x, q, d)
        e1 = c**2 * (th(2, 0) ** 4 + 2 * th(4, 0) ** 4) / 3
        amp, nu = c * th(3, 0) * th(4, 0), c * z
        g = th(2, nu) / th(1, nu)
        dg = (th(2, nu, 1) * th(1, nu) - th(2, nu) * th(1, nu, 1)) / th(1, nu) ** 2
        return complex(e1 + (amp * g) ** 2), complex(2 * amp**2 * g * dg * c)


def mp_invariants(w1, w3):
    """``g2 = (π/ω1)⁴E4/12``, ``g3 = (π/ω1)⁶E6/216`` by Eisenstein q-series, ``q = e^{−2πω3/ω1}`` (spec §1.3)."""
    with mpmath.workdps(30):
        q = mpmath.exp(-2 * mpmath.pi * mpmath.mpf(w3) / w1)
        sigma = lambda k, n: sum(d**k for d in range(1, n + 1) if n % d == 0)
        e4 = 1 + 240 * sum(sigma(3, n) * q**n for n in range(1, 80))
        e6 = 1 - 504 * sum(sigma(5, n) * q**n for n in range(1, 80))
        k = mpmath.pi / w1
        return float(k**4 * e4 / 12), float(k**6 * e6 / 216)


def make(seed=0, dims=DIMS, **options):
    torch.manual_seed(seed)
    return WePE(WePEConfig(**options), dims)


@pytest.mark.parametrize("w1,w3", LATTICES)
def test_wp_matches_mpmath_theta_oracle(w1, w3):
    wp, dwp = weierstrass_p(np.array(POINTS), w1, w3)
    for z, p, dp in zip(POINTS, wp, dwp):
        ref_p, ref_dp = mp_wp(z, w1, w3)
        assert abs(p - ref_p) <= 1e-12 * abs(ref_p), (z, p, ref_p)
        assert abs(dp - ref_dp) <= 1e-12 * abs(ref_dp), (z, dp, ref_dp)


def test_spec_reference_values():
    # spec §8.3, ω1 = ω3′ = ϖ, 12 significant figures.
    table = {
        0.5 + 0.25j: (1.92234226225 - 2.55687444081j, -2.03551159942 + 11.2702625076j),
        1.0 + 1.0j: (-0.475413484949j, 0.523765862074 + 0.523765862074j),
        0.3 + 1.7j: (-0.350984850636 - 0.100892040834j, 0.205842124877 - 0.29103886225j),
        0.187289825307 * (1 + 1j): (-14.253283273j, 76.1121809565 + 76.1121809565j),
        LEMNISCATE / 2: (0.603553390593, -0.853553390593),
    }
    wp, dwp = weierstrass_p(np.array(list(table)), LEMNISCATE, LEMNISCATE)
    for (p_ref, dp_ref), p, dp in zip(table.values(), wp, dwp):
        assert abs(p - p_ref) <= 1e-11 * max(1, abs(p_ref)) and abs(dp - dp_ref) <= 1e-11 * max(1, abs(dp_ref))


@pytest.mark.parametrize("w1,w3", LATTICES)
def test_differential_equation_and_invariants(w1, w3):
    g2, g3 = lattice_invariants(w1, w3)
    ref_g2, ref_g3 = mp_invariants(w1, w3)
    scale = max(abs(ref_g2), abs(ref_g3), 1.0)
    assert abs(g2 - ref_g2) <= 1e-12 * scale and abs(g3 - ref_g3) <= 1e-12 * scale
    wp, dwp = weierstrass_p(np.array(POINTS), w1, w3)
    residual = np.abs(dwp**2 - (4 * wp**3 - ref_g2 * wp - ref_g3))  # Eq. 17
    assert np.all(residual <= 1e-11 * np.maximum(np.abs(dwp) ** 2, 1.0))


def test_default_lattice_is_g2_quarter_not_one():
    # Thm B.9's ω1 = ϖ gives g2 = 1/4 (spec §7.1); g2 = 1 needs ω1 = Γ²(¼)/(4√π).
    assert lattice_invariants(LEMNISCATE, LEMNISCATE) == pytest.approx((0.25, 0.0), abs=1e-14)
    assert lattice_invariants(G2_ONE, G2_ONE) == pytest.approx((1.0, 0.0), abs=1e-13)


@pytest.mark.parametrize("w1,w3", LATTICES)
def test_half_periods(w1, w3):
    halves = np.array([w1, w1 + 1j * w3, 1j * w3])
    wp, dwp = weierstrass_p(halves, w1, w3)
    e = lattice_roots(w1, w3)
    assert np.max(np.abs(dwp)) <= 1e-12 * max(1.0, max(abs(x) for x in e) ** 1.5)
    assert np.allclose(wp, e, rtol=0, atol=1e-13 * max(1.0, *map(abs, e)))
    assert abs(sum(e)) <= 1e-13 * max(map(abs, e))
    assert e[0] > e[1] > e[2]
    if w1 == w3 == LEMNISCATE:
        assert e == pytest.approx((0.25, 0.0, -0.25), abs=1e-15)


def test_periodicity_parity_and_square_symmetry():
    z = np.array(POINTS)
    wp, dwp = weierstrass_p(z, LEMNISCATE, 0.9)
    for shift in (2 * LEMNISCATE, 1.8j, 4 * LEMNISCATE - 3.6j):
        p, dp = weierstrass_p(z + shift, LEMNISCATE, 0.9)
        np.testing.assert_allclose(p, wp, rtol=1e-11)
        np.testing.assert_allclose(dp, dwp, rtol=1e-11)
    p, dp = weierstrass_p(-z, LEMNISCATE, 0.9)
    np.testing.assert_allclose(p, wp, rtol=1e-13)
    np.testing.assert_allclose(dp, -dwp, rtol=1e-13)
    p_sq, _ = weierstrass_p(z, LEMNISCATE, LEMNISCATE)
    np.testing.assert_allclose(weierstrass_p(1j * z, LEMNISCATE, LEMNISCATE)[0], -p_sq, rtol=1e-12)


def test_cross_resolution_identity():
    # spec §8.3 item 9: PE(3H, 3W)[3i+1, 3j+1] = PE(H, W)[i, j] for direct evaluation.
    enc = make(dims=TrunkDims(32, 2, 1, 1, (5, 7)))
    coarse = enc.tables((5, 7)).model["pos_embed"].detach()
    fine = enc.tables((15, 21)).model["pos_embed"].detach()
    assert coarse.shape == (1, 1 + 35, 32) and fine.shape == (1, 1 + 315, 32)
    patches = fine[0, 1:].reshape(15, 21, 32)[1::3, 1::3].reshape(35, 32)
    torch.testing.assert_close(patches, coarse[0, 1:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fine[0, 0], coarse[0, 0], rtol=0, atol=0)  # class-token row


def test_features_in_row_major_order_and_mapping():
    cfg = WePEConfig()
    u, v = patch_centres((2, 3))
    feats = wepe_features(u, v, torch.tensor(cfg.omega3_init, dtype=F64), cfg)
    i, j = 1, 2
    z = cfg.alpha_u * (j + 0.5) / 3 * 2 * cfg.omega1 + 1j * cfg.alpha_v * (i + 0.5) / 2 * 2 * cfg.omega3_init
    p, dp = weierstrass_p(z, cfg.omega1, cfg.lattice_omega3)  # lattice stays square by default
    np.testing.assert_allclose(feats[i * 3 + j].numpy(), [p.real, p.imag, dp.real, dp.imag], rtol=1e-14)


def test_lut_error_bound_and_convergence():
    cfg = WePEConfig()
    small, large = measure_lut_error(cfg, 256), measure_lut_error(cfg, 512)
    assert max(small.values()) < 6e-3  # measured 5.0e-3 at the 64×64 grid (module docstring)
    assert max(large.values()) < 1.5e-3
    assert max(large.values()) < max(small.values()) / 3


def test_lut_reads_exact_values_at_nodes():
    cfg = WePEConfig(alpha_u=1.0, alpha_v=1.0)
    lut = build_wepe_lut(cfg.omega3_init, cfg, 9)
    u = torch.tensor([0.25, 0.5, 0.875], dtype=F64)
    v = torch.tensor([0.125, 0.75, 0.5], dtype=F64)
    exact = wepe_features(u, v, torch.tensor(cfg.omega3_init, dtype=F64), cfg).detach()
    torch.testing.assert_close(lut_features(lut, u, v), exact, rtol=1e-12, atol=1e-12)
    assert torch.all(lut[0, 0].abs() == cfg.feature_clamp)  # the pole node is clamped


def test_lut_mode_tables_close_to_exact():
    exact = make(seed=1).tables((14, 14)).model["pos_embed"]
    lut = make(seed=1, evaluation="lut").tables((14, 14)).model["pos_embed"]
    assert (lut - exact).abs().max() < 0.1  # 1.4e-3 feature error, amplified by LayerNorm's 1/std


def test_gradients_reach_every_learned_parameter():
    enc = make()
    enc.tables((4, 4)).model["pos_embed"].square().sum().backward()
    for name, param in enc.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_model_backward_reaches_projection():
    model = create_model("vit_tiny_patch16", encoding=get_config("wepe"), depth=1, img_size=32, num_classes=3)
    model(torch.randn(2, 3, 32, 32)).logsumexp(-1).sum().backward()
    assert model.pos_enc.proj.weight.grad.abs().sum() > 0
    assert model.pos_enc.omega3_raw.grad is not None


def test_feature_gradient_matches_finite_differences():
    x = torch.tensor([0.3, 1.1, 2.0], dtype=F64, requires_grad=True)
    y = torch.tensor([0.2, 0.5, 1.3], dtype=F64, requires_grad=True)
    fn = lambda a, b: _WeierstrassFeatures.apply(a, b, LEMNISCATE, 0.9, 1e4)
    assert torch.autograd.gradcheck(fn, (x, y), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_host_evaluation_is_float64_even_for_half_modules():
    # ℘′ at the corner of a 64×64 grid exceeds fp16's 65504 (spec §8.2); it is never evaluated in fp16.
    enc = make(feature_clamp=1e9, dims=TrunkDims(32, 2, 1, 1, (64, 64))).half()
    feats = enc.raw_features((64, 64))
    assert feats.dtype == F64 and torch.isfinite(feats).all() and feats.abs().max() > 65504
    assert enc.tables((64, 64)).model["pos_embed"].dtype == F64


def test_parameter_count_is_8d_plus_3():
    assert sum(p.numel() for p in make().parameters()) == 8 * DIMS.embed_dim + 3  # spec §1.12


def test_config_options_and_errors():
    assert isinstance(get_config("wepe"), WePEConfig)
    with pytest.raises(ConfigError):
        get_config("wepe", evaluation="series")
    with pytest.raises(ConfigError):
        get_config("wepe", lattice_tracks_omega3=True)  # needs learn_omega3=False
    enc = make(lattice_tracks_omega3=True, learn_omega3=False, omega3_init=LEMNISCATE, alpha_u=1.0, alpha_v=1.0)
    assert not enc.omega3_raw.requires_grad
    two = make(use_derivative=False)
    assert two.proj.in_features == 2 and two.tables((3, 3)).model["pos_embed"].shape == (1, 10, 32)
    code = make(alpha_scale_param="exp")
    assert float(code.alpha_scale().detach()) == pytest.approx(0.15)


def test_clamp_omega3_is_the_authors_bounds_and_off_by_default():
    # W_Ti.py: ω3′ = softplus(α_learn).clamp(0.02, 8.0); a new model keeps the paper's plain softplus.
    for raw, low, high in ((-6.0, 0.02, 0.02), (9.0, 8.0, 8.0), (0.125, 0.02, 8.0)):
        softplus = math.log1p(math.exp(raw))  # raw values exact in float32, the parameter's dtype
        plain, code = make(), make(clamp_omega3=True)
        for enc in (plain, code):
            with torch.no_grad():
                enc.omega3_raw.fill_(raw)
        assert float(code.omega3().detach()) == pytest.approx(min(max(softplus, low), high), rel=1e-12)
        assert float(plain.omega3().detach()) == pytest.approx(softplus, rel=1e-12)
    assert get_config("wepe").clamp_omega3 is False


def test_scale_cls_flag():
    on, off = make(seed=3), make(seed=3, scale_cls=False)
    cls_on, cls_off = on.tables((2, 2)).model["pos_embed"][0, 0], off.tables((2, 2)).model["pos_embed"][0, 0]
    torch.testing.assert_close(cls_on, 0.8 * cls_off)


def test_paper_model_builds():
    model = create_model("vit_tiny_patch16", encoding="wepe", **{**PAPER_MODEL, "depth": 1})
    assert model.pos_enc.dims.grid == (14, 14) and model.pos_enc.dims.embed_dim == 192
    assert math.isclose(float(model.pos_enc.omega3().detach()), WePEConfig().omega3_init, rel_tol=1e-6)


@pytest.mark.slow
def test_export_smoke():
    from deploykit.export import lint_graph, onnx_from_model

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding=get_config("wepe"), depth=2, img_size=64, num_classes=10).eval()
    proto = onnx_from_model(model, (96, 64))
    assert lint_graph(proto) == []
    tables = [t for t in proto.graph.initializer if t.name.startswith("pe_tables.")]
    assert [t.name for t in tables] == ["pe_tables.pos_embed"]
    assert tables[0].data_type == onnx.TensorProto.FLOAT
    host = model.pos_enc.tables((6, 4)).model["pos_embed"].detach()
    assert tuple(tables[0].dims) == (1, 1 + 24, model.cfg.embed_dim)
    np.testing.assert_array_equal(numpy_helper.to_array(tables[0]), host.float().numpy())
    # ONNX Runtime against float64 torch: tests/export/test_export.py, for every registered encoding.
