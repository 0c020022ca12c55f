"""Bring a quantized graph made elsewhere (NVIDIA Model Optimizer's ONNX PTQ, a QAT model exported
from PyTorch) into an export directory as the ``imported`` plan (``deploykit import-plan``).

The graph must be the directory's model: every check runs before anything is written, and a
graph that fails one is refused in one line.

1. it holds Q/DQ pairs, one image input of a fixed shape, and an fp32 graph was exported at that
   resolution (else: other resolution);
2. its matrix products (MatMul, Gemm, Conv with a constant weight), in graph order, have the fp32
   graph's ops and weight shapes (else: other architecture), and each weight, dequantized, is
   within ``MAX_WEIGHT_ERROR`` of the checkpoint's (relative L2; FP8 E4M3 rounding is about 3%,
   INT8 per channel well under 1%, another checkpoint's weights about 140%) (else: other weights);
3. ONNX Runtime runs it on the validation inputs against the checkpoint's PyTorch model, held to
   the ``imported`` plan's criteria (the INT8 plans': cosine and top-1/top-5 on real inputs).

Then the graph is written beside the others (``model_48_imported.onnx``) with the fp32 graph's
``deploykit.*`` metadata (ModelOpt drops it) and a quantization record naming its producer, Q/DQ
type and remainder type, and the manifest lists it: ``validate``, ``build``, ``profile`` and
``serve`` then take ``--precision imported`` like any plan. One imported graph per resolution: a
second import at the same resolution replaces the first.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from deploykit.errors import ConfigError, DeployKitError
from deploykit.export.metadata import GraphMetadata, QuantizationRecord, copy_metadata

IMPORTED = "imported"
PRODUCTS = ("MatMul", "Gemm", "Conv")
# Relative L2 error of a dequantized weight against the checkpoint's (module docstring).
MAX_WEIGHT_ERROR = 0.15


@dataclass(frozen=True)
class ImportedPlan:
    """What ``import_plan`` wrote: the graph's path, its resolution, its record and its check."""

    path: Path
    resolution: tuple[int, ...]
    record: QuantizationRecord
    metrics: dict


def import_plan(export_dir: str | os.PathLike, graph: str | os.PathLike, progress: Callable[[str], None] | None = None) -> ImportedPlan:
    """Check ``graph`` against the export directory's checkpoint and add it as the ``imported`` plan.

    Raises:
        DeployKitError: not an export directory, a graph that is not a quantized ONNX graph of
            this directory's model at an exported resolution, or one that fails the plan's
            criteria against PyTorch; nothing is written then.
    """
    from deploykit._io import directory_lock, write_json_atomic
    from deploykit.export.directory import ExportDir
    from deploykit.export.manifest import GraphEntry, graph_file_name, sha256_file

    directory = ExportDir(export_dir)
    manifest = directory.manifest()
    directory.check_reference(manifest)
    proto = _load(Path(graph))
    resolution = _resolution(proto, graph)
    try:
        fp32_entry = manifest.graph(resolution, "fp32")
    except DeployKitError:
        have = ", ".join("x".join(map(str, g.resolution)) for g in manifest.graphs if g.precision == "fp32")
        raise ConfigError(
            f"{graph} takes {'x'.join(map(str, resolution))} images; {export_dir} has fp32 graphs at {have} only "
            "(other resolution: export that resolution first)"
        ) from None
    fp32 = onnx.load(str(directory.graph(fp32_entry, manifest.encoding)))
    _check_weights(proto, fp32, graph)
    planned = _with_record(proto, fp32)
    name = graph_file_name(tuple(resolution), IMPORTED)
    with tempfile.TemporaryDirectory(prefix="deploykit-import-") as tmp:
        staged = Path(tmp) / name
        onnx.save_model(planned, str(staged))
        metrics = _check_against_pytorch(Path(export_dir), staged, tuple(resolution), progress, graph)
        target = Path(export_dir) / name
        with directory_lock(Path(export_dir)):
            _copy(staged, target)
            entry = GraphEntry.describing(planned, name, sha256_file(target))
            manifest = directory.manifest()
            manifest.graphs = [g for g in manifest.graphs if not (g.precision == IMPORTED and g.file == name)] + [entry]
            write_json_atomic(directory.manifest_file, manifest.to_dict())
    return ImportedPlan(target, tuple(resolution), GraphMetadata.of(planned).quantization, metrics)


def _load(path: Path) -> onnx.ModelProto:
    try:
        proto = onnx.load(str(path))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except Exception as err:  # onnx raises DecodeError, ValueError... on a file that is not a graph
        raise ConfigError(f"{path} is not an ONNX graph ({type(err).__name__})") from None
    if not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in proto.graph.node):
        raise ConfigError(f"{path} has no QuantizeLinear/DequantizeLinear nodes; import-plan takes a quantized (Q/DQ) graph")
    return proto


def _resolution(proto: onnx.ModelProto, path) -> tuple[int, ...]:
    constants = {t.name for t in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in constants]
    dims = [d.dim_value if d.HasField("dim_value") else None for d in inputs[0].type.tensor_type.shape.dim] if len(inputs) == 1 else []
    if len(dims) != 4 or None in dims[2:]:
        raise ConfigError(f"{path} needs one image input [N, C, H, W] with a fixed H and W (has {len(inputs)} inputs, shape {dims})")
    return tuple(dims[2:])


