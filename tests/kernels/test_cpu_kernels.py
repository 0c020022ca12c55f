"""deploykit's compiled SaPE2Distance kernel for the CPU runtimes (``deploykit.kernels``):
the op against float64 direct distances, each runner's split graph (ONNX Runtime's custom-op
library, OpenVINO's extension) against the function body and PyTorch, and the fallback when no
kernel can be built."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from deploykit import kernels as cpu_kernels
from deploykit.graph.plugin_nodes import mark_plugin_nodes
from deploykit.runners.onnxrt import CPU, OnnxrtRunner


@pytest.fixture(scope="module")
def library():
    built = cpu_kernels.compiled_library()
    assert built.path is not None, f"the kernel does not build here: {built.reason}"  # a compiler is part of CI's image
    return built.path


def _direct(zx: np.ndarray, zy: np.ndarray, prefix: int) -> np.ndarray:
    """Eq. 15 in float64, one difference at a time: the reference every form is judged against."""
    b, h, n, _ = zx.shape
    out = np.zeros((b, h, prefix + n, prefix + n))
    for z in (zx.astype(np.float64), zy.astype(np.float64)):
        out[:, :, prefix:, prefix:] += np.sqrt(((z[:, :, :, None, :] - z[:, :, None, :, :]) ** 2).sum(-1))
    return out


@pytest.mark.parametrize(
    "batch, heads, grid, prefix",
    [
        ((1, 3, (14, 14), 1)),  # ViT at 224 / 16: N = 196, not a multiple of the 32-token tile
        ((2, 2, (7, 31), 0)),  # non-square, no prefix token
        ((1, 2, (5, 3), 5)),  # registers: several prefix tokens
        ((1, 1, (1, 1), 1)),  # one patch
        ((1, 1, (16, 16), 0)),  # whole tiles only
    ],
)
def test_the_kernel_equals_float64_direct_distances_with_exact_zeros_and_symmetry(library, batch, heads, grid, prefix):
    rows, cols = grid
    rng = np.random.default_rng(rows * cols)
    zx = rng.standard_normal((batch, heads, rows * cols, cols)).astype(np.float32)
    zy = rng.standard_normal((batch, heads, rows * cols, rows)).astype(np.float32) * 30  # another scale per axis
    if rows * cols > 4:  # a flat region: tokens 1 and 4 share both signatures
        zx[:, :, 4], zy[:, :, 4] = zx[:, :, 1], zy[:, :, 1]
    got = cpu_kernels.distances(library, zx, zy, prefix)
    want = _direct(zx, zy, prefix)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-6 * want.max()
    assert np.array_equal(got, got.transpose(0, 1, 3, 2))  # exactly symmetric
    assert not np.diagonal(got, axis1=2, axis2=3).any()  # the diagonal is exactly 0
    assert not got[:, :, :prefix].any() and not got[:, :, :, :prefix].any()  # prefix rows and columns 0
    if rows * cols > 4:
        assert not got[:, :, prefix + 1, prefix + 4].any() and not got[:, :, prefix + 4, prefix + 1].any()


@pytest.mark.parametrize("lanes", [8, 16])
def test_both_vector_widths_equal_float64_whichever_this_cpu_picks(tmp_path, lanes):
    """The kernel's vectors are 16 floats under AVX-512 and 8 otherwise (its tiles 32 or 16 tokens):
    each width, built here whatever the CPU, gives the direct distances, N not a multiple of either tile."""
    import subprocess

    compiler = cpu_kernels._compiler()
    assert compiler, "no C compiler"
    library = tmp_path / f"lanes{lanes}.so"
    command = [compiler, *cpu_kernels.FLAGS, f"-DLANES={lanes}", str(cpu_kernels.SOURCE), "-o", str(library), "-lm", "-lpthread"]
    subprocess.run(command, check=True, capture_output=True)
    rng = np.random.default_rng(lanes)
    zx = rng.standard_normal((1, 2, 9 * 7, 7)).astype(np.float32)
    zy = rng.standard_normal((1, 2, 9 * 7, 9)).astype(np.float32)
    want = _direct(zx, zy, 1)
    got = cpu_kernels.distances(library, zx, zy, 1)
    assert np.abs(got - want).max() <= 1e-6 * want.max() and np.array_equal(got, got.transpose(0, 1, 3, 2))


@pytest.mark.parametrize(
    "grid, prefix, d, table, mode, table_std",
    [
        ((14, 14), 1, 64, 64, 1, 1.0),  # ViT-S at 224, the paper's mode
        ((7, 31), 0, 12, 16, 0, 1.0),  # non-square, d not a whole vector, M < W: positions clamp to M - 1
        ((5, 3), 5, 32, 8, 2, 0.02),  # registers, k_swap, small tables as trained ones start
        ((1, 1), 1, 8, 4, 1, 1.0),  # one patch
    ],
)
def test_the_signature_kernel_equals_float64_pytorch_in_every_mode(library, grid, prefix, d, table, mode, table_std):
    """deploykit::SaPE2Signatures (Eq. 9-14 in C, its exp a polynomial) against the float64
    reference PyTorch computes, within 1e-5 of the largest signature."""
    import torch

    from deploykit.encodings.sape2 import MODES, sape2_axis_signatures

    rows, cols = grid
    rng = np.random.default_rng(rows * cols + d)
    q, k = (rng.standard_normal((2, 3, prefix + rows * cols, d)).astype(np.float32) for _ in range(2))
    tx, ty = ((rng.standard_normal((d, table)) * table_std).astype(np.float32) for _ in range(2))
    got = cpu_kernels.signatures(library, q, k, tx, ty, rows, cols, prefix, 0.6, mode)
    as64 = [torch.from_numpy(a).double() for a in (q[:, :, prefix:], k[:, :, prefix:], tx, ty)]
    want = sape2_axis_signatures(*as64, grid, 0.6, MODES[mode])
    if table < max(grid):  # control: the case reaches the clamp
        assert (torch.sigmoid(0.6 * as64[0] @ as64[1].transpose(-1, -2)).sum(-1) > table - 1).any()
    for z, w in zip(got, want, strict=True):
        assert z.shape == tuple(w.shape) and np.abs(z - w.numpy()).max() <= 1e-5 * np.abs(w.numpy()).max()


def test_the_runner_computes_signatures_in_the_kernel_only_where_their_inputs_are_fp32(library):
    """A SaPE2AxisSignatures node with fp32 inputs becomes the library's SaPE2Signatures; one with
    an fp16 input keeps its function (the kernel reads fp32 only)."""
    from onnx import TensorProto, helper

    from deploykit.export.custom_ops import function_proto
    from deploykit.graph.plugin_nodes import compile_signatures

    attrs = {"grid_h": 2, "grid_w": 2, "num_prefix_tokens": 1, "scale": 1.0, "mode": 1}
    node = helper.make_node("SaPE2AxisSignatures", ["q", "k", "tx", "ty"], ["zx", "zy"], domain="deploykit", **attrs)
    for dtype, changes in ((TensorProto.FLOAT16, 0), (TensorProto.FLOAT, 1)):  # the fp32 graph is the control
        inputs = [helper.make_tensor_value_info(n, dtype, [1, 1, 5, 4]) for n in ("q", "k")]
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 3]) for n in ("tx", "ty")]
        outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("zx", "zy")]
        model = helper.make_model(
            helper.make_graph([node], "g", inputs, outputs),
            opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("deploykit", 1)],
            functions=[function_proto(("deploykit", "SaPE2AxisSignatures"))],
        )
        assert compile_signatures(model) == changes
        assert model.graph.node[0].op_type == ("SaPE2AxisSignatures" if changes == 0 else "SaPE2Signatures")
        assert len(model.functions) == 1 - changes  # the function goes once nothing calls it


def _distance_graph(grid_h: int, grid_w: int, prefix: int, zx_shape, zy_shape) -> bytes:
    node = onnx.helper.make_node(
        "SaPE2Distance", ["zx", "zy"], ["d"], domain="deploykit", grid_h=grid_h, grid_w=grid_w, num_prefix_tokens=prefix
    )
    graph = onnx.helper.make_graph(
        [node],
        "g",
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s) for n, s in (("zx", zx_shape), ("zy", zy_shape))],
        [onnx.helper.make_tensor_value_info("d", onnx.TensorProto.FLOAT, None)],
    )
    opsets = [onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid("deploykit", 1)]
    return onnx.helper.make_model(graph, opset_imports=opsets).SerializeToString()


def test_the_op_refuses_signatures_that_do_not_fit_its_grid(library):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    # grid 4 x 3 says Zx is [.., 12, 3]; these signatures are [.., 12, 4]: an error, not a read past the buffer
    session = ort.InferenceSession(_distance_graph(4, 3, 1, None, None), options, providers=[CPU])
    zx, zy = np.zeros((1, 1, 12, 4), np.float32), np.zeros((1, 1, 12, 4), np.float32)
    with pytest.raises(Exception, match="Zx must be"):
        session.run(None, {"zx": zx, "zy": zy})
    good = session.run(None, {"zx": np.zeros((1, 1, 12, 3), np.float32), "zy": zy})[0]
    assert good.shape == (1, 1, 13, 13) and not good.any()  # control: the same session runs signatures that fit


def test_the_op_adds_the_logits_it_is_given_where_they_fit(library):
    """The third input: logits + distances in one fp32 addition (what ONNX Runtime's Add gives, to
    the bit), the logits alone in prefix rows and columns; logits of another shape are an error."""
    import onnxruntime as ort

    model = onnx.load_from_string(_distance_graph(5, 3, 2, None, None))
    model.graph.node[0].input.append("logits")
    model.graph.input.append(onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=[CPU])
    rng = np.random.default_rng(3)
    zx, zy = rng.standard_normal((2, 3, 15, 3), dtype=np.float32), rng.standard_normal((2, 3, 15, 5), dtype=np.float32)
    logits = rng.standard_normal((2, 3, 17, 17), dtype=np.float32) * 10
    got = session.run(None, {"zx": zx, "zy": zy, "logits": logits})[0]
    assert np.array_equal(got, logits + cpu_kernels.distances(library, zx, zy, 2))
    assert np.array_equal(got[:, :, :2], logits[:, :, :2]) and np.array_equal(got[:, :, :, :2], logits[:, :, :, :2])
    with pytest.raises(Exception, match="logits must be"):
        session.run(None, {"zx": zx, "zy": zy, "logits": logits[:, :, :16, :16]})


@pytest.mark.parametrize("plan", ["fp32", "fp16"])
def test_onnx_runtime_s_form_folds_the_logits_add_into_the_kernel_and_equals_the_unfolded_split(encoding_export, library, plan):
    """On the export's graphs every block's distance node takes the logits and replaces their Add
    and CastLike (two fewer passes over [B, h, T, T]; the fp16 plan adds in fp32 too); its outputs
    equal the split graph's with ONNX Runtime's own Add to the bit."""
    import onnxruntime as ort

    from deploykit.graph.plugin_nodes import fold_logits_adds

    def session(model):
        options = ort.SessionOptions()
        options.register_custom_ops_library(str(library))
        return ort.InferenceSession(model.SerializeToString(), options, providers=[CPU])

    split = onnx.load(encoding_export("sape2") / ("model_64.onnx" if plan == "fp32" else f"model_64_{plan}.onnx"))
    mark_plugin_nodes(split, cpu_kernels.OPS)
    folded = onnx.ModelProto()
    folded.CopyFrom(split)
    blocks = sum(n.op_type == "SaPE2Distance" for n in split.graph.node)
    assert blocks > 1 and fold_logits_adds(folded) == blocks
    distances = [n for n in folded.graph.node if n.op_type == "SaPE2Distance"]
    assert all(len(n.input) == 3 for n in distances) and not [n for n in folded.graph.node if n.op_type == "CastLike"]
    assert len(folded.graph.node) == len(split.graph.node) - 2 * blocks
    images = np.random.default_rng(0).standard_normal((2, 3, 64, 64)).astype(np.float32)
    assert np.array_equal(session(folded).run(None, {"images": images})[0], session(split).run(None, {"images": images})[0])


def test_the_fold_keeps_the_cast_and_the_add_where_the_logits_are_not_fp32(library):
    """A bias added to fp16 logits keeps its CastLike and Add: the kernel adds in fp32 only."""
    from onnx import TensorProto, helper

    from deploykit.graph.plugin_nodes import fold_logits_adds

    nodes = [
        helper.make_node("SaPE2Distance", ["zx", "zy"], ["d"], domain="deploykit", grid_h=2, grid_w=2, num_prefix_tokens=0),
        helper.make_node("CastLike", ["d", "logits"], ["bias"]),
        helper.make_node("Add", ["logits", "bias"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("zx", TensorProto.FLOAT, [1, 1, 4, 2]),
        helper.make_tensor_value_info("zy", TensorProto.FLOAT, [1, 1, 4, 2]),
    ]
    for dtype, folds in ((TensorProto.FLOAT16, 0), (TensorProto.FLOAT, 1)):  # the fp32 graph is the control
        graph = helper.make_graph(nodes, "g", [*inputs, helper.make_tensor_value_info("logits", dtype, [1, 1, 4, 4])],
                                  [helper.make_tensor_value_info("y", dtype, None)])  # fmt: skip
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("deploykit", 1)])
        assert fold_logits_adds(model) == folds
        assert [n.op_type for n in model.graph.node] == (["SaPE2Distance", "CastLike", "Add"] if folds == 0 else ["SaPE2Distance"])


def _runner(runtime: str, graph, compiled: bool):
    from deploykit.backends.openvino import OpenvinoRunner

    if runtime == "onnxruntime":
        return OnnxrtRunner(graph, providers=[CPU], compiled_kernels=compiled)
    return OpenvinoRunner(graph, compiled_kernels=compiled)


@pytest.mark.parametrize("runtime, plan", [("onnxruntime", "fp32"), ("onnxruntime", "fp16"), ("openvino", "fp32")])
def test_each_cpu_runtime_runs_a_sape2_export_through_the_kernel_as_the_function_body_does(encoding_export, runtime, plan):
    """The export's own graph: the runner splits it, and the kernel's outputs equal the function
    body's (the runtime without deploykit) within fp32 rounding, at 1x and 2x."""
    import torch

    from tests.encoding_params import EXPORT_BASE, encoding_model

    model = encoding_model("sape2").eval()
    for size in (EXPORT_BASE, 2 * EXPORT_BASE):
        name = f"model_{size}.onnx" if plan == "fp32" else f"model_{size}_{plan}.onnx"
        graph = encoding_export("sape2") / name
        images = np.random.default_rng(size).standard_normal((2, 3, size, size)).astype(np.float32)
        with _runner(runtime, graph, True) as compiled, _runner(runtime, graph, False) as body:
            got, plain = (next(iter(r.infer({"images": images}).values())) for r in (compiled, body))
            assert "compiled" in compiled.info.kernels and "function body" in body.info.kernels
            assert "SaPE2Signatures" in compiled.info.kernels
        with torch.no_grad():
            want = model(torch.from_numpy(images)).numpy()
        scale = np.abs(want).max()
        assert np.abs(got.astype(np.float32) - plain.astype(np.float32)).max() <= (1e-5 if plan == "fp32" else 2e-2) * scale
        assert np.abs(got.astype(np.float32) - want).max() <= (1e-5 if plan == "fp32" else 2e-2) * scale


