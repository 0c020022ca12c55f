"""The graph metadata contract (``deploykit.export.metadata``): the ``deploykit.*`` text a graph
carries, as earlier deploykit versions wrote it, reads into typed fields and writes back to the
same text; other metadata survives; an unreadable value is named; and no module outside the
metadata module spells a ``deploykit.*`` key."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import onnx
import pytest

import deploykit
from deploykit.errors import DeployKitError
from deploykit.export.metadata import GraphMetadata, QuantizationRecord
from tests.test_cli import run_cli

# As an exported int8 graph of a resolution range carried them (text typed out here, not produced
# by the module under test).
WRITTEN = {
    "deploykit.version": "0.9.0",
    "deploykit.encoding": "gridpe",
    "deploykit.encoding_config": '{"name": "gridpe", "num_scales": 4}',
    "deploykit.model_config": '{"depth": 2, "embed_dim": 64}',
    "deploykit.resolution": "[224, 192]",
    "deploykit.resolution_range": "[[128, 128], [384, 384]]",
    "deploykit.patch_size": "16",
    "deploykit.block_outputs": '["add_3", "add_7"]',
    "deploykit.float_modules": '["model.pos"]',
    "deploykit.precision": "int8",
    "deploykit.quantization": '{"plan": "int8", "kept_float": []}',
}


def graph(props: dict[str, str]) -> onnx.ModelProto:
    proto = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    onnx.helper.set_model_props(proto, props)
    return proto


def test_written_text_reads_into_typed_fields():
    meta = GraphMetadata.of(graph(WRITTEN))
    assert meta.resolution == (224, 192) and meta.resolution_range == ((128, 128), (384, 384))
    assert meta.patch_size == 16 and meta.encoding == "gridpe" and meta.encoding_config["num_scales"] == 4
    assert meta.block_outputs == ("add_3", "add_7") and meta.float_modules == ("model.pos",)
    assert meta.plan == "int8" and meta.quantization == QuantizationRecord(plan="int8")
    assert meta.qk_channel_order is None and meta.fused_attention is None


def test_write_gives_back_the_same_text_and_keeps_foreign_metadata():
    foreign = {"author": "someone", "deploykit.from_a_later_version": "kept"}
    proto = graph({**WRITTEN, **foreign})
    GraphMetadata.of(proto).write(proto)
    assert {p.key: p.value for p in proto.metadata_props} == {**WRITTEN, **foreign}


def test_update_changes_only_the_named_field_and_removes_emptied_ones():
    proto = graph(WRITTEN)
    GraphMetadata.update(proto, precision="fp16", quantization=None, fused_attention=12)
    props = {p.key: p.value for p in proto.metadata_props}
    expected = {k: v for k, v in WRITTEN.items() if k != "deploykit.quantization"}
    assert props == {**expected, "deploykit.precision": "fp16", "deploykit.fused_attention": "12"}


def test_a_graph_without_a_plan_is_fp32_and_one_from_elsewhere_has_no_resolution():
    meta = GraphMetadata.of(graph({"author": "someone"}))
    assert meta.plan == "fp32" and meta.precision is None and meta.resolution is None


@pytest.mark.parametrize(
    "key,text", [("deploykit.resolution", "[224,"), ("deploykit.patch_size", "sixteen"), ("deploykit.resolution_range", "[1]")]
)
def test_an_unreadable_value_is_named(key, text):
    with pytest.raises(DeployKitError, match=key.replace(".", r"\.")):
        GraphMetadata.of(graph({**WRITTEN, key: text}))


def _modules() -> set[str]:
    root = Path(deploykit.__file__).parent
    return {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__") for p in root.rglob("*.py")}


def test_no_metadata_key_is_spelled_outside_the_metadata_module():
    """Any ``"deploykit.…"`` string in the package is a module name (the lazy-import tables), a
    ``"module:attribute"`` reference (the table of backends) or the plugin entry-point group;
    metadata keys live in ``deploykit/export/metadata.py`` only."""
    root = Path(deploykit.__file__).parent
    modules, found = _modules(), []
    for path in root.rglob("*.py"):
        if path.name == "metadata.py" and path.parent.name == "export":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("deploykit."):
                if node.value.partition(":")[0] not in modules and node.value != "deploykit.plugins":
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value}")
    assert not found, found


def test_a_quantization_record_reads_into_types_and_writes_back_the_same_text():
    text = (
        '{"plan": "int8", "calibration": "minmax", "samples": 8, "calibration_data": "8 bundled sample images", '
        '"attention_int8": false, "agreement": {"target": {"held_out": 4, "min_agreement": 0.995}, "met": true}, '
        '"quantized_nodes": 3, "float_nodes": {"pinned": ["blocks.0.mlp.fc2 (node_9)"]}, '
        '"kept_float": [{"module": "blocks.0.mlp.fc2", "onnx": "node_9", "reason": "pinned", "why": "--keep-float blocks.0.*"}]}'
    )
    proto = graph({"deploykit.quantization": text})
    record = GraphMetadata.of(proto).quantization
    assert record.samples == 8 and record.attention_int8 is False and record.agreement["met"]
    assert record.kept_float[0].reason == "pinned" and record.kept_float[0].module == "blocks.0.mlp.fc2"
    assert record.untrained_weights is None and record.sensitivity is None  # absent: not written back
    GraphMetadata.of(proto).write(proto)
    assert {p.key: p.value for p in proto.metadata_props}["deploykit.quantization"] == text


# Item 7 of issue 52: values deploykit never writes, each of which was read as given (zero or
# fractional sides, numbers for names, a list read as a dict) or gave a traceback (an int for the
# quantization record; nesting past Python's recursion limit).
TAMPERED = {
    "resolution zero": ("deploykit.resolution", "[0, 0]", r"expected 1 or 2 integers from 1 to 65,536, got \[0, 0\]"),
    "resolution a fraction": ("deploykit.resolution", "[48.5, 48]", r"got \[48\.5, 48\]"),
    "resolution a boolean": ("deploykit.resolution", "[true, 48]", r"got \[true, 48\]"),
    "resolution a string": ("deploykit.resolution", '"x"', r"got 'x'"),
    "resolution nested deep": ("deploykit.resolution", "[" * 100_000 + "]" * 100_000, r"it nests 100,000 levels deep; deploykit writes 12"),
    "range min above max": ("deploykit.resolution_range", "[[384, 384], [128, 128]]", r"expected min at most max"),
    "config a list of pairs": ("deploykit.encoding_config", "[[1, 2]]", r"expected an object, got a list of 1 item"),
    "quantization a number": ("deploykit.quantization", "5", r"expected an object, got 5"),
    "quantization plan a number": ("deploykit.quantization", '{"plan": 5}', r"plan must be a string, got 5"),
    "kept float a number": ("deploykit.quantization", '{"plan": "int8", "kept_float": [5]}', r"expected an object, got 5"),
    "block outputs numbers": ("deploykit.block_outputs", "[1, 2]", r"expected a list of strings, got \[1, 2\]"),
    "patch size zero": ("deploykit.patch_size", "0", r"expected an integer from 1 to 65,536, got 0"),
    "channel order repeated": ("deploykit.qk_channel_order", "[0, 0]", r"expected a permutation"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_a_value_deploykit_never_writes_is_refused_in_one_line(case):
    key, text, expected = TAMPERED[case]
    with pytest.raises(DeployKitError, match=rf"^the graph's {re.escape(key)} metadata is not readable \(.*{expected}") as err:
        GraphMetadata.of(graph({**WRITTEN, key: text}))
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


def test_inspect_names_a_tampered_graph_in_one_error_line(tmp_path, capsys):
    path = tmp_path / "model_48.onnx"
    onnx.save(graph({**WRITTEN, "deploykit.resolution": "[" * 100_000 + "]" * 100_000}), path)
    code, stdout, stderr = run_cli(capsys, "inspect", path)
    assert code == 1 and stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1
    assert "deploykit.resolution metadata is not readable (it nests 100,000 levels deep" in stderr
