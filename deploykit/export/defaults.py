"""The export defaults the command line shows and the library applies, stated once.

Imports nothing (the CLI reads it at start-up, before PyTorch or onnx): ``PLAN_NAMES`` are the
keys of ``deploykit.export.precision.PLANS`` in order (that module refuses to import otherwise),
and ``CalibrationOptions`` takes its defaults from here.
"""

PLAN_NAMES = ("fp32", "fp16", "bf16", "int8", "int8-dynamic", "int8-mha", "fp32-mha")

# INT8 calibration and its check (``deploykit.export.int8_static.CalibrationOptions``).
CALIBRATION_SAMPLES = 128
CALIBRATION_METHOD = "minmax"
HELD_OUT = 1000
# Top-1 agreement with fp32 the plan must reach on held-out inputs: 99.5% so that 99% holds on
# inputs the plan never saw (see CalibrationOptions.min_agreement).
MIN_AGREEMENT = 0.995
# Features models (no classes): mean per-row cosine with fp32.
MIN_COSINE = 0.995
