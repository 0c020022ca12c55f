"""deploykit's custom ops in ONNX: one node each, defined by a model-local function of plain ONNX ops.

A node ``deploykit::SaPE2Bias`` carries the op's attributes; its function body (below) is what
ONNX Runtime runs, and what a TensorRT parser inlines when no plugin of that name is loaded.
With the plugin of ``deploykit.plugins.sape2`` loaded, TensorRT runs the Triton kernel instead.

The exporter maps each ``torch.ops.deploykit.*`` op to a bare node through
``CUSTOM_TRANSLATIONS`` (its version converter and optimiser would inline a function given
there), and ``attach_functions`` adds the definitions to the exported model.
"""

from __future__ import annotations

import functools
import inspect
from typing import TypeVar, Union

import onnx
from onnxscript import BFLOAT16, DOUBLE, FLOAT, FLOAT16, script
from onnxscript import opset18 as op
from onnxscript.values import OnnxFunction, Op, Opset

import deploykit.encodings.sape2  # noqa: F401  registers torch.ops.deploykit.sape2_bias
from deploykit.errors import ExportError

DOMAIN = "deploykit"
FUNCTION_OPSET = op.version  # the opset the function bodies below are written in (18)
deploykit_opset = Opset(DOMAIN, 1)
# The exporter reads the function's signature from these annotations (typing.Union bounds, as
# onnxscript's own type constraints are written).
TFloat = TypeVar("TFloat", bound=Union[FLOAT16, BFLOAT16, FLOAT, DOUBLE])  # noqa: UP007  as onnxscript spells them
TTable = TypeVar("TTable", bound=Union[FLOAT16, BFLOAT16, FLOAT, DOUBLE])  # noqa: UP007  as onnxscript spells them


@script(deploykit_opset, default_opset=op)
def SaPE2AxisSignatures(
    q: TFloat,
    k: TFloat,
    table_x: TTable,
    table_y: TTable,
    grid_h: int,
    grid_w: int,
    num_prefix_tokens: int,
    scale: float,
    mode: int,
) -> tuple[FLOAT, FLOAT]:
    """The axis signatures of the patch tokens (Eq. 9-14), fp32: ``Zx`` ``[B, h, N, W]`` and
    ``Zy`` ``[B, h, N, H]``, tokens row-major; ``SaPE2Bias``'s first stage (same inputs and
    attributes), and what TensorRT builds before the distance plugin (``deploykit.graph.plugin_nodes``).

    (onnxscript takes only literals here: ``to=1`` is FLOAT, ``to=7`` INT64, 2⁶³−1 "to the end".)
    """
    prefix = op.Reshape(op.Constant(value_int=num_prefix_tokens), [1])
    rows = op.Reshape(op.Constant(value_int=grid_h), [1])
    cols = op.Reshape(op.Constant(value_int=grid_w), [1])
    gate_scale = op.Constant(value_float=scale)
    mode_id = op.Constant(value_int=mode)
    batch_heads = op.Slice(op.Shape(q), [0], [2])
    grid_shape = op.Concat(batch_heads, rows, cols, [-1], axis=0)  # [B, h, H, W, d]
    q_r = op.Reshape(op.Slice(op.Cast(q, to=1), prefix, [9223372036854775807], [2]), grid_shape)  # patch tokens, fp32
    k_r = op.Reshape(op.Slice(op.Cast(k, to=1), prefix, [9223372036854775807], [2]), grid_shape)
    # mode (spec A1): gates σ(s a·b) and projected c are (q, k, q), (q, k, k) or (k, q, k); Where
    # on a constant condition, no control flow.
    swap = op.Equal(mode_id, 2)
    a_r = op.Where(swap, k_r, q_r)
    b_r = op.Where(swap, q_r, k_r)
    c_r = op.Where(op.Equal(mode_id, 0), q_r, k_r)
    # Interpolation at p (Eq. 14) as c·E[:, ⌊p⌋] + (p − ⌊p⌋)·c·(E[:, ⌊p⌋+1] − E[:, ⌊p⌋]): two
    # products with constant tables and one gather index (the step past M − 1 is 0).
    ex = op.Cast(table_x, to=1)
    ey = op.Cast(table_y, to=1)
    top_index = op.Sub(op.Shape(ex, start=1, end=2), 1)
    top = op.Cast(top_index, to=1)  # M - 1
    step_x = op.Sub(op.Concat(op.Slice(ex, [1], top_index + 1, [1]), op.Slice(ex, top_index, top_index + 1, [1]), axis=1), ex)
    step_y = op.Sub(op.Concat(op.Slice(ey, [1], top_index + 1, [1]), op.Slice(ey, top_index, top_index + 1, [1]), axis=1), ey)

    # Row term: tokens of one row, [B, h, H, W, ·] (Eq. 9, 10, 13, 14).
    gates_x = op.Sigmoid(op.Mul(op.MatMul(a_r, op.Transpose(b_r, perm=[0, 1, 2, 4, 3])), gate_scale))
    pos_x = op.Min(op.CumSum(gates_x, [-1], reverse=1), top)
    lo_x = op.Floor(pos_x)
    at_x = op.Cast(lo_x, to=7)
    z_x = op.Add(
        op.GatherElements(op.MatMul(c_r, ex), at_x, axis=-1),
        op.Mul(op.Sub(pos_x, lo_x), op.GatherElements(op.MatMul(c_r, step_x), at_x, axis=-1)),
    )  # [B, h, H, W, W]: (y, x, m)

    # Column term: the same on [B, h, W, H, ·] (tokens of one column).
    a_c = op.Transpose(a_r, perm=[0, 1, 3, 2, 4])
    c_c = op.Transpose(c_r, perm=[0, 1, 3, 2, 4])
    gates_y = op.Sigmoid(op.Mul(op.MatMul(a_c, op.Transpose(b_r, perm=[0, 1, 3, 4, 2])), gate_scale))
    pos_y = op.Min(op.CumSum(gates_y, [-1], reverse=1), top)
    lo_y = op.Floor(pos_y)
    at_y = op.Cast(lo_y, to=7)
    z_y = op.Add(
        op.GatherElements(op.MatMul(c_c, ey), at_y, axis=-1),
        op.Mul(op.Sub(pos_y, lo_y), op.GatherElements(op.MatMul(c_c, step_y), at_y, axis=-1)),
    )  # [B, h, W, H, H]: (x, y, m)

    sig_x = op.Reshape(z_x, op.Concat(batch_heads, [-1], cols, axis=0))
    sig_y = op.Reshape(op.Transpose(z_y, perm=[0, 1, 3, 2, 4]), op.Concat(batch_heads, [-1], rows, axis=0))
    return sig_x, sig_y


