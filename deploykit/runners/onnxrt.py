"""ONNX Runtime runners: ``ort`` (CPU; CUDA first when onnxruntime-gpu is installed and sees a
GPU) and ``ort-cuda`` (the CUDA provider only, and nothing on the CPU without saying so); and
``run_graph``, a graph's outputs on the CPU provider, as the exporter's checks read them (inner
tensors marked as outputs by ``with_outputs``).

Where nodes run. ONNX Runtime places every node its CUDA provider has no kernel for on the CPU,
silently, and also puts small shape computations there on purpose (``GetCpuPreferredNodes``:
``Shape``, and the int64 arithmetic on shapes that feeds ``Reshape``). Its own switch,
``session.disable_cpu_ep_fallback``, refuses both, so every graph with a dynamic batch would be
refused. ``ort-cuda`` instead profiles one run when it activates (ONNX Runtime's profiler names
each node's provider and output types), and refuses any node on the CPU that computes anything
but an int64 shape, naming them, unless ``allow_cpu_fallback``. ``placement`` (and the runner's
``info``, which reports record) say where every node ran.

deploykit's custom ops. On the CPU provider alone, a graph with ``deploykit::SaPE2Bias`` nodes
runs them in deploykit's compiled kernels (``deploykit.kernels``: the signature stage where its
inputs are fp32, the pairwise distances with the logits' add), unless ``compiled_kernels=False``
or the kernels cannot be built here, when ONNX Runtime runs the function body; ``info.kernels``
says which. ``cpu_runner``, what the exporter's checks run, always runs the function body. On a
CPU whose int8 products saturate, int8 weights are narrowed to 7 bits as OpenVINO's runner does.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from deploykit.errors import DeployKitError, listed, one_line
from deploykit.runners.base import NodePlacement, Placement, RunInfo, Runner, run_rows
from deploykit.runners.cpu import denormal_mode_kept, denormals_flushed, int8_saturates
from deploykit.runners.streams import StreamScheduler, check_streams, threads_per_stream

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
_MAX_NAMED = 5  # nodes named in a one-line refusal


def default_providers() -> list[str]:
    """CUDA first when this onnxruntime build has it, then CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def session_options(intra_op_threads: int = 0):
    """Session options tuned for ViTs: sequential execution (parallel mode is slower for a chain
    of GEMMs on small machines: ``benchmarks/results/tune-ort-vit_small_patch16-ape-224.json``),
    full graph optimisation, denormals flushed to zero in ONNX Runtime's own threads (the runner
    flushes the calling thread, which computes too).

    Flushed, because a peaked softmax writes float32 denormals and every product with one takes a
    slow path on x86 (``deploykit.runners.cpu``; ``benchmarks/results/denormals.json``), while the outputs
    stay bit-identical."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = intra_op_threads
    opts.add_session_config_entry("session.set_denormal_as_zero", "1")
    opts.log_severity_level = 3  # errors only: keep the terminal for our report
    return opts


def wide_session_options():
    """``session_options`` of all the cores for the session beside a runner's streams: its threads
    stop spinning as its call returns, since the next work is often the streams' (a merged batch
    after a lone request), and a spinning thread holds the core one of them needs
    (``benchmarks/results/stream-spread.json``)."""
    opts = session_options()
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    return opts


def profiled_placement(profile: str | os.PathLike) -> Placement:
    """Read the node placement from an ONNX Runtime profile (``session.end_profiling()``): one
    ``kernel_time`` event per node run, with its provider and output types."""
    events = json.loads(Path(profile).read_text())
    nodes: dict[str, tuple[str, str, bool]] = {}
    for event in events:
        args = event.get("args", {})
        if event.get("cat") != "Node" or "provider" not in args or not event.get("name", "").endswith("_kernel_time"):
            continue
        name = event["name"].removesuffix("_kernel_time")
        outputs = [dtype for output in args.get("output_type_shape", []) for dtype in output]
        shape_only = bool(outputs) and all(dtype == "int64" for dtype in outputs)
        nodes.setdefault(name, (args["provider"], args.get("op_name", "?"), shape_only))
    providers = Counter(provider for provider, _, _ in nodes.values())
    cpu = tuple(f"{name} ({op})" for name, (provider, op, shape_only) in nodes.items() if provider == CPU and not shape_only)
    return Placement(dict(providers), cpu)


def check_placement(placement: Placement, backend: str, allow_cpu_fallback: bool) -> str:
    """``""``, or with ``allow_cpu_fallback`` a note saying which compute nodes ran on the CPU.

    Raises:
        DeployKitError: compute nodes ran on the CPU and that is not allowed.
    """
    if not placement.cpu_compute:
        return ""
    count = len(placement.cpu_compute)
    named = listed(list(placement.cpu_compute), _MAX_NAMED)
    if allow_cpu_fallback:
        return f"{count} node(s) ran on the CPU: {named}"
    raise DeployKitError(
        f"{backend}: ONNX Runtime runs {count} node(s) on the CPU, not the GPU: {named}; "
        "pass --allow-cpu-fallback to accept that (or use --backend trt)"
    )


def _zero_feed(session, low: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
    """One input of batch 1 for each graph input, zeros: dynamic dims as 1, except the trailing
    (height, width) of a resolution-range graph, set to ``low``, its smallest resolution."""
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64, "tensor(int32)": np.int32}
    feed = {}
    for i in session.get_inputs():
        dims = [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
        if low and len(dims) > len(low):
            tail = i.shape[-len(low) :]
            dims[-len(low) :] = [d if isinstance(d, int) and d > 0 else size for d, size in zip(tail, low)]
        feed[i.name] = np.zeros(dims, types.get(i.type, np.float32))
    return feed


class OnnxrtRunner(Runner):
    """Runs an ONNX model (path or serialized bytes) with ONNX Runtime.

    Args:
        model: path to a ``.onnx`` file, or its bytes.
        providers: execution providers in priority order; default ``default_providers()``.
        intra_op_threads: 0 lets ONNX Runtime choose (one per physical core).
        range_low: the smallest ``(height, width)`` of a resolution-range graph, whose height and
            width are symbolic: where ``zero_feed`` (and ort-cuda's placement probe) run it. Only
            the export's metadata says it; the backends' registry reads it there.
        streams: sessions of the graph, each with this machine's cores split between them
            (``intra_op_threads`` each, unless set), so that concurrent calls run in parallel
            instead of sharing one thread pool; beside them one session of all the cores, which a
            call that finds the runner idle keeps (``deploykit.runners.streams.StreamScheduler``).
        compiled_kernels: on the CPU provider alone, run deploykit's custom ops in its compiled
            kernels where they build here (module docstring); False runs their function bodies.
    """

    name = "ort"
    # ONNX Runtime guarantees InferenceSession::Run() is thread-safe (microsoft/onnxruntime#19301);
    # callers need no lock (benchmarks/ort_lock.py measures what one would cost).
    thread_safe = True

    def __init__(
        self,
        model: str | os.PathLike | bytes,
        providers: Sequence[str] | None = None,
        intra_op_threads: int = 0,
        range_low: tuple[int, ...] | None = None,
        streams: int = 1,
        compiled_kernels: bool = True,
    ):
        super().__init__()
        self.model = model
        self.providers = list(providers) if providers else None
        self.streams = check_streams(streams)
        self.intra_op_threads = intra_op_threads or (threads_per_stream(streams) if streams > 1 else 0)
        self.range_low = tuple(range_low) if range_low else None
        self.compiled_kernels = compiled_kernels
        self.kernels = ""  # what ran deploykit's custom ops (RunInfo.kernels), once active
        self.narrowed_weights = 0  # int8 weights narrowed to 7 bits (``_with_seven_bit_weights``)
        self._library: str | None = None
        self._session = self._scheduler = None

    def _activate(self, options=None) -> None:
        source = self.model if isinstance(self.model, bytes) else str(self.model)
        source = self._with_kernels(source)
        source = self._with_seven_bit_weights(source)
        try:
            # one session per stream (the same graph and options, a thread pool each), and with
            # streams the wide session of all the cores
            streams = [self._new_session(source, options or session_options(self.intra_op_threads)) for _ in range(self.streams)]
            wide = self._new_session(source, options or wide_session_options()) if self.streams > 1 else None
        except Exception as err:  # ORT raises its own Fail/InvalidGraph/NoSuchFile types
            raise DeployKitError(f"onnxruntime cannot load {self._label()}: {str(err).splitlines()[0]}") from err
        self._session = streams[0]
        self._scheduler = StreamScheduler(wide, streams, self._run) if wide else None
        self._outputs = [o.name for o in self._session.get_outputs()]

    def _with_kernels(self, source: str | bytes) -> str | bytes:
        """``source``, or the graph split for deploykit's compiled kernels (``self._library`` set)
        where it has their ops and runs on the CPU provider alone; ``self.kernels`` says which."""
        from deploykit.graph.plugin_nodes import SPLITS

        self._library, self.kernels = None, ""
        if (self.providers or default_providers()) != [CPU] or not _mentions(source, [op for _, op in SPLITS]):
            return source
        import onnx

        from deploykit.graph.plugin_nodes import for_cpu_kernels, has_companions, plugin_ops
        from deploykit.kernels import OPS, compiled_library

        try:
            model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(source)
        except Exception:  # not ONNX: ONNX Runtime says so in its words
            return source
        ops = plugin_ops(model, OPS)
        if not ops:
            return source
        names = ", ".join(f"{domain}::{op}" for domain, op in sorted(ops))
        library = compiled_library() if self.compiled_kernels else None
        if library is None or library.path is None or not has_companions(model):
            why = "compiled_kernels=False" if library is None else library.reason or "exported before its signature stage was a function"
            self.kernels = f"{names}: ONNX function body ({why})"
            return source
        form = for_cpu_kernels(model, OPS)
        self._library = str(library.path)
        ran = [*(["deploykit::SaPE2Signatures"] if form.signatures else []), *(f"{d}::{o}" for d, o in sorted(OPS))]
        stages = (
            "signatures and distances in deploykit's compiled kernels" if form.signatures else "distances in deploykit's compiled kernel"
        )
        self.kernels = f"{names}: {stages} ({', '.join(ran)}{', logits added there' if form.folded_adds else ''})"
        return model.SerializeToString()

    def _with_seven_bit_weights(self, source: str | bytes) -> str | bytes:
        """``source``, or with its int8 weights narrowed to 7 bits on a CPU whose int8 products
        saturate (``int8_saturates``; ``graph.openvino.weights_in_seven_bits``): there ONNX
        Runtime's u8s8 kernels sum pairs in 16 bits, and the zoo's GridPE int8 plan read cosine 0.981
        against fp32 on an AVX2 EPYC, within its 0.99 with 7-bit weights. ``self.narrowed_weights``
        counts them."""
        self.narrowed_weights = 0
        if (self.providers or default_providers()) != [CPU] or not int8_saturates():
            return source
        if not _mentions(source, ["DequantizeLinear"]):
            return source
        import onnx
        import onnx_ir as ir

        from deploykit.graph.openvino import weights_in_seven_bits

        try:
            model = ir.from_proto(onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(source))
        except Exception:  # not ONNX: ONNX Runtime says so in its words
            return source
        self.narrowed_weights = weights_in_seven_bits(model)
        return ir.to_proto(model).SerializeToString() if self.narrowed_weights else source

    def _new_session(self, source, options):
        import onnxruntime as ort

        if self._library:
            options.register_custom_ops_library(self._library)
        with denormal_mode_kept():
            return ort.InferenceSession(source, sess_options=options, providers=self.providers or default_providers())

    def _label(self) -> str:
        return "model bytes" if isinstance(self.model, bytes) else str(self.model)

    @property
    def info(self) -> RunInfo:
        return RunInfo(self.provider, kernels=self.kernels)

    @property
    def parallel_calls(self) -> int:
        return self._scheduler.pool.size if self._scheduler else 1

    @property
    def spreads_batches(self) -> bool:
        return self._scheduler is not None

    def input_names(self) -> list[str]:
        return [i.name for i in self._session.get_inputs()] if self._session else super().input_names()

    @property
    def provider(self) -> str:
        """The execution provider ONNX Runtime put first for this session (it drops CUDA
        silently when no GPU is usable: reports say which one ran)."""
        return self._session.get_providers()[0] if self._session else "not active"

    def zero_feed(self) -> dict[str, np.ndarray]:
        """One input of batch 1 for each graph input, zeros, at a shape the graph takes (``_zero_feed``): enough to time a graph."""
        return _zero_feed(self._session, self.range_low)

    def output_names(self) -> list[str]:
        return [o.name for o in self._session.get_outputs()]

    def _infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {k: np.ascontiguousarray(v) for k, v in feed.items()}
        # One session is thread-safe (callers need no lock), but concurrent calls on it share its
        # thread pool; with streams, the scheduler gives each call sessions of its own.
        return self._scheduler(feed) if self._scheduler else self._run(self._session, feed)

    def _run(self, session, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with denormals_flushed():  # the calling thread runs part of every kernel (session_options)
            outputs = session.run(self._outputs, feed)
        return dict(zip(self._outputs, outputs))

    def _deactivate(self) -> None:
        if self._scheduler:
            self._scheduler.close()
        self._session = self._scheduler = None


class OnnxrtCudaRunner(OnnxrtRunner):
    """ONNX Runtime on the GPU (``onnxruntime-gpu``): refuses a session without the CUDA provider,
    and one that runs compute nodes on the CPU unless ``allow_cpu_fallback`` (module docstring).

    Args:
        model: path to a ``.onnx`` file, or its bytes.
        intra_op_threads: 0 lets ONNX Runtime choose.
        allow_cpu_fallback: accept compute nodes on the CPU (``info`` still names them).
        range_low: as ``OnnxrtRunner``'s: where the placement probe runs a resolution-range graph.
    """

    name = "ort-cuda"

    def __init__(
        self,
        model: str | os.PathLike | bytes,
        intra_op_threads: int = 0,
        allow_cpu_fallback: bool = False,
        range_low: tuple[int, ...] | None = None,
    ):
        super().__init__(model, providers=[CUDA], intra_op_threads=intra_op_threads, range_low=range_low)
        self.allow_cpu_fallback = allow_cpu_fallback
        self.placement: Placement | None = None
        self.placement_note = ""

    def _activate(self) -> None:
        import onnxruntime as ort

        if CUDA not in ort.get_available_providers():
            raise DeployKitError("ort-cuda needs onnxruntime-gpu (this onnxruntime has no CUDA provider); pip install 'deploykit[gpu]'")
        with tempfile.TemporaryDirectory(prefix="deploykit-ort-profile-") as tmp:
            options = session_options(self.intra_op_threads)
            options.enable_profiling, options.profile_file_prefix = True, str(Path(tmp) / "placement")
            super()._activate(options)
            try:
                if not self._session.get_providers() or self._session.get_providers()[0] != CUDA:  # ORT drops CUDA when no GPU is usable
                    raise DeployKitError("ort-cuda: onnxruntime could not use the CUDA provider (no GPU, or a CUDA/cuDNN mismatch)")
                self._probe()
                self.placement = profiled_placement(self._session.end_profiling())  # profiling stops here
                self.placement_note = check_placement(self.placement, self.name, self.allow_cpu_fallback)
            except BaseException:
                self._session = None
                raise

    def _probe(self) -> None:
        """One profiled run (where each node runs), at a shape the graph takes; ONNX Runtime's
        failure is one line, and its own log of it is silenced (the error says it)."""
        import onnxruntime as ort

        feed, options = _zero_feed(self._session, self.range_low), ort.RunOptions()
        options.log_severity_level = 4  # fatal only
        try:
            self._session.run(None, feed, options)
        except Exception as err:  # ORT raises its own InvalidArgument/Fail/RuntimeException types
            raise DeployKitError(
                one_line(f"{self.name}: ONNX Runtime could not run {self._label()} to see where its nodes run: {err}")
            ) from err

    @property
    def info(self) -> RunInfo:
        return RunInfo(self.provider, placement=NodePlacement(self.placement, self.placement_note))


def cpu_runner(proto) -> OnnxrtRunner:
    """A runner of a graph (``onnx.ModelProto``) on ONNX Runtime's CPU provider: what the
    exporter's checks run (the same results on every machine, GPU or not: function bodies, no
    compiled kernel)."""
    return OnnxrtRunner(proto.SerializeToString(), providers=[CPU], compiled_kernels=False)


def _mentions(source: str | bytes, names: Iterable[str]) -> bool:
    """Whether a graph's bytes (or file) contain any of ``names``: a look before parsing it, through
    a memory map (no copy of a file of hundreds of MB; its pages are the ones the runtime reads next)."""
    import mmap

    wanted = [name.encode() for name in names]
    if isinstance(source, bytes):
        return any(name in source for name in wanted)
    if not Path(source).is_file():  # a FIFO would block the open
        return False
    try:
        with open(source, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return any(data.find(name) >= 0 for name in wanted)
    except (OSError, ValueError):  # not a regular file, or empty (mmap refuses a length of 0)
        return False


def run_graph(
    proto, inputs: np.ndarray, batch: int = 32, outputs: Sequence[str] | None = None, done: Callable[[int], None] | None = None
) -> np.ndarray | list[np.ndarray]:
    """``run_rows`` of a graph (``onnx.ModelProto``) on ONNX Runtime's CPU provider; ``outputs``
    the graph does not output (inner tensors, such as the block outputs recorded at export) are
    marked as outputs first (``with_outputs``)."""
    if outputs is not None and not set(outputs) <= {o.name for o in proto.graph.output}:
        proto = with_outputs(proto, outputs)
    with cpu_runner(proto) as runner:
        return run_rows(runner, inputs, batch, outputs, done)


def with_outputs(proto, names: Iterable[str]):
    """A copy of a graph (``onnx.ModelProto``) that also outputs ``names``, each declared with the
    element type shape inference gives it (a reduced-precision plan may store a block output in
    fp16 or bf16), float where it cannot tell; shapes are left to the runtime."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    have = {o.name for o in out.graph.output}
    wanted = [name for name in dict.fromkeys(names) if name not in have]
    if wanted:
        types = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(proto).graph.value_info}
        out.graph.output.extend(onnx.helper.make_tensor_value_info(n, types.get(n) or onnx.TensorProto.FLOAT, None) for n in wanted)
    return out
