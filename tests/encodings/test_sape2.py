"""SaPE²: the golden example and identities of ``shared/spec/sape2.md`` §6.4 and §8.8."""

import itertools
import math

import pytest
import torch

from deploykit.encodings import get_config
from deploykit.encodings.sape2 import (
    MODES,
    PAPER_MODEL,
    SaPE2Config,
    pairwise_distance,
    pairwise_distances_gram,
    sape2_axis_signatures,
    sape2_bias,
    sape2_bias_reference,
)
from deploykit.nn import create_model

F64 = torch.float64


def _golden_inputs():
    """Spec §6.4: B = h = 1, 2×2 grid, d = 2, M = 3, scale 1."""
    q = torch.tensor([[1, 0], [0, 1], [1, 1], [-1, 0.5]], dtype=F64)[None, None]
    k = torch.tensor([[0.5, -1], [2, 0], [0, 0], [1, -1]], dtype=F64)[None, None]
    ex = torch.tensor([[0, 1], [1, 0], [2, -1]], dtype=F64).T  # columns e[0], e[1], e[2]
    ey = torch.tensor([[1, 0], [0, 1], [0.5, 0]], dtype=F64).T
    return q, k, ex, ey


# Copied from the spec's table (computed there independently, in float64).
GOLDEN = {
    "q": (
        [[1.5032564092, 0.8807970780], [0.2310585786, 0.5], [1, 1], [-0.5236382857, 0.2263617143]],
        [[0.0612296656, 0.5], [0.7689414214, 0.2689414214], [1, 1], [-0.5475573313, -0.7263617143]],
        dict(b01=2.0724416658, b02=1.5808022091, b03=3.4990814258, b12=1.6839120118, b13=2.4531665588, b23=4.0272581358),
    ),
    "k": (
        [[1.2548846138, 0.3211956170], [1.5378828427, 1], [0, 0], [0.3648510476, -0.6351489524]],
        [[-0.8469258360, -0.25], [0.4621171573, 1.4621171573], [0, 0], [0.3967431083, 0.6351489524]],
        dict(b01=2.8906461385, b02=2.1783920093, b03=2.8329278432, b12=3.3678240236, b13=2.8419387179, b23=1.4813610940),
    ),
    "k_swap": (
        [[0.3371011289, -0.5965878679], [2.7615941560, 1], [0, 0], [0.3648510476, -0.6351489524]],
        [[-1, -0.0663110032], [0.7615941560, 1.7615941560], [0, 0], [0.0972661096, 0.6351489524]],
        dict(b01=5.4415665830, b02=1.6874364532, b03=1.3498286695, b12=4.8562505720, b13=4.2091446138, b23=1.3750358208),
    ),
}


@pytest.mark.parametrize("mode", MODES)
def test_golden_four_token_example(mode):
    q, k, ex, ey = _golden_inputs()
    zx, zy = sape2_axis_signatures(q, k, ex, ey, (2, 2), 1.0, mode)
    want_x, want_y, pairs = GOLDEN[mode]
    torch.testing.assert_close(zx[0, 0], torch.tensor(want_x, dtype=F64), atol=1e-9, rtol=0)
    torch.testing.assert_close(zy[0, 0], torch.tensor(want_y, dtype=F64), atol=1e-9, rtol=0)
    expect = torch.zeros(4, 4, dtype=F64)
    for name, value in pairs.items():
        i, j = int(name[1]), int(name[2])
        expect[i, j] = expect[j, i] = value
    torch.testing.assert_close(sape2_bias_reference(q, k, ex, ey, (2, 2), 1.0, mode)[0, 0], expect, atol=1e-9, rtol=0)
    op = sape2_bias(q, k, ex, ey, 2, 2, 0, 1.0, MODES.index(mode))  # the custom op, float64 kept
    assert op.dtype == F64
    torch.testing.assert_close(op[0, 0], expect, atol=1e-9, rtol=0)


