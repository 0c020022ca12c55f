"""What OpenVINO compiled below f32 though marked to stay in f32: the audit of the compiled graph
a bf16 run is judged by (``OpenvinoRunner.lowered_despite_mark``)."""

from __future__ import annotations

from typing import NamedTuple

# Compiled layer types (the CPU plugin's ``layerType``) that move or copy values without computing:
# one running in bf16 holds values rounded where they were converted, not rounded again.
_LAYOUT_LAYERS = frozenset(
    {"Reshape", "Transpose", "Concatenation", "Gather", "Split", "StridedSlice", "Pad", "Broadcast", "Tile", "Reorder"}
)
_PRODUCT_LAYERS = frozenset({"FullyConnected", "MatMul", "Convolution"})
_LOW_FLOATS = frozenset({"bf16", "f16"})


class Lowered(NamedTuple):
    """Layer type -> how many compiled nodes run marked ops below f32, in two kinds."""

    encoding: dict[str, int]  # an encoding op: the run is not faithful (``lowered_despite_mark``)
    elsewhere: dict[str, int]  # only the plan's other fp32 nodes (``lowered_elsewhere``)


def lowered_below_f32(marked: set[str], encoding_ops: dict[str, str], compiled) -> Lowered:
    """What OpenVINO compiled below f32 though marked (names are friendly names; ``encoding_ops``
    maps those of ``fp32_tensors(...).encoding`` to their op type). OpenVINO 2026.4 drops our mark
    where one of its passes replaces the op, so the runner reports what was compiled, not what it
    asked for.

    ``encoding``: nodes running an encoding op (tables' readers, rotations, LayerNorm, Softmax,
    encoding bodies, the residual stream). Two kinds of compiled node are not counted, each for a
    reason a test pins down:

    * a Softmax inside a fused attention ``Subgraph``: the Subgraph reports bf16 because its two
      products take bf16 inputs, and it computes the Softmax between them in f32 (OpenVINO's
      snippets lower Brgemm inputs only; ``test_fused_attention_keeps_its_softmax_in_f32``);
    * a layout node (``_LAYOUT_LAYERS``) whose values reach only products: they would be rounded
      for the product anyway (a rotated key transposed in bf16 is the rotated key rounded).

    ``elsewhere``: nodes holding marked ops outside ``encoding_ops`` only (the logits' product, the
    class token's batch expand on OpenVINO 2026.4): the bf16 plan keeps them in fp32, a run that
    rounds them rounds them as it rounds every product. Reported, not judged.
    """
    nodes = list(compiled.get_runtime_model().get_ops())
    layer = {id(op): op.get_rt_info()["layerType"].astype(str) for op in nodes}
    origins = {id(op): set(op.get_rt_info()["originalLayersNames"].astype(str).split(",")) for op in nodes}

    def held(op) -> set[str]:
        """The encoding ops a compiled node holds, less a fused attention's Softmax."""
        names = origins[id(op)] & encoding_ops.keys()
        if layer[id(op)] == "Subgraph":
            names = {n for n in names if encoding_ops[n] != "Softmax"}
        return names

    def feeds_products_only(op) -> bool:
        readers = [target.get_node() for out in op.outputs() for target in out.get_target_inputs()]
        return bool(readers) and all(
            layer[id(r)] in _PRODUCT_LAYERS
            or (layer[id(r)] == "Subgraph" and not held(r))
            or (layer[id(r)] in _LAYOUT_LAYERS and feeds_products_only(r))
            for r in readers
        )

    lowered = Lowered({}, {})
    for op in nodes:
        kind = layer[id(op)]
        if op.get_rt_info()["runtimePrecision"].astype(str) not in _LOW_FLOATS:
            continue
        if held(op):
            if not (kind in _LAYOUT_LAYERS and feeds_products_only(op)):
                lowered.encoding[kind] = lowered.encoding.get(kind, 0) + 1
        elif origins[id(op)] & marked and not origins[id(op)] & encoding_ops.keys():
            lowered.elsewhere[kind] = lowered.elsewhere.get(kind, 0) + 1
    return lowered
