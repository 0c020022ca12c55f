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

    (onnxscript takes only literals here: ``to=1`` is FLOAT, ``to=7`` INT64, 2⁶³−1 "to the end".)

    Inputs: ``q``, ``k`` ``[B, h, P + N, d]`` unscaled, prefix first, patches row-major;
    ``table_x``, ``table_y`` ``[d, M]``. Attributes: ``grid_h * grid_w = N``, ``num_prefix_tokens
    = P``, ``scale`` the gate temperature, ``mode`` 0 = q, 1 = k, 2 = k_swap. Output ``[B, h, P +
    N, P + N]``: the raw ``‖Zx_t − Zx_n‖ + ‖Zy_t − Zy_n‖``, prefix rows and columns 0.
    """
    prefix = op.Reshape(op.Constant(value_int=num_prefix_tokens), [1])
    rows = op.Reshape(op.Constant(value_int=grid_h), [1])
    cols = op.Reshape(op.Constant(value_int=grid_w), [1])
    gate_scale = op.Constant(value_float=scale)
    mode_id = op.Constant(value_int=mode)
    qf = op.Slice(op.Cast(q, to=1), prefix, [9223372036854775807], [2])  # patch tokens, fp32
    kf = op.Slice(op.Cast(k, to=1), prefix, [9223372036854775807], [2])
    ex = op.Cast(table_x, to=1)
    ey = op.Cast(table_y, to=1)
    # mode: gates σ(s q·k) or, for k_swap, σ(s k·q) = the transpose of the q·k product; projected
    # q (mode 0) or k. Chosen by Where on a constant condition (no control flow), applied to the
    # small [.., L, L] and [.., L, M] tensors rather than to q and k.
    swap = op.Equal(mode_id, 2)
    project_q = op.Equal(mode_id, 0)
    batch_heads = op.Slice(op.Shape(q), [0], [2])
    grid_shape = op.Concat(batch_heads, rows, cols, [-1], axis=0)  # [B, h, H, W, d]
    q_r = op.Reshape(qf, grid_shape)
    k_r = op.Reshape(kf, grid_shape)
    top = op.Cast(op.Sub(op.Shape(ex, start=1, end=2), 1), to=1)  # M - 1

    # Row term: tokens of one row, [B, h, H, W, ·] (Eq. 9, 10, 13, 14).
    qk_x = op.MatMul(q_r, op.Transpose(k_r, perm=[0, 1, 2, 4, 3]))
    gate_logits_x = op.Where(swap, op.Transpose(qk_x, perm=[0, 1, 2, 4, 3]), qk_x)
    pos_x = op.Min(op.CumSum(op.Sigmoid(op.Mul(gate_logits_x, gate_scale)), [-1], reverse=1), top)
    lo_x = op.Floor(pos_x)
    w_x = op.Sub(pos_x, lo_x)
    logits_x = op.Where(project_q, op.MatMul(q_r, ex), op.MatMul(k_r, ex))  # [B, h, H, W, M]
    at_hi_x = op.GatherElements(logits_x, op.Cast(op.Ceil(pos_x), to=7), axis=-1)
    at_lo_x = op.GatherElements(logits_x, op.Cast(lo_x, to=7), axis=-1)
    z_x = op.Add(op.Mul(at_hi_x, w_x), op.Mul(at_lo_x, op.Sub(1.0, w_x)))  # [B, h, H, W, W]

    # Column term: the same on [B, h, W, H, ·] (tokens of one column).
    q_c = op.Transpose(q_r, perm=[0, 1, 3, 2, 4])
    k_c = op.Transpose(k_r, perm=[0, 1, 3, 2, 4])
    qk_y = op.MatMul(q_c, op.Transpose(k_r, perm=[0, 1, 3, 4, 2]))
    gate_logits_y = op.Where(swap, op.Transpose(qk_y, perm=[0, 1, 2, 4, 3]), qk_y)
    pos_y = op.Min(op.CumSum(op.Sigmoid(op.Mul(gate_logits_y, gate_scale)), [-1], reverse=1), top)
    lo_y = op.Floor(pos_y)
    w_y = op.Sub(pos_y, lo_y)
    logits_y = op.Where(project_q, op.MatMul(q_c, ey), op.MatMul(k_c, ey))
    at_hi_y = op.GatherElements(logits_y, op.Cast(op.Ceil(pos_y), to=7), axis=-1)
    at_lo_y = op.GatherElements(logits_y, op.Cast(lo_y, to=7), axis=-1)
    z_y = op.Add(op.Mul(at_hi_y, w_y), op.Mul(at_lo_y, op.Sub(1.0, w_y)))  # [B, h, W, H, H]: (x, y, m)

    # Signatures with the component axis first, [B, h, W, N] and [B, h, H, N] (tokens row-major),
    # so the broadcast difference [B, h, W, N, N] has N-long contiguous runs: in ORT ~1.3-1.5×
    # faster than over [B, h, N, N, W] (ReduceL2 was slower still at 384). Direct distance
    # (Eq. 15): exactly zero on the diagonal.
    sig_x = op.Reshape(op.Transpose(z_x, perm=[0, 1, 4, 2, 3]), op.Concat(batch_heads, cols, [-1], axis=0))
    sig_y = op.Reshape(op.Transpose(z_y, perm=[0, 1, 4, 3, 2]), op.Concat(batch_heads, rows, [-1], axis=0))
    diff_x = op.Sub(op.Unsqueeze(sig_x, [4]), op.Unsqueeze(sig_x, [3]))
    diff_y = op.Sub(op.Unsqueeze(sig_y, [4]), op.Unsqueeze(sig_y, [3]))
    dist_x = op.Sqrt(op.ReduceSum(op.Mul(diff_x, diff_x), [2], keepdims=0))
    dist_y = op.Sqrt(op.ReduceSum(op.Mul(diff_y, diff_y), [2], keepdims=0))
    # Zero prefix rows and columns: pad at the start of the last two axes.
    pads = op.Concat([0, 0], prefix, prefix, [0, 0, 0, 0], axis=0)
    return op.CastLike(op.Pad(op.Add(dist_x, dist_y), pads), q)


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
FUNCTIONS = {("deploykit", "SaPE2Bias"): SaPE2Bias}


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
    for key in sorted(used - have):
        proto.functions.append(FUNCTIONS[key].to_function_proto())
    if used and not any(o.domain == DOMAIN for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))


def _custom_translations() -> dict:
    import torch

    return {torch.ops.deploykit.sape2_bias.default: _sape2_bias_translation}


CUSTOM_TRANSLATIONS = _custom_translations()