def _naive_signatures(q, k, ex, ey, grid, scale, mode):
    """Eq. 9-14 entry by entry with Python loops: an oracle independent of the tensor code."""
    H, W = grid
    a, b, c = {"q": (q, k, q), "k": (q, k, k), "k_swap": (k, q, k)}[mode]
    M = ex.shape[1]

    def interp(vec, table, p):
        p = min(p, M - 1)
        lo = math.floor(p)
        hi = math.ceil(p)
        return (p - lo) * float(vec @ table[:, hi]) + (1 - p + lo) * float(vec @ table[:, lo])

    zx = torch.zeros(H * W, W, dtype=F64)
    zy = torch.zeros(H * W, H, dtype=F64)
    for y, x in itertools.product(range(H), range(W)):
        t = y * W + x
        for m in range(W):  # Eq. 10: tokens of t's row from column m to the right edge
            p = sum(float(torch.sigmoid(scale * (a[t] @ b[y * W + j]))) for j in range(m, W))
            zx[t, m] = interp(c[t], ex, p)
        for m in range(H):  # column analogue, towards the bottom edge
            p = sum(float(torch.sigmoid(scale * (a[t] @ b[j * W + x]))) for j in range(m, H))
            zy[t, m] = interp(c[t], ey, p)
    return zx, zy


@pytest.mark.parametrize("mode", MODES)
def test_non_square_grid_matches_entrywise_oracle(mode):
    g = torch.Generator().manual_seed(1)
    H, W, d, M = 3, 5, 4, 4  # M < W: positions clamp at M - 1
    q, k = torch.randn(2, 1, H * W, d, generator=g, dtype=F64).unbind(0)
    ex, ey = torch.randn(2, d, M, generator=g, dtype=F64).unbind(0)
    zx, zy = sape2_axis_signatures(q[None], k[None], ex, ey, (H, W), 0.7, mode)
    want_x, want_y = _naive_signatures(q[0], k[0], ex, ey, (H, W), 0.7, mode)
    torch.testing.assert_close(zx[0, 0], want_x, atol=1e-12, rtol=0)
    torch.testing.assert_close(zy[0, 0], want_y, atol=1e-12, rtol=0)
    bias = sape2_bias_reference(q[None], k[None], ex, ey, (H, W), 0.7, mode)[0, 0]
    dist = lambda z: torch.stack([torch.stack([(z[i] - z[j]).norm() for j in range(H * W)]) for i in range(H * W)])
    torch.testing.assert_close(bias, dist(want_x) + dist(want_y), atol=1e-12, rtol=0)


def _random(H=4, W=6, heads=3, d=8, M=7, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, H * W, d, generator=g, dtype=F64) for _ in range(2))
    ex, ey = (torch.randn(d, M, generator=g, dtype=F64) for _ in range(2))
    return q, k, ex, ey, (H, W)


@pytest.mark.parametrize("mode", MODES)
def test_metric_properties(mode):
    q, k, ex, ey, grid = _random()
    zx, zy = sape2_axis_signatures(q, k, ex, ey, grid, 0.35, mode)
    bias = sape2_bias_reference(q, k, ex, ey, grid, 0.35, mode)
    assert torch.equal(bias, bias.transpose(-1, -2))
    assert (bias >= 0).all() and (bias.diagonal(dim1=-2, dim2=-1) == 0).all()  # exactly 0: direct form
    for term in (pairwise_distance(zx), pairwise_distance(zy)):  # each axis term is a (pseudo)metric
        # d(i, j) <= d(i, l) + d(l, j) for every triple
        slack = term[..., :, None, :] + term[..., None, :, :].transpose(-1, -3) - term[..., :, :, None]
        assert (slack >= -1e-12).all()
    assert bias.abs().max() > 1  # the tables are std 1: a real signal


