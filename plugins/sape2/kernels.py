"""Triton kernel for the SaPE² bias: one launch, tile by tile, never storing the signatures.

Program ``(i, j, bh)`` writes the ``[BLOCK, BLOCK]`` tile of ``bias[bh]`` for token rows ``i·BLOCK…``
and columns ``j·BLOCK…``. It rebuilds the axis signatures of its row and column tokens column by
column, from the right edge (bottom edge for the column term) inwards, so the reverse cumulative
sum of the gates (Eq. 10) is a running sum and every step needs only ``[BLOCK]`` vectors:

    p_m   = p_{m+1} + σ(s · a_t · b_(line(t), m))          running suffix sum
    z_m   = Σ_p max(0, 1 − |min(p_m, M−1) − p|) · (c_t · E[:, p])   linear interpolation (Eq. 14)
    acc  += (z_m(rows) − z_m(cols))²                         direct distance (Eq. 15)

The interpolation has two forms, chosen per op instance at compile time (``GATHER``): the
hat-function form, which equals the floor/ceil form exactly (spec §8.5 (b)) and needs no gather,
projects every token on the whole table once per tile (``tl.dot``, the table in shared memory:
``4·BLOCK_D·(BLOCK_M + BLOCK)`` bytes); the gather form reads the table's two columns at
``floor(p)`` and ``floor(p) + 1`` for each token at each step, ``O(d)`` work whatever ``M``, and
no table in shared memory. Tables of more than 16 entries (grids above 15 patches a side), or
whose hat form would not fit, take the gather form (``HAT_MAX_BLOCK_M``: measured), so no instance needs more than the 48 KiB of shared memory
a launch gets without opting in (``SHARED_MEM_OPT_IN``), which TensorRT's AOT launch may not do:
on an H200, a launch of a 72 KiB instance without the opt-in was refused
(``benchmarks/results/gpu-lent.json``).

All arithmetic is fp32 whatever the input dtype (spec §8.7); prefix rows and columns are written
as 0. One launch with no workspace is what a TensorRT AOT plugin can run
(``trt_plugin.py``); the same kernel backs ``torch.ops.deploykit.sape2_bias`` on CUDA.

Importing this module needs Triton (``pip install 'deploykit[triton]'``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import triton
import triton.language as tl

MODES = ("q", "k", "k_swap")  # the ``mode`` attribute, as deploykit.encodings.sape2.MODES
BLOCK = 32  # token tile; rows and columns share it so a token's signature is computed identically
# Dynamic shared memory a CUDA launch gets without raising the function's attribute first.
SHARED_MEM_OPT_IN = 48 * 1024


@triton.jit
def _interpolated(c, table_ptr, p, offs_d, mask_d, M):
    """``c_t · E[:, p]`` linearly interpolated at real ``p`` in ``[0, M - 1]`` (Eq. 14), from the
    two table columns around it: ``[BLOCK]``."""
    lo = p.to(tl.int32)  # p >= 0: truncation is floor
    frac = p - lo.to(tl.float32)
    hi = tl.minimum(lo + 1, M - 1)
    e_lo = tl.load(table_ptr + offs_d[None, :] * M + lo[:, None], mask=mask_d[None, :], other=0.0).to(tl.float32)
    e_hi = tl.load(table_ptr + offs_d[None, :] * M + hi[:, None], mask=mask_d[None, :], other=0.0).to(tl.float32)
    return tl.sum(c * ((1.0 - frac)[:, None] * e_lo + frac[:, None] * e_hi), axis=1)


@triton.jit
def _squared_axis_distance(a_ptr, b_ptr, c_ptr, table_ptr, tok_i, tok_j, ALONG_ROW, H, W, P, D, M, SCALE, BLOCK, BLOCK_D, BLOCK_M, GATHER):
    """``Σ_m (Z_i[m] − Z_j[m])²`` ``[BLOCK, BLOCK]`` for patch tokens ``tok_i``, ``tok_j`` (one axis:
    the row term when ``ALONG_ROW``). ``ALONG_ROW`` and the arguments after it are compile-time
    constants: the callers pass the kernels' ``tl.constexpr`` arguments (``kernel_constants``)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    mask_d = offs_d < D
    rows_i = (P + tok_i)[:, None] * D + offs_d[None, :]
    rows_j = (P + tok_j)[:, None] * D + offs_d[None, :]
    a_i = tl.load(a_ptr + rows_i, mask=mask_d[None, :], other=0.0).to(tl.float32)
    a_j = tl.load(a_ptr + rows_j, mask=mask_d[None, :], other=0.0).to(tl.float32)
    if GATHER:
        c_i = tl.load(c_ptr + rows_i, mask=mask_d[None, :], other=0.0).to(tl.float32)
        c_j = tl.load(c_ptr + rows_j, mask=mask_d[None, :], other=0.0).to(tl.float32)
    else:
        table = tl.load(table_ptr + offs_d[:, None] * M + offs_m[None, :], mask=mask_d[:, None] & (offs_m[None, :] < M), other=0.0)
        table = table.to(tl.float32)
        # c_t · E[:, p] for every integer p (Eq. 13); ieee: no TF32 rounding of the projection.
        zint_i = tl.dot(tl.load(c_ptr + rows_i, mask=mask_d[None, :], other=0.0).to(tl.float32), table, input_precision="ieee")
        zint_j = tl.dot(tl.load(c_ptr + rows_j, mask=mask_d[None, :], other=0.0).to(tl.float32), table, input_precision="ieee")
    line_i = tok_i // W if ALONG_ROW else tok_i % W  # the token's row (row term) or column
    line_j = tok_j // W if ALONG_ROW else tok_j % W
    L: tl.constexpr = W if ALONG_ROW else H
    p_i = tl.zeros([BLOCK], dtype=tl.float32)
    p_j = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    grid_p = offs_m[None, :].to(tl.float32)
    for step in range(L):
        m = L - 1 - step  # from the far edge inwards: p_m is a running suffix sum
        nb_i = line_i * W + m if ALONG_ROW else m * W + line_i
        nb_j = line_j * W + m if ALONG_ROW else m * W + line_j
        b_i = tl.load(b_ptr + (P + nb_i)[:, None] * D + offs_d[None, :], mask=mask_d[None, :], other=0.0).to(tl.float32)
        b_j = tl.load(b_ptr + (P + nb_j)[:, None] * D + offs_d[None, :], mask=mask_d[None, :], other=0.0).to(tl.float32)
        p_i += tl.sigmoid(SCALE * tl.sum(a_i * b_i, axis=1))
        p_j += tl.sigmoid(SCALE * tl.sum(a_j * b_j, axis=1))
        if GATHER:
            z_i = _interpolated(c_i, table_ptr, tl.minimum(p_i, M - 1.0), offs_d, mask_d, M)
            z_j = _interpolated(c_j, table_ptr, tl.minimum(p_j, M - 1.0), offs_d, mask_d, M)
        else:
            hat_i = tl.maximum(1.0 - tl.abs(tl.minimum(p_i, M - 1.0)[:, None] - grid_p), 0.0)
            hat_j = tl.maximum(1.0 - tl.abs(tl.minimum(p_j, M - 1.0)[:, None] - grid_p), 0.0)
            z_i = tl.sum(hat_i * zint_i, axis=1)
            z_j = tl.sum(hat_j * zint_j, axis=1)
        diff = z_i[:, None] - z_j[None, :]
        acc += diff * diff
    return acc


