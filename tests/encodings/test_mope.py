"""MoPE (Zeris 2026) and EGA-1: identities of ``shared/spec/mope.md`` §2.2, §3 and §8.5."""

import math

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from deploykit.encodings import get_config
from deploykit.encodings.base import TrunkDims
from deploykit.encodings.mope import (  # importing registers "mope"
    PAPER_MODEL,
    EnergyGate,
    MoPE1d,
    MoPE2d,
    MoPEConfig,
    build_mope2d_table,
    build_mope_table,
    causal_mask,
    ega_attention,
    ega_gate_logits,
    ega_log_gate,
    ega_weights_eval,
    ega_weights_train,
    init_mope_params,
    mope_effective_params,
)
from deploykit.encodings.rope import apply_rotary
from deploykit.nn import create_model

F64 = torch.float64
CODE = dict(admissibility=5.0, omega_cap=0.95 * math.pi, sigma_floor=1e-3)  # the authors' forward


def _positions(t):
    return torch.arange(t, dtype=F64)


def _random_params(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    log_omega, log_sigma = init_mope_params(n, "code")
    return log_omega + 0.3 * torch.randn(n, generator=g, dtype=F64), log_sigma + torch.randn(n, generator=g, dtype=F64)


def _sinusoid_swapped(positions, omega):
    """The paper's Eq. 2-3 table (even sin, odd cos), each pair then swapped (digest A1)."""
    phase = positions[:, None] * omega
    sinusoid = torch.stack([phase.sin(), phase.cos()], dim=-1).flatten(-2)
    return sinusoid.unflatten(-1, (-1, 2)).flip(-1).flatten(-2), sinusoid


def test_sigma_infinity_is_the_pair_swapped_sinusoidal_table():
    log_omega, _ = init_mope_params(32, "paper")  # ω_i = 10000^(-2i/64): Vaswani frequencies
    assert torch.allclose(log_omega.exp(), 10000.0 ** (-torch.arange(0, 64, 2, dtype=F64) / 64), rtol=1e-15)
    omega, sigma = mope_effective_params(log_omega, torch.full((32,), math.inf, dtype=F64), **CODE)
    assert torch.equal(omega, log_omega.exp())  # c/σ = 0: the clamp is a no-op
    pos = _positions(300)
    table = build_mope_table(pos, omega, sigma, eps=1e-8)
    swapped, unswapped = _sinusoid_swapped(pos, omega)
    assert torch.equal(table, swapped)
    assert not torch.allclose(table, unswapped, atol=0.1)  # Prop. 1 needs the swap


@pytest.mark.parametrize("finite", [False, True])
def test_rope_form(finite):
    log_omega, log_sigma = _random_params(16)
    sigma_in = log_sigma if finite else torch.full_like(log_sigma, math.inf)
    omega, sigma = mope_effective_params(log_omega, sigma_in, **CODE)
    pos = _positions(40)
    table = build_mope_table(pos, omega, sigma)
    envelope = torch.exp(-(pos[:, None] ** 2) / (2 * sigma**2))  # [T, n]
    g = torch.stack([envelope, torch.zeros_like(envelope)], dim=-1).flatten(-2)  # [G, 0, G, 0, …]
    phase = pos[:, None] * omega
    torch.testing.assert_close(table, apply_rotary(g, phase.cos(), phase.sin()), atol=1e-12, rtol=0)
    if not finite:  # MoPE_∞(b) = R(b)·e
        assert torch.equal(g, torch.tensor([1.0, 0.0], dtype=F64).repeat(40, 16))


def test_dot_product_identity_and_translation_invariance_at_infinity():
    log_omega, log_sigma = _random_params(24, seed=1)
    omega, sigma = mope_effective_params(log_omega, log_sigma, **CODE)
    pos = _positions(30)
    table = build_mope_table(pos, omega, sigma)
    envelope = torch.exp(-(pos[:, None] ** 2) / (2 * sigma**2))
    lag = pos[None, :, None] - pos[:, None, None]  # [m, n, 1]: n - m
    kernel = (envelope[:, None] * envelope[None, :] * torch.cos(omega * lag)).sum(-1)  # Σ G(m)G(n)cos(ω(n-m))
    torch.testing.assert_close(table @ table.T, kernel, atol=1e-12, rtol=0)
    # Midpoint factorisation (digest §2.2-4): C = cos(ωτ) e^{-τ²/4σ²} e^{-((m+n)/2)²/σ²} per pair.
    mid = (pos[:, None, None] + pos[None, :, None]) / 2
    factored = torch.cos(omega * lag) * torch.exp(-(lag**2) / (4 * sigma**2)) * torch.exp(-(mid**2) / sigma**2)
    torch.testing.assert_close(factored.sum(-1), kernel, atol=1e-12, rtol=0)
    # σ = ∞: the RoPE score for unit q = k = e, a function of n - m only.
    inf_omega, inf_sigma = mope_effective_params(log_omega, torch.full_like(log_sigma, math.inf), **CODE)
    gram = build_mope_table(pos, inf_omega, inf_sigma) @ build_mope_table(pos, inf_omega, inf_sigma).T
    torch.testing.assert_close(gram, torch.cos(inf_omega * lag).sum(-1), atol=1e-12, rtol=0)
    for tau in (0, 3, 7):
        diagonal = torch.diagonal(gram, offset=tau)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), atol=1e-12, rtol=0)


