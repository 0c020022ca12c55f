"""ONNX Runtime's runner on a CPU whose int8 products saturate (no VNNI or AMX): int8 weights are
narrowed to 7 bits, as OpenVINO's runner narrows them."""

from __future__ import annotations

from unittest import mock

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from deploykit.runners.onnxrt import CPU, OnnxrtRunner


def _int8_product() -> bytes:
    """x [1, 4] · dequantised int8 weight [4, 2], whose values reach ±127 (beyond 7 bits)."""
    weight = numpy_helper.from_array(np.array([[127, -127], [100, 3], [-90, 64], [1, -128]], np.int8), "w")
    scale, zero = numpy_helper.from_array(np.array(0.01, np.float32), "s"), numpy_helper.from_array(np.array(0, np.int8), "z")
    nodes = [helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wf"]), helper.make_node("MatMul", ["x", "wf"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], initializer=[weight, scale, zero],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def test_int8_weights_are_narrowed_to_seven_bits_only_where_int8_products_saturate():
    x = {"x": np.ones((1, 4), np.float32)}
    for saturates in (True, False):  # False is the control: the graph as exported
        with (
            mock.patch("deploykit.runners.onnxrt.int8_saturates", return_value=saturates),
            OnnxrtRunner(_int8_product(), providers=[CPU]) as runner,
        ):
            y = runner.infer(x)["y"]
            assert runner.narrowed_weights == (1 if saturates else 0)
        exact = np.array([[127 + 100 - 90 + 1, -127 + 3 + 64 - 128]], np.float32) * 0.01
        halved = np.array([[63 + 50 - 45 + 0, -64 + 2 + 32 - 64]], np.float32) * 0.02  # rint(v / 2) clipped to [-64, 63]: 127 -> 63
        np.testing.assert_allclose(y, halved if saturates else exact, rtol=1e-6)
    onnx.checker.check_model(onnx.load_from_string(_int8_product()))