@triton.jit
def _bias_tile(q_ptr, k_ptr, table_x_ptr, table_y_ptr, rows, cols, H, W, P, D, M, SCALE, MODE, BLOCK, BLOCK_D, BLOCK_M, GATHER):
    """The bias ``‖Zx_i − Zx_j‖ + ‖Zy_i − Zy_j‖`` ``[BLOCK, BLOCK]`` of token rows ``rows`` and
    columns ``cols`` of one batch·head's q, k; 0 where either is a prefix token or past the end.

    One tile computation for both kernels: ``sape2_bias_kernel`` stores it, the fused attention
    kernel (``fused.py``) adds it to its logits, so the two cannot drift apart. The arguments
    after ``cols`` are the kernels' compile-time constants (``kernel_constants``).
    """
    T: tl.constexpr = P + H * W
    valid_i = (rows >= P) & (rows < T)
    valid_j = (cols >= P) & (cols < T)
    tok_i = tl.where(valid_i, rows - P, 0)
    tok_j = tl.where(valid_j, cols - P, 0)
    # mode: gate operands (a, b) and projected c are (q, k, q), (q, k, k) or (k, q, k) (spec A1)
    if MODE == 2:
        a_ptr, b_ptr = k_ptr, q_ptr
    else:
        a_ptr, b_ptr = q_ptr, k_ptr
    if MODE == 0:
        c_ptr = q_ptr
    else:
        c_ptr = k_ptr
    sq_x = _squared_axis_distance(
        a_ptr, b_ptr, c_ptr, table_x_ptr, tok_i, tok_j, True, H, W, P, D, M, SCALE, BLOCK, BLOCK_D, BLOCK_M, GATHER
    )
    sq_y = _squared_axis_distance(
        a_ptr, b_ptr, c_ptr, table_y_ptr, tok_i, tok_j, False, H, W, P, D, M, SCALE, BLOCK, BLOCK_D, BLOCK_M, GATHER
    )
    bias = tl.sqrt(sq_x) + tl.sqrt(sq_y)
    return tl.where(valid_i[:, None] & valid_j[None, :], bias, 0.0)  # prefix rows/columns: 0


