"""The profiling defaults the command line shows and the library applies, stated once.

Imports only other defaults and the table of backends (the CLI reads it at start-up, before PyTorch): ``Budget`` and ``profile()``
take their defaults from here.
"""

from deploykit.backends.defaults import RUNNER
from deploykit.runners.table import REFERENCE

BACKENDS = (REFERENCE, RUNNER)  # PyTorch eager and the runner every machine has
BATCHES = (1,)
DEVICE = "auto"

# Budget of one measurement: seconds of timed calls, untimed calls before them, rounds.
DURATION_S = 1.0
WARMUP = 3
ROUNDS = 1
