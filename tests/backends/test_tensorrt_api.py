"""The engine path held to TensorRT's real API on a machine without a GPU.

Every TensorRT object here is an autospec of the real class (``tests.trt_api.strict_autospec``:
attributes and call signatures are the class's own): TensorRT 11's runtime from ``tensorrt_lean``
(the same runtime classes as full TensorRT), TensorRT-RTX's from ``tensorrt_rtx``. What needs a
GPU is replaced by ``HostDevice`` below (torch.cuda's buffers, streams and graph capture,
emulated on the CPU), never TensorRT.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import tensorrt_lean as lean
import tensorrt_rtx as rtx
import torch

from deploykit.backends import cuda_graphs
from deploykit.backends.cuda_graphs import CAPTURE_REFUSED, CudaGraphExecutor, rtx_graph_note
from deploykit.backends.rtx_runtime import rtx_context
from deploykit.errors import DeployKitError
from tests.trt_api import strict_autospec


class _Stream:
    cuda_stream = 7

    def synchronize(self):
        pass


class _Graph:
    """What a CUDA graph holds: the work enqueued while it was captured, replayed as recorded."""

    def __init__(self):
        self.work = []

    def replay(self):
        for step in self.work:
            step()


class HostDevice:
    """``TorchCudaDevice``'s four methods on the CPU. Work enqueued while capturing is recorded
    into the graph instead of running, as CUDA stream capture does."""

    def __init__(self):
        self.tensors, self.capturing, self.captures = {}, None, 0

    def stream(self):
        return _Stream()

    def empty(self, shape, dtype):
        tensor = torch.zeros(shape, dtype=getattr(torch, dtype))
        self.tensors[tensor.data_ptr()] = tensor
        return tensor

    @contextlib.contextmanager
    def capture(self, stream):
        self.capturing, self.captures = _Graph(), self.captures + 1
        try:
            yield self.capturing
        finally:
            self.capturing = None

    def run_on(self, stream):
        return contextlib.nullcontext()


def _lean_engine(device, fail_capture=False):
    """A TensorRT engine (``images`` [B, 3] -> ``logits`` = 2·images) and the context it creates,
    both autospecs of tensorrt_lean's classes; ``execute_async_v3`` does its work on the tensors
    bound by address, or records it while ``device`` captures."""
    names = ["images", "logits"]
    engine = strict_autospec(lean.ICudaEngine, num_io_tensors=2)
    context = strict_autospec(lean.IExecutionContext)
    engine.create_execution_context.return_value = context
    engine.get_tensor_name.side_effect = names.__getitem__
    engine.get_tensor_mode.side_effect = lambda n: lean.TensorIOMode.INPUT if n == "images" else lean.TensorIOMode.OUTPUT
    engine.get_tensor_dtype.return_value = lean.DataType.FLOAT
    engine.get_tensor_shape.side_effect = lambda n: (-1, 3)
    shapes, addresses = {}, {}
    context.set_input_shape.side_effect = lambda name, shape: shapes.__setitem__(name, tuple(shape)) or True
    context.get_tensor_shape.side_effect = lambda name: shapes["images"]
    context.set_tensor_address.side_effect = lambda name, ptr: addresses.__setitem__(name, ptr) or True

    def execute(stream):
        source, target = device.tensors[addresses["images"]], device.tensors[addresses["logits"]]

        def work():
            target.copy_(source * 2)

        if device.capturing is not None:
            if fail_capture:
                return False  # TensorRT could not enqueue: the graph holds nothing of it
            device.capturing.work.append(work)
            return True
        work()
        return True

    context.execute_async_v3.side_effect = execute
    return engine, context


@pytest.fixture
def tensorrt(monkeypatch):
    """``import_trt("tensorrt")`` answers TensorRT 11's lean runtime (full TensorRT does not install here)."""
    monkeypatch.setattr(cuda_graphs, "import_trt", lambda module: lean)


