"""Running graphs, torch-free: the ``Runner`` interface and batched runs (``base``), the table of
backends every command reads (``table``: names, devices, the TensorRT flavours as data), ONNX
Runtime's runners (``onnxrt``, the runner every machine has), inference streams (``streams``) and
what this CPU is (``cpu``). Below ``deploykit.checks`` and ``deploykit.export``, whose plan checks
and INT8 calibration run graphs through them; the other runners are ``deploykit.backends``.
"""
