"""Run under TRITON_INTERPRET=1 (set before Triton is imported): the SaPE² kernels on CPU against
the float64 reference. Prints one JSON object; plugins/sape2/tests/test_sape2_kernels.py asserts on it."""

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch

from deploykit.encodings.sape2 import MODES, sape2_axis_signatures, sape2_bias_reference
from deploykit.plugins.sape2.kernels import sape2_bias_triton, sape2_signatures_triton


def bias_errors():
    results = []
    g = torch.Generator().manual_seed(0)
    # (grid, prefix, head dim, M, dtype): non-square and square grids, prefix tokens, tables
    # clamped (M - 1 below the grid's side), head sizes 32/80/128, fp16 I/O, and a grid whose
    # tokens span two tiles with a partial last one; every mode of each.
    cases = [
        ((3, 5), 1, 32, 4, torch.float32),
        ((4, 6), 2, 80, 7, torch.float16),
        ((5, 5), 0, 128, 4, torch.float32),
        ((6, 7), 1, 16, 8, torch.float32),
    ]
    for (grid, prefix, d, m, dtype), mode in [(c, mode) for c in cases for mode in range(len(MODES))]:
        q, k = (torch.randn(2, 2, prefix + grid[0] * grid[1], d, generator=g).to(dtype) for _ in range(2))
        tx, ty = (torch.randn(d, m, generator=g) for _ in range(2))
        out = sape2_bias_triton(q, k, tx, ty, grid, 0.4, mode, prefix)
        args64 = [t.double() for t in (q, k, tx, ty)]
        ref = sape2_bias_reference(*args64, grid, 0.4, MODES[mode], prefix)
        zx, zy = sape2_signatures_triton(q, k, tx, ty, grid, 0.4, mode, prefix)
        ref_zx, ref_zy = sape2_axis_signatures(args64[0][:, :, prefix:], args64[1][:, :, prefix:], *args64[2:], grid, 0.4, MODES[mode])
        results.append(
            dict(
                grid=grid,
                prefix=prefix,
                head_dim=d,
                npos_max=m,
                dtype=str(dtype),
                mode=mode,
                out_dtype=str(out.dtype),
                max_err=(out.double() - ref).abs().max().item(),
                max_ref=ref.abs().max().item(),
                signature_shapes=[list(zx.shape), list(zy.shape)],
                signature_err=max((zx.double() - ref_zx).abs().max().item(), (zy.double() - ref_zy).abs().max().item()),
                signature_max=max(ref_zx.abs().max().item(), ref_zy.abs().max().item()),
                diag_zero=bool((out.diagonal(dim1=-2, dim2=-1) == 0).all()),
                symmetric=bool((out == out.transpose(-1, -2)).all()),
                prefix_zero=bool((out[..., :prefix, :] == 0).all() and (out[..., :, :prefix] == 0).all()),
            )
        )
    return results


def cuda_op_route():
    """What ``torch.ops.deploykit.sape2_bias`` runs for CUDA tensors (``_sape2_bias_cuda``), called
    here on CPU tensors the interpreter accepts: fp32/fp16 go to the Triton kernel, float64 to the
    reference (the kernel computes in fp32)."""
    from unittest import mock

    from deploykit.encodings import sape2

    g = torch.Generator().manual_seed(2)
    grid, prefix, d, m = (3, 4), 1, 8, 5
    q, k = (torch.randn(1, 2, prefix + 12, d, generator=g) for _ in range(2))
    tx, ty = (torch.randn(d, m, generator=g) for _ in range(2))
    ref = sape2_bias_reference(*(t.double() for t in (q, k, tx, ty)), grid, 0.5, "k_swap", prefix)
    results = {}
    for name, dtype in (("float32", torch.float32), ("float64", torch.float64)):
        args = [t.to(dtype) for t in (q, k)] + [tx, ty]
        with mock.patch("deploykit.plugins.sape2.kernels.sape2_bias_triton", wraps=sape2_bias_triton) as kernel:
            out = sape2._sape2_bias_cuda(*args, *grid, prefix, 0.5, 2)
        results[name] = dict(kernel_calls=kernel.call_count, out_dtype=str(out.dtype), max_err=(out.double() - ref).abs().max().item())
    return results


if __name__ == "__main__":
    print(json.dumps({"bias": bias_errors(), "cuda_op": cuda_op_route()}))