def test_cuda_graphs_on_tensorrt_call_only_what_tensorrt_has(tensorrt):
    """Defect 1: ``is_stream_capturable`` exists on TensorRT-RTX only; TensorRT's context has no
    such attribute, so every profile with CUDA graphs (the default) ended in AttributeError."""
    assert not hasattr(lean.IExecutionContext, "is_stream_capturable") and hasattr(rtx.IExecutionContext, "is_stream_capturable")
    device = HostDevice()
    engine, context = _lean_engine(device)
    executor = CudaGraphExecutor(engine, "tensorrt", device)
    executor.activate()
    rng = np.random.default_rng(0)
    for shape in [(2, 3), (4, 3), (2, 3), (4, 3), (2, 3)]:  # alternating: each replay must use its own shape's buffers
        images = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(executor.infer({"images": images})["logits"], images * 2)
    assert executor.capturable is True and executor.note == "" and set(executor.graphs) == {(2, 3), (4, 3)}
    assert device.captures == 2  # one capture per shape, replayed after
    assert context.execute_async_v3.call_count == 4  # per shape: one plain run, one enqueue into the graph


def test_a_capture_whose_enqueue_failed_is_never_replayed(tensorrt):
    """Defect 4: ``execute_async_v3``'s result inside the capture was ignored, so a failed enqueue
    left an empty graph, replayed with the previous call's outputs at that shape."""
    device = HostDevice()
    engine, _ = _lean_engine(device, fail_capture=True)
    executor = CudaGraphExecutor(engine, "tensorrt", device)
    executor.activate()
    first, second = np.ones((2, 3), np.float32), np.full((2, 3), 5, np.float32)
    np.testing.assert_array_equal(executor.infer({"images": first})["logits"], first * 2)
    np.testing.assert_array_equal(executor.infer({"images": second})["logits"], second * 2)  # not the stale 2s
    assert executor.graphs == {} and executor.capturable is False and executor.note == CAPTURE_REFUSED
    assert device.captures == 1  # not tried again


def test_a_capture_cuda_refuses_runs_without_graphs(tensorrt):
    device = HostDevice()

    @contextlib.contextmanager
    def refused(stream):
        yield _Graph()
        raise RuntimeError("operation not permitted when stream is capturing")

    device.capture = refused
    engine, _ = _lean_engine(device)
    executor = CudaGraphExecutor(engine, "tensorrt", device)
    executor.activate()
    images = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(executor.infer({"images": images})["logits"], images * 2)
    assert executor.capturable is False and executor.note.startswith("CUDA graph capture failed: operation not permitted")


def test_a_failed_plain_execution_is_an_error_not_stale_outputs(tensorrt):
    device = HostDevice()
    engine, context = _lean_engine(device)
    context.execute_async_v3.side_effect = lambda stream: False
    executor = CudaGraphExecutor(engine, "tensorrt", device)
    executor.activate()
    with pytest.raises(DeployKitError, match=r"execute_async_v3 failed at input shape \[2, 3\]"):
        executor.infer({"images": np.ones((2, 3), np.float32)})


def test_tensorrt_rtx_captures_graphs_through_its_runtime_config():
    """Defect 4, RTX: TensorRT-RTX compiles kernels per shape lazily; it captures graphs itself
    when its context is created with WHOLE_GRAPH_CAPTURE, not ours."""
    engine = strict_autospec(rtx.ICudaEngine)
    config = strict_autospec(rtx.IRuntimeConfig)
    context = strict_autospec(rtx.IExecutionContext)
    engine.create_runtime_config.return_value = config
    engine.create_execution_context.return_value = context
    context.get_runtime_config.return_value = config  # the context holds the config it was made with
    assert rtx_context(engine, rtx, cuda_graph=True) is context and rtx_graph_note(context, rtx) == ""
    assert config.cuda_graph_strategy == rtx.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
    engine.create_execution_context.assert_called_once_with(config)
    context.execute_async_v3.assert_not_called()  # nothing captured by us
    # What the context runs with is said, not what was asked: a context whose config reads DISABLED.
    context.get_runtime_config.return_value = disabled = strict_autospec(rtx.IRuntimeConfig)
    disabled.cuda_graph_strategy = rtx.CudaGraphStrategy.DISABLED
    assert rtx_context(engine, rtx, cuda_graph=True) is context
    assert (
        rtx_graph_note(context, rtx) == "TensorRT-RTX's execution context runs with cuda_graph_strategy DISABLED, not WHOLE_GRAPH_CAPTURE"
    )
    engine.create_execution_context.return_value = None
    with pytest.raises(DeployKitError, match="could not create an execution context with CUDA graphs"):
        rtx_context(engine, rtx, cuda_graph=True)


