"""Graph rewrites, one rule set per runtime, on one toolkit (onnx_ir, onnxscript's rewriter).

Each rule keeps the graph's values and changes only its spelling to the one a runtime runs
best; node metadata (the exporter's name scopes that validation and quantization read) is carried
to the replacement nodes by the rewriter. Torch-free.

==============================================  ===========================================  ================================
rule set                                        what it spells differently                   applied
==============================================  ===========================================  ================================
``ort.ONNXRUNTIME``                             fusable GELU, 3-D linears as 2-D ``Gemm``,   at export, before folding: the
                                                the key transpose as one ``Transpose``       file is ONNX Runtime's form
``dynamic_quantizer.dynamic_quantizer_rules``   the selected ``Gemm`` as ``MatMul`` + bias   before ONNX Runtime's
                                                                                             ``quantize_dynamic`` reads it
``openvino.TOKEN_AXIS``, ``THREE_PRODUCTS``     int8 linears over [B, N, K], packed qkv as   when the OpenVINO runner loads
                                                three products (and 7-bit int8 weights)      a graph (``prepare_for_openvino``)
==============================================  ===========================================  ================================

ONNX Runtime's spelling is the exported file's because the file is also what Triton's ONNX
Runtime backend loads as it is, what TensorRT parses, and what the export's fingerprints and
int8 calibration hash; the other two take the linears back to their own spelling when they read it.

``edits`` holds the edits that change what a graph computes but carry no numeric meaning of their
own (quantized nodes back to float, a graph started at given tensors): the INT8 fallback decides
what to edit, on the same toolkit.
"""

from deploykit.graph.rules import RuleSet

__all__ = ["RuleSet"]
