"""Which quantized nodes an INT8 plan moves back to float, found in minutes.

Two steps, each a small number of passes over the data whatever the model's depth:

1. **Sensitivity, one pass.** Each quantized node's quantization error where it counts, at the
   graph's output, with that node alone quantized: ``Σ‖y_n − y‖² / Σ‖y‖²`` (ONNX Runtime's SQNR,
   as a ratio rather than in dB, taken at the output). A few nodes at a time hold both forms,
   int8 and fp32, blended per row by a mask, in the part of the fp32 graph from the first of them
   on; one run over the inputs repeated once per node measures them side by side
   (``node_sensitivity``).
2. **Fallback, bisection.** Nodes ranked by that error go back to float as a prefix of the ranking:
   the smallest prefix that meets the target is found by bisection over its length, so the
   target is checked ``O(log n)`` times rather than once per node. A node goes back to float by
   a graph edit on the quantized graph (its inputs read the fp32 tensors again, and the Q/DQ
   pairs nobody reads any more are dropped), so calibration and the quantizer run once.

A target (``QualityTarget``) fits the model: top-1 agreement with the fp32 graph for a
classifier, mean per-token cosine (and optionally relative error) for a features model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx

from deploykit.checks import Agreement, Reference, check_runner
from deploykit.export.int8_selection import QUANTIZED_OP_TYPES
from deploykit.graph.edits import back_to_float, counterpart, starting_at
from deploykit.runners.base import Runner, output_rows
from deploykit.runners.onnxrt import cpu_runner, with_outputs

if TYPE_CHECKING:  # imported where used: onnx_ir is slow to import
    import onnx_ir as ir

# Inputs per ORT call of the sensitivity pass (nodes × inputs each): activations stay at a batch's.
_SENSITIVITY_BATCH = 16
# Groups of nodes whose cut tensors one fp32 run captures (a ViT-S at 224: 17 groups, 3 runs).
_GROUPS_PER_CAPTURE = 8
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QualityTarget:
    """What the quantized graph must keep of the fp32 graph's outputs on held-out inputs: the
    fallback's goal (``checks.Agreement``: top-1 agreement for a classifier, mean cosine and
    relative error for features), searched for, not a pass/fail bar (the plan's criteria in
    ``precision.PLANS`` are that).

    Attributes:
        reference: the held-out inputs (neither the calibration inputs nor a test split) and the
            fp32 graph's output rows on them (``deploykit.runners.onnxrt.run_graph``'s: one per image
            for a classifier or a pooled features model, one per token for a model returning
            every token).
        goal: the agreement to reach.
        max_float_share: at most this share of the quantized nodes falls back to float (a
            third: GeoPE at 2× needed 5 of its 17).
        batch: inputs per call of ``measure``'s runs (``onnx_export.rows_per_call``).
    """

    reference: Reference
    goal: Agreement
    max_float_share: float = 1 / 3
    batch: int = 32

    def measure(self, runner: Runner, stop_early: bool = True) -> tuple[dict, bool, np.ndarray]:
        """Run an active runner over the held-out inputs (``checks.check_runner``) and return the
        metrics, whether the goal is met, and the output rows that ran. With ``stop_early``, stops
        as soon as the goal can no longer be met, so a failing trial costs only part of a pass; its
        metrics are then those of the rows seen (``complete`` False)."""
        checked = check_runner(runner, self.reference, (self.goal,), batch=self.batch, stop_early=stop_early)
        metrics = {**checked.result.metrics, "rows": len(checked.outputs), "complete": checked.complete}
        return metrics, checked.complete and checked.result.passed, checked.outputs

    def describe(self) -> str:
        return self.goal.describe()

    def to_dict(self) -> dict:
        return {"held_out": len(self.reference.inputs), **self.goal.to_dict()}


# ---------------------------------------------------------------------------------- sensitivity


def node_sensitivity(
    fp32: onnx.ModelProto, qdq: onnx.ModelProto, nodes: Sequence[str], inputs: np.ndarray, done: Callable[[int], None] | None = None
) -> dict[str, float]:
    """Each quantized node's quantization error at the graph's output, when it alone is quantized:
    ``Σ‖y_n − y‖² / Σ‖y‖²`` over the output rows of ``inputs`` (module docstring).

    Nodes are measured a few at a time, in the order they run. For each group, one graph computes
    the group's nodes both ways: their int8 form (the plan's Q/DQ pairs) and their fp32 twin (same
    inputs before quantization, fp32 weight), blended by a 0/1 mask per row,
    ``y = y_fp32 + mask · (y_int8 − y_fp32)``; every other node is fp32. The inputs are repeated
    once per node of the group, and a node's mask is 1 on its own copy only, so each copy runs the
    fp32 graph with exactly one node quantized. Upstream of the group's first node every copy is
    the fp32 graph, so that graph starts there (``deploykit.graph.edits.starting_at``), fed the
    fp32 tensors crossing the cut (from fp32 runs, a few cuts at a time): on a 12-block ViT the
    pass computes about half the blocks per copy, in fp32 only, where blending every node in one
    graph computed all of them in both forms.

    Measuring at the output, not at the node (ONNX Runtime's ``qdq_loss_debug`` compares each
    tensor before and after its Q/DQ pair), matters: on the zoo's APE model at 2× its training
    resolution, the nodes with the largest local error were the last blocks' MLPs, and keeping 8
    of them float left top-1 agreement at 98.0%; the largest at the output were block 0's and the
    patch embedding, and keeping 3 float gave 99.3%.

    Args:
        fp32: the fp32 graph.
        qdq: the same graph with ``nodes`` quantized (Q/DQ on their inputs), node names kept.
        nodes: names of the quantized nodes to measure.
        inputs: ``[k, ...]`` graph inputs; each node is measured on all of them (a few suffice:
            the error of every output row is summed).
        done: optional, called with the number of nodes measured so far (a 12-block model's
            pass takes a minute on two cores).

    Returns:
        Node name → relative squared error at the output (0: quantizing it changes nothing).
    """
    import onnx_ir as ir

    position = {n.name: i for i, n in enumerate(fp32.graph.node)}  # ONNX graphs are topologically sorted
    ordered = sorted(nodes, key=position.__getitem__)
    outputs = {n.name: n.output[0] for n in fp32.graph.node if n.name in set(nodes)}
    per_run = max(1, _SENSITIVITY_BATCH // len(inputs))  # nodes measured per run
    groups = [ordered[i : i + per_run] for i in range(0, len(ordered), per_run)]
    cuts = [_cut(fp32, position[group[0]]) for group in groups]
    graph_input, graph_output = fp32.graph.input[0].name, fp32.graph.output[0].name
    crossing = sorted({t for cut in cuts for t in cut} - {graph_input})
    # One fp32 run on another number of inputs gives the shapes: each node output's rows per input
    # and rank (the masks'), and each crossing tensor's batch axis (against the runs below).
    few = inputs[:1] if len(inputs) > 1 else np.concatenate([inputs, inputs])
    shapes = {t: v.shape for t, v in _run(fp32, [*outputs.values(), *crossing], few).items()}
    rows = {t: shapes[t][0] // len(few) for t in outputs.values()}
    ranks = {t: len(shapes[t]) for t in outputs.values()}
    pairs, reference, error, fp32_ir = list(zip(groups, cuts)), None, {}, ir.from_proto(fp32)
    for first in range(0, len(pairs), _GROUPS_PER_CAPTURE):
        window = pairs[first : first + _GROUPS_PER_CAPTURE]
        # The fp32 tensors crossing these cuts, from one fp32 run (a few cuts at a time: on a
        # ViT-B at 384 all of them would take a gigabyte).
        names = sorted({t for _, cut in window for t in cut} - {graph_input})
        values = _run(fp32, names, inputs)
        reference = output_rows(values[graph_output]) if reference is None else reference
        axes = {graph_input: 0, **_batch_axes(names, values, shapes, len(inputs) / len(few))}
        values[graph_input] = inputs
        for group, cut in window:
            others = [n for n in nodes if n not in group]
            blended = ir.from_proto(qdq)
            back_to_float(blended, fp32_ir, others, QUANTIZED_OP_TYPES)
            masks = _blend(blended, fp32_ir, group, ranks)
            # Tensors without a batch axis (shapes, tables) are recomputed from the (repeated) input.
            fed = [graph_input, *(t for t in cut if t in axes and t != graph_input)]
            feed = {t: np.concatenate([values[t]] * len(group), axis=axes[t]) for t in fed}
            for i, mask in enumerate(masks):
                on = np.zeros(len(group) * len(inputs), np.float32)
                on[i * len(inputs) : (i + 1) * len(inputs)] = 1
                feed[mask.input] = np.repeat(on, rows[mask.output]).reshape(-1, *([1] * (mask.rank - 1)))
            starting_at(blended, {t: values[t] for t in fed})
            with cpu_runner(ir.to_proto(blended)) as runner:
                out = output_rows(runner.infer(feed)[graph_output]).reshape(len(group), *reference.shape)
            for i, mask in enumerate(masks):
                error[mask.node] = float(np.sum((out[i] - reference) ** 2) / max(np.sum(reference**2), 1e-300))
            if done:
                done(len(error))
    return {n: error[n] for n in nodes}


def _run(graph: onnx.ModelProto, names: Sequence[str], inputs: np.ndarray) -> dict[str, np.ndarray]:
    """The graph's outputs and the tensors ``names`` on ``inputs`` (one batch), as the graph makes them."""
    with cpu_runner(with_outputs(graph, names)) as runner:
        return runner.infer({graph.graph.input[0].name: inputs})


