"""``deploykit package triton``: every generated config parses with Triton's own protobuf schema
and says what it should; the repository loads in PyTriton's bundled tritonserver where that
build has the model's backend (it ships the Python backend only)."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc.model_config_pb2 as model_config_pb2
from google.protobuf import text_format
from serve_reference import torch_preprocess
from server_process import free_ports, process_tree, stop, wait_until

from deploykit.backends.openvino import openvino_source
from deploykit.cli import main
from deploykit.errors import DeployKitError
from deploykit.inputs.builtin import sample_images
from deploykit.inputs.imaging import Preprocessing
from deploykit.serve import defaults
from deploykit.serve.triton_repo import RepositoryOptions, package_triton
from tests.test_imaging import png_header_only

TAGS = ["32", "48"]


@pytest.fixture(scope="module")
def repo(export_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("repo") / "models"
    main_args = ["package", "triton", str(export_dir), "--output", str(out), "--max-batch-size", "8", "--preferred-batch-size", "4"]
    try:
        main(main_args)
    except SystemExit as exit_:
        assert exit_.code in (0, None)
    return out


def parse(path: Path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_the_repository_is_readable_by_the_server_user_as_a_plain_mkdir_would_make_it(repo):
    """Triton often runs as another user than the one who packaged: a 0700 repository (mkdtemp's
    mode, kept by the rename) would be unreadable to it."""
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(repo.stat().st_mode) == 0o777 & ~mask


def test_layout_and_every_config_parses(repo):
    expected = {
        f"{kind}_{tag}{suffix}"
        for tag in TAGS
        for kind, suffix in [
            ("vit", "_trt"),
            ("vit", "_onnx"),
            ("vit", "_openvino"),
            ("preprocess", ""),
            ("classify", "_trt"),
            ("classify", "_onnx"),
            ("classify", "_openvino"),
        ]
    }
    models = {p.name for p in repo.iterdir() if p.is_dir()}
    assert models == expected
    for name in models:
        config = parse(repo / name / "config.pbtxt")
        assert config.name == name
        assert config.max_batch_size == 8
        assert (repo / name / "1").is_dir()
    assert (repo / "vit_32_onnx/1/model.onnx").stat().st_size > 0
    import deploykit.inputs.imaging

    for tag in TAGS:  # the pipeline's own preprocessing travels with the model
        assert (repo / f"preprocess_{tag}/1/deploykit_imaging.py").read_bytes() == Path(deploykit.inputs.imaging.__file__).read_bytes()
    readme = (repo / "README.md").read_text()
    # No path to a plugin library that nothing builds: SaPE²'s plugin is Python; Triton gets the inlined op.
    assert "LD_PRELOAD" not in readme and "libdeploykit" not in readme and "without `--plugins`" in readme


@pytest.mark.parametrize("tag", TAGS)
def test_inference_models(repo, export_dir, tag):
    res = int(tag)
    trt, onnx_cfg = parse(repo / f"vit_{tag}_trt/config.pbtxt"), parse(repo / f"vit_{tag}_onnx/config.pbtxt")
    assert trt.platform == "tensorrt_plan" and onnx_cfg.platform == "onnxruntime_onnx"
    for config in (trt, onnx_cfg):
        assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("images", model_config_pb2.TYPE_FP32, [3, res, res])]
        assert [(o.name, list(o.dims)) for o in config.output] == [("logits", [10])]
        assert list(config.dynamic_batching.preferred_batch_size) == [4]
        assert config.dynamic_batching.max_queue_delay_microseconds == defaults.MAX_QUEUE_DELAY_US
        assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
        assert [w.batch_size for w in config.model_warmup] == [1, 4]
        assert all(w.inputs["images"].zero_data and list(w.inputs["images"].dims) == [3, res, res] for w in config.model_warmup)
    assert trt.optimization.cuda.graphs and [s.batch_size for s in trt.optimization.cuda.graph_spec] == [1, 4]
    assert not onnx_cfg.optimization.cuda.graphs
    manifest = json.loads((export_dir / "manifest.json").read_text())
    assert (repo / f"vit_{tag}_onnx/1/model.onnx").read_bytes() == (export_dir / f"model_{tag}.onnx").read_bytes()
    assert any(tuple(g["resolution"]) == (res, res) for g in manifest["graphs"])


@pytest.mark.parametrize("tag", TAGS)
def test_openvino_models_run_the_graph_on_cpu_with_an_explicit_f32_hint(repo, export_dir, tag):
    config = parse(repo / f"vit_{tag}_openvino/config.pbtxt")
    assert config.backend == "openvino" and config.default_model_filename == "model.onnx"
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert {k: v.string_value for k, v in config.parameters.items()} == {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
    assert [(i.name, list(i.dims)) for i in config.input] == [("images", [3, int(tag), int(tag)])]
    # What deploykit's OpenVINO runner reads (qkv as three products), computing the exported graph's logits.
    packaged, exported = repo / f"vit_{tag}_openvino/1/model.onnx", export_dir / f"model_{tag}.onnx"
    assert packaged.read_bytes() == openvino_source(exported, "f32").graph != exported.read_bytes()
    x = np.random.default_rng(0).standard_normal((2, 3, int(tag), int(tag))).astype(np.float32)
    logits = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0] for p in (packaged, exported)]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tag", TAGS)
def test_ensembles_connect_preprocessing_to_each_variant(repo, tag):
    pre = parse(repo / f"preprocess_{tag}/config.pbtxt")
    assert pre.backend == "python" and pre.input[0].data_type == model_config_pb2.TYPE_STRING
    assert {k: v.string_value for k, v in pre.parameters.items()}["height"] == tag
    for variant in ("trt", "onnx", "openvino"):
        ens = parse(repo / f"classify_{tag}_{variant}/config.pbtxt")
        assert ens.platform == "ensemble"
        steps = ens.ensemble_scheduling.step
        assert [s.model_name for s in steps] == [f"preprocess_{tag}", f"vit_{tag}_{variant}"]
        # each step's tensors exist in the model it calls, and the steps are chained
        assert set(steps[0].input_map) == {i.name for i in pre.input}
        assert set(steps[0].output_map) == {o.name for o in pre.output}
        assert steps[0].output_map["images"] == steps[1].input_map["images"]
        assert steps[1].output_map["logits"] == ens.output[0].name


def test_refuses_nonempty_output_and_leaves_it(export_dir, repo, tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    with pytest.raises(DeployKitError, match="already exists"):
        package_triton(export_dir, target, RepositoryOptions())
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".taken")]  # no temporary left behind


# ----------------------------------------------------------------------------------------------
# loading in the bundled tritonserver


def _bundled_backends() -> set[str]:
    import pytriton as pytriton

    return {p.name for p in (Path(pytriton.__file__).parent / "tritonserver/backends").iterdir() if p.is_dir()}


BACKEND_OF = {"trt": "tensorrt", "onnx": "onnxruntime"}


def test_bundled_server_lacks_onnxruntime_and_tensorrt_backends():
    """Why the inference models and ensembles are not loaded below (fails if a build adds them)."""
    backends = _bundled_backends()
    assert "python" in backends
    missing = {"onnxruntime", "tensorrt"} - backends
    if not missing:
        pytest.fail("the bundled tritonserver now has onnxruntime/tensorrt backends: load those models in a test too")
    pytest.skip(f"PyTriton's tritonserver ships no {', '.join(sorted(missing))} backend; only {sorted(backends)}")


@pytest.fixture(scope="module")
def bundled_server(repo, tmp_path_factory):
    """PyTriton's tritonserver binary on the generated repository, preprocessing models only."""
    import pytriton

    dist = Path(pytriton.__file__).parent / "tritonserver"
    work = tmp_path_factory.mktemp("tritonserver")
    shutil.copytree(dist / "backends", work / "backends")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copy(dist / "python_backend_stubs" / version / "triton_python_backend_stub", work / "backends/python/")
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        LD_LIBRARY_PATH=f"{sysconfig.get_config_var('LIBDIR')}{os.pathsep}{libs}",
    )
    http_port, grpc_port = free_ports(2)
    cmd = [
        str(dist / "bin/tritonserver"),
        f"--model-repository={repo}",
        f"--backend-directory={work / 'backends'}",
        "--model-control-mode=explicit",
        *[f"--load-model=preprocess_{t}" for t in TAGS],
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--allow-metrics=false",
        "--exit-timeout-secs=5",
    ]
    log = work / "server.log"
    import tritonclient.http as httpclient

    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    tree = [(proc.pid, "")]
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        wait_until(lambda: all(client.is_model_ready(f"preprocess_{t}") for t in TAGS), proc, timeout_s=120, log=log)
        tree = process_tree(proc.pid)
        yield client
    finally:
        stop(proc, tree)


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("tag", TAGS)
def test_preprocessing_model_serves_in_bundled_tritonserver(bundled_server, export_dir, tag):
    from tritonclient.http import InferInput

    config = json.loads((export_dir / "config.json").read_text())
    images = sample_images(2)
    tensor = InferInput("image", [2, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[_png(img)] for img in images], dtype=object))
    served = bundled_server.infer(f"preprocess_{tag}", [tensor]).as_numpy("images")
    res = (int(tag), int(tag))
    settings = {k: config[k] for k in ("crop_pct", "crop_mode", "interpolation")}
    expected = np.stack([torch_preprocess(img, res, config["mean"], config["std"], **settings) for img in images])
    assert served.shape == expected.shape == (2, 3, *res)
    # the served model preprocesses with the code validation uses: equal to float32 rounding
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(served, np.stack([Preprocessing(config["mean"], config["std"], **settings)(img, res) for img in images]))


