"""OpenVINO's marks for the nodes a bf16 hint keeps in f32: found on the model read from ONNX,
set as the typed attribute the CPU plugin reads, and kept through its low-precision passes."""

from __future__ import annotations

import numpy as np

from deploykit._lazy import lazy_import

# The runtime-info key deploykit marks a node to keep in f32 with (a string entry: OpenVINO 2026.4's
# CPU plugin does not read it; ``with_typed_marks`` turns the marks into the attribute it reads).
KEEP_FP32 = "disable_fp16_compression_0"


def ops_computing(model, tensors: set[str]) -> list:
    """Every op of an OpenVINO ``model`` read from ONNX that computes one of ``tensors`` (ONNX
    output names).

    One ONNX node may become several ops (LayerNormalization becomes MVN, Multiply, Add): only
    the last carries the ONNX tensor name, so the walk goes back from it through the ops whose
    outputs have no ONNX name (the node's own decomposition) and takes those too.
    """
    ops = {op.get_name(): op for op in model.get_ops()}
    named = {key: {n for out in op.outputs() for n in out.get_names()} for key, op in ops.items()}
    found: set[str] = set()
    stack = [key for key, names in named.items() if names & tensors]
    while stack:
        key = stack.pop()
        if key in found or ops[key].get_type_name() in ("Parameter", "Constant", "Result"):
            continue
        found.add(key)
        sources = (inp.get_source_output().get_node().get_name() for inp in ops[key].inputs())
        stack += [source for source in sources if not named[source]]
    return [ops[key] for key in found]


def keep_fp32(model, tensors: set[str]) -> list:
    """Mark every op of ``model`` computing one of ``tensors`` (``ops_computing``) as kept in f32;
    returns the marked ops."""
    computing = ops_computing(model, tensors)
    for op in computing:
        op.get_rt_info()[KEEP_FP32] = ""
    return computing


def with_typed_marks(core, model, marked: set[str]):
    """``model`` with each op named in ``marked`` carrying the attribute OpenVINO's CPU plugin
    reads to keep an op out of a reduced inference precision.

    A runtime-info entry set from Python is a string, and OpenVINO 2026.4's CPU plugin reads a
    typed ``DisablePrecisionConversion`` that Python cannot create. Its IR reader creates it from
    ``<attribute name="precise" version="0"/>`` (``DisableFP16Compression``'s RTTI), so the model
    goes through an IR in memory with that attribute on each marked layer. Measured on a Xeon with
    AMX (default model, bf16 hint): every LayerNorm then ran in f32, where the string mark left
    them all in bf16."""
    import html
    import re
    import tempfile
    from pathlib import Path

    ov = lazy_import("openvino")

    def mark(match: re.Match) -> str:
        return match.group(0) + PRECISE_IR if html.unescape(match.group(1)) in marked else match.group(0)

    with tempfile.TemporaryDirectory(prefix="deploykit-openvino-") as tmp:
        xml = Path(tmp) / "model.xml"
        ov.save_model(model, xml, compress_to_fp16=False)
        text = re.sub(r'<layer id="[^"]*" name="([^"]*)" type="[^"]*" version="[^"]*">', mark, xml.read_text())
        weights = np.fromfile(xml.with_suffix(".bin"), dtype=np.uint8)
    return core.read_model(text, ov.Tensor(weights))


PRECISE_IR = '<rt_info><attribute name="precise" version="0" /></rt_info>'
# The runtime-info key of OpenVINO's low-precision ``BiasAttribute`` (``LowPrecision::Bias`` with an
# empty version): the CPU plugin looks it up by key alone, so a string entry set from Python counts.
LPT_BIAS = "LowPrecision::Bias_"


def exempt_adds_from_low_precision_passes(model, marked: set[str]) -> int:
    """Mark each ``Add`` named in ``marked`` so that OpenVINO's low-precision passes leave it in
    place; returns how many.

    After an int8 product, the low-precision ``AddTransformation`` moves the product's
    dequantization scale through the residual ``Add`` and rebuilds it as new nodes, which do not
    carry the keep-f32 mark (it is not copyable): an int8 plan's residual stream then ran in bf16
    (24 compiled nodes on a seeded ViT-S/16). The CPU plugin skips that pass for an ``Add`` marked
    as a bias; so marked, the ``Add`` stays the graph's own node, keeps its mark and runs in f32,
    and the product's scale is applied before it (``test_bf16_hint_keeps_an_int8_plan_s_residual_stream_in_f32``).
    """
    adds = [op for op in model.get_ops() if op.get_type_name() == "Add" and op.get_friendly_name() in marked]
    for op in adds:
        op.get_rt_info()[LPT_BIAS] = ""
    return len(adds)