def _batch_axes(names: Sequence[str], values: dict[str, np.ndarray], other: dict[str, tuple[int, ...]], ratio: float) -> dict[str, int]:
    """Each tensor's batch axis, from its values and its shape on another number of inputs
    (``ratio``: the first's over the other's): the one axis whose length scales by it. Tensors
    without one (shapes, tables) are left out."""
    axes = {}
    for name in names:
        big, few = values[name].shape, other[name]
        changed = [i for i, (b, f) in enumerate(zip(big, few)) if b != f]
        if len(big) == len(few) and len(changed) == 1 and big[changed[0]] == few[changed[0]] * ratio:
            axes[name] = changed[0]
    return axes


def _cut(fp32: onnx.ModelProto, start: int) -> list[str]:
    """The tensors crossing the cut before node ``start``: made by an earlier node (or the graph's
    input) and read by node ``start`` or a later one. Initializers are carried by the graph."""
    made = {fp32.graph.input[0].name}
    for node in fp32.graph.node[:start]:
        made.update(node.output)
    read = {name for node in fp32.graph.node[start:] for name in _reads(node)} | {o.name for o in fp32.graph.output}
    return sorted(made & read)


def _reads(node: onnx.NodeProto) -> set[str]:
    """Every tensor a node reads, those its subgraphs (an ``If``'s branches) read from outside included."""
    names = set(node.input)
    for attribute in node.attribute:
        for graph in [attribute.g, *attribute.graphs]:
            for inner in graph.node:
                names |= _reads(inner)
    return names - {""}


