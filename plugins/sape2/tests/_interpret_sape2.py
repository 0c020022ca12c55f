"""Run under TRITON_INTERPRET=1 (set before Triton is imported): the SaPE² kernels on CPU against
the float64 reference. Prints one JSON object; tests/plugins/test_sape2_kernels.py asserts on it."""

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch

from deploykit.encodings.sape2 import MODES, sape2_bias_reference
from deploykit.plugins.sape2.kernels import sape2_bias_triton


def bias_errors():
    results = []
    g = torch.Generator().manual_seed(0)
    # (grid, prefix, head dim, M, dtype): non-square, prefix tokens, M < W (clamping), fp16 I/O,
    # and a grid whose tokens span two tiles with a partial last one.
    cases = [((3, 5), 1, 8, 4, torch.float32), ((4, 6), 2, 16, 7, torch.float16), ((6, 7), 0, 8, 8, torch.float32)]
    # Both forms of the interpolation (the hat over the whole table, the gather of two columns).
    for (grid, prefix, d, m, dtype), mode, gather in [
        (c, mode, gather) for c in cases for mode in range(len(MODES)) for gather in (False, True)
    ]:
        q, k = (torch.randn(2, 2, prefix + grid[0] * grid[1], d, generator=g).to(dtype) for _ in range(2))
        tx, ty = (torch.randn(d, m, generator=g) for _ in range(2))
        out = sape2_bias_triton(q, k, tx, ty, grid, 0.4, mode, prefix, gather)
        ref = sape2_bias_reference(*(t.double() for t in (q, k, tx, ty)), grid, 0.4, MODES[mode], prefix)
        results.append(
            dict(
                grid=grid,
                prefix=prefix,
                dtype=str(dtype),
                mode=mode,
                gather=gather,
                out_dtype=str(out.dtype),
                max_err=(out.double() - ref).abs().max().item(),
                max_ref=ref.abs().max().item(),
                diag_zero=bool((out.diagonal(dim1=-2, dim2=-1) == 0).all()),
                prefix_zero=bool((out[..., :prefix, :] == 0).all() and (out[..., :, :prefix] == 0).all()),
            )
        )
    return results


def fused_errors():
    """Fused attention vs softmax((q·k + b)/√d) v in float64 (Eq. 16), and the Eq. 16-off variant."""
    from deploykit.plugins.sape2.fused import sape2_attention_triton

    results = []
    g = torch.Generator().manual_seed(1)
    for grid, prefix, d, m, divided, gather in [
        ((5, 7), 1, 16, 6, True, False),
        ((4, 4), 0, 8, 5, False, False),
        ((5, 7), 1, 16, 6, True, True),
    ]:
        q, k, v = (torch.randn(1, 2, prefix + grid[0] * grid[1], d, generator=g) for _ in range(3))
        tx, ty = (torch.randn(d, m, generator=g) for _ in range(2))
        out = sape2_attention_triton(q, k, v, tx, ty, grid, 0.3, 1, prefix, divided, gather)
        q64, k64, v64 = q.double(), k.double(), v.double()
        bias = sape2_bias_reference(q64, k64, tx.double(), ty.double(), grid, 0.3, "k", prefix)
        logits = q64 @ k64.transpose(-1, -2) * d**-0.5 + bias * (d**-0.5 if divided else 1.0)
        ref = logits.softmax(-1) @ v64
        results.append(
            dict(
                grid=grid,
                max_err=(out.double() - ref).abs().max().item(),
                bias_max=bias.abs().max().item(),
                spread=(ref - v64.mean(-2, keepdim=True)).abs().max().item(),
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
    print(json.dumps({"bias": bias_errors(), "fused": fused_errors(), "cuda_op": cuda_op_route()}))