@pytest.fixture
def rtx_runner(monkeypatch):
    """A TensorRT-RTX ``TrtRunner`` on an RTX 4090 whose engine deserializes to an autospec of
    TensorRT-RTX's engine; Polygraphy's ``TrtRunner`` (it needs CUDA to allocate) is the real
    class, autospecced."""
    from deploykit.backends import trt_runner
    from deploykit.backends._polygraphy import backend
    from deploykit.backends.devices import Device

    pg = backend("tensorrt_rtx")  # binds Polygraphy to TensorRT-RTX before anything imports polygraphy.backend.trt
    PolygraphyRunner = pg.TrtRunner
    engine = strict_autospec(rtx.ICudaEngine, num_io_tensors=2)
    engine.get_tensor_name.side_effect = ["images", "logits"].__getitem__
    engine.get_tensor_mode.side_effect = lambda n: rtx.TensorIOMode.INPUT if n == "images" else rtx.TensorIOMode.OUTPUT
    engine.get_tensor_profile_shape.return_value = [(1, 3, 32, 32), (4, 3, 32, 32), (8, 3, 32, 32)]
    engine.create_runtime_config.return_value = config = strict_autospec(rtx.IRuntimeConfig)
    engine.create_execution_context.return_value = context = strict_autospec(rtx.IExecutionContext)
    context.get_runtime_config.return_value = config  # the context holds the config it was made with
    made = []

    def polygraphy_runner(engine_or_context, *args, **kwargs):
        runner = mock.create_autospec(PolygraphyRunner, instance=True)
        runner.is_active = False
        # What Polygraphy's activate() sets: the context it runs (made from an engine, or given) and its stream.
        runner.context = engine_or_context if engine_or_context is context else engine.create_execution_context()
        runner.stream = SimpleNamespace(ptr=11)
        made.append((engine_or_context, runner))
        return runner

    monkeypatch.setattr(pg, "EngineFromBytes", lambda data, runtime=None: lambda: engine)
    monkeypatch.setattr(pg, "TrtRunner", polygraphy_runner)
    monkeypatch.setattr(trt_runner, "check_rtx_engine", lambda runtime, data, what: None)
    gpu = Device("12.8", "570.1", "NVIDIA RTX 4090", "8.9")
    return (
        lambda cuda_graph, **kw: trt_runner.TrtRunner(b"engine", "tensorrt_rtx", cuda_graph=cuda_graph, device_info=gpu, **kw),
        engine,
        made,
    )


def test_rtx_runner_with_cuda_graphs_hands_polygraphy_the_graph_capturing_context(rtx_runner):
    make, engine, made = rtx_runner
    with make(cuda_graph=True) as runner:
        ((given, polygraphy),) = made
        assert given is engine.create_execution_context.return_value  # the WHOLE_GRAPH_CAPTURE context
        assert engine.create_runtime_config.return_value.cuda_graph_strategy == rtx.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
        assert runner.cuda_graphs and runner.cuda_graph_note == "" and runner.batch_range == (1, 8)
        polygraphy.activate.assert_called_once_with()
    with make(cuda_graph=False) as runner:
        assert made[-1][0] is engine and not runner.cuda_graphs and runner.cuda_graph_note == "not requested"


def test_rtx_runner_reports_cuda_graphs_only_while_tensorrt_rtx_can_capture(rtx_runner):
    """Issue 42: RTX CUDA graphs were reported as used whether or not TensorRT-RTX could capture.
    TensorRT-RTX captures inside execute_async_v3 and reports nothing; after each execution the
    runner asks it (is_stream_capturable, on the stream that execution ran on)."""
    make, engine, made = rtx_runner
    context = engine.create_execution_context.return_value
    with make(cuda_graph=True) as runner:
        polygraphy = made[-1][1]
        polygraphy.infer.side_effect = lambda feed: {"logits": np.zeros((len(feed["images"]), 10), np.float32)}
        context.is_stream_capturable.return_value = True
        runner.infer({"images": np.zeros((4, 3, 32, 32), np.float32)})
        context.is_stream_capturable.assert_called_with(11)
        assert runner.cuda_graphs and runner.info.cuda_graphs.used and runner.cuda_graph_note == ""
        context.is_stream_capturable.return_value = False  # e.g. data-dependent shapes at this batch
        runner.infer({"images": np.zeros((1, 3, 32, 32), np.float32)})
        assert not runner.cuda_graphs and not runner.info.cuda_graphs.used
        assert runner.cuda_graph_note == (
            "TensorRT-RTX cannot capture the execution at input shape [1, 3, 32, 32] into a CUDA graph (is_stream_capturable is False: "
            "the engine was built without REQUIRE_USER_ALLOCATION, so it may allocate at run time; "
            "deploykit build --require-user-allocation builds one that never does)"
        )
        context.is_stream_capturable.return_value = True
        runner.infer({"images": np.zeros((4, 3, 32, 32), np.float32)})
        assert not runner.cuda_graphs  # one execution that could not be captured is enough to say so


