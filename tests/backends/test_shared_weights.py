"""One weight set for every resolution's weight-stripped engine (issue 54).

TensorRT-RTX's builder on this CPU host refuses refittable and stripped builds (Myelin needs
CUDA: ``test_engine_kinds.test_rtx_refuses_refittable_engines_on_a_cpu_host``), and
deserialising needs a GPU, so the engines' records here are the real ones ``current_fingerprint``
writes for a stripped build, beside stand-in engine bytes; everything else is real: the zoo
model's graphs at two resolutions, the weight set written from them, ONNX Runtime running the
refit graphs, and TensorRT-RTX's own ONNX parser reading them into networks whose weights are
named as each engine's refitter asks for them.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from deploykit.backends.build import share_weights
from deploykit.backends.devices import Device
from deploykit.backends.engine_cache import (
    EngineFromPath,
    current_fingerprint,
    engine_paths,
    read_fingerprint,
    write_fingerprint,
)
from deploykit.backends.shared_weights import INLINE_BYTES, write_weight_set
from deploykit.backends.tensorrt import BuildOptions
from deploykit.errors import DeployKitError, StaleEngineError
from deploykit.export.directory import ExportDir, refit_graph_file, shared_weights_file
from deploykit.export.manifest import sha256_file
from deploykit.export.metadata import GraphMetadata

RESOLUTIONS = (32, 48)
RTX_4090 = Device("13.0", "580.65", "NVIDIA GeForce RTX 4090", "8.9")


@pytest.fixture
def export_copy(zoo_ape_export, tmp_path) -> Path:
    return shutil.copytree(zoo_ape_export, tmp_path / "exp")


def _graphs(export_dir: Path) -> list[Path]:
    return [export_dir / f"model_{r}.onnx" for r in RESOLUTIONS]


def _initializers(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t, base_dir=str(path.parent)) for t in onnx.load(str(path)).graph.initializer}


def _external(path: Path) -> dict[str, dict[str, str]]:
    """Each initializer's external-data entries, as the refit graph stores them (no data loaded)."""
    proto = onnx.load(str(path), load_external_data=False)
    return {t.name: {e.key: e.value for e in t.external_data} for t in proto.graph.initializer}


def test_the_weight_set_holds_each_distinct_initializer_once(export_copy):
    graphs = _graphs(export_copy)
    written = write_weight_set(graphs, "rtx")
    weights = shared_weights_file(export_copy, "rtx")
    assert written.weights == weights and set(written.engines) == set(graphs)
    # The size it claims is the file's, and it is what the graphs hold, each distinct tensor once.
    per_graph = [_initializers(g) for g in graphs]
    distinct = {a.tobytes() for tensors in per_graph for a in tensors.values() if a.nbytes >= INLINE_BYTES}
    assert weights.stat().st_size == written.stored_bytes == sum(len(b) for b in distinct)
    assert written.graph_bytes == sum(a.nbytes for tensors in per_graph for a in tensors.values())
    # What both resolutions hold alike (every parameter of the model) has one place in the one file;
    # what differs (the positional table baked for each resolution, shape constants) has its own.
    refit = [_external(refit_graph_file(g, "rtx")) for g in graphs]
    same = {n for n in per_graph[0] if np.array_equal(per_graph[0][n], per_graph[1][n])}
    assert {n for n in per_graph[0] if n.startswith("model.")} <= same and "pe_tables.pos_embed" not in same
    assert all(refit[0][n] == refit[1][n] for n in same)
    assert all(refit[0][n]["offset"] != refit[1][n]["offset"] for n in set(per_graph[0]) - same if refit[0][n])
    assert written.stored_bytes < written.graph_bytes * 0.51
    for graph, entries in zip(graphs, refit):
        # every tensor but the smallest (shape operands, which ONNX Runtime needs inline) is in the one file
        big = {n for n, a in per_graph[graphs.index(graph)].items() if a.nbytes >= INLINE_BYTES}
        assert {n for n, e in entries.items() if e} == big and {e["location"] for e in entries.values() if e} == {weights.name}
        assert refit_graph_file(graph, "rtx").stat().st_size < written.stored_bytes / 10
        # read back through the one file, each tensor is the exported graph's
        got, want = _initializers(refit_graph_file(graph, "rtx")), _initializers(graph)
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_onnx_runtime_runs_each_refit_graph_as_its_graph(export_copy):
    import onnxruntime as ort

    graphs = _graphs(export_copy)
    write_weight_set(graphs, "rtx")
    rng = np.random.default_rng(0)
    for graph, res in zip(graphs, RESOLUTIONS):
        images = rng.standard_normal((2, 3, res, res)).astype(np.float32)
        run = [
            ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"images": images})[0]
            for p in (graph, refit_graph_file(graph, "rtx"))
        ]
        np.testing.assert_array_equal(run[1], run[0])


