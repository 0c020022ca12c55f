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
    """The ``int8-dynamic`` plan: the selected weight products (``MatMul``, as the exported graph
    spells a linear layer) dynamically quantized.

    Attention products stay float: both inputs are activations, and a per-call range for each
    is what ``DynamicQuantizeLinear`` costs twice over.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    selection = select_nodes(proto, attention=False)
    # The quantizer logs "consider pre-processing" advice on the root logger.
    with tempfile.TemporaryDirectory(prefix="deploykit-int8-") as tmp, quiet_logger(""):
        source, target = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        onnx.save_model(proto, str(source))  # model-local functions (SaPE2Bias) come along
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
