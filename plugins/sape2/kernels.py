"""Triton kernels for the SaPE² bias, in two stages: the axis signatures once per (image, head),
then the pairwise distances between them.

``sape2_signature_kernel``: program ``(line, b·h)`` computes the signatures of the ``L`` tokens of
one row (row term, ``Zx``) or one column (column term, ``Zy``), column by column from the far
edge inwards, so the reverse cumulative sum of the gates (Eq. 10) is a running sum:

    p_m  = p_{m+1} + σ(s · a_t · b_(line(t), m))            running suffix sum
    z_m  = (1 − f) · c_t · E[:, ⌊p⌋] + f · c_t · E[:, ⌊p⌋+1],   p = min(p_m, M − 1)   (Eq. 14)

The interpolation reads the table's two columns around ``p`` for each token at each step: ``O(d)``
work whatever ``M``, no table in shared memory. All of it costs ``O(N·(H+W)·d)`` per (image,
head), computed once (the earlier single-kernel form rebuilt them inside every output tile, 40-70
times over at 384-512 px). The signatures are written in fp32, ``Zx`` ``[B·h, N, W]`` and ``Zy``
``[B·h, N, H]`` (the layout of ``sape2_axis_signatures``).

``sape2_distance_kernel``: program ``(i, j, b·h)`` writes the ``[BLOCK, BLOCK]`` tile of the bias
for token rows ``i·BLOCK…`` and columns ``j·BLOCK…``:

    bias = sqrt(Σ_m (Zx_i[m] − Zx_j[m])²) + sqrt(Σ_m (Zy_i[m] − Zy_j[m])²)       direct (Eq. 15)

in fp32 registers, ``CHUNK`` signature entries at a time: the diagonal is exactly zero and the
tile exactly symmetric (a token's difference with itself is 0, and ``(a−b)² = (b−a)²``), which
the Gram form is not (spec §8.7). Prefix rows and columns are written as 0. This kernel alone
is what the TensorRT plugin launches (``trt_plugin.py``): an AOT plugin runs one kernel and has
no workspace, so there the signature stage stays plain ONNX ops
(``deploykit.graph.plugin_nodes``). ``torch.ops.deploykit.sape2_bias`` on CUDA runs both
(``sape2_bias_triton``).

All arithmetic is fp32 whatever the input dtype (spec §8.7). Importing this module needs Triton
(``pip install 'deploykit[triton]'``).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

import triton
import triton.language as tl

MODES = ("q", "k", "k_swap")  # the ``mode`` attribute, as deploykit.encodings.sape2.MODES
BLOCK = 32  # the distance kernel's token tile (rows and columns)
CHUNK = 4  # signature entries the distance kernel reads per step, per token (16 bytes)
# Dynamic shared memory a CUDA launch gets without raising the function's attribute first.
SHARED_MEM_OPT_IN = 48 * 1024


@triton.jit
def _interpolated(c, table_ptr, p, offs_d, mask_d, M):
    """``c_t · E[:, p]`` linearly interpolated at real ``p`` in ``[0, M - 1]`` (Eq. 14), from the
    two table columns around it: ``[BLOCK_L]``."""
    lo = p.to(tl.int32)  # p >= 0: truncation is floor
    frac = p - lo.to(tl.float32)
    hi = tl.minimum(lo + 1, M - 1)
    e_lo = tl.load(table_ptr + offs_d[None, :] * M + lo[:, None], mask=mask_d[None, :], other=0.0).to(tl.float32)
    e_hi = tl.load(table_ptr + offs_d[None, :] * M + hi[:, None], mask=mask_d[None, :], other=0.0).to(tl.float32)
    return tl.sum(c * ((1.0 - frac)[:, None] * e_lo + frac[:, None] * e_hi), axis=1)


@triton.jit
def sape2_signature_kernel(
    q_ptr,
    k_ptr,
    table_ptr,
    z_ptr,
    ALONG_ROW: tl.constexpr,
    H: tl.constexpr,
    W: tl.constexpr,
    P: tl.constexpr,
    D: tl.constexpr,
    M: tl.constexpr,
    SCALE: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(H if ALONG_ROW else W, B·h)``; q, k ``[B·h, P + H·W, D]``, table ``[D, M]``, z
    ``[B·h, H·W, L]`` fp32 with ``L = W if ALONG_ROW else H``: one row's (column's) signatures."""
    L: tl.constexpr = W if ALONG_ROW else H
    T: tl.constexpr = P + H * W
    line = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    q_ptr += bh * T * D
    k_ptr += bh * T * D
    z_ptr += bh * (H * W) * L
    # mode: gate operands (a, b) and projected c are (q, k, q), (q, k, k) or (k, q, k) (spec A1)
    if MODE == 2:
        a_ptr, b_ptr = k_ptr, q_ptr
    else:
        a_ptr, b_ptr = q_ptr, k_ptr
    if MODE == 0:
        c_ptr = q_ptr
    else:
        c_ptr = k_ptr
    offs_l = tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    mask_l, mask_d = offs_l < L, offs_d < D
    tok = line * W + offs_l if ALONG_ROW else offs_l * W + line  # the line's tokens, in order
    rows = (P + tok)[:, None] * D + offs_d[None, :]
    mask = mask_l[:, None] & mask_d[None, :]
    a = tl.load(a_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    p = tl.zeros([BLOCK_L], dtype=tl.float32)
    for step in range(L):
        m = L - 1 - step  # from the far edge inwards: p_m is a running suffix sum
        nb = line * W + m if ALONG_ROW else m * W + line
        b = tl.load(b_ptr + (P + nb) * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        p += tl.sigmoid(SCALE * tl.sum(a * b[None, :], axis=1))
        z = _interpolated(c, table_ptr, tl.minimum(p, M - 1.0), offs_d, mask_d, M)
        tl.store(z_ptr + tok * L + m, z, mask=mask_l)


@triton.jit
def _squared_distance(z_ptr, tok_i, tok_j, L: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """``Σ_m (z_i[m] − z_j[m])²`` ``[BLOCK, BLOCK]`` for tokens ``tok_i``, ``tok_j`` of ``z`` ``[N, L]``."""
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for m0 in range(0, L, CHUNK):
        offs = m0 + tl.arange(0, CHUNK)
        mask = offs[None, :] < L
        z_i = tl.load(z_ptr + tok_i[:, None] * L + offs[None, :], mask=mask, other=0.0)
        z_j = tl.load(z_ptr + tok_j[:, None] * L + offs[None, :], mask=mask, other=0.0)
        diff = z_i[:, None, :] - z_j[None, :, :]
        acc += tl.sum(diff * diff, axis=2)
    return acc


@triton.jit
def sape2_distance_kernel(
    zx_ptr,
    zy_ptr,
    out_ptr,
    H: tl.constexpr,
    W: tl.constexpr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK), cdiv(T, BLOCK), B·h)``; zx ``[B·h, H·W, W]``, zy ``[B·h, H·W, H]``
    fp32, out ``[B·h, T, T]`` with ``T = P + H·W``.

    Argument order (inputs, then outputs; everything else compile-time) is what a TensorRT AOT
    plugin launches.
    """
    N: tl.constexpr = H * W
    T: tl.constexpr = P + N
    bh = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid_i = (rows >= P) & (rows < T)
    valid_j = (cols >= P) & (cols < T)
    tok_i = tl.where(valid_i, rows - P, 0)
    tok_j = tl.where(valid_j, cols - P, 0)
    sq_x = _squared_distance(zx_ptr + bh * N * W, tok_i, tok_j, W, BLOCK, CHUNK)
    sq_y = _squared_distance(zy_ptr + bh * N * H, tok_i, tok_j, H, BLOCK, CHUNK)
    bias = tl.where(valid_i[:, None] & valid_j[None, :], tl.sqrt(sq_x) + tl.sqrt(sq_y), 0.0)  # prefix rows/columns: 0
    out = out_ptr + bh * T * T + rows[:, None] * T + cols[None, :]
    tl.store(out, bias.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < T) & (cols[None, :] < T))


def signature_constants(grid: tuple[int, int], num_prefix_tokens: int, head_dim: int, npos_max: int, scale: float, mode: int) -> dict:
    """The compile-time arguments of ``sape2_signature_kernel`` for one op instance, less ``ALONG_ROW``."""
    return dict(
        H=grid[0],
        W=grid[1],
        P=num_prefix_tokens,
        D=head_dim,
        M=npos_max,
        SCALE=float(scale),
        MODE=int(mode),
        BLOCK_L=max(16, triton.next_power_of_2(max(grid))),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )


def kernel_constants(grid: tuple[int, int], num_prefix_tokens: int) -> dict:
    """The compile-time arguments of ``sape2_distance_kernel`` (the plugin's kernel) for one op instance."""
    return dict(H=grid[0], W=grid[1], P=num_prefix_tokens, BLOCK=BLOCK, CHUNK=CHUNK)


def launch_grid(num_tokens: int, batch_heads: int) -> tuple[int, int, int]:
    return triton.cdiv(num_tokens, BLOCK), triton.cdiv(num_tokens, BLOCK), batch_heads


def sape2_signatures_triton(q, k, table_x, table_y, grid, scale, mode, num_prefix_tokens):
    """``Zx`` ``[B, h, N, W]`` and ``Zy`` ``[B, h, N, H]`` in fp32 (torch tensors on a Triton
    device, or CPU under ``TRITON_INTERPRET=1``); the values of
    ``deploykit.encodings.sape2.sape2_axis_signatures`` for the patch tokens of ``q``, ``k``
    ``[B, h, P + N, d]``."""
    import torch

    B, h, T, D = q.shape
    H, W = grid
    q, k = q.contiguous(), k.contiguous()
    consts = signature_constants(grid, num_prefix_tokens, D, table_x.shape[1], scale, mode)
    zx = torch.empty(B, h, H * W, W, dtype=torch.float32, device=q.device)
    zy = torch.empty(B, h, H * W, H, dtype=torch.float32, device=q.device)
    sape2_signature_kernel[(H, B * h)](q, k, table_x.contiguous(), zx, ALONG_ROW=True, **consts)
    sape2_signature_kernel[(W, B * h)](q, k, table_y.contiguous(), zy, ALONG_ROW=False, **consts)
    return zx, zy


def sape2_distance_triton(zx, zy, grid, num_prefix_tokens, dtype=None):
    """The bias ``[B, h, P + N, P + N]`` (``dtype``, default fp32) from fp32 signatures ``zx``
    ``[B, h, N, W]``, ``zy`` ``[B, h, N, H]``: what the TensorRT plugin's kernel computes."""
    import torch

    B, h, N, _ = zx.shape
    T = num_prefix_tokens + N
    out = torch.empty(B, h, T, T, dtype=dtype or torch.float32, device=zx.device)
    consts = kernel_constants(grid, num_prefix_tokens)
    sape2_distance_kernel[launch_grid(T, B * h)](zx.contiguous(), zy.contiguous(), out, **consts)
    return out


def sape2_bias_triton(q, k, table_x, table_y, grid, scale, mode, num_prefix_tokens):
    """The bias ``[B, h, T, T]`` in q's dtype: signatures once, then distances (three launches);
    same contract as ``deploykit.encodings.sape2.sape2_bias``."""
    zx, zy = sape2_signatures_triton(q, k, table_x, table_y, grid, scale, mode, num_prefix_tokens)
    return sape2_distance_triton(zx, zy, grid, num_prefix_tokens, q.dtype)


_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def compile_kernel(io_dtype: str, constants: dict, target, ptx_version: int | None = None):
    """Compile ``sape2_distance_kernel`` ahead of time for one GPU (no GPU needed to compile).

    Args:
        io_dtype: the output's dtype, ``"float32"``, ``"float16"`` or ``"bfloat16"`` (the
            signatures it reads are fp32).
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

    signature = {"zx_ptr": "*fp32", "zy_ptr": "*fp32", "out_ptr": f"*{_TRITON_TYPES[io_dtype]}"}
    signature.update({name: "constexpr" for name in constants})
    source = ASTSource(fn=sape2_distance_kernel, signature=signature, constexprs=dict(constants))
    options = {} if ptx_version is None else {"ptx_version": ptx_version}
    return triton.compile(source, target=target, options=options)


def build_needs() -> list[str]:
    """What compiling the kernel ahead of time needs and this host lacks: Triton's CUDA driver is
    active only under a CUDA build of torch that sees a GPU (``CudaDriver.is_active``), and it
    compiles its launcher stubs with a C compiler, found as Triton finds it (``CC``, else gcc,
    else clang on ``PATH``: ``triton.runtime.build``)."""
    import torch

    missing = []
    if not torch.cuda.is_available() or torch.version.hip is not None:
        missing.append(f"a CUDA build of torch that sees a GPU (torch {torch.__version__} sees none)")
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        missing.append("a C compiler (gcc or clang on PATH, or CC) for Triton's launcher stubs")
    return missing


def device_target():
    """The ``GPUTarget`` of the current CUDA device (what ``triton.compile`` targets by default).

    Raises:
        MissingDependencyError: what ``build_needs`` finds missing, in one line, instead of
            Triton's "0 active drivers" or "Failed to find C compiler" from deep in the build.
    """
    from triton.runtime import driver

    from deploykit.errors import MissingDependencyError

    missing = build_needs()
    if missing:
        raise MissingDependencyError(f"the SaPE² plugin compiles its kernel when the engine is built and needs {' and '.join(missing)}")
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
    """Compile ``sape2_distance_kernel`` for ``target`` as the TensorRT plugin hands it over: PTX cut
    to ``num_args`` parameters, the launch grid of its tokens, its block and shared memory. The
    plugin (``trt_plugin``) and the lent-GPU check (``benchmarks/gpu_lent.py``), which launches it
    with the CUDA driver API, both take it from here."""
    compiled = compile_kernel(io_dtype, constants, target, ptx_version)
    tokens = constants["P"] + constants["H"] * constants["W"]
    tiles_x, tiles_y, _ = launch_grid(tokens, 1)
    meta = compiled.metadata
    return AotKernel(meta.name, launchable_ptx(compiled, num_args), tiles_x, tiles_y, meta.num_warps * 32, meta.shared)