@dataclass(frozen=True)
class _Mask:
    node: str  # the quantized node
    input: str  # the graph input holding its 0/1 row mask
    output: str  # the node's output (as the fp32 graph names it)
    rank: int


def _blend(model: ir.Model, fp32: ir.Model, nodes: Sequence[str], ranks: dict[str, int]) -> list[_Mask]:
    """Make each of ``nodes`` of a Q/DQ ``model`` also run as its fp32 twin, in place, its output
    the mask-blend of the two (``node_sensitivity``); the masks are new graph inputs (``ranks``:
    each output's). The other tensors' recorded shapes are dropped: the blended graph runs on the
    inputs repeated once per node."""
    import onnx_ir as ir

    graph, wanted = model.graph, set(nodes)
    twins = {n.name: n for n in fp32.graph if n.name in wanted}
    known = ir.convenience.create_value_mapping(graph)
    masks = []
    for node in [n for n in graph if n.name in wanted]:
        int8, twin = node.outputs[0], twins[node.name]
        y = int8.name
        fp32_twin = ir.Node(
            twin.domain,
            twin.op_type,
            [None if v is None else counterpart(graph, v, known) for v in twin.inputs],  # fp32 weights copied in
            twin.attributes.values(),
            num_outputs=1,
            name=f"{node.name}.fp32",
            metadata_props=dict(twin.metadata_props),
        )
        mask = _Mask(node.name, f"{node.name}.mask", y, ranks[y])
        mask_input = ir.Value(
            name=mask.input, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([f"{node.name}.rows"] + [1] * (mask.rank - 1))
        )
        graph.inputs.append(mask_input)
        # y = y_fp32 + mask * (y_int8 - y_fp32)
        delta = ir.Node("", "Sub", [int8, fp32_twin.outputs[0]], name=f"{node.name}.delta")
        masked = ir.Node("", "Mul", [delta.outputs[0], mask_input], name=f"{node.name}.masked")
        blended = ir.Node("", "Add", [fp32_twin.outputs[0], masked.outputs[0]], name=f"{node.name}.blend")
        out = blended.outputs[0]
        out.type, out.shape = int8.type, int8.shape
        ir.convenience.replace_all_uses_with(int8, out, replace_graph_outputs=True)
        delta.replace_input_with(0, int8)  # but the blend's own Sub
        for value, suffix in ((int8, "int8"), (fp32_twin.outputs[0], "fp32"), (delta.outputs[0], "delta"), (masked.outputs[0], "masked")):
            value.name = f"{y}.{suffix}"
        out.name = known[y] = y
        graph.insert_after(node, [fp32_twin, delta, masked, blended])
        masks.append(mask)
    for node in graph:
        for value in node.outputs:
            if not value.is_graph_output():
                value.type, value.shape = None, None
    return masks


