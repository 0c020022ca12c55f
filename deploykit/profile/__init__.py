"""Latency across resolutions, batches and backends, and what the positional encoding costs.

Method (the README's `deploykit profile` paragraph says it for users):

* every measurement starts with untimed warm-up calls, so each resolution, batch and backend
  switch is warmed (PyTorch's and ONNX Runtime's thread pools fight for the cores when they
  alternate call by call; the untimed calls let the other pool go idle first);
* every runner's call (PyTorch's too: ``TorchRunner``) is timed with ``perf_counter_ns``; each
  returns host arrays, so on a GPU its copies are in the time; the positional step alone, queued
  on a GPU, is timed with CUDA events;
* kernel-only (the model on a prepared input) and end-to-end (uint8 camera frames through
  ``deploykit.inputs.imaging.preprocess``, host copies, the model, softmax + top-5) side by side;
* the same trunk with a learned APE runs in the same session, so each encoding's cost is a
  ratio measured under the same load; in PyTorch eager the positional step alone (table add,
  q/k rotation, or logits bias, over all blocks) shows where that cost goes (``pe_share``, on
  the ``torch`` records only: it cannot be timed alone inside an ONNX graph or an engine);
* ``torch.set_flush_denormal(True)`` during timing runs: denormals in GELU can slow one variant
  by tens of percent for reasons that have nothing to do with the encoding.

A sequence model (MoPE + EGA) is profiled the same way with its length as the resolution: token
ids as the kernel input, and text → character ids → model → next-token top-5 as end-to-end.

Backends are every name in the table of backends (``deploykit.runners.table``): ``torch``
(eager, the reference) and every runner of a graph or an engine, so a backend added there is
profiled with no change here.

One module per job: ``timing`` (stats, budgets, timers), ``flops`` (the analytic count),
``targets`` (what is profiled and what runs it), ``run`` (``profile()``), ``report`` (records
and ratios), ``output`` (CSV, plot, terminal table), ``environment`` (what it ran on).
"""

from deploykit._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".flops": ["gemm_shapes", "model_flops"],
        ".options": ["ProfileOptions"],
        ".report": ["BASELINE_ENCODING", "FP32", "RECORD_FIELDS", "TORCH_BACKEND", "ProfileRecord", "ProfileReport", "Verdict"],
        ".run": ["profile"],
        ".targets": ["Subject", "ape_twin", "backend_names"],
        ".timing": ["Budget", "CpuTimer", "CudaEventTimer", "LatencyStats", "denormals_flushed", "measure"],
    },
)
