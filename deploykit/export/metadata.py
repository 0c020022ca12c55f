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

from deploykit.errors import DeployKitError

PREFIX = "deploykit."


def _range(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    low, high = value
    return tuple(low), tuple(high)


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
        """Read ``to_dict``'s form back (keys this version does not know are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in record.items() if k in known}
        values["kept_float"] = tuple(KeptFloat(**entry) for entry in record.get("kept_float", ()))
        return cls(**values)


# How each field's text is read back: JSON then the converter, an int, or (any other field) the text as is.
_JSON_FIELDS = {
    "encoding_config": dict,
    "model_config": dict,
    "resolution": tuple,
    "resolution_range": _range,
    "block_outputs": tuple,
    "float_modules": tuple,
    "qk_channel_order": tuple,
    "quantization": QuantizationRecord.from_dict,
}
_INT_FIELDS = frozenset({"patch_size", "fused_attention"})


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
                if f.name in _JSON_FIELDS:
                    values[f.name] = _JSON_FIELDS[f.name](json.loads(text))
                elif f.name in _INT_FIELDS:
                    values[f.name] = int(text)
                else:
                    values[f.name] = text
            except (TypeError, ValueError) as err:  # JSONDecodeError is a ValueError
                raise DeployKitError(f"the graph's {key} metadata is not readable ({type(err).__name__}: {str(err)[:80]})") from err
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


def copy_metadata(source: onnx.ModelProto, target: onnx.ModelProto) -> None:
    """Give ``target`` exactly ``source``'s model metadata (rewriters such as ONNX Runtime's
    quantizer keep it only partly)."""
    del target.metadata_props[:]
    target.metadata_props.extend(source.metadata_props)
