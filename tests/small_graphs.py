"""Small ONNX graphs in the forms deploykit exports, built with ``onnx.helper`` for the rule-set
and runner tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def int8_linear(tokens: int, features: int, channels: int, bias: bool, weight_limit: int = 63, flattened: bool = False) -> onnx.ModelProto:
    """One linear layer as deploykit exports it quantized: [B, N, K] through a per-tensor Q/DQ
    pair, a MatMul on per-channel int8 weights, the bias added. ``flattened``: ONNX Runtime's
    spelling instead, rows flattened to [B·N, K], one Gemm, reshaped back to [B, N, C]. Weights
    within ±63 by default, so no CPU's int8 products saturate."""
    rng = np.random.default_rng(0)
    constants = {
        "x_scale": np.array(0.05, np.float32),
        "x_zero": np.array(0, np.int8),
        "w": rng.integers(-weight_limit, weight_limit + 1, (features, channels)).astype(np.int8),
        "w_scale": (0.01 * 2.0 ** np.arange(channels)).astype(np.float32),
        "w_zero": np.zeros(channels, np.int8),
        "bias": rng.standard_normal(channels).astype(np.float32),
    }
    quantized = [
        helper.make_node("QuantizeLinear", ["rows" if flattened else "x", "x_scale", "x_zero"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["w_dq"], axis=1),
    ]
    if flattened:
        constants |= {"flat": np.array([-1, features], np.int64), "back": np.array([-1, tokens, channels], np.int64)}
        nodes = [
            helper.make_node("Reshape", ["x", "flat"], ["rows"]),
            *quantized,
            helper.make_node("Gemm", ["x_dq", "w_dq", "bias"][: 3 if bias else 2], ["y_flat"]),
            helper.make_node("Reshape", ["y_flat", "back"], ["y"]),
        ]
    else:
        nodes = [*quantized, helper.make_node("MatMul", ["x_dq", "w_dq"], ["product" if bias else "y"])]
        nodes += [helper.make_node("Add", ["product", "bias"], ["y"])] if bias else []
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", tokens, features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", tokens, channels])],
        [numpy_helper.from_array(value, name) for name, value in constants.items() if bias or name != "bias"],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def packed_qkv(
    tokens: int = 5, features: int = 8, heads: int = 2, head_dim: int = 4, form: str = "gemm", bias: bool = True
) -> onnx.ModelProto:
    """One attention's qkv as timm's ``Attention`` exports: a product to ``3·h·d`` channels
    (``form``: ``"gemm"`` on flattened rows, ``"matmul"`` over [B, N, K] plus bias, or
    ``"int8"``: ``"matmul"`` on per-channel int8 weights), reshaped to [B, N, 3, h, d], permuted
    to [3, B, h, N, d] and unbound by Slice + Squeeze into graph outputs ``q``, ``k``, ``v``."""
    rng = np.random.default_rng(0)
    channels = 3 * heads * head_dim
    constants = {
        "flat": np.array([-1, features], np.int64),
        "heads": np.array([-1, tokens, 3, heads, head_dim], np.int64),
        "bias": rng.standard_normal(channels).astype(np.float32),
        **{f"at{i}": np.array([i], np.int64) for i in range(4)},
    }
    weight = rng.standard_normal((features, channels)).astype(np.float32)
    if form == "int8":
        constants |= {"w_q": rng.integers(-63, 64, weight.shape).astype(np.int8), "w_scale": np.full(channels, 0.02, np.float32)}
        constants["w_zero"] = np.zeros(channels, np.int8)
        nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w"], name="w_dq", axis=1)]
    else:
        constants["w"] = weight
        nodes = []
    inputs = ["w", "bias"] if bias else ["w"]
    if form == "gemm":
        nodes += [
            helper.make_node("Reshape", ["x", "flat"], ["rows"], name="flatten"),
            helper.make_node("Gemm", ["rows", *inputs], ["packed"], name="qkv"),
        ]
    else:
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["product" if bias else "packed"], name="qkv"))
        nodes += [helper.make_node("Add", ["product", "bias"], ["packed"], name="qkv_bias")] if bias else []
    nodes += [
        helper.make_node("Reshape", ["packed", "heads"], ["split"], name="split_heads"),
        helper.make_node("Transpose", ["split"], ["permuted"], name="permute", perm=[2, 0, 3, 1, 4]),
    ]
    for i, name in enumerate("qkv"):
        nodes += [
            helper.make_node("Slice", ["permuted", f"at{i}", f"at{i + 1}", "at0"], [f"{name}_sliced"], name=f"slice_{name}"),
            helper.make_node("Squeeze", [f"{name}_sliced", "at0"], [name], name=f"unbind_{name}"),
        ]
    graph = helper.make_graph(
        nodes,
        "qkv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", tokens, features])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", heads, tokens, head_dim]) for name in "qkv"],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