# ------------------------------------------------------------------------------------- fallback


def dequantize_nodes(qdq: onnx.ModelProto, fp32: onnx.ModelProto, nodes: Iterable[str]) -> onnx.ModelProto:
    """``qdq`` with ``nodes`` back in float: each reads, in place of a ``DequantizeLinear``
    output, the input the same node reads in ``fp32`` (the activation, or the fp32 weight); Q/DQ
    pairs and int8 weights nobody reads any more are dropped (``deploykit.graph.edits.back_to_float``).
    The graph is otherwise unchanged: the other nodes keep their calibrated scales."""
    import onnx_ir as ir

    wanted = list(nodes)
    if not wanted:
        out = onnx.ModelProto()
        out.CopyFrom(qdq)
        return out
    model = ir.from_proto(qdq)
    back_to_float(model, ir.from_proto(fp32), wanted, QUANTIZED_OP_TYPES)
    return ir.to_proto(model)


@dataclass
class Trial:
    """One checked plan of the fallback: how many of the ranked nodes were float, and its metrics."""

    float_count: int
    metrics: dict
    met: bool


def bisect_fallback(
    ranked: Sequence[str],
    budget: int,
    check: Callable[[list[str]], tuple[dict, bool]],
    progress: Callable[[str], None] | None = None,
) -> tuple[int, list[Trial]]:
    """The fewest leading nodes of ``ranked`` whose return to float meets the target.

    ``check(float_nodes, stop_early)`` builds and measures that plan (every plan but the first,
    which is reported in full, may stop as soon as it misses). Checked: no node (done if met), all
    ``budget`` nodes (if that misses, more float cannot be afforded: returns ``budget``), then
    bisection between the two, assuming more float never hurts (the usual case; the trials are
    recorded). At most ``2 + ⌈log2(budget)⌉`` checks.

    Returns:
        The number of leading nodes kept float, and every trial.
    """
    trials: list[Trial] = []

    def trial(count: int) -> bool:
        metrics, met = check(list(ranked[:count]), stop_early=count > 0)
        trials.append(Trial(count, metrics, met))
        if progress:
            progress(f"{count} of {len(ranked)} matmuls float: {summary(metrics)}{'' if met else ' (target missed)'}")
        return met

    if trial(0) or budget == 0:
        return 0, trials
    if not trial(budget):
        return budget, trials
    low, high = 0, budget  # low misses, high meets
    while high - low > 1:
        mid = (low + high) // 2
        if trial(mid):
            high = mid
        else:
            low = mid
    return high, trials