def test_the_split_graph_needs_the_kernel(encoding_export, library):
    """The runner's graph has no SaPE2Bias function left: without the library ONNX Runtime cannot
    load it, so a runner that says it ran the kernel cannot have run the function body instead."""
    import onnxruntime as ort

    model = onnx.load(encoding_export("sape2") / f"model_{64}.onnx")
    mark_plugin_nodes(model, cpu_kernels.OPS)
    assert not [f for f in model.functions if f.name == "SaPE2Bias"]
    with pytest.raises(Exception, match="SaPE2Distance"):
        ort.InferenceSession(model.SerializeToString(), providers=[CPU])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    assert ort.InferenceSession(model.SerializeToString(), options, providers=[CPU])  # control: with it, it loads


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("compiler", ["no-such-cc", "false"])
def test_without_a_working_compiler_the_runner_runs_the_function_body_and_says_why(
    encoding_export, monkeypatch, tmp_path, compiler, runtime
):
    monkeypatch.setenv("CC" if runtime == "onnxruntime" else "CXX", compiler)
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path))
    cpu_kernels.compiled_library.cache_clear()
    try:
        built = cpu_kernels.compiled_library(runtime)
        assert built.path is None and built.reason.count("\n") == 0
        assert ("compiler (no-such-cc) on PATH" in built.reason) if compiler == "no-such-cc" else ("false failed" in built.reason)
        graph = encoding_export("sape2") / "model_64.onnx"
        images = np.zeros((1, 3, 64, 64), np.float32)
        with _runner(runtime, graph, True) as runner:
            assert np.isfinite(next(iter(runner.infer({"images": images}).values()))).all()
            assert runner.info.kernels.startswith("deploykit::SaPE2Bias: ONNX function body") and built.reason in runner.info.kernels
    finally:
        cpu_kernels.compiled_library.cache_clear()