def test_bundled_preprocessing_rejects_non_image_bytes_and_keeps_serving(bundled_server):
    from tritonclient.http import InferInput
    from tritonclient.utils import InferenceServerException

    bad = InferInput("image", [1, 1], "BYTES")
    bad.set_data_from_numpy(np.array([[b"not an image"]], dtype=object))
    with pytest.raises(InferenceServerException) as info:
        bundled_server.infer("preprocess_32", [bad])
    assert str(info.value.status()) == "400"
    assert info.value.message() == "cannot decode image bytes: not a PNG, JPEG, WEBP, BMP image"
    huge = InferInput("image", [1, 1], "BYTES")
    huge.set_data_from_numpy(np.array([[png_header_only(12000, 12000)]], dtype=object))
    with pytest.raises(InferenceServerException) as info:
        bundled_server.infer("preprocess_32", [huge])
    assert str(info.value.status()) == "400"
    assert info.value.message() == "image is 12000x12000 = 144000000 pixels; this server takes at most 40000000"
    good = InferInput("image", [1, 1], "BYTES")
    good.set_data_from_numpy(np.array([[_png(sample_images(1)[0])]], dtype=object))
    assert bundled_server.infer("preprocess_32", [good]).as_numpy("images").shape == (1, 3, 32, 32)