def test_row_and_column_permutations_permute_their_own_term():
    q, k, ex, ey, (H, W) = _random(H=5, W=4)
    zx, zy = sape2_axis_signatures(q, k, ex, ey, (H, W), 0.5, "k")
    grid_idx = torch.arange(H * W).reshape(H, W)
    for axis, perm in [(0, torch.tensor([3, 0, 4, 2, 1])), (0, torch.arange(H).roll(1)), (1, torch.tensor([2, 0, 3, 1]))]:
        tokens = (grid_idx[perm] if axis == 0 else grid_idx[:, perm]).reshape(-1)  # permuted token order
        px, py = sape2_axis_signatures(q[:, :, tokens], k[:, :, tokens], ex, ey, (H, W), 0.5, "k")
        same, other = (pairwise_distance(px), pairwise_distance(zx)), (pairwise_distance(py), pairwise_distance(zy))
        if axis == 1:
            same, other = other, same
        # whole rows (axis 0) moved: the row term follows the tokens exactly (bx(ΠX) = Π bx Πᵀ)
        assert torch.equal(same[0], same[1][..., tokens[:, None], tokens[None, :]])
        # the other term does not (SaPE² is not translation-equivariant, spec §8.8-8)
        assert not torch.allclose(other[0], other[1][..., tokens[:, None], tokens[None, :]], atol=1e-3)


def test_prefix_rows_and_columns_are_zero_and_patch_block_unchanged():
    q, k, ex, ey, grid = _random()
    g = torch.Generator().manual_seed(5)
    prefix_q, prefix_k = (torch.randn(2, 3, 2, 8, generator=g, dtype=F64) for _ in range(2))
    full = sape2_bias_reference(torch.cat([prefix_q, q], 2), torch.cat([prefix_k, k], 2), ex, ey, grid, 0.5, "q", 2)
    assert full.shape == (2, 3, 26, 26)
    assert (full[..., :2, :] == 0).all() and (full[..., :, :2] == 0).all()
    # (not bitwise: the sliced inputs take another matmul path)
    torch.testing.assert_close(full[..., 2:, 2:], sape2_bias_reference(q, k, ex, ey, grid, 0.5, "q"), atol=1e-12, rtol=0)


def test_position_linear_table_is_exact_and_k_zero_gates_are_half():
    q, _, _, _, (H, W) = _random(H=3, W=5, M=8)
    d = q.shape[-1]
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(d, 1, generator=g, dtype=F64), torch.randn(d, 1, generator=g, dtype=F64)
    table = a + torch.arange(8, dtype=F64) * b  # e[p] = a + p·b, M - 1 ≥ W: nothing clamps
    k = torch.zeros_like(q)  # Q mode, K = 0: every gate is 1/2, p_m = (W - m) / 2
    zx, zy = sape2_axis_signatures(q, k, table, table, (H, W), 0.9, "q")
    qa, qb = q @ a, q @ b  # [B, h, N, 1]
    torch.testing.assert_close(zx, qa + (W - torch.arange(W, dtype=F64)) / 2 * qb, atol=1e-12, rtol=0)
    torch.testing.assert_close(zy, qa + (H - torch.arange(H, dtype=F64)) / 2 * qb, atol=1e-12, rtol=0)


def test_heads_and_batch_are_independent_and_tables_shared_across_heads():
    q, k, ex, ey, grid = _random(heads=4)
    bias = sape2_bias_reference(q, k, ex, ey, grid, 0.5, "k")
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(sape2_bias_reference(q[:, perm], k[:, perm], ex, ey, grid, 0.5, "k"), bias[:, perm], atol=0, rtol=0)
    torch.testing.assert_close(sape2_bias_reference(q[1:], k[1:], ex, ey, grid, 0.5, "k"), bias[1:], atol=0, rtol=0)


def _flat_region(q, k, start, length):
    """Tokens ``start…start+length`` all equal to token ``start`` (a flat patch of an image): their
    signatures coincide, where the matrix-product form's rounding is largest."""
    for t in (q, k):
        t[..., start : start + length, :] = t[..., start : start + 1, :]
    return q, k


