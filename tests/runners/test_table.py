"""The table of backends is the one place a backend's identity lives: no module compares a
backend's name (or a TensorRT flavour's module) as a string, and what is derived from the table
(``auto``'s order, the GPU backends, the engine backends, registry lookups) follows it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import deploykit
from deploykit.backends import defaults, registry
from deploykit.errors import ConfigError, DeployKitError
from deploykit.runners import table
from deploykit.runners.onnxrt import OnnxrtRunner

PACKAGE = Path(deploykit.__file__).parent
TABLE = PACKAGE / "backends" / "table.py"
# Every name a backend or a TensorRT flavour goes by.
NAMES = {*table.names(), *(f.module for f in table.FLAVOURS), *(f.tag for f in table.FLAVOURS)}


def _literals(node: ast.expr) -> list[str]:
    """The backend names ``node`` spells as string literals (itself, or a tuple/list/set of them)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and i.value in NAMES]


def name_branches(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every comparison with a backend name spelled as a string (``==``,
    ``!=``, ``in``, ``not in``), and of every dict that maps one such name to another (a
    flavour map written again; not a module to its extra of the same name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, name) for operand in (node.left, *node.comparators) for name in _literals(operand)]
        elif isinstance(node, ast.Dict):
            pairs = [
                (k, v)
                for k, v in zip(node.keys, node.values)
                if k is not None and _literals(k) and _literals(v) and _literals(v) != _literals(k)
            ]
            found += [(node.lineno, _literals(k)[0]) for k, _ in pairs]
    return found


def test_the_check_finds_name_branches():
    code = 'if backend == "ort": pass\nif m in ("tensorrt", "x"): pass\nTAGS = {"tensorrt": "trt"}\nok = device == "cuda"\n'
    code += 'EXTRAS = {"openvino": "openvino"}\n'
    assert name_branches(code) == [(1, "ort"), (2, "tensorrt"), (3, "tensorrt")]


def test_no_backend_name_is_branched_on_outside_the_table():
    branches = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != TABLE
        for line, name in name_branches(path.read_text())
    ]
    assert not branches, "compare a descriptor's field (deploykit.runners.table) instead:\n" + "\n".join(branches)


def test_every_reference_in_the_table_resolves():
    for backend in table.BACKENDS:
        for ref in (backend.runner, backend.bisect, backend.unavailable):
            assert ref is None or callable(table.resolve(ref)), (backend.name, ref)
    assert table.BASELINE in table.names((table.GRAPH,)) and table.find(table.REFERENCE).runs == table.MODEL


def test_engine_backends_and_their_flavours_come_from_the_table():
    assert defaults.ENGINE_BACKENDS == tuple(table.engine_flavours()) == tuple(f.tag for f in table.FLAVOURS)
    with pytest.raises(ValueError, match="unknown TensorRT module 'tensorrt_llm'; choose one of: tensorrt, tensorrt_rtx"):
        table.flavour("tensorrt_llm")


def test_a_backend_added_to_the_table_is_created_by_name(stand_in_backend):
    made = []
    stand_in_backend("stand-in", lambda path, options: made.append((path, options)) or "runner")
    assert registry.create_runner("stand-in", "model.onnx", allow_cpu_fallback=True) == "runner"
    assert made == [("model.onnx", registry.RunnerOptions(allow_cpu_fallback=True))]
    assert registry.create_bisect_runner("stand-in", "model.onnx", b"") is None  # no bisect factory: none
    with pytest.raises(ConfigError, match="unknown backend 'torch'"):  # runs the model, not a graph
        registry.create_runner("torch", "model.onnx")


def test_auto_tries_backends_in_the_table_s_order(good_export, monkeypatch):
    from deploykit.serve.pipeline import Pipeline

    tried = []

    def factory(name):
        def make(path):
            tried.append(name)
            if name != "ort":
                raise DeployKitError(f"{name} cannot run here")
            return OnnxrtRunner(path)

        return make

    factories = {name: factory(name) for name in ("ort", "trt", "rtx")}
    with Pipeline(good_export, factories=factories) as pipe:
        assert list(pipe.skipped[pipe.resolutions[0]]) == ["trt", "rtx"]
    assert tried[:3] == ["trt", "rtx", "ort"]
    # ONNX Runtime ranked first in the table: auto takes it without trying an engine.
    ranked = [dataclasses.replace(b, auto_rank=-1) if b.name == "ort" else b for b in table.BACKENDS]
    monkeypatch.setattr(table, "BACKENDS", tuple(ranked))
    tried.clear()
    with Pipeline(good_export, factories=factories) as pipe:
        assert pipe.skipped[pipe.resolutions[0]] == {}
    assert set(tried) == {"ort"}


def test_a_usable_gpu_backend_of_the_table_outranks_a_profiled_cpu_choice(good_export, stand_in_backend, monkeypatch, tmp_path):
    """The GPU backends serve looks for are the table's: a GPU backend added there, usable here,
    keeps a profiled CPU choice from being taken."""
    import json
    import shutil

    from deploykit.export.directory import CHOICE_FILE
    from deploykit.export.manifest import Manifest, sha256_file
    from deploykit.inputs.resolutions import resolution_tag
    from deploykit.serve.pipeline import Pipeline

    out = shutil.copytree(good_export, tmp_path / "exp")
    entry = Manifest.read(out).graphs_at("fp32")[0]
    choice = {"backend": "openvino", "precision": "fp32", "batch": 1, "p50_ms": 1.0, "graph_sha256": sha256_file(out / entry.file)}
    (out / CHOICE_FILE).write_text(json.dumps({"choices": {resolution_tag(tuple(entry.resolution)): [choice]}}))
    stand_in_backend("stand-in-gpu", lambda path, options: OnnxrtRunner(path), device=table.GPU)
    monkeypatch.setattr(registry, "available_backends", lambda: ["ort", "stand-in-gpu"])
    with Pipeline(out, factories={"ort": OnnxrtRunner, "openvino": OnnxrtRunner}) as pipe:
        assert pipe.backends[tuple(entry.resolution)] == "ort"
        assert "GPU backend stand-in-gpu usable: profiled CPU choice (openvino fp32) not taken" in pipe.describe_backends()[0]
