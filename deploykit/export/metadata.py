"""What deploykit records inside every graph it writes: one typed record, read and written here only.

An exported ONNX file carries its own description in ``metadata_props`` under ``deploykit.`` keys,
so a graph separated from its export directory still says what it is (the manifest is built from
it, ``inspect`` shows it, engine fingerprints and quantization read it). The keys and their text
encoding are the on-disk contract and do not change: ``deploykit.resolution`` is ``"[224, 224]"``,
``deploykit.precision`` is ``"int8"``. Fields a graph does not carry are ``None`` (or empty) here,
and are not written.

Torch-free (onnx and json only): export, backends, validate and inspection all read it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import onnx

from deploykit._fields import check_values, json_nesting, show
from deploykit.errors import DeployKitError, one_line

PREFIX = "deploykit."

# deploykit writes at most 6 levels (quantization → agreement → trials → trial → moved nodes); a
# graph's metadata nested deeper was not written by it, and Python's JSON reader would recurse
# once per level into a RecursionError. Sides bounded as the manifest bounds them.
MAX_NESTING = 12
MAX_SIDE = 1 << 16


def _object(value: Any) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {show(value)}")
    return value


def _shape(value: Any) -> tuple[int, ...]:
    """A resolution: 1 or 2 positive integers (``[224, 224]``, ``[128]``)."""
    if not (isinstance(value, list) and len(value) in (1, 2) and all(type(n) is int and 0 < n <= MAX_SIDE for n in value)):
        raise ValueError(f"expected 1 or 2 integers from 1 to {MAX_SIDE:,}, got {show(value)}")
    return tuple(value)


def _range(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``[min, max]``: two resolutions of one rank, min at most max on every side."""
    if not (isinstance(value, list) and len(value) == 2):
        raise ValueError(f"expected [min, max] resolutions, got {show(value)}")
    low, high = _shape(value[0]), _shape(value[1])
    if len(low) != len(high) or any(a > b for a, b in zip(low, high)):
        raise ValueError(f"expected min at most max, got {list(low)} and {list(high)}")
    return low, high


def _names(value: Any) -> tuple[str, ...]:
    if not (isinstance(value, list) and all(isinstance(name, str) for name in value)):
        raise TypeError(f"expected a list of strings, got {show(value)}")
    return tuple(value)


def _channel_order(value: Any) -> tuple[int, ...]:
    """A permutation of the channels (``export.qk_channels``): each index once."""
    if not (isinstance(value, list) and all(type(i) is int for i in value) and sorted(value) == list(range(len(value)))):
        raise ValueError(f"expected a permutation of 0 … n-1, got {show(value)}")
    return tuple(value)


def _count(low: int) -> Any:
    def read(value: Any) -> int:
        if type(value) is not int or not low <= value <= MAX_SIDE:
            raise ValueError(f"expected an integer from {low} to {MAX_SIDE:,}, got {show(value)}")
        return value

    return read


@dataclass(frozen=True)
class KeptFloat:
    """One node a quantized plan keeps float, and why.

    Attributes:
        module: its module path (``blocks.1.mlp.fc2``), ``""`` when the exporter named none.
        onnx: its ONNX node name.
        reason: ``policy`` (the selection's rule, in ``why``), ``pinned`` (``--keep-float``) or
            ``sensitivity`` (the fallback moved it back).
        why: the rule, the pattern, or its output error when int8 alone.
    """

    module: str
    onnx: str
    reason: str
    why: str = ""