def _within_fp32_criterion(out, reference):
    """Issue 51's criterion for the fp32 bias: within 1e-3 × the float64 reference's largest value,
    exact zeros where Eq. 15 and A6 have them, no NaN."""
    assert torch.isfinite(out).all()
    error = (out.double() - reference).abs().max() / reference.abs().max()
    assert error <= 1e-3, f"{error:.2e} of the largest bias"
    assert (out.diagonal(dim1=-2, dim2=-1) == 0).all()
    return error


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "grid,prefix,M,std",
    [((14, 14), 1, 15, 1.0), ((12, 20), 1, 9, 0.02), ((24, 24), 0, 25, 1.0)],  # 224/16, non-square + clamping, 384/16
)
def test_fp32_op_within_criterion_of_float64_direct_form(mode, grid, prefix, M, std):
    g = torch.Generator().manual_seed(11)
    N, d = grid[0] * grid[1], 64
    q, k = (torch.randn(1, 2, prefix + N, d, generator=g, dtype=F64) for _ in range(2))
    q, k = _flat_region(q, k, prefix + grid[1], 2 * grid[1])  # rows 1 and 2 alike: their row terms coincide
    ex, ey = (torch.randn(d, M, generator=g, dtype=F64) * std for _ in range(2))
    reference = sape2_bias_reference(q, k, ex, ey, grid, d**-0.5, mode, prefix)
    out = sape2_bias(*(t.float() for t in (q, k, ex, ey)), *grid, prefix, d**-0.5, MODES.index(mode))
    assert out.dtype == torch.float32
    _within_fp32_criterion(out, reference)
    assert (out[..., :prefix, :] == 0).all() and (out[..., :, :prefix] == 0).all()
    zx, _ = sape2_axis_signatures(q[:, :, prefix:], k[:, :, prefix:], ex, ey, grid, d**-0.5, mode)
    coinciding = pairwise_distance(zx)[..., grid[1] : 3 * grid[1], grid[1] : 3 * grid[1]]
    assert coinciding.max() < 1e-12 * reference.max()  # the case is exercised: zero row terms
    flat = sape2_bias(*(t.float() for t in (q[..., :1, :].expand_as(q), k[..., :1, :].expand_as(k), ex, ey)), *grid, prefix, d**-0.5, 1)
    # a flat image: every signature equal, so every distance is 0; the square's rounding is
    # taken back with each token's own diagonal entry (sqrt(ε)·|Z| ≈ 3e-4 of the bias without)
    assert flat.abs().max() <= 1e-5 * reference.abs().max()


def test_centring_keeps_the_matrix_product_form_exact_where_the_plain_gram_form_is_not():
    # Signatures far from the origin relative to their spread (a table with a large constant
    # part): ‖z‖² ≫ the squared distances, the case the Gram form's cancellation ruins.
    g = torch.Generator().manual_seed(3)
    zx, zy = (200.0 + torch.randn(1, 2, 150, L, generator=g, dtype=F64) for L in (15, 10))
    reference = pairwise_distance(zx) + pairwise_distance(zy)
    out = pairwise_distances_gram(zx.float(), zy.float())
    error = _within_fp32_criterion(out, reference)

    def plain_gram(z):  # control: the same product without centring
        norm = (z * z).sum(-1, keepdim=True)
        return (norm + norm.transpose(-1, -2) - 2 * z @ z.transpose(-1, -2)).clamp_min(0).sqrt()

    plain = plain_gram(zx.float()) + plain_gram(zy.float())
    plain_error = (plain.double() - reference).abs().max() / reference.abs().max()
    assert plain_error > 1e-3 and plain_error > 30 * error