def _weights(proto: onnx.ModelProto) -> list[tuple[str, str, np.ndarray]]:
    """``(op type, node name, float weight)`` of each product with a constant weight, in graph
    order; a quantized weight dequantized (``DequantizeLinear`` of a stored value, or of a
    ``QuantizeLinear`` of a float one), fp16 read as float32."""
    constants = {t.name: t for t in proto.graph.initializer}
    producers = {o: n for n in proto.graph.node for o in n.output}
    for node in proto.graph.node:  # Constant nodes hold weights too
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t

    def value(name: str) -> np.ndarray | None:
        if name in constants:
            return numpy_helper.to_array(constants[name]).astype(np.float32)
        node = producers.get(name)
        if node is None:
            return None
        if node.op_type in ("Cast", "Identity"):
            return value(node.input[0])
        if node.op_type == "DequantizeLinear":
            source = producers.get(node.input[0])
            if source is not None and source.op_type == "QuantizeLinear":
                return value(source.input[0])  # Q/DQ of a float weight: the float weight itself
            stored, scale = value(node.input[0]), value(node.input[1])
            if stored is None or scale is None:
                return None
            zero = value(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros_like(scale)
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            shape = [1] * stored.ndim
            if scale.ndim == 1 and stored.ndim:
                shape[axis % stored.ndim] = -1
            return (stored - zero.reshape(shape)) * scale.reshape(shape)
        return None

    out = []
    for node in proto.graph.node:
        if node.op_type in PRODUCTS and len(node.input) > 1:
            weight = value(node.input[1])
            if weight is not None and weight.ndim >= 2:
                out.append((node.op_type, node.name, weight))
    return out


def _check_weights(proto: onnx.ModelProto, fp32: onnx.ModelProto, path) -> None:
    from deploykit.export import names

    theirs, ours = _weights(proto), _weights(fp32)
    layout = lambda ws: [(op, w.shape) for op, _, w in ws]
    if layout(theirs) != layout(ours):
        first = next((k for k, (a, b) in enumerate(zip(layout(theirs), layout(ours), strict=False)) if a != b), min(len(theirs), len(ours)))
        found = f"{theirs[first][0]} {theirs[first][2].shape}" if first < len(theirs) else "nothing"
        wanted = f"{ours[first][0]} {ours[first][2].shape}" if first < len(ours) else "nothing"
        raise ConfigError(
            f"{path} is another architecture: {len(theirs)} weighted matrix products against the checkpoint's {len(ours)}; "
            f"product {first + 1} is {found} where the checkpoint has {wanted}"
        )
    modules = names.module_paths(fp32)
    for (_, _, a), (_, name, b) in zip(theirs, ours, strict=True):
        error = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))
        if error > MAX_WEIGHT_ERROR:
            raise ConfigError(
                f"{path} holds other weights: {names.describe(name, modules)} differs from the checkpoint's by {error:.0%} "
                f"(relative L2; quantization alone stays under {MAX_WEIGHT_ERROR:.0%})"
            )


def _with_record(proto: onnx.ModelProto, fp32: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with the fp32 graph's ``deploykit.*`` metadata and the imported plan's record."""
    from deploykit.export.gpu_plans import TYPE_NAMES, qdq_type

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    copy_metadata(fp32, out)
    products = [n for n in out.graph.node if n.op_type in PRODUCTS]
    dequantized = {n.output[0] for n in out.graph.node if n.op_type == "DequantizeLinear"}
    quantized = sum(1 for n in products if dequantized & set(n.input))
    remainder = _remainder(out)
    producer = " ".join(p for p in (proto.producer_name, proto.producer_version) if p) or "unknown"
    record = QuantizationRecord(
        plan=IMPORTED,
        quantized_nodes=quantized,
        qdq_type=TYPE_NAMES.get(qdq_type(out) or 0, "other"),
        remainder=remainder,
        source=producer,
    )
    GraphMetadata.update(out, precision=IMPORTED, quantization=record)
    return out


def _remainder(proto: onnx.ModelProto) -> str:
    """The type most products run in: ``fp16``, ``bf16`` or ``fp32``."""
    from onnx import TensorProto

    inferred = onnx.shape_inference.infer_shapes(proto)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    counts: dict[int, int] = {}
    for node in proto.graph.node:
        if node.op_type in PRODUCTS:
            kind = types.get(node.output[0], TensorProto.FLOAT)
            counts[kind] = counts.get(kind, 0) + 1
    kind = max(counts, key=counts.get) if counts else TensorProto.FLOAT
    return {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}.get(kind, "fp32")


def _check_against_pytorch(export_dir: Path, graph: Path, resolution: tuple[int, ...], progress, shown) -> dict:
    """Run ``graph`` on ONNX Runtime against the directory's PyTorch model on the validation
    inputs, held to the imported plan's criteria; refuse it when it fails."""
    from deploykit.backends import registry
    from deploykit.backends.defaults import RUNNER
    from deploykit.checks import check_runner
    from deploykit.export.bundle import load_reference
    from deploykit.export.precision import PLANS
    from deploykit.inputs.builtin import VALIDATION_NOISE, VALIDATION_REAL
    from deploykit.validation.run import References

    model = load_reference(export_dir)
    references = References(VALIDATION_NOISE, VALIDATION_REAL, progress=progress)
    with registry.create_runner(RUNNER, graph) as runner:
        checked = check_runner(runner, references.at(model, resolution), PLANS[IMPORTED], batch=4, exact=True)
    if not checked.result.passed:
        raise ConfigError(
            f"{shown} fails the {IMPORTED} plan's criteria against the checkpoint's PyTorch model: {'; '.join(checked.result.failures)}"
        )
    return dict(checked.result.metrics)


def _copy(source: Path, target: Path) -> None:
    from deploykit._io import atomic_path

    with atomic_path(target) as tmp:
        tmp.write_bytes(source.read_bytes())
