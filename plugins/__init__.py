"""TensorRT plugins and the GPU kernels behind them, one package per custom op.

This directory sits at the top of the repository (``plugins/<op>/``: source, README, tests) and
installs as ``deploykit.plugins`` (``pyproject.toml``'s ``package-dir``), so each plugin package
is importable under one name, ``deploykit.plugins.<op>``, and is found by ``deploykit build
--plugins <op>`` through the entry-point group ``deploykit.plugins``. Nothing here imports Triton
or TensorRT at import time, and nothing here imports deploykit beyond its infrastructure
(``deploykit._lazy``, ``deploykit._nvml``): an encoding's own op (SaPE²'s on CUDA) uses these
kernels.
"""

# Installed plugin packages (this one's among them) register under the entry-point group that is
# this package's own name, "deploykit.plugins": one name for where plugins live and how they are found.
ENTRY_POINT_GROUP = __name__
