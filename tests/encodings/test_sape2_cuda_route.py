"""The CUDA route of ``torch.ops.deploykit.sape2_bias`` without Triton: the op's PyTorch form runs,
and that is said once, with the import tried once (not on every call)."""

from __future__ import annotations

import importlib
import sys
import warnings

import torch

from deploykit.encodings import sape2


def _args():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 1 + 6, 8, generator=g) for _ in range(2))
    tx, ty = (torch.randn(8, 4, generator=g) for _ in range(2))
    return q, k, tx, ty, 2, 3, 1, 0.5, 2


def test_missing_triton_is_said_once_and_imported_once(monkeypatch):
    attempts = []
    real_import = importlib.import_module

    def counting_import(name, *args, **kwargs):
        if name == "triton":
            attempts.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setattr(importlib, "import_module", counting_import)
    sape2._triton_kernels.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outputs = [sape2._sape2_bias_cuda(*_args()) for _ in range(3)]
    finally:
        sape2._triton_kernels.cache_clear()  # later tests import the real kernels
    said = [w for w in caught if issubclass(w.category, RuntimeWarning) and "Triton" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "PyTorch" in str(said[0].message) and "deploykit[triton]" in str(said[0].message)
    assert attempts == ["triton"]
    cpu = sape2.sape2_bias(*_args())  # the same PyTorch code as on the CPU
    assert all(torch.equal(out, cpu) for out in outputs)
    q, k, tx, ty, gh, gw, prefix, scale, mode = (t.double() if isinstance(t, torch.Tensor) else t for t in _args())
    reference = sape2.sape2_bias_reference(q, k, tx, ty, (gh, gw), scale, sape2.MODES[mode], prefix)
    torch.testing.assert_close(cpu.double(), reference, atol=1e-3 * reference.abs().max().item(), rtol=0)
