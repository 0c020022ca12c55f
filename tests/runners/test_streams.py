"""Inference streams (``deploykit.runners.streams``): a runner with several streams answers what one
stream answers, and runs concurrent calls at once, each on an executor of its own; with a wide
executor, a lone call keeps every core (``StreamScheduler``); profile keeps streams only where they
raise throughput."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from deploykit.errors import ConfigError
from deploykit.profile.streams import pick_streams
from deploykit.runners.onnxrt import OnnxrtRunner
from deploykit.runners.streams import ExecutorPool, StreamScheduler, check_streams, threads_per_stream, usable_cores

TWO_CORES = pytest.mark.skipif(usable_cores() < 2, reason="two streams need two cores (OpenVINO caps streams at the cores)")


def _graph() -> bytes:
    """``logits = images @ w``: [B, 16] float32 → [B, 5]."""
    weights = np.random.default_rng(0).standard_normal((16, 5)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["images", "w"], ["logits"])],
        "tiny",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])],
        [onnx.numpy_helper.from_array(weights, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _openvino(streams: int):
    from deploykit.backends.openvino import OpenvinoRunner

    return OpenvinoRunner(_graph(), streams=streams)


FEED = {"images": np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)}


@TWO_CORES
def test_openvino_with_streams_answers_as_one_stream_does_on_a_request_per_call():
    with _openvino(1) as one, _openvino(2) as two:
        assert one.parallel_calls == 1 and two.parallel_calls == 2
        assert one.info.precision.streams == 1 and two.info.precision.streams == 2
        np.testing.assert_array_equal(two.infer(FEED)["logits"], one.infer(FEED)["logits"])
        # two calls at once: each holds an infer request of its own while the other runs
        held, answers, together = [], [], threading.Barrier(2, timeout=10)

        def call():
            with two._requests.take() as slot:
                together.wait()  # both inside: a pool of one request would never let the second in
                held.append(id(slot.request))
                slot.request.infer(FEED, share_inputs=True)
                answers.append(slot.request.get_tensor("logits").data.copy())

        threads = [threading.Thread(target=call) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(set(held)) == 2 and len(answers) == 2
        for answer in answers:
            np.testing.assert_array_equal(answer, one.infer(FEED)["logits"])


@TWO_CORES
def test_concurrent_infer_calls_on_openvino_streams_all_answer_right():
    with _openvino(2) as runner:
        expected = runner.infer(FEED)["logits"]
        results, start = [], threading.Barrier(4, timeout=10)

        def call():
            start.wait()
            results.append(runner.infer(FEED)["logits"])

        threads = [threading.Thread(target=call) for _ in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(results) == 4 and all(np.array_equal(r, expected) for r in results)


@TWO_CORES
def test_openvino_requests_specialize_a_new_shape_one_at_a_time_and_then_run_together():
    """A request's first call at a shape runs alone (concurrent specializations can deadlock the
    CPU plugin on few cores); calls at shapes their requests have run overlap."""
    from unittest import mock

    import openvino as ov

    with _openvino(2) as runner:
        inside, most, lock = [0], [0], threading.Lock()
        overlap = threading.Barrier(2, timeout=10)

        def infer(inputs, share_inputs=False):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            try:
                if phase == "known shape":
                    overlap.wait()  # both requests inside at once, or a BrokenBarrierError
                else:
                    threading.Event().wait(0.05)  # long enough for a second first call to overlap
            finally:
                with lock:
                    inside[0] -= 1

        slots = [runner._requests.take() for _ in range(2)]
        for slot_context in slots:
            slot = slot_context.__enter__()
            slot.request = mock.create_autospec(ov.InferRequest, instance=True)
            slot.request.infer.side_effect = infer
            slot_context.__exit__(None, None, None)

        def calls(batch: int, count: int):
            threads = [threading.Thread(target=runner.infer, args=({"images": np.zeros((batch, 16), np.float32)},)) for _ in range(count)]
            [t.start() for t in threads]
            [t.join() for t in threads]

        phase = "first calls"
        calls(3, 2)
        assert most[0] == 1  # each request's first call at batch 3: never two at once
        phase, most[0] = "known shape", 0
        calls(3, 2)
        assert most[0] == 2 and not overlap.broken


def test_onnxruntime_streams_are_sessions_with_the_cores_split_beside_one_of_all_cores():
    with OnnxrtRunner(_graph(), providers=["CPUExecutionProvider"]) as one, OnnxrtRunner(_graph(), streams=2) as two:
        assert one.parallel_calls == 1 and two.parallel_calls == 2
        assert not one.spreads_batches and two.spreads_batches
        streams = [two._scheduler.pool.take().__enter__() for _ in range(2)]
        assert {s.get_session_options().intra_op_num_threads for s in streams} == {threads_per_stream(2)}
        assert two._scheduler.wide.get_session_options().intra_op_num_threads == 0  # ONNX Runtime's own count: every core
        for session in streams:
            two._scheduler.pool._free.put(session)
        # a lone batch spread row by row over the streams, and a lone row on the wide session
        np.testing.assert_array_equal(two.infer(FEED)["logits"], one.infer(FEED)["logits"])
        np.testing.assert_array_equal(two.infer({"images": FEED["images"][:1]})["logits"], one.infer(FEED)["logits"][:1])


class Recorder:
    """``run(executor, feed)`` of a ``StreamScheduler`` over named executors: records who ran which
    rows and answers ``images * 2``; ``gate`` (a barrier) holds every run until that many are inside."""

    def __init__(self, gate: threading.Barrier | None = None):
        self.runs, self.gate, self.lock = [], gate, threading.Lock()

    def __call__(self, executor: str, feed: dict) -> dict:
        if self.gate:
            self.gate.wait()
        with self.lock:
            self.runs.append((executor, feed["images"][:, 0].tolist()))
        return {"logits": feed["images"] * 2}


def test_a_lone_call_keeps_the_whole_machine_and_a_lone_batch_fills_every_stream():
    """One row alone: the wide executor. Several rows alone: spread over both streams at once (the
    gate lets no row run until a row of each stream is inside), one row per run, answered in order."""
    rows = np.arange(4, dtype=np.float32)[:, None].repeat(16, 1)  # two rounds of the gate
    spread = Recorder(threading.Barrier(2, timeout=10))
    scheduler = StreamScheduler("wide", ["s0", "s1"], spread)
    try:
        np.testing.assert_array_equal(scheduler({"images": rows})["logits"], rows * 2)
        assert {executor for executor, _ in spread.runs[:2]} == {"s0", "s1"}  # both streams ran together
        assert sorted(r for _, (r,) in spread.runs) == [0, 1, 2, 3] and len(spread.runs) == 4
        spread.gate = None
        np.testing.assert_array_equal(scheduler({"images": rows[3:4]})["logits"], rows[3:4] * 2)
        assert spread.runs[-1] == ("wide", [3.0])
    finally:
        scheduler.close()


def test_the_rows_beyond_whole_rounds_run_on_the_wide_executor_first():
    """Five rows on two streams: one on the wide executor, then two rounds of two, so no stream
    idles while the other runs an odd row; the answers stay in the rows' order."""
    rows = np.arange(5, dtype=np.float32)[:, None]
    runs = Recorder()
    scheduler = StreamScheduler("wide", ["s0", "s1"], runs)
    try:
        np.testing.assert_array_equal(scheduler({"images": rows})["logits"], rows * 2)
        assert runs.runs[0] == ("wide", [0.0])
        assert sorted(r for _, (r,) in runs.runs[1:]) == [1.0, 2.0, 3.0, 4.0]  # then one row per run
        assert {executor for executor, _ in runs.runs[1:]} <= {"s0", "s1"}
    finally:
        scheduler.close()