def test_rtx_capture_is_judged_by_the_engine_s_builder_flag_too(rtx_runner):
    """An engine built with REQUIRE_USER_ALLOCATION (its record says so: ``capture_guaranteed``)
    never allocates at run time, so TensorRT-RTX's first answer stands for every shape and it is
    not asked again; a refusal then is the stream's, and says so."""
    make, engine, made = rtx_runner
    context = engine.create_execution_context.return_value
    with make(cuda_graph=True, capture_guaranteed=True) as runner:
        polygraphy = made[-1][1]
        polygraphy.infer.side_effect = lambda feed: {"logits": np.zeros((len(feed["images"]), 10), np.float32)}
        context.is_stream_capturable.return_value = True
        for batch in (4, 1, 8):
            runner.infer({"images": np.zeros((batch, 3, 32, 32), np.float32)})
        context.is_stream_capturable.assert_called_once_with(11)
        assert runner.cuda_graphs and runner.cuda_graph_note == ""
    with make(cuda_graph=True, capture_guaranteed=True) as runner:
        made[-1][1].infer.side_effect = polygraphy.infer.side_effect
        context.is_stream_capturable.return_value = False
        runner.infer({"images": np.zeros((2, 3, 32, 32), np.float32)})
        assert not runner.cuda_graphs and runner.cuda_graph_note == (
            "TensorRT-RTX cannot capture the execution at input shape [2, 3, 32, 32] into a CUDA graph "
            "(is_stream_capturable is False on this stream, although the engine was built with REQUIRE_USER_ALLOCATION)"
        )
    with make(cuda_graph=True) as runner:  # without the flag, each execution is asked
        made[-1][1].infer.side_effect = polygraphy.infer.side_effect
        context.is_stream_capturable.reset_mock(return_value=True)
        context.is_stream_capturable.return_value = True
        for batch in (4, 1, 8):
            runner.infer({"images": np.zeros((batch, 3, 32, 32), np.float32)})
        assert context.is_stream_capturable.call_count == 3 and runner.cuda_graphs


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_tensorrt_rtx_keeps_its_compiled_kernels_in_a_runtime_cache_beside_the_engine(rtx_runner, tmp_path, cuda_graph):
    """Item 7 of issue 42: TensorRT-RTX compiles an engine's kernels when they first run; without
    its runtime cache every process compiled them again. The cache is created from the context's
    runtime config (with the CUDA-graph strategy when asked), filled from the file beside the
    engine, and written back, whole or not at all, when the runner deactivates."""
    make, engine, made = rtx_runner
    config, cache = engine.create_runtime_config.return_value, strict_autospec(rtx.IRuntimeCache)
    config.create_runtime_cache.return_value = cache
    config.set_runtime_cache.return_value = True
    cache.deserialize.return_value = True
    cache.serialize.return_value = memoryview(b"kernels compiled by run 1 and run 2")  # IHostMemory is a buffer
    path = tmp_path / "model_32.rtx.runtime-cache"
    path.write_bytes(b"kernels compiled by run 1")
    with make(cuda_graph=cuda_graph, runtime_cache=path) as runner:
        cache.deserialize.assert_called_once_with(b"kernels compiled by run 1")
        config.set_runtime_cache.assert_called_once_with(cache)
        engine.create_execution_context.assert_called_once_with(config)
        assert made[-1][0] is engine.create_execution_context.return_value  # Polygraphy runs that context
        assert (config.cuda_graph_strategy == rtx.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE) is cuda_graph
        assert runner.cuda_graphs is cuda_graph and path.read_bytes() == b"kernels compiled by run 1"
    assert path.read_bytes() == b"kernels compiled by run 1 and run 2"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary file left beside it


