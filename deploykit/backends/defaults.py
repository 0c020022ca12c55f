"""The backend defaults the command line shows and the library applies, stated once.

Imports only the table of backends (the CLI reads it at start-up, before onnx or TensorRT):
``validate()``, ``build()`` and ``BuildOptions`` take their defaults from here.
"""

from deploykit.runners.table import BASELINE, ENGINE, names

# The runner every machine has: ONNX Runtime on the CPU (validate's and serve-bench's default).
RUNNER = BASELINE

# ``deploykit build``: the engine backends (TensorRT first), a static batch of 1, and the largest
# batch of a dynamic-batch profile.
ENGINE_BACKENDS = tuple(names((ENGINE,)))
ENGINE_BATCH = 1
ENGINE_MAX_BATCH = 8