def test_a_call_beside_others_takes_a_stream_whole():
    """While one call runs, a second takes a free stream with its whole feed: no wide executor, no
    spreading, so concurrent callers share the cores out."""
    inside, release = threading.Event(), threading.Event()
    runs = Recorder()

    def run(executor, feed):
        if executor == "wide":
            inside.set()
            release.wait(10)
        return runs(executor, feed)

    scheduler = StreamScheduler("wide", ["s0", "s1"], run)
    try:
        first = threading.Thread(target=scheduler, args=({"images": np.zeros((1, 16), np.float32)},))
        first.start()
        assert inside.wait(10)
        batch = np.ones((3, 16), np.float32)
        np.testing.assert_array_equal(scheduler({"images": batch})["logits"], batch * 2)
        release.set()
        first.join(10)
        assert runs.runs[0][0] in ("s0", "s1") and runs.runs[0][1] == [1.0, 1.0, 1.0]
        assert runs.runs[1] == ("wide", [0.0])
    finally:
        release.set()
        scheduler.close()


def test_a_failing_row_fails_the_spread_call_and_leaves_the_streams_free():
    def run(executor, feed):
        if feed["images"][0, 0] == 2:
            raise ValueError("row 2")
        return {"logits": feed["images"]}

    scheduler = StreamScheduler("wide", ["s0", "s1"], run)
    try:
        with pytest.raises(ValueError, match="row 2"):
            scheduler({"images": np.arange(4, dtype=np.float32)[:, None]})
        assert scheduler.pool._free.qsize() == 2 and scheduler._running == 0
        np.testing.assert_array_equal(scheduler({"images": np.ones((2, 1), np.float32)})["logits"], np.ones((2, 1)))
    finally:
        scheduler.close()


def test_a_pool_lets_in_as_many_callers_as_it_holds_executors():
    pool = ExecutorPool(["a", "b"])
    with pool.take() as first, pool.take() as second:
        assert {first, second} == {"a", "b"}
    one, inside = ExecutorPool(["only"]), threading.Event()
    with one.take():
        waiter = threading.Thread(target=lambda: one.take().__enter__() and inside.set(), daemon=True)
        waiter.start()
        assert not inside.wait(0.2)  # the only executor is out: the second caller waits
    assert inside.wait(10)  # and gets it once it is back


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_stream_count_below_one_is_refused(bad):
    with pytest.raises(ConfigError, match=r"streams must be an integer from 1 to the \d+ usable cores"):
        check_streams(bad)


def test_streams_are_kept_only_for_a_clear_throughput_gain():
    assert pick_streams({1: 100.0, 2: 180.0}) == (2, 1.8)
    assert pick_streams({1: 100.0, 2: 105.0}) == (1, 1.0)  # within the margin: the latency setting
    assert pick_streams({1: 100.0, 2: 90.0}) == (1, 1.0)


def test_an_openvino_runner_on_a_share_of_the_cores_leaves_its_threads_unpinned():
    """Runners side by side, each on its share of the cores (a served model's instances, each a
    process): OpenVINO would pin every process's threads from core 0 up, putting them all on the
    same cores. A runner left to OpenVINO's own thread count keeps OpenVINO's pinning."""
    from deploykit.backends.openvino import OpenvinoRunner

    with OpenvinoRunner(_graph(), threads=1) as share, OpenvinoRunner(_graph()) as whole:
        assert share._compiled.get_property("ENABLE_CPU_PINNING") is False
        assert int(share._compiled.get_property("INFERENCE_NUM_THREADS")) == 1
        assert "ENABLE_CPU_PINNING" not in whole._config()
