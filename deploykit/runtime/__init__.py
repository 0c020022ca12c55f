"""Running graphs, torch-free: the ``Runner`` interface every backend implements, running inputs
through a runner in batches, and ONNX Runtime's runners.

Below ``deploykit.export`` in the layers (``tests/test_layers.py``), so the exporter's own checks
(the int8 plan's calibration fallback and plan check, the bundle's held-out reference) run graphs
through the same runner as ``deploykit.validate``. It imports nothing of deploykit but the errors.
"""

from deploykit.runtime.base import Runner, output_rows, run_batched, run_exact_batches, run_rows
from deploykit.runtime.onnxrt import OnnxrtRunner, cpu_runner, run_graph, with_outputs

__all__ = [
    "OnnxrtRunner",
    "Runner",
    "cpu_runner",
    "output_rows",
    "run_batched",
    "run_exact_batches",
    "run_graph",
    "run_rows",
    "with_outputs",
]