def test_a_runtime_cache_tensorrt_rtx_refuses_is_replaced(rtx_runner, tmp_path):
    make, engine, _ = rtx_runner
    config, cache = engine.create_runtime_config.return_value, strict_autospec(rtx.IRuntimeCache)
    config.create_runtime_cache.return_value = cache
    config.set_runtime_cache.return_value = True
    cache.deserialize.return_value = False  # from another GPU, driver or TensorRT-RTX version
    cache.serialize.return_value = memoryview(b"kernels for this GPU")
    path = tmp_path / "model_32.rtx.runtime-cache"
    path.write_bytes(b"kernels for another GPU")
    with make(cuda_graph=False, runtime_cache=path):
        config.set_runtime_cache.assert_called_once_with(cache)  # an empty cache, filled by this run
    assert path.read_bytes() == b"kernels for this GPU"
    path.unlink()
    with make(cuda_graph=False, runtime_cache=path):
        pass
    assert path.read_bytes() == b"kernels for this GPU"  # none yet: made, not read


def test_engine_runners_keep_the_runtime_cache_beside_the_engine(tmp_path):
    from deploykit.backends.engine_cache import engine_paths
    from deploykit.backends.trt_runner import engine_runner

    onnx_path = tmp_path / "model_32_fp16.onnx"
    engine = engine_paths(onnx_path, "tensorrt_rtx")[0]
    engine.write_bytes(b"engine")
    cache = engine_runner(onnx_path, "tensorrt_rtx").runtime_cache.path
    assert (
        cache.parent == engine.parent
        and cache.name.startswith("model_32_fp16.rtx.")
        and cache not in engine_paths(onnx_path, "tensorrt_rtx")
    )


def test_tensorrt_errors_reach_the_user_as_one_line(rtx_runner, caplog):
    """Defect 8: TensorRT's run-time messages went nowhere (Polygraphy's logger does not
    propagate) and a PolygraphyException from inference surfaced as a traceback."""
    from polygraphy.logger import G_LOGGER

    from deploykit.backends._polygraphy import backend

    make, _, made = rtx_runner
    trt_logger = backend("tensorrt_rtx").get_trt_logger()  # the logger TensorRT's runtime writes to

    def failing_infer(feed):
        trt_logger.log(rtx.ILogger.Severity.WARNING, "[executionContext.cpp::setTensorAddress] tensor is misaligned")
        trt_logger.log(rtx.ILogger.Severity.ERROR, "[executionContext.cpp::enqueueV3] Error Code 1: Cuda Runtime (out of memory)")
        G_LOGGER.critical("`execute_async_v3()` failed. Please see the logging output above for details.")  # raises, as Polygraphy does

    with make(cuda_graph=False) as runner:
        made[-1][1].infer.side_effect = failing_infer
        with caplog.at_level(logging.WARNING, logger="deploykit"):
            with pytest.raises(DeployKitError) as err:
                runner.infer({"images": np.zeros((2, 3, 32, 32), np.float32)})
    assert str(err.value).startswith("rtx: inference failed: ") and "Cuda Runtime (out of memory)" in str(err.value)
    assert "\n" not in str(err.value)
    assert any("tensor is misaligned" in r.getMessage() for r in caplog.records)  # warnings reach the log


def test_devices_each_engine_backend_supports():
    """Defect 6: TensorRT-RTX runs on 7.5, 8.6, 8.9, 12.0 (and 12.1): not on A100/H100/H200/B200."""
    from deploykit.backends.devices import Device, check_device, supports

    assert [cc for cc in ("7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0") if supports("tensorrt_rtx", cc)] == [
        "7.5",
        "8.6",
        "8.9",
        "12.0",
    ]
    assert [cc for cc in ("7.0", "7.5", "8.0", "9.0", "10.0", "12.0") if supports("tensorrt", cc)] == ["7.5", "8.0", "9.0", "10.0", "12.0"]
    check_device("tensorrt_rtx", Device("12.8", "570.1", "NVIDIA GeForce RTX 4090", "8.9"))
    with pytest.raises(
        DeployKitError, match=r"^NVIDIA H100 80GB HBM3 \(compute capability 9.0\) is not supported by rtx .*use --backend trt$"
    ):
        check_device("tensorrt_rtx", Device("12.8", "570.1", "NVIDIA H100 80GB HBM3", "9.0"))
    with pytest.raises(
        DeployKitError, match=r"^Tesla V100.* is not supported by trt \(compute capability 7.5 and newer\); use --backend ort-cuda$"
    ):
        check_device("tensorrt", Device("12.2", "535.1", "Tesla V100-SXM2-16GB", "7.0"))
    with pytest.raises(DeployKitError, match=r"^the trt runner needs a CUDA GPU .*use --backend ort$"):
        check_device("tensorrt", Device())


