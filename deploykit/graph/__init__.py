"""Graph rewrites, one rule set per runtime, on one toolkit (onnx_ir, onnxscript's rewriter).

Each rule keeps the graph's values and changes only its spelling to the one a runtime runs
best; node metadata (the exporter's name scopes that validation and quantization read) is carried
to the replacement nodes by the rewriter. Torch-free.

===============================  ============================================  ===================================
rule set                         what it spells differently                    applied
===============================  ============================================  ===================================
``canonical.CANONICAL``          GELU as ONNX Runtime's GeluFusion matches     at export, before folding: the
                                 it, the key transpose as one ``Transpose``    file's own form, for every runtime
``openvino.THREE_PRODUCTS``      packed qkv as three products (and 7-bit      when the OpenVINO runner loads a
                                 int8 weights)                                 graph (``prepare_for_openvino``)
===============================  ============================================  ===================================

The file holds only spellings that keep every bit and that no runtime reads worse; what one
runtime alone prefers is applied when that runtime reads the graph, so no rule set undoes
another. The file is what TensorRT parses, what ONNX Runtime's quantizers read (linear layers as
``MatMul`` over [B, N, K], the op ``quantize_dynamic`` takes and the axis OpenVINO's low-precision
passes keep an int8 weight's per-channel scales on) and what the export's fingerprints hash.

``edits`` holds the edits that change what a graph computes but carry no numeric meaning of their
own (quantized nodes back to float, a graph started at given tensors): the INT8 fallback decides
what to edit, on the same toolkit. ``cast`` is the cast plans' pass (products in fp16 or bf16,
tables, normalisations, custom ops and the logits in fp32; ``deploykit.export.precision`` says
which plan asks for it); ``fused_attention`` fuses attention into ONNX Runtime's
``MultiHeadAttention`` (the ``*-mha`` plans).
"""

from deploykit.graph.rules import RuleSet

__all__ = ["RuleSet"]