def summary(metrics: dict) -> str:
    """``top-1 agreement 99.40%, mean cosine 0.99962`` (features: cosine and relative error)."""
    parts = []
    if "top1_agreement" in metrics:
        parts.append(f"top-1 agreement {metrics['top1_agreement']:.2%} (pairwise estimate {metrics['top1_agreement_estimate']:.2%})")
    parts.append(f"mean cosine {metrics['mean_cosine']:.5f}")
    if "top1_agreement" not in metrics:
        parts.append(f"mean relative error {metrics['mean_relative_error']:.4f}")
    return ", ".join(parts) + ("" if metrics.get("complete", True) else " (stopped early)")


@dataclass(frozen=True)
class Fallback:
    """What the fallback chose: the graph, how many leading nodes of the ranking went back to float,
    the record of its trials, and the chosen plan's output rows on every held-out input (None when
    no complete run of exactly that graph was made)."""

    graph: onnx.ModelProto
    float_count: int
    record: dict
    outputs: np.ndarray | None


def fall_back(
    fp32: onnx.ModelProto, qdq: onnx.ModelProto, ranked: list[str], target: QualityTarget, progress: Callable[[str], None] | None = None
) -> Fallback:
    """Move the fewest most-sensitive nodes (``ranked``, most sensitive first) of ``qdq`` back to
    float that meet ``target`` (``bisect_fallback``)."""
    complete: dict[int, np.ndarray] = {}  # float count -> output rows of a trial that ran every input

    def check(nodes: list[str], stop_early: bool = True) -> tuple[dict, bool]:
        with cpu_runner(dequantize_nodes(qdq, fp32, nodes)) as runner:
            metrics, met, outputs = target.measure(runner, stop_early=stop_early)
        if metrics["complete"]:
            complete[len(nodes)] = outputs
        return metrics, met

    budget = int(len(ranked) * target.max_float_share)
    count, trials = bisect_fallback(ranked, budget, check, progress)
    final = next(t for t in reversed(trials) if t.float_count == count)
    if not final.metrics["complete"]:  # the plan kept misses its target: say by how much, on every input
        final = Trial(count, *check(ranked[:count], stop_early=False))
    record = {
        "target": target.to_dict(),
        "quantized_all": trials[0].metrics,
        "final": final.metrics,
        "met": final.met,
        "checks": len(trials),
        "trials": [{"float": t.float_count, "met": t.met, **t.metrics} for t in trials],
    }
    if not final.met:
        _log.warning(
            "the int8 plan misses its target (%s) with %d of %d matmuls back in float (the most allowed): %s",
            target.describe(),
            count,
            len(ranked),
            summary(final.metrics),
        )
    return Fallback(dequantize_nodes(qdq, fp32, ranked[:count]), count, record, complete.get(count))
