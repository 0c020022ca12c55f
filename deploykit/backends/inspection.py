"""``deploykit inspect PATH``: what an exported graph or a built engine is.

A graph (``.onnx``): its encoding, positional tables, precision plan, opset, custom ops and
model-local functions, inputs and outputs, what TensorRT-RTX's parser reports about it (when
``tensorrt_rtx`` is installed; it runs on CPU) and what OpenVINO reads (when ``openvino`` is
installed: its ops, and how many a bf16 hint would keep in f32). An engine (``.engine``/``.plan``): its
fingerprint (what it was built from and for), profile shapes, and its layers with their
precisions from TensorRT's engine inspector, which needs the engine deserialized, so a CUDA GPU;
elsewhere the report says why the layers are missing.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

from deploykit.catalog import TABLE_PREFIX
from deploykit.errors import DeployKitError, one_line

GRAPH_SUFFIXES = (".onnx",)
ENGINE_SUFFIXES = (".engine", ".plan")


def inspect_path(path: str | os.PathLike) -> dict:
    """A JSON-ready description of a graph or an engine.

    Raises:
        DeployKitError: ``path`` is neither (one line).
    """
    path = Path(path)
    if path.is_file() and path.suffix in GRAPH_SUFFIXES:
        return inspect_graph(path)
    if path.is_file() and path.suffix in ENGINE_SUFFIXES:
        return inspect_engine(path)
    what = "does not exist" if not path.exists() else "is a directory" if path.is_dir() else f"has suffix {path.suffix!r}"
    raise DeployKitError(
        f"{path} {what}; inspect takes an ONNX graph ({', '.join(GRAPH_SUFFIXES)}) or a TensorRT engine ({', '.join(ENGINE_SUFFIXES)})"
    )


def inspect_graph(path: Path) -> dict:
    """Encoding, tables, precision plan, opset, custom ops and TensorRT-RTX's parse of one graph."""
    import onnx

    from deploykit.export.metadata import GraphMetadata

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # protobuf's DecodeError and friends: not a model
        raise DeployKitError(one_line(f"{path} is not a readable ONNX graph: {err}")) from err
    meta = GraphMetadata.of(proto)
    tables = [i for i in proto.graph.initializer if i.name.startswith(TABLE_PREFIX)]
    custom = Counter(f"{n.domain}::{n.op_type}" for n in proto.graph.node if n.domain not in ("", "ai.onnx"))
    return {
        "kind": "graph",
        "path": str(path),
        "encoding": meta.encoding_config,
        "precision_plan": meta.precision or "not recorded (not exported by deploykit)",
        "opset": {o.domain or "ai.onnx": o.version for o in proto.opset_import},
        "inputs": [_value_info(v) for v in proto.graph.input],
        "outputs": [_value_info(v) for v in proto.graph.output],
        "tables": [
            {"name": t.name, "shape": list(t.dims), "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name} for t in tables
        ],
        "initializer_dtypes": dict(Counter(onnx.helper.tensor_dtype_to_np_dtype(i.data_type).name for i in proto.graph.initializer)),
        "casts": sum(n.op_type == "Cast" for n in proto.graph.node),
        "custom_ops": dict(custom),
        "functions": [f"{f.domain}::{f.name}" for f in proto.functions],
        "tensorrt_rtx": _rtx_parse(path),
        "openvino": _openvino_read(path),
    }


def _value_info(value) -> dict:
    import onnx

    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in value.type.tensor_type.shape.dim]
    return {"name": value.name, "shape": dims, "dtype": onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name}


def _rtx_parse(path: Path) -> dict:
    """What TensorRT-RTX's ONNX parser makes of the graph (through Polygraphy's loader)."""
    from deploykit._lazy import is_available
    from deploykit.runners.table import TENSORRT_RTX

    if not is_available(TENSORRT_RTX.module):
        return {"parsed": None, "note": f"{TENSORRT_RTX.module} is not installed (pip install 'deploykit[{TENSORRT_RTX.tag}]')"}
    from deploykit.backends._polygraphy import TrtMessages, backend, summarise

    pg = backend(TENSORRT_RTX.module)
    with TrtMessages("TensorRT-RTX parse", log=None) as messages:
        try:
            with messages.failing_as("TensorRT-RTX could not parse the graph"):
                _, network, _ = pg.NetworkFromOnnxPath(str(path), strongly_typed=True)()
        except DeployKitError as err:
            return {"parsed": False, "errors": messages.errors or [str(err)]}
        warnings = summarise(messages.warnings, hint="")
        layers = Counter(str(network.get_layer(i).type).split(".")[-1] for i in range(network.num_layers))
    return {"parsed": True, "layers": network.num_layers, "layer_types": dict(layers.most_common()), "warnings": warnings}


