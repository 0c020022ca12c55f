"""Graph rewrites, one rule set per runtime, on one toolkit (onnx_ir, onnxscript's rewriter).

Each rule keeps the graph's values and changes only its spelling to the one a runtime runs
best; node metadata (the exporter's name scopes that validation and quantization read) is carried
to the replacement nodes by the rewriter. Torch-free: export applies ``ONNXRUNTIME`` before
folding, the dynamic quantizer its rules before ONNX Runtime's quantizer reads the graph, and the
OpenVINO runner ``prepare_for_openvino`` when it loads a graph.

=====================  =============================================  ==============================
rule set               what it spells differently                     applied
=====================  =============================================  ==============================
``ONNXRUNTIME``        fusable GELU, 3-D linears as 2-D ``Gemm``,     at export (the file is the form
                       the key transpose as one ``Transpose``         Triton's ONNX Runtime, TensorRT
                                                                      and fingerprints read)
``DYNAMIC_QUANTIZER``  selected ``Gemm`` as ``MatMul`` + ``Add``      before ``quantize_dynamic``
``OPENVINO``           int8 linears with their token axis, packed     when OpenVINO loads a graph
                       qkv as three products, 7-bit int8 weights
=====================  =============================================  ==============================
"""

from deploykit.graph.rules import RuleSet

__all__ = ["RuleSet"]
