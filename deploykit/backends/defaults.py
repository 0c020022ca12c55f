"""The backend defaults the command line shows and the library applies, stated once.

Imports nothing (the CLI reads it at start-up, before onnx or TensorRT): ``validate()``,
``build()`` and ``BuildOptions`` take their defaults from here.
"""

# The runner every machine has: ONNX Runtime on the CPU (validate's and serve-bench's default).
RUNNER = "ort"

# ``deploykit build``: TensorRT (``rtx``: TensorRT-RTX), a static batch of 1, and the largest
# batch of a dynamic-batch profile.
ENGINE_BACKENDS = ("trt", "rtx")
ENGINE_BATCH = 1
ENGINE_MAX_BATCH = 8