def _openvino_read(path: Path) -> dict:
    """What OpenVINO's ONNX reader makes of the graph: its op types, and the ops a bf16 hint keeps in f32."""
    from deploykit._lazy import is_available, lazy_import

    if not is_available("openvino"):
        return {"read": None, "note": "openvino is not installed (pip install 'deploykit[openvino]')"}
    from deploykit.backends.openvino import openvino_source
    from deploykit.backends.openvino_marks import keep_fp32

    try:
        source = openvino_source(path, "bf16")
        model = lazy_import("openvino").Core().read_model(source.graph)
    except (DeployKitError, RuntimeError) as err:  # OpenVINO raises RuntimeError for a graph it cannot convert
        return {"read": False, "error": one_line(err)}
    ops = Counter(op.get_type_name() for op in model.get_ops())
    return {
        "read": True,
        "ops": sum(ops.values()),
        "op_types": dict(ops.most_common()),
        "kept_f32_under_bf16_hint": len(keep_fp32(model, source.fp32)),
    }


def inspect_engine(path: Path) -> dict:
    """Fingerprint, profile shapes and (with a GPU) layers and their precisions of one engine."""
    from deploykit.backends.engine_cache import read_fingerprint
    from deploykit.errors import StaleEngineError
    from deploykit.runners.table import engine_flavours

    info: dict = {"kind": "engine", "path": str(path), "bytes": path.stat().st_size}
    installed: list[str] = []  # plugin packages to load before the engine deserializes
    try:
        record = read_fingerprint(path.with_suffix(".json"))
    except StaleEngineError as err:
        info["fingerprint"] = None
        info["note"] = str(err)
        tag = path.suffixes[-2].lstrip(".") if len(path.suffixes) > 1 else ""
        module = engine_flavours()[tag].module if tag in engine_flavours() else None
    else:
        from deploykit.export.manifest import sha256_file

        info.update(
            fingerprint=record.fingerprint.to_dict(),
            plugins=record.plugins,
            plugin_layers=record.plugin_layers,
            matches_fingerprint=sha256_file(path) == record.engine_sha256,
            profile_shapes=record.fingerprint.shapes,
            profiles=[[list(shape) for shape in profile] for profile in record.profiles],  # every optimization profile
            lean_runtime=record.lean_runtime,
            # a weight-stripped engine's refit graph and the one weights file it shares (None: it carries its weights)
            shared_weights=record.shared_weights.to_dict() if record.shared_weights is not None else None,
        )
        # Plugins whose kernels the engine carries need loading no more than TensorRT needs them.
        module, installed = record.fingerprint.module, [] if record.self_contained else record.installed_plugins
    if module is None:
        info["layers"] = {"note": "unknown TensorRT flavour (no fingerprint, and the name is not model_<res>.trt/.rtx.engine)"}
    else:
        info["layers"] = _engine_layers(path, module, installed)
    return info


def _engine_layers(path: Path, module: str, installed_plugins=()) -> dict:
    """Layers and their output precisions from TensorRT's engine inspector (needs a GPU to
    deserialize the engine, and the installed plugins it was built with, loaded first); a note
    saying why otherwise. ``plugin_layers`` counts the layers TensorRT ran as plugins."""
    from deploykit.backends._polygraphy import TrtMessages, backend, import_trt
    from deploykit.backends.plugins import Plugins

    try:
        pg, trt = backend(module), import_trt(module)
        Plugins.resolve(installed_plugins or ()).load(module)
        with TrtMessages(f"{module} engine inspector", log=logging.getLogger(__name__)) as messages:
            with messages.failing_as("cannot deserialize the engine here", DeployKitError):
                engine = pg.EngineFromBytes(path.read_bytes())()
    except DeployKitError as err:
        return {"note": f"layers unavailable: {err} (the engine inspector needs a CUDA GPU and the engine's plugins)"}
    inspector = engine.create_engine_inspector()
    layers = []
    for i in range(engine.num_layers):
        layer = json.loads(inspector.get_layer_information(i, trt.LayerInformationFormat.JSON))
        if not isinstance(layer, dict):  # built without detailed profiling verbosity: the name only
            layer = {"Name": layer}
        outputs = [_precision(o) for o in layer.get("Outputs", [])]
        layers.append({"name": layer.get("Name", "?"), "type": layer.get("LayerType", "?"), "outputs": outputs})
    return {"count": engine.num_layers, "plugin_layers": sum("Plugin" in str(layer["type"]) for layer in layers), "layers": layers}


def _precision(tensor: dict) -> str:
    """A layer output's data type and format as the engine inspector's JSON gives them: TensorRT
    11 (and TensorRT-RTX) split TensorRT 10's ``Format/Datatype`` into ``Datatype`` and
    ``Format`` (joined here as Polygraphy's ``inspect model`` joins them); ``?`` when neither."""
    if "Format/Datatype" in tensor:
        return tensor["Format/Datatype"]
    return " ".join(tensor[k] for k in ("Datatype", "Format") if tensor.get(k)) or "?"


def render(info: dict, indent: int = 0) -> list[str]:
    """Indented ``key: value`` lines for the terminal (nested dicts indented, lists one item a line)."""
    lines, pad = [], "  " * indent
    for key, value in info.items():
        if isinstance(value, dict) and value:
            lines += [f"{pad}{key}:", *render(value, indent + 1)]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            lines.append(f"{pad}{key}:")
            lines += [f"{pad}  - " + ", ".join(f"{k}={json.dumps(v)}" for k, v in item.items()) for item in value]
        else:
            lines.append(f"{pad}{key}: {value if isinstance(value, str) else json.dumps(value)}")
    return lines
