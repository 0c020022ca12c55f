"""Tests for deploykit.export.lint: each rule fires on a planted pattern and only there."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploykit.errors import ExportError
from deploykit.export.lint import LintIssue, check_graph, lint_graph

OPSET = 18
IR_VERSION = 10  # accepted by onnx's checker and by onnxruntime 1.31


def _model(nodes, inputs, outputs, initializers=(), functions=(), extra_opsets=()):
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    opsets = [helper.make_opsetid("", OPSET), *extra_opsets]
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, functions=list(functions))


def _f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _rules(issues):
    return [i.rule for i in issues]


def _clean_model():
    """x @ W + pe_tables.cos, all fp32."""
    return _model(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"), helper.make_node("Add", ["h", "pe_tables.cos"], ["y"], name="add_pe")],
        [_f32("x", [2, 4])],
        [_f32("y", [2, 4])],
        [_init("W", np.ones((4, 4), np.float32)), _init("pe_tables.cos", np.zeros((2, 4), np.float32))],
    )


def test_clean_graph_has_no_findings():
    model = _clean_model()
    assert lint_graph(model) == []
    check_graph(model)  # must not raise


def test_scatter_flagged_and_check_graph_raises_one_line():
    model = _model(
        [helper.make_node("ScatterND", ["x", "idx", "upd"], ["y"], name="prefix_write")],
        [_f32("x", [4, 3])],
        [_f32("y", [4, 3])],
        [_init("idx", np.array([[0]], np.int64)), _init("upd", np.ones((1, 3), np.float32))],
    )
    issues = lint_graph(model)
    assert LintIssue in {type(i) for i in issues}
    scatter = [i for i in issues if i.rule == "scatter"]
    assert len(scatter) == 1
    assert scatter[0].node == "prefix_write"
    assert "prefix_write" in scatter[0].message

    with pytest.raises(ExportError) as exc:
        check_graph(model)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith("exported graph failed lint (")
    assert "scatter: " in msg and "prefix_write" in msg


def test_check_graph_joins_all_issues_on_one_line():
    model = _model(
        [
            helper.make_node("ScatterND", ["x", "idx", "upd"], ["s"], name="sc"),
            helper.make_node("Add", ["s", "pe_tables.sin"], ["y"], name="add"),
        ],
        [_f32("x", [4, 3])],
        [_f32("y", [4, 3])],
        [
            _init("idx", np.array([[0]], np.int64)),
            _init("upd", np.ones((1, 3), np.float32)),
            _init("pe_tables.sin", np.zeros((4, 3), np.float16)),
        ],
    )
    issues = lint_graph(model)
    with pytest.raises(ExportError) as exc:
        check_graph(model)
    msg = str(exc.value)
    assert f"({len(issues)} issues)" in msg
    assert msg.count("; ") >= len(issues) - 1
    assert "\n" not in msg


def test_if_flagged_as_control_flow():
    then_g = helper.make_graph([helper.make_node("Identity", ["x"], ["t_out"])], "then", [], [_f32("t_out", [2])])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e_out"])], "else", [], [_f32("e_out", [2])])
    node = helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)
    model = _model(
        [node],
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, []), _f32("x", [2])],
        [_f32("y", [2])],
    )
    issues = lint_graph(model)
    assert [i.node for i in issues if i.rule == "control-flow"] == ["branch"]
    assert "checker" not in _rules(issues)


def test_fp16_positional_table_flagged_other_fp16_initializer_not():
    model = _model(
        [helper.make_node("Add", ["x", "pe_tables.sin"], ["h"], name="add_pe"), helper.make_node("Mul", ["h", "scale"], ["y"], name="mul")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 4])],
        [_init("pe_tables.sin", np.zeros((2, 4), np.float16)), _init("scale", np.ones((2, 4), np.float16))],
    )
    issues = lint_graph(model)
    assert [i.node for i in issues if i.rule == "fp16-table"] == ["pe_tables.sin"]
    assert _rules(issues) == ["fp16-table"]


def test_fp16_table_respects_custom_prefixes():
    model = _model(
        [helper.make_node("Add", ["x", "rope.freqs"], ["y"], name="add")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2])],
        [_init("rope.freqs", np.zeros(2, np.float16))],
    )
    assert lint_graph(model) == []
    assert _rules(lint_graph(model, table_prefixes=("rope.",))) == ["fp16-table"]


def test_complex_input_flagged():
    model = _model(
        [helper.make_node("Identity", ["z"], ["y"], name="ident")],
        [helper.make_tensor_value_info("z", TensorProto.COMPLEX64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.COMPLEX64, [2])],
    )
    issues = [i for i in lint_graph(model) if i.rule == "complex-type"]
    assert {i.node for i in issues} == {"z", "y"}
    assert len(issues) == 2  # reported once each despite the inferred graph repeating them


def test_add_of_initializers_is_unfolded_constant():
    model = _model(
        [helper.make_node("Add", ["a", "b"], ["c"], name="const_add"), helper.make_node("Mul", ["x", "c"], ["y"], name="mul")],
        [_f32("x", [2])],
        [_f32("y", [2])],
        [_init("a", np.ones(2, np.float32)), _init("b", np.ones(2, np.float32))],
    )
    issues = lint_graph(model)
    assert [(i.rule, i.node) for i in issues] == [("unfolded-constant", "const_add")]


def test_unfolded_constant_propagates_through_constant_nodes():
    two = _init("two", np.full(2, 2.0, np.float32))
    model = _model(
        [
            helper.make_node("Constant", [], ["k"], name="k_const", value=two),
            helper.make_node("Neg", ["k"], ["nk"], name="neg"),
            helper.make_node("Add", ["nk", "k"], ["s"], name="sum"),
            helper.make_node("Mul", ["x", "s"], ["y"], name="mul"),
        ],
        [_f32("x", [2])],
        [_f32("y", [2])],
    )
    flagged = [i.node for i in lint_graph(model) if i.rule == "unfolded-constant"]
    assert flagged == ["neg", "sum"]


def test_constant_node_alone_not_flagged():
    value = _init("v", np.ones(2, np.float32))
    model = _model(
        [helper.make_node("Constant", [], ["k"], name="k_const", value=value), helper.make_node("Add", ["x", "k"], ["y"], name="add")],
        [_f32("x", [2])],
        [_f32("y", [2])],
    )
    assert lint_graph(model) == []


def test_scatter_inside_local_function_flagged():
    fn = helper.make_function(
        "deploykit",
        "WritePrefix",
        ["buf", "idx", "upd"],
        ["out"],
        [helper.make_node("ScatterND", ["buf", "idx", "upd"], ["out"], name="fn_scatter")],
        opset_imports=[helper.make_opsetid("", OPSET)],
    )
    model = _model(
        [helper.make_node("WritePrefix", ["x", "idx", "upd"], ["y"], name="call", domain="deploykit")],
        [_f32("x", [4, 3])],
        [_f32("y", [4, 3])],
        [_init("idx", np.array([[0]], np.int64)), _init("upd", np.ones((1, 3), np.float32))],
        functions=[fn],
        extra_opsets=[helper.make_opsetid("deploykit", 1)],
    )
    issues = lint_graph(model)
    scatter = [i for i in issues if i.rule == "scatter"]
    assert [i.node for i in scatter] == ["fn_scatter"]
    assert "deploykit.WritePrefix" in scatter[0].message
    assert "checker" not in _rules(issues)


def test_unknown_input_fails_checker():
    model = _model(
        [helper.make_node("Add", ["x", "does_not_exist"], ["y"], name="bad_add")],
        [_f32("x", [2])],
        [_f32("y", [2])],
    )
    issues = lint_graph(model)
    assert "checker" in _rules(issues)
    checker = next(i for i in issues if i.rule == "checker")
    assert "\n" not in checker.message