@triton.jit
def sape2_bias_kernel(
    q_ptr,
    k_ptr,
    table_x_ptr,
    table_y_ptr,
    out_ptr,
    H: tl.constexpr,
    W: tl.constexpr,
    P: tl.constexpr,
    D: tl.constexpr,
    M: tl.constexpr,
    SCALE: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK), cdiv(T, BLOCK), B·h)``; q, k ``[B·h, T, D]``, tables ``[D, M]``, out ``[B·h, T, T]``.

    Argument order (inputs, then outputs; everything else compile-time) is what a TensorRT AOT
    plugin launches.
    """
    T: tl.constexpr = P + H * W
    bh = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    q_ptr += bh * T * D
    k_ptr += bh * T * D
    bias = _bias_tile(q_ptr, k_ptr, table_x_ptr, table_y_ptr, rows, cols, H, W, P, D, M, SCALE, MODE, BLOCK, BLOCK_D, BLOCK_M, GATHER)
    out = out_ptr + bh * T * T + rows[:, None] * T + cols[None, :]
    tl.store(out, bias.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < T) & (cols[None, :] < T))


# The hat form's work per step grows with the padded table (``BLOCK_M``), and it keeps the table
# and one operand in shared memory, ``4·BLOCK_D·(BLOCK_M + BLOCK)`` bytes (what Triton 3.6 allots,
# checked by compiling in plugins/sape2/tests): past either bound the gather form is taken. On an
# H200 (ViT-B heads, batch 8; benchmarks/results/gpu-lent-kernels.json) the hat form was 1.2x
# faster with 16 entries (224 px) and slower from 32 on: 1.06x at 384 px, 5.4x at 512, 25x with
# tables for 2048 px.
HAT_MAX_BLOCK_M = 16


def kernel_constants(
    grid: tuple[int, int], num_prefix_tokens: int, head_dim: int, npos_max: int, scale: float, mode: int, gather: bool | None = None
) -> dict:
    """The compile-time arguments of ``sape2_bias_kernel`` for one op instance (``gather``: force
    the interpolation's form; None: the hat form where it fits, ``HAT_MAX_BLOCK_M``)."""
    block_m, block_d = max(16, triton.next_power_of_2(npos_max)), max(16, triton.next_power_of_2(head_dim))
    hat_fits = block_m <= HAT_MAX_BLOCK_M and 4 * block_d * (block_m + BLOCK) <= SHARED_MEM_OPT_IN
    return dict(
        H=grid[0],
        W=grid[1],
        P=num_prefix_tokens,
        D=head_dim,
        M=npos_max,
        SCALE=float(scale),
        MODE=int(mode),
        BLOCK=BLOCK,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        GATHER=not hat_fits if gather is None else bool(gather),
    )


def launch_grid(num_tokens: int, batch_heads: int) -> tuple[int, int, int]:
    return triton.cdiv(num_tokens, BLOCK), triton.cdiv(num_tokens, BLOCK), batch_heads


def sape2_bias_triton(q, k, table_x, table_y, grid, scale, mode, num_prefix_tokens, gather: bool | None = None):
    """The bias ``[B, h, T, T]`` in q's dtype (torch tensors on a Triton device, or CPU under
    ``TRITON_INTERPRET=1``); same contract as ``deploykit.encodings.sape2.sape2_bias``
    (``gather``: the interpolation's form, as ``kernel_constants``)."""
    import torch

    B, h, T, D = q.shape
    out = torch.empty(B, h, T, T, dtype=q.dtype, device=q.device)
    consts = kernel_constants(grid, num_prefix_tokens, D, table_x.shape[1], scale, mode, gather)
    sape2_bias_kernel[launch_grid(T, B * h)](q.contiguous(), k.contiguous(), table_x.contiguous(), table_y.contiguous(), out, **consts)
    return out


_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def compile_kernel(io_dtype: str, table_dtype: str, constants: dict, target, ptx_version: int | None = None):
    """Compile ``sape2_bias_kernel`` ahead of time for one GPU (no GPU needed to compile).

    Args:
        io_dtype, table_dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``: q/k/out, tables.
        constants: from ``kernel_constants``.
        target: a ``triton.backends.compiler.GPUTarget``, the GPU the engine is built for
            (``device_target()``): Triton writes ``sm_90a``-style PTX for 9.0 and newer, which
            loads on that architecture only.
        ptx_version: the PTX ISA version to write (``87`` is 8.7), at most what the driver that
            will load it accepts (``driver_ptx_version()``); None: what Triton's ptxas writes.

    Returns:
        Triton's compiled kernel: ``.asm["ptx"]``, ``.metadata.name``, ``.metadata.num_warps``,
        ``.metadata.shared``; pass it through ``launchable_ptx`` before handing it to TensorRT.
    """
    from triton.compiler import ASTSource

    io, tab = f"*{_TRITON_TYPES[io_dtype]}", f"*{_TRITON_TYPES[table_dtype]}"
    signature = {"q_ptr": io, "k_ptr": io, "table_x_ptr": tab, "table_y_ptr": tab, "out_ptr": io}
    signature.update({name: "constexpr" for name in constants})
    source = ASTSource(fn=sape2_bias_kernel, signature=signature, constexprs=dict(constants))
    options = {} if ptx_version is None else {"ptx_version": ptx_version}
    return triton.compile(source, target=target, options=options)


def device_target():
    """The ``GPUTarget`` of the current CUDA device (what ``triton.compile`` targets by default)."""
    from triton.runtime import driver

    return driver.active.get_current_target()


def driver_ptx_version(target) -> int | None:
    """The newest PTX ISA version both Triton's ptxas and the installed driver handle for
    ``target``, or None without a driver (then Triton's own choice). A driver refuses to load PTX
    newer than its CUDA version (``CUDA_ERROR_UNSUPPORTED_PTX_VERSION``): Triton 3.6's ptxas
    writes PTX 8.7, which a CUDA 12.4 driver (PTX 8.4) cannot load."""
    from triton.backends.nvidia.compiler import get_ptxas, ptx_get_version

    from deploykit._nvml import cuda_driver_version

    driver = cuda_driver_version()
    if driver is None:
        return None
    return min(ptx_get_version(get_ptxas(target.arch).version), ptx_get_version(driver))


_ENTRY = re.compile(r"(\.visible\s+)?\.entry\s+(?P<name>[\w$]+)\s*\((?P<params>[^)]*)\)", re.S)
_PARAM = re.compile(r"\.param\s+[^,]*?(?P<name>[\w$]+)\s*$")


def ptx_parameters(ptx: str, name: str) -> list[str]:
    """The ``.param`` names of kernel ``name`` in ``ptx``, in order."""
    entry = next((m for m in _ENTRY.finditer(ptx) if m.group("name") == name), None)
    if entry is None:
        raise ValueError(f"no .entry {name} in the PTX")
    params = [p.strip() for p in entry.group("params").split(",") if p.strip()]
    return [_PARAM.search(p).group("name") for p in params]


def launchable_ptx(compiled, num_args: int) -> str:
    """The compiled kernel's PTX with exactly the ``num_args`` parameters the plugin passes.

    TensorRT's AOT plugins launch a kernel with its inputs, the extra scalar arguments and its
    outputs, nothing else. Triton 3.3+ appends hidden pointer parameters to every kernel (global
    and profile scratch); a launch that passes fewer arguments than the entry declares reads past
    its argument array. Trailing parameters are dropped only where that cannot change the
    kernel: Triton reserved no scratch for them and the body never reads them.

    Raises:
        ValueError: the entry takes fewer parameters, or needs the ones beyond ``num_args``.
    """
    ptx, name, meta = compiled.asm["ptx"], compiled.metadata.name, compiled.metadata
    params = ptx_parameters(ptx, name)
    if len(params) < num_args:
        raise ValueError(f"{name} takes {len(params)} parameters, but the plugin passes {num_args}")
    extra = params[num_args:]
    scratch = getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0)
    used = [p for p in extra if re.search(rf"\[{re.escape(p)}\b", ptx)]
    if scratch or used:
        raise ValueError(
            f"{name} needs parameters beyond the {num_args} the plugin passes ({', '.join(used) or 'scratch memory'}); "
            "this Triton version's kernels cannot run as a TensorRT AOT plugin"
        )
    if not extra:
        return ptx
    entry = next(m for m in _ENTRY.finditer(ptx) if m.group("name") == name)
    kept = [p for p in entry.group("params").split(",") if p.strip()][:num_args]
    return ptx[: entry.start("params")] + ",".join(kept).rstrip() + "\n" + ptx[entry.end("params") :]