def test_tensorrt_rtx_parses_each_refit_graph_from_the_one_file_with_the_weights_its_refitter_names(export_copy):
    """TensorRT names a parsed network's weights after the ONNX initializers, and its refitter
    asks for them by those names (``Refitter.get_all_weights``, after deserialising: GPU): every
    tensor of each refit graph held in the one weights file is a weight of the network
    TensorRT-RTX's parser makes of it, read through that file (``mark_weights_refittable`` is
    True only for a weight the network has)."""
    import tensorrt_rtx as trt

    graphs = _graphs(export_copy)
    write_weight_set(graphs, "rtx")
    logger = trt.Logger(trt.Logger.INTERNAL_ERROR)
    for graph in graphs:
        refit = refit_graph_file(graph, "rtx")
        network = trt.Builder(logger).create_network(0)
        parser = trt.OnnxParser(network, logger)
        assert parser.parse_from_file(str(refit)), [str(parser.get_error(i)) for i in range(parser.num_errors)]
        # every tensor in the one file is a weight of the network (a scalar the parser folds is not: it stays inline)
        names = [n for n, entries in _external(refit).items() if entries]
        assert names and [network.mark_weights_refittable(n) for n in names] == [True] * len(names)
        assert not network.mark_weights_refittable("model.blocks.9.attn.qkv.weight")


def _stripped_records(export_dir: Path, module: str = "tensorrt_rtx", strip=(True, True)) -> list[Path]:
    """Each graph's record as a stripped build of it writes it, beside stand-in engine bytes."""
    plain = BuildOptions(module=module, compute_capabilities=("8.9",), optimization_level=0)
    options = dataclasses.replace(plain, refittable=True, strip_weights=True)
    paths = []
    for graph, stripped in zip(_graphs(export_dir), strip):
        opts = options if stripped else plain
        shapes = {"images": [[4, 3, int(graph.stem.split("_")[1]), int(graph.stem.split("_")[1])]] * 3}
        fingerprint = current_fingerprint(graph, GraphMetadata.of_file(graph), shapes, opts, device=RTX_4090)
        engine, fp_path = engine_paths(graph, module)
        engine.write_bytes(b"serialized engine of " + graph.name.encode())
        write_fingerprint(fp_path, fingerprint, sha256_file(engine))
        paths.append(fp_path)
    return paths


def test_build_records_the_one_weight_set_and_the_runner_refits_from_it(export_copy):
    from deploykit.backends.trt_runner import engine_runner

    records = _stripped_records(export_copy)
    written = share_weights(export_copy, "tensorrt_rtx")
    assert written is not None and set(written.engines) == set(_graphs(export_copy))
    weights = shared_weights_file(export_copy, "rtx")
    for graph, fp_path in zip(_graphs(export_copy), records):
        shared = read_fingerprint(fp_path).shared_weights
        assert (shared.weights, shared.weights_sha256) == (weights.name, sha256_file(weights))
        assert shared.refit_graph_sha256 == sha256_file(refit_graph_file(graph, "rtx"))
        runner = engine_runner(graph, "tensorrt_rtx", device=RTX_4090)
        assert runner.refit_from == refit_graph_file(graph, "rtx")  # not the graph: one weight set for both
        assert EngineFromPath(graph, "tensorrt_rtx", device=RTX_4090)() == engine_paths(graph, "tensorrt_rtx")[0].read_bytes()
    assert ExportDir(export_copy).foreign_files() == []  # a re-export knows them as deploykit's
    from deploykit.backends.inspection import inspect_path

    assert (
        inspect_path(engine_paths(_graphs(export_copy)[1], "tensorrt_rtx")[0])["shared_weights"] == shared.to_dict()
    )  # deploykit inspect says so
    # A weight set changed since (edited, or written again by hand) is refused before the engine is loaded.
    with weights.open("r+b") as f:
        f.write(b"\0\0\0\0")
    with pytest.raises(StaleEngineError, match=r"model.rtx.weights changed since the weight-stripped engine's weight set was written"):
        EngineFromPath(_graphs(export_copy)[0], "tensorrt_rtx", device=RTX_4090)()