@script(deploykit_opset, default_opset=op)
def SaPE2Bias(
    q: TFloat,
    k: TFloat,
    table_x: TTable,
    table_y: TTable,
    grid_h: int,
    grid_w: int,
    num_prefix_tokens: int,
    scale: float,
    mode: int,
) -> TFloat:
    """SaPE² bias (spec §2.2, §8.5), computed in fp32 and returned in the dtype of ``q``.

    Inputs: ``q``, ``k`` ``[B, h, P + N, d]`` unscaled, prefix first, patches row-major;
    ``table_x``, ``table_y`` ``[d, M]``. Attributes: ``grid_h * grid_w = N``, ``num_prefix_tokens
    = P``, ``scale`` the gate temperature, ``mode`` 0 = q, 1 = k, 2 = k_swap. Output ``[B, h, P +
    N, P + N]``: the raw ``‖Zx_t − Zx_n‖ + ‖Zy_t − Zy_n‖``, prefix rows and columns 0.

    Cost is the op's arithmetic: signatures once per (image, head), then per axis one
    ``[T, L + 2] · [L + 2, T]`` product and three passes over ``[B, h, T, T]`` (clamp, sqrt, the
    sum), one more for the exact diagonal; never a ``[.., N, N, L]`` difference. The steps are
    those of ``deploykit.encodings.sape2.pairwise_distances_gram``; the float64 direct form
    (``sape2_bias_reference``) is what both are judged against.
    """
    sig_x, sig_y = SaPE2AxisSignatures(
        q, k, table_x, table_y, grid_h=grid_h, grid_w=grid_w, num_prefix_tokens=num_prefix_tokens, scale=scale, mode=mode
    )
    prefix = op.Reshape(op.Constant(value_int=num_prefix_tokens), [1])
    rows = op.Reshape(op.Constant(value_int=grid_h), [1])
    cols = op.Reshape(op.Constant(value_int=grid_w), [1])
    batch_heads = op.Slice(op.Shape(q), [0], [2])
    # Signatures centred: the distance is translation-invariant,
    # and centring bounds the Gram form's cancellation by sqrt(ε)·(spread of Z) instead of
    # sqrt(ε)·|Z| (spec §8.7). The prefix tokens get zero rows (below).
    sig_x = op.Sub(sig_x, op.ReduceMean(sig_x, [2]))
    sig_y = op.Sub(sig_y, op.ReduceMean(sig_y, [2]))
    # ‖z_t − z_n‖² as one product per axis: [z, |z|², 1] · [−2z, 1, |z|²]ᵀ ([B, h, T, T]). A
    # prefix token's rows are [0, 0, −1] and [0, −1, 0], so every square with a prefix token is
    # −|z|² ≤ 0 (0 between two of them), which the clamp below makes exactly 0.
    ones = op.Expand(op.Constant(value_float=1.0), op.Concat(batch_heads, op.Mul(rows, cols), [1], axis=0))
    prefix_shape = op.Concat(batch_heads, prefix, [1], axis=0)
    no_prefix = op.Expand(op.Constant(value_float=0.0), prefix_shape)
    minus_prefix = op.Expand(op.Constant(value_float=-1.0), prefix_shape)
    norm_x = op.ReduceSumSquare(sig_x, [-1])
    norm_y = op.ReduceSumSquare(sig_y, [-1])
    prefix_x = op.Expand(op.Constant(value_float=0.0), op.Concat(batch_heads, prefix, cols, axis=0))
    prefix_y = op.Expand(op.Constant(value_float=0.0), op.Concat(batch_heads, prefix, rows, axis=0))
    left_x = op.Concat(op.Concat(prefix_x, no_prefix, minus_prefix, axis=-1), op.Concat(sig_x, norm_x, ones, axis=-1), axis=2)
    left_y = op.Concat(op.Concat(prefix_y, no_prefix, minus_prefix, axis=-1), op.Concat(sig_y, norm_y, ones, axis=-1), axis=2)
    right_x = op.Concat(
        op.Concat(prefix_x, minus_prefix, no_prefix, axis=-1), op.Concat(op.Mul(sig_x, -2.0), ones, norm_x, axis=-1), axis=2
    )
    right_y = op.Concat(
        op.Concat(prefix_y, minus_prefix, no_prefix, axis=-1), op.Concat(op.Mul(sig_y, -2.0), ones, norm_y, axis=-1), axis=2
    )
    # Tokens whose signatures are equal along an axis (a flat region of an image) meet the
    # product's worst cancellation, and its rounding gives each pair of them the same value as each
    # one's own diagonal entry: less half of each of the two diagonal entries (in that order),
    # those pairs and the diagonal are exactly 0 (Eq. 15), and every other entry moves by at most
    # that rounding. Relu: what rounding leaves below 0 where signatures nearly coincide.
    flat = op.Concat(batch_heads, [-1], axis=0)
    tokens = op.Add(prefix, op.Mul(rows, cols))
    diagonal = op.Mul(op.Range(0, op.Squeeze(tokens), 1), op.Add(tokens, 1))  # in [.., T·T]
    square_x = op.MatMul(left_x, op.Transpose(right_x, perm=[0, 1, 3, 2]))
    square_y = op.MatMul(left_y, op.Transpose(right_y, perm=[0, 1, 3, 2]))
    half_own_x = op.Mul(op.Gather(op.Reshape(square_x, flat), diagonal, axis=2), -0.5)  # [B, h, T]
    half_own_y = op.Mul(op.Gather(op.Reshape(square_y, flat), diagonal, axis=2), -0.5)
    dist_x = op.Sqrt(op.Relu(op.Add(op.Add(square_x, op.Unsqueeze(half_own_x, [3])), op.Unsqueeze(half_own_x, [2]))))
    dist_y = op.Sqrt(op.Relu(op.Add(op.Add(square_y, op.Unsqueeze(half_own_y, [3])), op.Unsqueeze(half_own_y, [2]))))
    bias = op.Add(dist_x, dist_y)
    return op.CastLike(bias, q)