@dataclass(frozen=True)
class AotKernel:
    """The kernel a TensorRT AOT plugin launches for one op instance, and how it launches it.

    Attributes:
        name: the PTX entry.
        ptx: the PTX, its parameters cut to what the launch passes (``launchable_ptx``).
        grid_x, grid_y: token tiles of the rows and columns; grid z is ``B·h``, known at run time.
        block_x: threads per program (``num_warps · 32``).
        shared_mem: dynamic shared memory per program, in bytes. Above 48 KiB a launch must first
            raise the function's ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` (``SHARED_MEM_OPT_IN``).
    """

    name: str
    ptx: str
    grid_x: int
    grid_y: int
    block_x: int
    shared_mem: int


def aot_kernel(io_dtype: str, constants: dict, target, ptx_version: int | None, num_args: int) -> AotKernel:
    """Compile ``sape2_bias_kernel`` for ``target`` as the TensorRT plugin hands it over: PTX cut
    to ``num_args`` parameters, the launch grid of its tokens, its block and shared memory. The
    plugin (``trt_plugin``) and the lent-GPU check (``benchmarks/gpu_lent.py``), which launches it
    with the CUDA driver API, both take it from here."""
    compiled = compile_kernel(io_dtype, "float32", constants, target, ptx_version)
    tokens = constants["P"] + constants["H"] * constants["W"]
    tiles_x, tiles_y, _ = launch_grid(tokens, 1)
    meta = compiled.metadata
    return AotKernel(meta.name, launchable_ptx(compiled, num_args), tiles_x, tiles_y, meta.num_warps * 32, meta.shared)