def test_admissibility_clamp_values_and_gradients():
    log_omega, log_sigma = _random_params(64, seed=2)
    log_sigma = log_sigma - 1.0  # many dims below ωσ = 5
    omega, sigma = mope_effective_params(log_omega, log_sigma, **CODE)
    assert (omega * sigma >= 5.0 * (1 - 1e-12)).all()
    raw = log_omega.exp().clamp(max=0.95 * math.pi)
    kept = raw * sigma >= 5.0
    assert kept.any() and (~kept).any()
    assert torch.equal(omega[kept], raw[kept])
    torch.testing.assert_close(omega[~kept], 5.0 / sigma[~kept], atol=1e-12, rtol=0)
    # Alg. 1 exactly (no code constants): ω ← max(ω, 5/σ).
    paper_omega, _ = mope_effective_params(log_omega, log_sigma)
    torch.testing.assert_close(paper_omega, torch.maximum(log_omega.exp(), 5.0 / log_sigma.exp()), atol=1e-12, rtol=0)
    # Hard where (code): clamped dims give log ω no gradient; straight-through (App. A.3) does.
    clamped = log_omega.exp() * log_sigma.exp() < 5.0
    for straight, expect_zero in [(False, True), (True, False)]:
        lo = log_omega.clone().requires_grad_()
        w, _ = mope_effective_params(lo, log_sigma, straight_through=straight)
        w.sum().backward()
        assert (lo.grad[clamped] == 0).all() == expect_zero
        assert (lo.grad[~clamped] != 0).all()


def test_inits_sit_on_the_boundary():
    for init in ("code", "paper"):
        log_omega, log_sigma = init_mope_params(128, init)
        product = (log_omega + log_sigma).exp()
        torch.testing.assert_close(product, torch.full((128,), 5.0, dtype=F64), atol=1e-12, rtol=0)
    omega = init_mope_params(128, "code")[0].exp()
    assert omega[0] == 1.0 and abs(omega[-1] - 0.99 * math.pi) < 1e-12  # digest §1.5 code init
    assert abs(init_mope_params(128, "paper")[0].exp()[-1] - 1.0746e-4) < 1e-8  # paper: ω_127 ≈ 0.000107


def test_mope1d_rows_and_offsets():
    pe = MoPE1d(PAPER_MODEL["embed_dim"])
    assert pe.log_omega.shape == (128,)  # 128 pairs, 256 parameters (A6)
    table = pe(256)
    assert table.shape == (256, 256) and table.dtype == F64
    assert torch.equal(table[0], torch.tensor([1.0, 0.0], dtype=F64).repeat(128))  # PE(0) = [1, 0, 1, 0, …]
    assert torch.equal(pe(64), table[:64]) and torch.equal(pe(10, offset=100), table[100:110])
    # σ ≤ 5 at init: fp32 rows are exactly 0 past 14.37σ (digest §8.1, the subnormal limit)
    assert table.abs().max() <= 1.0 and torch.count_nonzero(table[73:].float()) == 0 and table[71].float().any()


def _encoding(**options):
    return MoPE2d(get_config("mope", **options), TrunkDims(32, 2, 1, 1, (4, 4)))


def test_2d_table_layout_prefix_and_axes():
    enc = _encoding()
    table = enc.tables((3, 5)).model["pos_embed"]
    assert table.shape == (1, 1 + 15, 32) and table.dtype == F64
    assert torch.equal(table[0, 0], torch.zeros(32, dtype=F64))  # default prefix: zero row
    omega, sigma = enc.effective_params()
    ys, xs = torch.arange(3, dtype=F64).repeat_interleave(5), torch.arange(5, dtype=F64).repeat(3)
    assert torch.equal(table[0, 1:, :16], build_mope_table(ys, omega[0], sigma[0], 1.0, 1e-8))  # rows, b0 = (3-1)/2
    assert torch.equal(table[0, 1:, 16:], build_mope_table(xs, omega[1], sigma[1], 2.0, 1e-8))  # cols, b0 = (5-1)/2
    unit = _encoding(prefix="unit").tables((3, 5)).model["pos_embed"]
    assert torch.equal(unit[0, 0], torch.tensor([1.0, 0.0], dtype=F64).repeat(16))
    assert torch.equal(unit[0, 1:], table[0, 1:])
    two = build_mope2d_table((3, 5), omega, sigma, "center", 1e-8, num_prefix=2, prefix="unit")  # e.g. cls + register
    assert two.shape == (1, 17, 32) and torch.equal(two[0, :2], unit[0, :1].expand(2, 32))
    assert torch.equal(two[:, 2:], table[:, 1:])