# The exporter's version converter and optimiser inline every model-local function, so the
# translation records a bare node (typed by the function's schema) and ``attach_functions`` adds
# the definitions to the finished model.
def _schema(name: str, inputs: dict[str, str], outputs: dict[str, str], attributes: dict) -> onnx.defs.OpSchema:
    """A ``deploykit`` op's schema: ``{name: type var}`` inputs/outputs, ``{name: AttrType}`` attributes."""
    schema = onnx.defs.OpSchema
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
    return schema(
        name,
        DOMAIN,
        1,
        inputs=[schema.FormalParameter(n, t) for n, t in inputs.items()],
        outputs=[schema.FormalParameter(n, t) for n, t in outputs.items()],
        type_constraints=[(t, floats, "") for t in sorted({*inputs.values(), *outputs.values()})],
        attributes=[schema.Attribute(n, t, required=True) for n, t in attributes.items()],
    )


_INT, _FLOAT = onnx.defs.OpSchema.AttrType.INT, onnx.defs.OpSchema.AttrType.FLOAT
_SAPE2_NODE = Op(
    deploykit_opset,
    "SaPE2Bias",
    _schema(
        "SaPE2Bias",
        inputs={"q": "T", "k": "T", "table_x": "T2", "table_y": "T2"},
        outputs={"bias": "T"},
        attributes=dict(grid_h=_INT, grid_w=_INT, num_prefix_tokens=_INT, scale=_FLOAT, mode=_INT),
    ),
)
FUNCTIONS = {("deploykit", "SaPE2Bias"): SaPE2Bias, ("deploykit", "SaPE2AxisSignatures"): SaPE2AxisSignatures}
# Functions attached beside an op's: the first stage the split of TensorRT's plugin form keeps
# (``deploykit.graph.plugin_nodes``).
COMPANIONS = {("deploykit", "SaPE2Bias"): [("deploykit", "SaPE2AxisSignatures")]}


