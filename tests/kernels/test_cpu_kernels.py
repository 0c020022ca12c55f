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
