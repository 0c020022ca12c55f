"""Analytic FLOPs of one forward (multiply-add = 2 FLOPs), counted from the matrix products each
architecture's ``DeploySpec`` lists."""

from __future__ import annotations

from deploykit.nn.spec import deploy_spec


def gemm_shapes(cfg, resolution: tuple[int, ...], batch: int) -> list[tuple[int, int, int, int]]:
    """Every matrix product of one forward as ``(count, m, k, n)`` (``count`` batched products of
    ``[m, k] @ [k, n]``): ``DeploySpec.gemm_shapes`` of the config's architecture."""
    return deploy_spec(cfg).gemm_shapes(resolution, batch)


def model_flops(cfg, resolution: tuple[int, ...], batch: int) -> int:
    """FLOPs of one forward counted from the GEMMs (``DeploySpec.flops``)."""
    return deploy_spec(cfg).flops(resolution, batch)