@dataclass(frozen=True)
class QuantizationRecord:
    """What a quantized plan decided (``deploykit.quantization``): how it was calibrated, which nodes
    stayed float and why, and what the INT8 fallback measured. Written by the quantizers
    (``int8_static``, ``int8_dynamic``); fields a plan has no part of are None and not written.

    Attributes:
        plan: ``int8`` or ``int8-dynamic``.
        calibration: the calibration method (static plans).
        samples: calibration inputs.
        calibration_data: where they came from, in words.
        inputs: the calibration and held-out inputs' records (source, count, sha256), by role.
        attention_int8: the attention products were quantized too.
        untrained_weights: True when the weights look untrained (agreement then says little).
        sensitivity: the sensitivity pass: its measure, inputs and most sensitive nodes.
        agreement: the fallback's record: its target, the all-int8 and final metrics, its trials.
        quantized_nodes: how many nodes run int8.
        float_nodes: reason → the float nodes, as ``module (onnx)``.
        kept_float: every float node with its reason.
        qdq_type: the type the Q/DQ pairs quantize to (``int8``, ``float8e4m3fn``), for the GPU
            plans (``gpu_plans``) and a graph brought in; None: ``int8``'s.
        remainder: the type of what is not quantized (``fp16``, ``bf16``); None: fp32.
        source: who wrote the Q/DQ graph when deploykit did not (``import-plan``: its producer).
    """

    plan: str
    calibration: str | None = None
    samples: int | None = None
    calibration_data: str | None = None
    inputs: dict | None = None
    attention_int8: bool | None = None
    untrained_weights: bool | None = None
    sensitivity: dict | None = None
    agreement: dict | None = None
    quantized_nodes: int | None = None
    float_nodes: dict[str, list[str]] | None = None
    kept_float: tuple[KeptFloat, ...] = ()
    qdq_type: str | None = None
    remainder: str | None = None
    source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (graph metadata, the manifest): the fields set, in this order."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "kept_float":
                value = [dataclasses.asdict(entry) for entry in value]
            if value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> QuantizationRecord:
        """Read ``to_dict``'s form back (keys this version does not know are ignored), every field
        checked for the type ``to_dict`` writes before it is kept.

        Raises:
            TypeError, ConfigError: a field of another type than ``to_dict`` writes (names it).
        """
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in _object(record).items() if k in known}
        check_values(cls, {k: v for k, v in values.items() if k != "kept_float"})  # the str/int/bool fields
        for name in ("inputs", "sensitivity", "agreement", "float_nodes"):
            if values.get(name) is not None:
                _object(values[name])
        for nodes in (values.get("float_nodes") or {}).values():
            _names(nodes)
        kept = values.get("kept_float", [])
        if not isinstance(kept, (list, tuple)):
            raise TypeError(f"kept_float: expected a list, got {show(kept)}")
        for entry in kept:
            check_values(KeptFloat, _object(entry), prefix="kept_float.")
        values["kept_float"] = tuple(KeptFloat(**entry) for entry in kept)
        return cls(**values)


# How each field's text is read back: parsed as JSON, then checked and converted by its reader
# (integers are written as their digits, which JSON reads); any other field is the text as is.
_JSON_FIELDS = {
    "encoding_config": _object,
    "model_config": _object,
    "resolution": _shape,
    "resolution_range": _range,
    "patch_size": _count(1),
    "block_outputs": _names,
    "float_modules": _names,
    "qk_channel_order": _channel_order,
    "quantization": QuantizationRecord.from_dict,
    "fused_attention": _count(0),
}


