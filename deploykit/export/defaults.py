"""The export defaults the command line shows and the library applies, stated once.

Imports nothing (the CLI reads it at start-up, before PyTorch or onnx): ``PLAN_NAMES`` are the
keys of ``deploykit.export.precision.PLANS`` in order (that module refuses to import otherwise),
and ``CalibrationOptions`` takes its defaults from here.
"""

# Opset 18: LayerNormalization is native (17+), and TensorRT 10.x, TensorRT-RTX and ONNX
# Runtime all parse it; newer opsets map SDPA to an Attention op that TensorRT 10 lacks.
DEFAULT_OPSET = 18
# What a requested opset may be. Below 17 there is no LayerNormalization op: the exporter's
# version converter cannot write one and silently leaves the graph at its own opset. Above 25:
# TensorRT 11's ONNX parser reads up to opset 25 (its support matrix), and the exporter's
# converter fails beyond it. SaPE²'s ONNX function is written in opset 18 (custom_ops.FUNCTION_OPSET).
SUPPORTED_OPSETS = range(17, 26)

PLAN_NAMES = ("fp32", "fp16", "bf16", "int8", "int8-dynamic", "int8-mha", "fp32-mha", "fp8", "int8-fp16", "imported")

# INT8 calibration and its check (``deploykit.export.int8_static.CalibrationOptions``).
CALIBRATION_SAMPLES = 128
CALIBRATION_METHOD = "minmax"
# ONNX Runtime's calibrators (``CalibrationMethod`` members, lower-cased).
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")
HELD_OUT = 1000
# Top-1 agreement with fp32 the plan must reach on held-out inputs: 99.5% so that 99% holds on
# inputs the plan never saw (see CalibrationOptions.min_agreement).
MIN_AGREEMENT = 0.995
# Features models (no classes): mean per-row cosine with fp32.
MIN_COSINE = 0.995
