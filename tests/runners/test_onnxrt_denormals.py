"""ONNX Runtime runs deploykit's graphs with float32 denormals flushed to zero, in its own threads
and in the thread that calls it, and leaves that thread's mode as it found it."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from deploykit.runners.cpu import flushing_denormals
from deploykit.runners.onnxrt import CPU, OnnxrtRunner

# 1e-30 * 1e-10 = 1e-40: below float32's smallest normal (1.2e-38), so each element is a denormal
# unless the thread that computed it flushes. A million elements: ONNX Runtime splits the Mul
# across its thread pool and the calling thread.
_ELEMENTS = 1 << 20


def _denormal_graph() -> bytes:
    scale = lambda name, value: helper.make_tensor(name, TensorProto.FLOAT, [], [value])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "a"], ["h"]), helper.make_node("Mul", ["h", "b"], ["y"])],
        "denormals",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [_ELEMENTS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [_ELEMENTS])],
        initializer=[scale("a", 1e-30), scale("b", 1e-10)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


@pytest.fixture(scope="module")
def graph() -> bytes:
    model = _denormal_graph()
    onnx.checker.check_model(onnx.load_from_string(model))
    return model


def _run_in_fresh_thread(runner: OnnxrtRunner, x: np.ndarray) -> tuple[np.ndarray, bool]:
    def call():
        return runner.infer({"x": x})["y"], flushing_denormals()

    with ThreadPoolExecutor(1) as pool:  # as serve's workers call it: a thread of its own
        return pool.submit(call).result()


def test_the_runner_flushes_denormals_where_a_plain_session_keeps_them(graph):
    x = np.ones(_ELEMENTS, np.float32)
    # control: the graph does write denormals when nothing flushes
    plain = ort.InferenceSession(graph, providers=[CPU]).run(None, {"x": x})[0]
    assert np.count_nonzero(plain) == _ELEMENTS and float(plain.max()) < np.finfo(np.float32).tiny

    with OnnxrtRunner(graph, providers=[CPU], intra_op_threads=2) as runner:
        assert not flushing_denormals()
        y = runner.infer({"x": x})["y"]
        assert np.count_nonzero(y) == 0
        assert not flushing_denormals()  # the caller's mode is back as it was
        in_thread, flushing_after = _run_in_fresh_thread(runner, x)
        assert np.count_nonzero(in_thread) == 0 and not flushing_after


# In a fresh process: ONNX Runtime changes the mode only in the thread creating its first session.
_FIRST_SESSION = """
import sys
from deploykit.runners.cpu import flushing_denormals
from deploykit.runners.onnxrt import CPU, OnnxrtRunner, session_options
graph = open(sys.argv[1], "rb").read()
if sys.argv[2] == "plain":
    import onnxruntime as ort
    ort.InferenceSession(graph, session_options(), providers=[CPU])
else:
    OnnxrtRunner(graph, providers=[CPU]).activate()
print(flushing_denormals())
"""


@pytest.mark.parametrize("creator, flushing_after", [("plain", "True"), ("runner", "False")])
def test_creating_the_first_session_leaves_the_caller_s_mode_alone(graph, tmp_path, creator, flushing_after):
    """The plain session is the control: with deploykit's options, ONNX Runtime alone leaves the
    creating thread flushing for good; the runner puts its mode back."""
    path = tmp_path / "denormals.onnx"
    path.write_bytes(graph)
    run = subprocess.run([sys.executable, "-c", _FIRST_SESSION, str(path), creator], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [flushing_after]