def test_the_device_is_refused_before_the_engine_is_read(monkeypatch):
    from deploykit.backends.devices import Device
    from deploykit.backends.trt_runner import TrtRunner

    def never():
        raise AssertionError("the engine was read (and its plugins loaded) on a device that cannot run it")

    runner = TrtRunner(never, "tensorrt_rtx", device_info=Device("12.8", "570.1", "NVIDIA A100-SXM4-80GB", "8.0"))
    with pytest.raises(DeployKitError, match="is not supported by rtx"):
        runner.activate()


def test_tensorrt_rtx_judges_an_engine_from_its_header():
    from deploykit.backends.devices import check_rtx_engine

    runtime = rtx.Runtime(rtx.Logger(rtx.Logger.Severity.ERROR))
    with pytest.raises(
        DeployKitError, match=r"^the rtx engine is not valid on this system according to TensorRT-RTX \(malformed engine data\); rebuild"
    ):
        check_rtx_engine(runtime, b"not an engine" * 64, "the rtx engine")


def test_concurrent_runners_each_hear_only_their_own_tensorrt_messages():
    """Item 7 of issue 42: every open ``TrtMessages`` block collected every TensorRT message in the
    process (a server's runners on their threads took each other's errors into their one-line
    failures), and a warning one runner logged silenced the same warning of another (Polygraphy's
    once-per-process filter). TensorRT-RTX's logger, through Polygraphy, on two threads whose steps
    are ordered by events (no timing)."""
    import threading

    from deploykit.backends._polygraphy import TrtMessages, backend

    trt_logger = backend("tensorrt_rtx").get_trt_logger()  # the one logger TensorRT writes to
    warn, error = rtx.ILogger.Severity.WARNING, rtx.ILogger.Severity.ERROR
    both_open, a_logged, b_logged = threading.Event(), threading.Event(), threading.Event()
    heard = {}

    def runner(name, mine, theirs_done, done):
        with TrtMessages(f"runner {name}", log=None) as messages:
            if name == "b":
                both_open.set()
            both_open.wait()
            theirs_done.wait()  # a logs first, then b, each inside its own block, both open
            trt_logger.log(warn, "engine uses a slow fallback kernel")  # the same warning on both runners
            trt_logger.log(error, f"enqueue failed on runner {name}")
            done.set()
            mine.wait()  # both blocks stay open until both have logged
        heard[name] = (messages.warnings, messages.errors)

    a_start = threading.Event()
    a_start.set()
    threads = [
        threading.Thread(target=runner, args=("a", b_logged, a_start, a_logged)),
        threading.Thread(target=runner, args=("b", b_logged, a_logged, b_logged)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for name in ("a", "b"):
        assert heard[name] == (["engine uses a slow fallback kernel"], [f"enqueue failed on runner {name}"])


def test_a_runtime_cache_that_cannot_be_written_is_a_warning_after_the_run(rtx_runner, tmp_path, caplog):
    """Issue 54: a run that succeeded beside a read-only export directory ended in an error when
    the runtime cache was written back; it is a warning. (These tests run as root, whom a
    read-only mode does not stop, so the directory is made unwritable by being a file.)"""
    make, engine, _ = rtx_runner
    config, cache = engine.create_runtime_config.return_value, strict_autospec(rtx.IRuntimeCache)
    config.create_runtime_cache.return_value = cache
    config.set_runtime_cache.return_value = True
    cache.serialize.return_value = memoryview(b"kernels for this GPU")
    not_a_directory = tmp_path / "export"
    not_a_directory.write_bytes(b"a file where the directory should be")
    path = not_a_directory / "model_32.rtx.runtime-cache"
    with caplog.at_level(logging.WARNING, logger="deploykit.backends.rtx_runtime"):
        with make(cuda_graph=False, runtime_cache=path) as runner:
            runner.infer({"images": np.zeros((1, 3, 32, 32), np.float32)})
    assert [r.getMessage() for r in caplog.records] == [
        f"TensorRT-RTX's runtime cache was not saved (cannot write {path}: Not a directory); the next run compiles the kernels again"
    ]
    assert not_a_directory.read_bytes() == b"a file where the directory should be"
