"""The serving defaults the command line shows and the library applies, stated once.

Imports only other defaults (the CLI reads it at start-up, before numpy or Triton): ``ServerOptions``,
``RayOptions``, ``RepositoryOptions`` and ``BenchOptions`` take their defaults from here.
"""

from deploykit.backends.defaults import RUNNER

# Where ``deploykit serve`` listens (loopback unless asked otherwise).
HOST = "127.0.0.1"
HTTP_PORT = 8000
GRPC_PORT = 8001
METRICS_PORT = 8002
BACKEND = "auto"  # TensorRT if usable, else ONNX Runtime
TOP_K = 5
RAY_REPLICAS = 2

# Triton's dynamic batching, for the server, the benchmark's server and a packaged repository.
MAX_BATCH_SIZE = 32
# No wait to fill a batch: a request alone runs at once, and the batcher still merges every request
# queued while the model instances were busy (Triton's dynamic batcher with a zero delay).
MAX_QUEUE_DELAY_US = 0
# Largest HTTP body or gRPC message the front accepts (Triton behind it never sees a larger one).
MAX_REQUEST_BYTES = 64 * 2**20
# Request bodies the front holds at once, in MAX_REQUEST_BYTES each (more: 503 with Retry-After).
IN_FLIGHT_BODIES = 4
# Values one request's JSON may hold: Python makes an object of each (up to ~100 bytes); larger
# tensors go as binary data (the KServe binary extension tritonclient uses by default).
MAX_JSON_VALUES = 2**20
# The front's read deadlines: a request head from its first byte (or the connection's opening),
# then its body.
HEADER_TIMEOUT_S = 10.0
# HTTP connections one client address may hold open at once (its own share of file descriptors).
MAX_CONNECTIONS_PER_CLIENT = 512
BODY_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 30.0

# A packaged Triton repository: preferred batch sizes (also the CUDA-graph batch sizes).
PREFERRED_BATCH_SIZES = (8, 16)
GPU_INSTANCES = 1
ONNX_KIND = "gpu"
ONNX_KINDS = ("gpu", "cpu")

# ``deploykit serve-bench``.
BENCH_CONCURRENCY = (1, 8, 32)
BENCH_REQUESTS = 256
BENCH_BACKEND = RUNNER
BENCH_CLIENT = "auto"
BENCH_CLIENTS = ("auto", "perf_analyzer", "builtin")
# The open loop (--rate): Poisson arrivals as AIPerf's default, seeded; at most this many
# unanswered requests (perf_analyzer's --max-threads plays that part), so a slow server cannot
# exhaust the client.
BENCH_SCHEDULE = "poisson"
BENCH_SCHEDULES = ("poisson", "constant")
BENCH_MAX_OUTSTANDING = 64
# Longest wait for one answer: a server that never answers ends the benchmark, not hangs it.
BENCH_REQUEST_TIMEOUT_S = 60.0