def function_proto(key: tuple[str, str]) -> onnx.FunctionProto:
    """The function of ``key`` with every call to another ``deploykit`` function written out in its
    body: TensorRT's ONNX parser (10.x, TensorRT-RTX 1.x) loses attribute references through a
    function called from a function (a SaPE² graph then fails to parse: "last dimension of
    input0 = 1"), and gets them right one level deep."""
    proto = FUNCTIONS[key].to_function_proto()
    nodes = []
    for node in proto.node:
        if node.domain != DOMAIN:
            nodes.append(node)
            continue
        callee = function_proto((node.domain, node.op_type))
        nodes.extend(_written_out(callee, node, f"{node.op_type}_{len(nodes)}/"))
    for number, node in enumerate(nodes):  # unique again (ONNX Runtime checks), as onnxscript names them
        node.name = f"n{number}"
    del proto.node[:]
    proto.node.extend(nodes)
    return proto


def _written_out(callee: onnx.FunctionProto, call: onnx.NodeProto, prefix: str) -> list[onnx.NodeProto]:
    """``callee``'s nodes standing in for ``call``: its inputs and outputs renamed to the call's,
    its other values prefixed, its attribute references resolved through the call's attributes."""
    names = dict(zip(callee.input, call.input)) | dict(zip(callee.output, call.output))
    passed = {a.name: a for a in call.attribute}
    nodes = []
    for original in callee.node:
        node = onnx.NodeProto()
        node.CopyFrom(original)
        for values in (node.input, node.output):
            values[:] = [names.get(v, prefix + v) if v else v for v in values]
        for attribute in node.attribute:
            if attribute.ref_attr_name:
                given = passed[attribute.ref_attr_name]
                name = attribute.name
                attribute.CopyFrom(given)
                attribute.name = name
        nodes.append(node)
    return nodes


def _bare_node_translation(function: OnnxFunction, node: Op):
    """The exporter's translation of a custom op: records the bare ``node`` (``attach_functions``
    adds ``function`` as its definition), taking exactly ``function``'s parameters.

    The exporter binds the torch op's arguments by the translation's signature and annotations,
    which must be the function's; they are taken from it (``__wrapped__``, ``__annotations__``)
    rather than written out a second time.
    """
    signature = inspect.signature(function.function)
    inputs = [param.name for param in node.op_schema.inputs]

    def translation(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        attributes = {name: value for name, value in bound.items() if name not in inputs}
        return node(*(bound[name] for name in inputs), **attributes)

    translation.__name__ = translation.__qualname__ = f"{function.name}_translation"  # in the exporter's messages
    return functools.update_wrapper(translation, function.function, assigned=("__annotations__",), updated=())


_sape2_bias_translation = _bare_node_translation(SaPE2Bias, _SAPE2_NODE)


def attach_functions(proto: onnx.ModelProto) -> None:
    """Add the function of every ``deploykit`` op the graph uses (once each), in place.

    Raises:
        ExportError: the graph's opset is not the one the functions are written in (ONNX wants
            a function's default-domain opset to equal its model's).
    """
    have = {(f.domain, f.name) for f in proto.functions}
    used = {(n.domain, n.op_type) for n in proto.graph.node if n.domain == DOMAIN}
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    if used and opset != FUNCTION_OPSET:
        names = ", ".join(f"{domain}::{name}" for domain, name in sorted(used))
        raise ExportError(
            f"{names} is defined as an ONNX function in opset {FUNCTION_OPSET}; export this model with --opset {FUNCTION_OPSET}, not {opset}"
        )
    needed = used | {companion for key in used for companion in COMPANIONS.get(key, ())}
    for key in sorted(needed - have):
        proto.functions.append(function_proto(key))
    if used and not any(o.domain == DOMAIN for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))


def _custom_translations() -> dict:
    import torch

    return {torch.ops.deploykit.sape2_bias.default: _sape2_bias_translation}


CUSTOM_TRANSLATIONS = _custom_translations()