def test_only_stripped_engines_share_the_weight_set(export_copy):
    from deploykit.backends.trt_runner import engine_runner

    records = _stripped_records(export_copy, strip=(False, True))
    written = share_weights(export_copy, "tensorrt_rtx")
    assert list(written.engines) == [_graphs(export_copy)[1]]
    assert read_fingerprint(records[0]).shared_weights is None and not refit_graph_file(_graphs(export_copy)[0], "rtx").exists()
    assert engine_runner(_graphs(export_copy)[0], "tensorrt_rtx", device=RTX_4090).refit_from is None


def test_package_triton_refuses_a_weight_stripped_engine(export_copy, tmp_path):
    """Triton's TensorRT backend deserialises an engine as it is: a stripped one would run with
    no weights, so packaging it is refused in one line."""
    from deploykit.serve.triton_repo import RepositoryOptions, package_triton

    _stripped_records(export_copy, module="tensorrt_rtx")
    for graph in _graphs(export_copy):  # the TensorRT engine Triton would load: the same record, as TensorRT's
        rtx_engine, rtx_fp = engine_paths(graph, "tensorrt_rtx")
        engine, fp_path = engine_paths(graph, "tensorrt")
        shutil.copyfile(rtx_engine, engine)
        shutil.copyfile(rtx_fp, fp_path)
    with pytest.raises(
        DeployKitError, match=r"^model_\d+.trt.engine is weight-stripped .*, or serve it with deploykit serve, which refits it$"
    ):
        package_triton(export_copy, tmp_path / "repo", RepositoryOptions())
    assert not (tmp_path / "repo").exists()


def test_the_debug_engine_of_a_stripped_engine_is_built_with_its_weights(export_copy):
    """``validate --debug`` builds a debug engine with the recorded engine's settings; nothing refits
    it, so it is built with its weights (before, the stripped record's STRIP_PLAN went with it:
    TensorRT-RTX's real builder refused it here, and on a GPU it would have run without weights)."""
    from deploykit.backends.trt_runner import debug_engine_runner

    _stripped_records(export_copy)
    graph = _graphs(export_copy)[0]
    runner = debug_engine_runner(graph, graph.read_bytes(), "tensorrt_rtx", device=RTX_4090)
    assert runner.refit_from is None and len(runner.engine()) > 0  # TensorRT-RTX's real builder, on this CPU


def test_a_later_build_of_another_resolution_joins_the_one_weight_set(export_copy):
    """``build --strip-weights -r 32``, then ``-r 48``: the second writes the weight set over both
    engines and names it in the first one's record too, which still loads."""
    first = _stripped_records(export_copy, strip=(True, False))[0]
    share_weights(export_copy, "tensorrt_rtx")
    alone, kept = read_fingerprint(first).shared_weights, first.read_text()
    _stripped_records(export_copy, strip=(True, True))  # the 48 px engine built stripped later
    first.write_text(kept)  # the 32 px engine's record as the first build left it (naming the weight set of 32 px alone)
    written = share_weights(export_copy, "tensorrt_rtx")
    assert set(written.engines) == set(_graphs(export_copy))
    joined = read_fingerprint(first).shared_weights
    assert joined.weights == alone.weights and joined.weights_sha256 != alone.weights_sha256
    for graph in _graphs(export_copy):
        EngineFromPath(graph, "tensorrt_rtx", device=RTX_4090)()  # neither refused as changed since
