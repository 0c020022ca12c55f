"""The ``int8-dynamic`` plan: ONNX Runtime's dynamic form (``DynamicQuantizeLinear`` +
``MatMulInteger``, fused to ``DynamicQuantizeMatMul`` on CPU): weights int8 per channel,
activation ranges taken per call, so no calibration. ONNX Runtime only (TensorRT has no such
ops). Which nodes: ``int8_selection``, attention products float.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

from deploykit._terminal import quiet_logger
from deploykit.errors import ExportError
from deploykit.export import names
from deploykit.export.int8_selection import select_nodes, with_plan_record
from deploykit.export.lint import check_scales


def quantize_dynamic_int8(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The ``int8-dynamic`` plan: the selected weight products as ``MatMul`` + bias ``Add``
    (ONNX Runtime's dynamic quantizer takes MatMul, not Gemm), then dynamically quantized.

    Attention products stay float: both inputs are activations, and a per-call range for each
    is what ``DynamicQuantizeLinear`` costs twice over.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    selection = select_nodes(proto, attention=False)
    unfolded = _gemm_as_matmul(proto, set(selection.quantize))
    # The quantizer logs "consider pre-processing" advice on the root logger.
    with tempfile.TemporaryDirectory(prefix="deploykit-int8-") as tmp, quiet_logger(""):
        source, target = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        onnx.save_model(unfolded, str(source))
        try:
            quantize_dynamic(
                str(source),
                str(target),
                op_types_to_quantize=["MatMul"],
                per_channel=True,
                weight_type=QuantType.QInt8,
                nodes_to_quantize=selection.quantize or None,
                nodes_to_exclude=list(selection.keep_float),
                extra_options={"MatMulConstBOnly": True},
            )
        except (ValueError, RuntimeError, onnx.checker.ValidationError) as err:
            raise ExportError(f"dynamic INT8 quantization failed: {str(err).splitlines()[0]}") from err
        out = onnx.load_model(str(target))
    check_scales(out)
    return with_plan_record(out, proto, selection.record(names.module_paths(proto), plan="int8-dynamic", attention_int8=False))


def _gemm_as_matmul(proto: onnx.ModelProto, nodes: set[str]) -> onnx.ModelProto:
    """Each named ``Gemm(a, W, b)`` (no transposes, unit alpha/beta) → ``MatMul(a, W)`` + ``Add(·, b)``,
    keeping the node's name on the MatMul so the selection still finds it."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(proto)
    for node in [n for n in graph.nodes if n.op == "Gemm" and n.name in nodes]:
        if any(node.attrs.get(k, d) != d for k, d in (("transA", 0), ("transB", 0), ("alpha", 1.0), ("beta", 1.0))):
            continue  # our exporter writes plain Gemms; anything else stays as it is
        a, w, *bias = node.inputs
        out = node.outputs[0]
        node.outputs.clear()
        product = gs.Variable(f"{out.name}.matmul", dtype=out.dtype)
        graph.nodes.append(gs.Node("MatMul", node.name, inputs=[a, w], outputs=[product if bias else out]))
        if bias:
            graph.nodes.append(gs.Node("Add", f"{node.name}.bias", inputs=[product, bias[0]], outputs=[out]))
        node.inputs.clear()
    graph.cleanup().toposort()
    return gs.export_onnx(graph)  # model-local functions (SaPE2Bias) come along
