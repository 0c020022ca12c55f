"""TensorRT plugins and the GPU kernels behind them, one package per custom op.

Each plugin package is importable under one name, ``deploykit.plugins.<op>``, and is found by
``deploykit build --plugins <op>`` through the entry-point group ``deploykit.plugins``
(``pyproject.toml``). Nothing here imports Triton or TensorRT at import time, and nothing here
imports deploykit beyond ``deploykit._lazy``: an encoding's own op (SaPE²'s on CUDA) uses these
kernels.
"""