@pytest.mark.parametrize("origin", ["corner", "center"])
def test_2d_envelope_origin(origin):
    table = _encoding(origin=origin).tables((5, 7)).model["pos_embed"][0, 1:].reshape(5, 7, 32)
    amplitude = table.unflatten(-1, (-1, 2)).norm(dim=-1)  # [gh, gw, 16] = G per pair
    peak = (0, 0) if origin == "corner" else (2, 3)
    torch.testing.assert_close(amplitude[peak], torch.ones(16, dtype=F64), atol=1e-15, rtol=0)  # G(b0) = 1
    assert (amplitude <= 1.0 + 1e-15).all()
    rows, cols = amplitude[..., :8], amplitude[..., 8:]  # row half depends on y only, column half on x only
    assert torch.equal(rows, rows[:, :1].expand_as(rows)) and torch.equal(cols, cols[:1].expand_as(cols))
    assert (rows[:, 0].argmax(0) == peak[0]).all() and (cols[0].argmax(0) == peak[1]).all()
    if origin == "center":  # symmetric about the centre
        torch.testing.assert_close(amplitude, amplitude.flip(0).flip(1), atol=1e-12, rtol=0)
    if origin == "corner":  # pair (cos, sin) at the corner patch is (1, 0)
        assert torch.equal(table[0, 0], torch.tensor([1.0, 0.0], dtype=F64).repeat(16))


def test_2d_sigma_infinity_is_axial_sinusoid():
    for origin in ("corner", "center"):
        enc = _encoding(init="paper", origin=origin)
        with torch.no_grad():
            enc.log_sigma.fill_(math.inf)
        table = enc.tables((3, 4)).model["pos_embed"][0, 1:]
        omega = enc.log_omega.to(F64).exp()
        ys, xs = torch.arange(3, dtype=F64).repeat_interleave(4), torch.arange(4, dtype=F64).repeat(3)
        expect = torch.cat([_sinusoid_swapped(ys, omega[0])[0], _sinusoid_swapped(xs, omega[1])[0]], dim=-1)
        assert torch.equal(table, expect)


def test_gradients_reach_omega_and_sigma():
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding=get_config("mope"), depth=1, img_size=64, num_classes=10).double()
    model(torch.randn(2, 3, 64, 64, dtype=F64)).square().sum().backward()
    for p in (model.pos_enc.log_omega, model.pos_enc.log_sigma):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    assert set(k for k in model.state_dict() if "pos_enc" in k) == {"pos_enc.log_omega", "pos_enc.log_sigma"}


def test_config_validation():
    bad_options = [dict(init="dyadic"), dict(origin="learned"), dict(prefix="learned"), dict(clamp_grad="soft")]
    for bad in [*bad_options, dict(admissibility=0.0), dict(sigma_floor=-1.0)]:
        with pytest.raises(ValueError):
            MoPEConfig(**bad)
    with pytest.raises(ValueError, match="divisible by 4"):
        MoPE2d(MoPEConfig(), TrunkDims(30, 2, 1, 1, (4, 4)))
    assert PAPER_MODEL["embed_dim"] // PAPER_MODEL["num_heads"] == 32


# ----------------------------------------------------------------------------------------------- EGA


def _ega_inputs(t=9, heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, heads, t, t, generator=g, dtype=F64) * 3
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)  # causal
    energy = torch.randn(2, heads, t, generator=g, dtype=F64)
    alpha, tau = torch.tensor([2.0, 0.5, 5.0], dtype=F64), torch.tensor([0.0, 0.35, -1.0], dtype=F64)
    return scores, ega_gate_logits(energy, alpha, tau)