@dataclass(frozen=True)
class GraphMetadata:
    """A graph's ``deploykit.*`` metadata.

    Attributes:
        version: the deploykit version that exported it.
        encoding: the positional encoding's name (``"wepe"``).
        encoding_config: the encoding's config as ``config_to_dict`` writes it.
        model_config: the trunk's config (``cfg.to_dict()``).
        resolution: the input resolution it was exported at (``(height, width)``, or
            ``(length,)`` for a sequence model); for a range, the shape it is tuned for.
        resolution_range: ``(min, max)`` of a resolution-range graph.
        patch_size: the patch size of image models.
        block_outputs: the tensor names of each transformer block's output (block order), for
            the first-divergent-block search.
        float_modules: module scopes (``model.blocks.0.pos``) every quantized plan keeps float.
        qk_channel_order: the channel order q and k are stored in when rotary pairs were made
            contiguous (``export.qk_channels``).
        precision: the precision plan (``"fp16"``, ``"int8"``); None in a graph that no plan
            has been applied to, which is fp32 (``plan``).
        quantization: a quantized plan's record: calibration, nodes kept float and why.
        fused_attention: how many attention cores a ``*-mha`` plan fused.
    """

    version: str | None = None
    encoding: str | None = None
    encoding_config: dict | None = None
    model_config: dict | None = None
    resolution: tuple[int, ...] | None = None
    resolution_range: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    patch_size: int | None = None
    block_outputs: tuple[str, ...] = ()
    float_modules: tuple[str, ...] = ()
    qk_channel_order: tuple[int, ...] | None = None
    precision: str | None = None
    quantization: QuantizationRecord | None = None
    fused_attention: int | None = None

    @property
    def plan(self) -> str:
        """The precision plan, ``"fp32"`` when none was recorded (graphs written before plans)."""
        return self.precision or "fp32"

    @classmethod
    def of(cls, proto: onnx.ModelProto) -> GraphMetadata:
        """The record in ``proto``; fields it does not carry keep their defaults.

        Raises:
            DeployKitError: a ``deploykit.*`` value that cannot be read (names the key).
        """
        return cls.from_props({p.key: p.value for p in proto.metadata_props})

    @classmethod
    def from_props(cls, props: Mapping[str, str]) -> GraphMetadata:
        """The record in a graph's metadata map (``onnx``'s ``metadata_props``, or ONNX Runtime's
        ``custom_metadata_map`` of a loaded session).

        Raises:
            DeployKitError: a ``deploykit.*`` value that cannot be read (names the key).
        """
        values = {}
        for f in dataclasses.fields(cls):
            key = PREFIX + f.name
            if key not in props:
                continue
            text = props[key]
            try:
                values[f.name] = _JSON_FIELDS[f.name](_json(text)) if f.name in _JSON_FIELDS else text
            except (TypeError, ValueError, DeployKitError) as err:  # JSONDecodeError is a ValueError
                raise DeployKitError(f"the graph's {key} metadata is not readable ({one_line(err, 160)})") from err
        return cls(**values)

    @classmethod
    def of_file(cls, path: str | os.PathLike) -> GraphMetadata:
        """The record of an ONNX file, read without its external weight files."""
        return cls.of(onnx.load(str(path), load_external_data=False))

    def props(self) -> dict[str, str]:
        """The ``metadata_props`` entries this record writes (fields left empty are absent)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, QuantizationRecord):
                out[PREFIX + f.name] = json.dumps(value.to_dict())
            elif f.name in _JSON_FIELDS:
                out[PREFIX + f.name] = json.dumps(value)  # tuples become lists
            else:
                out[PREFIX + f.name] = str(value)
        return out

    def write(self, proto: onnx.ModelProto) -> None:
        """Store this record in ``proto``: every field's key set, or removed where the field is
        empty; other metadata (another tool's, or ``deploykit.*`` keys this version does not
        know) is kept."""
        ours = {PREFIX + f.name for f in dataclasses.fields(self)}
        kept = {p.key: p.value for p in proto.metadata_props if p.key not in ours}
        del proto.metadata_props[:]
        onnx.helper.set_model_props(proto, {**kept, **self.props()})

    @classmethod
    def update(cls, proto: onnx.ModelProto, **changes: Any) -> GraphMetadata:
        """Change some fields of ``proto``'s record in place; returns the new record."""
        record = dataclasses.replace(cls.of(proto), **changes)
        record.write(proto)
        return record


def _json(text: str) -> Any:
    """``text`` parsed as JSON, its nesting bounded before the parser recurses into it."""
    if text.count("[") + text.count("{") > MAX_NESTING:  # the scan below is needed only then
        depth, _ = json_nesting(text)
        if depth > MAX_NESTING:
            raise ValueError(f"it nests {depth:,} levels deep; deploykit writes {MAX_NESTING} at most")
    return json.loads(text)


def copy_metadata(source: onnx.ModelProto, target: onnx.ModelProto) -> None:
    """Give ``target`` exactly ``source``'s model metadata (rewriters such as ONNX Runtime's
    quantizer keep it only partly)."""
    del target.metadata_props[:]
    target.metadata_props.extend(source.metadata_props)