@pytest.mark.slow
def test_custom_op_computes_half_inputs_in_fp32_and_has_reference_gradients():
    q, k, ex, ey, grid = _random(H=3, W=4, heads=2, d=4, M=5, batch=1)
    q, k = (torch.cat([t[:, :, :1], t], 2) for t in (q, k))  # one prefix token
    half = sape2_bias(q.half(), k.half(), ex.half(), ey.half(), *grid, 1, 0.5, 1)
    assert half.dtype == torch.float16
    fp32 = sape2_bias(*(t.half().float() for t in (q, k, ex, ey)), *grid, 1, 0.5, 1)
    torch.testing.assert_close(half, fp32.half(), atol=0, rtol=0)  # fp32 inside, one rounding at the end
    inputs = [t.clone().requires_grad_() for t in (q, k, ex, ey)]
    torch.autograd.gradcheck(lambda *t: sape2_bias(*t, *grid, 1, 0.5, 2), inputs)
    out = sape2_bias(*inputs, *grid, 1, 0.5, 2)
    assert torch.isfinite(torch.autograd.grad(out.sum(), inputs[0])[0]).all()  # no NaN from sqrt at 0


def test_zero_tables_reduce_exactly_to_the_baseline_vit():
    torch.manual_seed(0)
    base = create_model("vit_tiny_patch16", encoding="ape", depth=2, img_size=64, num_classes=10).double().eval()
    sape = create_model("vit_tiny_patch16", encoding="sape2+ape", depth=2, img_size=64, num_classes=10).double().eval()
    missing, unexpected = sape.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(".sape_" in key for key in missing)
    with torch.no_grad():
        for p in sape.pos_enc.blocks.parameters():
            p.zero_()
        x = torch.randn(2, 3, 96, 64, dtype=F64)
        tables = sape.tables((6, 4), F64)
        q = torch.randn(2, 3, 25, 64, dtype=F64)
        assert not sape.pos_enc.logits_bias(q, q, tables.layers[0], (6, 4)).any()  # bias ≡ 0
        torch.testing.assert_close(sape(x), base(x), atol=1e-13, rtol=0)
        for p in sape.pos_enc.blocks.parameters():
            p.normal_()
        assert not torch.allclose(sape(x), base(x), atol=1e-3)


def test_eq16_scaling_and_config_defaults():
    dims_model = create_model("vit_tiny_patch16", encoding="sape2", depth=1, img_size=64, num_classes=10)
    enc = dims_model.pos_enc
    assert enc.npos_max == 5 and enc.gate_scale == 64**-0.5  # max(4, 4) + 1; head_dim 64
    assert enc.blocks[0].sape_x.pos_emb.shape == (1, 64, 5)
    q, k = torch.randn(2, 2, 3, 17, 64).unbind(0)
    tables = {key: value.float() for key, value in enc.tables((4, 4)).layers[0].items()}
    learned = [unit.pos_emb[0].detach() for unit in (enc.blocks[0].sape_x, enc.blocks[0].sape_y)]
    torch.testing.assert_close(tables["table_x"], learned[0] / 8)  # the tables carry the 1/√d
    raw = sape2_bias(q, k, *learned, 4, 4, 1, 0.125, MODES.index("k"))
    torch.testing.assert_close(enc.logits_bias(q, k, tables, (4, 4)), raw / 8)  # Eq. 16: (q·k + b) / √d
    other = create_model(
        "vit_tiny_patch16",
        encoding=get_config("sape2", bias_divided_by_sqrt_d=False, npos_max=3, mode="q"),
        depth=1,
        img_size=64,
        num_classes=10,
    ).pos_enc
    tables = {key: value.float() for key, value in other.tables((4, 4)).layers[0].items()}
    assert tables["table_x"].shape == (64, 3)
    torch.testing.assert_close(other.logits_bias(q, k, tables, (4, 4)), sape2_bias(q, k, *tables.values(), 4, 4, 1, 0.125, 0))
    paper = create_model("vit_small_patch4_32", encoding="sape2+ape", num_classes=10).pos_enc
    assert paper.npos_max == 9 and paper.dims.grid == (8, 8) and len(paper.blocks) == PAPER_MODEL["depth"]


def test_config_validation():
    for bad in (dict(mode="both"), dict(npos_max=0), dict(gate_scale=-1.0), dict(distance="gram"), dict(prefix_bias="learned")):
        with pytest.raises(ValueError):
            SaPE2Config(**bad)