def test_ega_eval_form_equals_gated_renormalised_form():
    scores, z = _ega_inputs()
    train = ega_weights_train(scores, torch.sigmoid(z))
    torch.testing.assert_close(ega_weights_eval(scores, ega_log_gate(z)), train, atol=1e-12, rtol=0)
    torch.testing.assert_close(train.sum(-1), torch.ones(2, 3, 9, dtype=F64), atol=1e-12, rtol=0)
    v = torch.randn(2, 3, 9, 4, dtype=F64)  # the attention path, via queries/keys giving these scores
    q, k = torch.eye(9, dtype=F64).expand(2, 3, 9, 9), torch.randn(2, 3, 9, 9, dtype=F64)
    s = q @ k.transpose(-1, -2) / 3.0
    s_causal = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -math.inf)
    expect = ega_weights_train(s_causal, torch.sigmoid(z)) @ v
    torch.testing.assert_close(ega_attention(q, k, v, ega_log_gate(z), causal_mask(9)), expect, atol=1e-12, rtol=0)


def test_ega_gate_statistics_and_limits():
    scores, _ = _ega_inputs()
    energy = torch.randn(2, 3, 9, dtype=F64)
    z = ega_gate_logits(energy, torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64))  # α = 0: plain attention
    torch.testing.assert_close(ega_weights_train(scores, torch.sigmoid(z)), scores.softmax(-1), atol=1e-12, rtol=0)
    e = ega_gate_logits(energy, torch.ones(3, dtype=F64), torch.zeros(3, dtype=F64))  # the z-score itself
    torch.testing.assert_close(e.mean(-1), torch.zeros(2, 3, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(e.std(-1, correction=0), torch.ones(2, 3, dtype=F64), atol=1e-12, rtol=0)
    alpha, tau = torch.full((3,), 2.0, dtype=F64), torch.full((3,), 0.5, dtype=F64)
    one = ega_gate_logits(torch.randn(1, 3, 1, dtype=F64), alpha, tau)
    assert torch.equal(one, torch.full((1, 3, 1), -1.0, dtype=F64))  # T = 1: e = 0, z = -ατ
    gate = EnergyGate(16, 3)
    assert gate(torch.randn(2, 5, 16).half()).dtype == torch.float32  # gate math never in fp16


def test_paper_model_builds_a_mope_table_and_gate():
    d, h, t = PAPER_MODEL["embed_dim"], PAPER_MODEL["num_heads"], PAPER_MODEL["context"]
    x = torch.randn(2, t, d)
    assert (x + MoPE1d(d)(t).float()).shape == (2, t, d)
    assert EnergyGate(d, h, PAPER_MODEL["ega_alpha_init"], PAPER_MODEL["ega_tau_init"])(x).shape == (2, h, t)


# ------------------------------------------------------------------------------------------- export


@pytest.mark.slow
def test_export_smoke():
    from deploykit.export import lint_graph, onnx_from_model

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16", encoding=get_config("mope"), depth=2, img_size=64, num_classes=10).eval()
    with torch.no_grad():  # a non-trivial table: move parameters off the init
        model.pos_enc.log_sigma.add_(torch.randn_like(model.pos_enc.log_sigma))
    proto = onnx_from_model(model, (96, 64))
    assert lint_graph(proto) == []
    assert not {n.op_type for n in proto.graph.node} & {"Cos", "Sin", "Exp", "ScatterND"}
    tables = {t.name: t for t in proto.graph.initializer if t.name.startswith("pe_tables.")}
    assert list(tables) == ["pe_tables.pos_embed"] and tables["pe_tables.pos_embed"].data_type == onnx.TensorProto.FLOAT
    host = model.pos_enc.tables((6, 4)).model["pos_embed"].detach()
    np.testing.assert_array_equal(numpy_helper.to_array(tables["pe_tables.pos_embed"]), host.float().numpy())
    # ONNX Runtime against float64 torch: tests/export/test_export.py, for every registered encoding.


class _EgaEval(torch.nn.Module):
    """One causal EGA head block in eval form: ``softmax(qkᵀ/√d + log g) v``."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.gate = heads, torch.nn.Linear(dim, 3 * dim, bias=False), EnergyGate(dim, heads)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return ega_weights_eval(scores, ega_log_gate(self.gate(x))) @ v


def test_ega_eval_form_exports_to_onnx():
    from deploykit.runners.onnxrt import OnnxrtRunner

    torch.manual_seed(0)
    module = _EgaEval().eval()
    with torch.no_grad():
        module.gate.proj.weight.normal_()
    x = torch.randn(2, 11, 16)
    program = torch.onnx.export(module, (x,), dynamo=True, opset_version=18, input_names=["x"], output_names=["y"])
    with OnnxrtRunner(program.model_proto.SerializeToString()) as runner:
        out = runner.infer({"x": x.numpy()})["y"]
    with torch.no_grad():
        ref = module.double()(x.double()).numpy()
    np.testing.assert_allclose(out, ref, atol=1e-5)
