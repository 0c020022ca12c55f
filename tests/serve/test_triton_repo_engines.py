"""``deploykit package triton`` ships the engines ``deploykit build`` wrote: across the seam
build → package, by the names build uses (``engine_paths``), checked against the fingerprint,
with the TensorRT model's batch settings fitted to the engine's profile; a TensorRT-RTX engine
is not a ``tensorrt_plan`` and is said so, not copied."""

from __future__ import annotations

import shlex
import shutil

import pytest
import tritonclient.grpc.model_config_pb2 as model_config_pb2
from google.protobuf import text_format

from deploykit.backends.engine_cache import Fingerprint, engine_paths, write_fingerprint
from deploykit.backends.plugins import Plugins
from deploykit.cli import main
from deploykit.errors import ConfigError, DeployKitError, StaleEngineError
from deploykit.export.manifest import sha256_file
from deploykit.serve.triton_repo import RepositoryOptions, package_triton

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


def parse(path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def _tensorrt_engine(graph, batches=(1, 8, 16), data=b"serialized TensorRT engine", plugins=Plugins(), plugin_layers=0, embedded=0):
    """An engine file and fingerprint where ``deploykit build --backend trt`` puts them (TensorRT
    itself cannot be installed here, so the bytes are a stand-in)."""
    engine, fp_path = engine_paths(graph, "tensorrt")
    engine.write_bytes(data)
    shapes = {"images": [[b, 3, 32, 32] for b in batches]}
    fingerprint = Fingerprint(
        onnx_sha256=sha256_file(graph),
        encoding="{}",
        precision="fp32",
        shapes=shapes,
        build={},
        module="tensorrt",
        trt_version="10.13.0",
        cuda_driver="13.0",
        driver="580.65",
        gpu="NVIDIA L4",
        compute_capability="8.9",
        plugin_sha256=plugins.sha256(),
    )
    write_fingerprint(fp_path, fingerprint, sha256_file(engine), plugins, plugin_layers, embedded)
    return engine


def test_rtx_build_then_package_says_the_rtx_engine_is_not_a_tensorrt_plan(export_dir, tmp_path, capsys):
    exp = shutil.copytree(export_dir, tmp_path / "exp")
    main(["build", str(exp), "--backend", "rtx", "--opt-level", "0", "-r", "32"])
    assert (exp / "model_32.rtx.engine").is_file()
    capsys.readouterr()
    main(["package", "triton", str(exp), "--output", str(tmp_path / "repo")])
    err = capsys.readouterr().err
    repo = tmp_path / "repo"
    assert not (repo / "vit_32_trt/1/model.plan").exists()
    readme = (repo / "README.md").read_text()
    assert "`model_32.rtx.engine` (TensorRT-RTX) was not copied: Triton's `tensorrt_plan` platform loads TensorRT engines only" in readme
    assert "model_32.rtx.engine is a TensorRT-RTX engine" in err
    assert "trtexec --onnx=vit_48_onnx/1/model.onnx" in readme  # 48 px: nothing built, how to build


def test_the_engine_build_wrote_is_packaged_and_the_batching_fits_it(export_dir, tmp_path):
    exp = shutil.copytree(export_dir, tmp_path / "exp")
    engine = _tensorrt_engine(exp / "model_48.onnx", batches=(1, 8, 16))
    repo = package_triton(exp, tmp_path / "repo", RepositoryOptions(max_batch_size=32, preferred_batch_sizes=(8, 32)))
    assert (repo / "vit_48_trt/1/model.plan").read_bytes() == engine.read_bytes()
    assert not (repo / "vit_32_trt/1/model.plan").exists()
    trt, ensemble, onnx_cfg = (parse(repo / f"{m}/config.pbtxt") for m in ("vit_48_trt", "classify_48_trt", "vit_48_onnx"))
    assert trt.max_batch_size == ensemble.max_batch_size == 16 and list(trt.dynamic_batching.preferred_batch_size) == [8]
    assert [s.batch_size for s in trt.optimization.cuda.graph_spec] == [1, 8]
    assert onnx_cfg.max_batch_size == 32  # ONNX Runtime takes any batch
    readme = (repo / "README.md").read_text()
    # The TensorRT it was built with, which Triton's container must carry.
    assert (
        "copied from `model_48.trt.engine` of the export directory, built with TensorRT 10.13.0 on NVIDIA L4 (compute capability 8.9)."
        in readme
    )
    assert "--maxShapes=images:32x3x32x32 --stronglyTyped`" in readme  # how to build the 32 px one: strongly typed, as deploykit does


def test_an_engine_with_python_plugin_layers_is_refused_and_one_with_a_library_carries_it(export_dir, tmp_path):
    """Triton's TensorRT backend loads plugin libraries only: an engine whose layers run a Python
    plugin at inference cannot deserialize there (defect 5); one built with a library gets the
    library, given again and checked against the fingerprint, and the flag that loads it."""
    exp = shutil.copytree(export_dir, tmp_path / "exp")
    _tensorrt_engine(exp / "model_32.onnx", plugins=Plugins.resolve(["sape2"]), plugin_layers=2)
    with pytest.raises(
        DeployKitError, match=r"model_32.trt.engine runs 2 layer\(s\) as TensorRT Python plugins .*do not carry their kernel.*--rebuild"
    ) as err:
        package_triton(exp, tmp_path / "a")
    assert "\n" not in str(err.value) and not (tmp_path / "a").exists()

    library = tmp_path / "libs" / "libsape2_plugin.so"
    library.parent.mkdir()
    library.write_bytes(b"\x7fELF stand-in plugin library")
    _tensorrt_engine(exp / "model_32.onnx", plugins=Plugins.resolve([library]), plugin_layers=2)
    with pytest.raises(StaleEngineError, match="needs the plugins it was built with .*libsape2_plugin.so"):
        package_triton(exp, tmp_path / "b")  # not given: never copied from a path the fingerprint names
    repo = package_triton(exp, tmp_path / "c", plugins=Plugins.resolve([library]))
    assert (repo / "plugins" / "libsape2_plugin.so").read_bytes() == library.read_bytes()
    readme = (repo / "README.md").read_text()
    assert _tritonserver_args(readme)[2:] == ["--backend-config=tensorrt,plugins=$PWD/plugins/libsape2_plugin.so"]
    assert "needs `libsape2_plugin.so`" in readme
    # Plugins loaded at build but used by no layer: the engine needs nothing at load.
    _tensorrt_engine(exp / "model_32.onnx", plugins=Plugins.resolve(["sape2"]), plugin_layers=0)
    assert not (package_triton(exp, tmp_path / "d") / "plugins").exists()


def test_an_engine_whose_plugin_layers_carry_their_kernel_is_packaged_with_no_plugin(export_dir, tmp_path):
    """Issue 42, item 6: the SaPE² plugin is ahead-of-time (its kernel compiled into the engine),
    and NVIDIA documents that such an engine needs no Python, Triton or plugin registration to
    deserialize (it runs in trtexec), yet packaging refused it as a Python plugin."""
    exp = shutil.copytree(export_dir, tmp_path / "exp")
    engine = _tensorrt_engine(exp / "model_32.onnx", batches=(1, 4, 8), plugins=Plugins.resolve(["sape2"]), plugin_layers=2, embedded=2)
    repo = package_triton(exp, tmp_path / "repo")
    assert (repo / "vit_32_trt/1/model.plan").read_bytes() == engine.read_bytes()
    assert not (repo / "plugins").exists()
    readme = (repo / "README.md").read_text()
    assert "tritonserver --model-repository=$PWD\n" in readme  # no plugin library to load
    assert (
        "copied from `model_32.trt.engine`" in readme
        and "its 2 plugin layer(s) carry their compiled kernel, so it needs no plugin" in readme
    )


def _tritonserver_args(readme: str) -> list[str]:
    """The README's ``tritonserver`` command as a POSIX shell splits it, after checking that the
    shell sees one command (``;`` outside quotes ends one)."""
    (line,) = [line.strip() for line in readme.splitlines() if line.strip().startswith("tritonserver ")]
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    assert not [t for t in tokens if set(t) <= set(";&|<>()")], f"{line!r} is more than one shell command"
    return tokens


def test_two_plugin_libraries_are_loaded_by_one_tritonserver_command(export_dir, tmp_path):
    """Item 7 of issue 42: the libraries were joined with an unquoted ';', which ends the shell
    command there: tritonserver got the first library and the shell ran the second as a command."""
    exp = shutil.copytree(export_dir, tmp_path / "exp")
    libraries = []
    for name in ("liba_plugin.so", "libb_plugin.so"):
        (tmp_path / "libs").mkdir(exist_ok=True)
        (tmp_path / "libs" / name).write_bytes(b"\x7fELF stand-in plugin library " + name.encode())
        libraries.append(tmp_path / "libs" / name)
    plugins = Plugins.resolve(libraries)
    _tensorrt_engine(exp / "model_32.onnx", plugins=plugins, plugin_layers=2)
    repo = package_triton(exp, tmp_path / "repo", plugins=plugins)
    args = _tritonserver_args((repo / "README.md").read_text())
    assert args[:2] == ["tritonserver", "--model-repository=$PWD"]
    (config,) = args[2:]
    backend, setting = config.removeprefix("--backend-config=").split(",", 1)
    assert backend == "tensorrt" and setting.startswith("plugins=")
    # Triton's TensorRT backend splits the value at ';' (its README: plugins="/path/plugin1.so;/path2/plugin2.so").
    assert sorted(setting.removeprefix("plugins=").split(";")) == ["$PWD/plugins/liba_plugin.so", "$PWD/plugins/libb_plugin.so"]
    assert sorted(p.name for p in (repo / "plugins").iterdir()) == ["liba_plugin.so", "libb_plugin.so"]


def test_a_stale_or_fixed_batch_engine_is_refused(export_dir, tmp_path):
    exp = shutil.copytree(export_dir, tmp_path / "exp")
    engine = _tensorrt_engine(exp / "model_32.onnx", batches=(4, 4, 4))
    with pytest.raises(ConfigError, match="takes batches 4-4 only, but Triton sends any batch from 1; build it with --dynamic"):
        package_triton(exp, tmp_path / "a", RepositoryOptions())
    engine.write_bytes(b"something else")
    with pytest.raises(StaleEngineError, match=r"model_32.trt.engine changed since it was built; rebuild with"):
        package_triton(exp, tmp_path / "b", RepositoryOptions())
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