def test_a_build_is_reused_and_keyed_by_its_source(tmp_path, monkeypatch):
    compiler = cpu_kernels._compiler()
    assert compiler, "no C compiler"
    first = cpu_kernels.build(compiler, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build(compiler, tmp_path) == first and first.stat().st_mtime_ns == stamp  # not compiled again
    assert cpu_kernels.build(cpu_kernels._compiler("openvino"), tmp_path, "openvino") != first  # a library per runtime
    edited = tmp_path / "edited.c"
    edited.write_text(cpu_kernels.SOURCE.read_text() + "\n/* another source */\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", edited)
    assert cpu_kernels.build(compiler, tmp_path) != first  # another source, another library


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_graphs_without_deploykit_ops_are_left_as_they_are(good_export, runtime):
    with _runner(runtime, good_export / "model_32.onnx", True) as runner:
        assert runner.info.kernels == "" and "kernels" not in runner.info.to_dict()


def test_a_bf16_hint_keeps_the_function_body(encoding_export):
    """OpenVINO's bf16 plan keeps the op's body marked f32; the extension's op computes f32 only."""
    from deploykit.backends.openvino import OpenvinoRunner, cpu_capabilities

    if "BF16" not in cpu_capabilities():
        pytest.skip("this CPU has no native bf16")
    with OpenvinoRunner(encoding_export("sape2") / "model_64_bf16.onnx", precision_hint="bf16", compiled_kernels=True) as runner:
        assert "function body (a bf16 hint" in runner.info.kernels


def test_a_home_that_cannot_be_written_builds_in_a_private_temporary_folder(tmp_path, monkeypatch):
    blocked = tmp_path / "home-cache"
    blocked.write_text("a file where the cache folder would go")  # mkdir under it fails, even as root
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(blocked))
    monkeypatch.setattr(cpu_kernels.tempfile, "tempdir", str(tmp_path))
    chosen = cpu_kernels.cache_dir()
    assert chosen == tmp_path / f"deploykit-{os.getuid()}" / "cpu-kernels"
    assert chosen.parent.stat().st_mode & 0o777 == 0o700
    (tmp_path / f"deploykit-{os.getuid()}").chmod(0o777)  # a folder others can write is never used
    assert cpu_kernels.cache_dir() == blocked / "cpu-kernels"


def test_pytorch_s_cpu_op_uses_the_kernel_without_importing_onnx_runtime(tmp_path):
    """PyTorch's fp32 CPU op runs the kernel through its plain-buffer entries, checked with ctypes
    alone: a PyTorch-only caller never imports ONNX Runtime for it."""
    import subprocess
    import sys

    code = """
import sys, torch
import deploykit.encodings.sape2  # registers torch.ops.deploykit.sape2_bias
from deploykit import kernels as cpu_kernels
g = torch.Generator().manual_seed(0)
q, k = (torch.randn(1, 2, 1 + 12, 8, generator=g) for _ in range(2))
tx, ty = (torch.randn(8, 16, generator=g) for _ in range(2))
got = torch.ops.deploykit.sape2_bias(q, k, tx, ty, 3, 4, 1, 0.5, 1)
want = torch.ops.deploykit.sape2_bias(q.double(), k.double(), tx.double(), ty.double(), 3, 4, 1, 0.5, 1)
assert cpu_kernels.compiled_library("buffers").path is not None, cpu_kernels.compiled_library("buffers").reason
assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
print("onnxruntime" in sys.modules)
"""
    env = {**os.environ, "DEPLOYKIT_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False"]
