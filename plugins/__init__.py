"""TensorRT plugins and the GPU kernels behind them, one package per custom op.

The folder lives at the repository's top level (``plugins/``) and is installed as
``deploykit.plugins`` through the link ``deploykit/plugins -> ../plugins``, so a wheel, an editable
install and the tests all import it as ``deploykit.plugins.<op>``. Nothing here imports Triton or
TensorRT at import time.
"""
