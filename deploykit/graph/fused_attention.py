"""The ``fp32-mha`` plan: attention fused into ONNX Runtime's ``com.microsoft.MultiHeadAttention``.

An opset-18 graph spells attention as ``MatMul → Softmax → MatMul`` and ONNX Runtime materialises
every ``[B, h, N, N]`` score matrix; at 2304 tokens (the 48-px zoo model at 384 px) that is most
of the time. PyTorch eager runs its fused SDPA kernel instead. ``MultiHeadAttention`` is ONNX
Runtime's fused CPU/GPU attention; TensorRT does not parse it (and fuses attention itself from
the plain graph), so this is an ONNX Runtime plan of its own, like ``int8-dynamic``.

The rewrite is onnxscript's maintained ONNX Runtime fusions (``ort_fusions``): the SDPA pattern
(scale folded into q and k, an optional additive mask such as SaPE²'s bias or a causal mask)
becomes one ``SDPA`` node, then ``MultiHeadAttention``. Values change by summation order only,
so the plan is judged with the fp32 tolerance.
"""

from __future__ import annotations

import onnx

from deploykit.errors import ExportError


def fuse_attention(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``proto`` with every matched attention replaced by ``MultiHeadAttention``, and
    how many were (the plan records it in the graph's metadata).

    Raises:
        ExportError: no attention in the graph matched the pattern (the plan would be the fp32
            graph under another name).
    """
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import sdpa, sdpa_via_mha

    model = ir.from_proto(proto)
    found = sdpa.fuse_sdpa(model)
    fused = sdpa_via_mha.replace_sdpa_by_mha(model) if found else 0
    if not fused:
        raise ExportError("fp32-mha: no attention in the graph matches ONNX Runtime's MultiHeadAttention pattern")
    return ir.to_proto(model), fused
