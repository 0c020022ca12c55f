"""Judging an INT8 plan before it is written: the planned graph against its fp32 graph on
held-out inputs (``check_plan``, naming the first divergent block by the same search as
``deploykit.validate``), and the plan's record as terminal lines (``describe_plan``); after it
is written, the target it was held to, with its held-out inputs drawn again (``recorded_target``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx

from deploykit.checks import Agreement, Bar, Reference, Tolerance, bar_of, check_runner, first_divergent, judge
from deploykit.checks.run import JudgedPlan
from deploykit.errors import ExportError, InputError, listed
from deploykit.export import names, sensitivity
from deploykit.export.int8_selection import QUANTIZED_OP_TYPES, quantized_word
from deploykit.export.metadata import GraphMetadata, QuantizationRecord
from deploykit.runners.onnxrt import cpu_runner, run_graph


def describe_plan(details: QuantizationRecord) -> list[str]:
    """A quantized graph's record (``deploykit.quantization``) as terminal lines, every node by its
    module path with its ONNX name beside it: what was quantized and on what, what stayed float
    and why (pinned, sensitivity, policy), the most sensitive nodes and the target reached."""
    kept = details.kept_float
    kind = quantized_word(details.plan)
    lines = [f"{details.quantized_nodes} matmuls {kind}, {len(kept) or sum(map(len, (details.float_nodes or {}).values()))} float"]
    if details.calibration_data is not None:
        lines[0] += f"; calibrated ({details.calibration}) on {details.calibration_data}"
    for entry in kept:
        if entry.reason != "policy":
            why = f" ({entry.why})" if entry.why else ""
            lines.append(f"kept float: {names.describe(entry.onnx, {entry.onnx: entry.module})}: {entry.reason}{why}")
    policy: dict[str, list[str]] = {}
    for entry in kept:
        if entry.reason == "policy":
            policy.setdefault(entry.why, []).append(entry.module or entry.onnx)
    if policy:
        groups = [f"{why} {len(mods)} ({listed(list(dict.fromkeys(mods)), 3)})" for why, mods in policy.items()]
        lines.append(f"kept float by policy: {'; '.join(groups)}")
    if details.sensitivity:
        ranked = details.sensitivity["most_sensitive"]
        lines.append("most sensitive: " + ", ".join(f"{e['module'] or e['onnx']} {e['output_error']:.1e}" for e in ranked))
    if details.agreement:
        record = details.agreement
        goal = Agreement.from_dict(record["target"]).describe()
        moved = sum(1 for e in kept if e.reason == "sensitivity")
        lines.append(
            f"target {goal} on {record['target']['held_out']} held-out inputs: "
            f"{sensitivity.summary(record['quantized_all'])} with every matmul {kind}; "
            f"{sensitivity.summary(record['final'])} with {moved} back in float ({record['checks']} checks)"
            + ("" if record["met"] else "; target missed")
        )
    if details.untrained_weights:
        lines.append("warning: the weights look untrained; agreement on random weights says nothing about a trained model")
    return lines


def check_plan(
    fp32: onnx.ModelProto,
    planned: onnx.ModelProto,
    inputs: np.ndarray,
    criteria: Sequence[Bar] | JudgedPlan,
    label: str,
    top_k: bool = True,
    reference: np.ndarray | None = None,
    done: Callable[[int], None] | None = None,
    actual: np.ndarray | None = None,
    batch: int = 32,
) -> dict:
    """Judge a quantized graph against its fp32 graph on held-out real inputs by its plan's
    ``criteria`` (``checks.check_runner``; ``top_k``: the outputs are logits; a headless
    backbone's features are judged by cosine only; ``reference`` and ``actual``: the fp32 and the
    planned graph's outputs on them, when already computed; ``done``: called with the number of
    inputs the planned graph has run on so far; ``batch``: inputs per call).

    Returns:
        The criteria's metrics.

    Raises:
        ExportError: the plan fails its criteria; the message names the first block whose output
            leaves its tolerance and the quantized nodes in that block, by module path.
    """
    reference = run_graph(fp32, inputs, batch) if reference is None else reference
    held_out = Reference(inputs, reference, num_real=len(inputs), top_k=top_k)
    if actual is None:
        with cpu_runner(planned) as runner:
            checked = check_runner(runner, held_out, criteria, batch=batch, done=done)
    else:
        checked = judge(held_out, actual, criteria)
        if done:
            done(len(inputs))
    if not checked:
        block = _first_divergent_block(fp32, planned, inputs[:16], bar_of(checked.criteria, Tolerance))
        modules = names.module_paths(fp32)
        nodes = [
            names.describe(n.name, modules)
            for n in planned.graph.node
            if block
            and n.op_type in QUANTIZED_OP_TYPES
            and _quantized_input(planned, n)
            and (modules.get(n.name, "") == block or modules.get(n.name, "").startswith(block + "."))
        ]
        where = f"; first divergent block {block} (quantized there: {', '.join(nodes) or 'none'})" if block else ""
        raise ExportError(f"{label} fails its tolerance on {len(inputs)} held-out inputs ({'; '.join(checked.result.failures)}){where}")
    return dict(checked.result.metrics)


def _quantized_input(proto: onnx.ModelProto, node: onnx.NodeProto) -> bool:
    dequantized = {n.output[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    return any(name in dequantized for name in node.input)


def _first_divergent_block(fp32: onnx.ModelProto, planned: onnx.ModelProto, inputs: np.ndarray, tolerance: Tolerance) -> str:
    """``blocks.<i>`` (the module path) whose output first leaves ``tolerance``
    (``checks.first_divergent``, as ``validate`` judges blocks; the block outputs recorded at
    export, marked as outputs of both graphs as ``validate`` marks them), or ``""``."""
    block_outputs = list(GraphMetadata.of(fp32).block_outputs)
    reference, actual = (run_graph(g, inputs, outputs=block_outputs) for g in (fp32, planned))
    block = first_divergent(reference, actual, tolerance)
    return "" if block is None else f"blocks.{block}"


def recorded_target(model, shape: tuple[int, ...], details: QuantizationRecord | None):
    """The quality target an int8 plan's export held it to, and the held-out inputs it was checked
    on, drawn again as the export drew them: ``(CalibrationOptions, inputs)``, or None when the
    export set no target (or the graph carries no record).

    ``details`` is the plan graph's ``deploykit.quantization``: its ``agreement.target`` (held-out
    count and thresholds, ``--min-agreement`` and the others as given) and the fingerprint of its
    held-out inputs. Those were a zoo model's val split or crops of the bundled images or text
    (``DefaultCalibration``), or the user's ``--calibration-data``, whose path the record keeps
    (``UserCalibration``: the same split of it). Drawn again, they must match the fingerprint.

    Raises:
        InputError: the held-out inputs drawn again differ from the export's (the user's data
            moved or changed since).
    """
    from deploykit.export.int8_static import CalibrationOptions
    from deploykit.inputs.builtin import DefaultCalibration
    from deploykit.inputs.user import UserCalibration, read_inputs

    if details is None:
        return None
    goal = (details.agreement or {}).get("target")
    recorded = (details.inputs or {}).get("held_out")
    if not goal or not recorded:
        return None
    # A user's data is recorded by its path; the default inputs by a description, no path.
    data = UserCalibration(read_inputs(recorded["source"])) if Path(recorded["source"]).exists() else DefaultCalibration()
    held_out, record = data.held_out(model, tuple(shape), details.samples, recorded["count"])
    if record["sha256"] != recorded["sha256"]:
        raise InputError(
            f"the plan's held-out inputs ({recorded['description']}) are not the ones its export checked it on: "
            "they moved or changed since (sha256 differs); export the plan again"
        )
    options = CalibrationOptions(
        held_out=recorded["count"], **{key: goal[key] for key in ("min_agreement", "min_cosine", "max_relative_error")}
    )
    return options, held_out
