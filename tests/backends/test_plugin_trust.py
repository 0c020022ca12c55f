"""Plugins are code: only the ones the user names are loaded, and an engine runs only with the
plugins it was built with, loaded before it is deserialized.

A "plugin" here writes a marker file when imported, so "nothing was imported" is a fact about
the file system; each test names its plugin directory uniquely (module names are cached per
process). The shared library is a stand-in: a copy of a harmless extension module of this
Python, loaded the way TensorRT plugin libraries are (``ctypes.CDLL``); whether it was loaded is
read from the process's memory map.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import deploykit
from deploykit.backends.plugins import Plugins
from deploykit.errors import ExportError, StaleEngineError
from deploykit.export import export
from deploykit.nn import create_model

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
MAPS = Path("/proc/self/maps")


def _marker_plugin(tmp_path: Path) -> tuple[Path, Path]:
    """``(plugin directory, marker file)``: importing the plugin writes the marker."""
    root, marker = tmp_path / f"evil_{tmp_path.name}", tmp_path / "imported.txt"
    root.mkdir()
    (root / "payload.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    return root, marker


def _stand_in_library(directory: Path, extra: bytes = b"") -> Path:
    import _ctypes

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "libdeploykit_standin.so"
    path.write_bytes(Path(_ctypes.__file__).read_bytes() + extra)
    return path


def _mapped(path: Path) -> bool:
    return str(path) in MAPS.read_text()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny export with a TensorRT-RTX engine built without plugins."""
    from deploykit.backends.build import build

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("trust") / "exp"
    export(create_model("vit_tiny_patch16", encoding="ape", depth=1, img_size=32, num_classes=10), [(32, 32)], out)
    build(out, "rtx", optimization_level=0)
    return out


def test_control_a_named_plugin_directory_is_imported(tmp_path):
    root, marker = _marker_plugin(tmp_path)
    assert not marker.exists()
    Plugins.resolve([root]).load("tensorrt_rtx")
    assert marker.read_text() == "imported"  # the marker proves an import when one happens


def test_a_fingerprint_naming_a_plugin_directory_is_refused_and_nothing_imported(built, tmp_path, capsys):
    from deploykit.backends.engine_cache import EngineFromPath
    from deploykit.cli import main

    out = shutil.copytree(built, tmp_path / "exp")
    root, marker = _marker_plugin(tmp_path)
    fp_path = out / "model_32.rtx.json"
    record = json.loads(fp_path.read_text())
    # What whoever writes the fingerprint can write: the directory (under either key) and its hash.
    record["plugins"] = record["plugin_dirs"] = [str(root)]
    record["fingerprint"]["plugin_sha256"] = Plugins.resolve([root]).sha256()
    fp_path.write_text(json.dumps(record))
    with pytest.raises(StaleEngineError, match=r"needs the plugins it was built with .*evil_.*pass them with --plugins") as err:
        EngineFromPath(out / "model_32.onnx", "tensorrt_rtx")()
    assert "\n" not in str(err.value)
    with pytest.raises(SystemExit) as exit_info:
        main(["-q", "validate", str(out), "--backend", "rtx", "--num-random", "1", "--num-real", "0"])  # -q: no step lines
    stderr = capsys.readouterr().err.strip()
    # Without a GPU the runner refuses on the device, before reading the fingerprint's plugins.
    assert exit_info.value.code == 1 and stderr.startswith("error: the rtx runner needs a CUDA GPU") and "\n" not in stderr
    assert not marker.exists() and not [m for m in sys.modules if root.name in m]


def test_build_does_not_import_plugins_from_the_working_directory(built, tmp_path, monkeypatch, capsys):
    from deploykit.cli import main

    out = shutil.copytree(built, tmp_path / "exp")
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "plugins").mkdir()
    marker = tmp_path / "imported.txt"
    (work / "plugins" / "payload.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    monkeypatch.chdir(work)
    for backend in ("trt", "rtx"):  # trt stops at the missing TensorRT here, after plugins would have loaded
        try:
            main(["build", str(out), "--backend", backend, "--opt-level", "0"])
        except SystemExit as exit_:
            assert exit_.code == 1 and "tensorrt is not available" in capsys.readouterr().err
    assert not marker.exists()
    assert json.loads((out / "model_32.rtx.json").read_text())["fingerprint"]["plugin_sha256"] is None


def test_the_runner_refuses_plugins_other_than_the_build_s(built, tmp_path):
    from deploykit.backends.build import build
    from deploykit.backends.engine_cache import EngineFromPath

    out = shutil.copytree(built, tmp_path / "exp")
    library = _stand_in_library(tmp_path / "lib")
    build(out, "rtx", optimization_level=0, plugins=Plugins.resolve([library]), rebuild=True)
    onnx_path = out / "model_32.onnx"
    with pytest.raises(StaleEngineError, match=r"needs the plugins it was built with \(.*libdeploykit_standin.so\); pass them"):
        EngineFromPath(onnx_path, "tensorrt_rtx")()
    other = _stand_in_library(tmp_path / "other", extra=b"\0")
    with pytest.raises(StaleEngineError, match="built with other plugins than the ones given") as err:
        EngineFromPath(onnx_path, "tensorrt_rtx", plugins=Plugins.resolve([other]))()
    assert "\n" not in str(err.value) and not _mapped(other)
    root, marker = _marker_plugin(tmp_path)
    with pytest.raises(StaleEngineError, match="built with other plugins"):
        EngineFromPath(onnx_path, "tensorrt_rtx", plugins=Plugins.resolve([library, root]))()
    assert not marker.exists()


@pytest.mark.skipif(not MAPS.exists(), reason="reads /proc/self/maps (Linux)")
def test_plugin_library_recorded_by_build_is_loaded_before_the_engine_deserializes(built, tmp_path, monkeypatch):
    """build records the library (by hash) → the runner, given the same library (here a copy at
    another path, so its loading shows), loads it before deserializing."""
    from deploykit.backends import trt_runner
    from deploykit.backends.build import build
    from deploykit.backends.devices import Device

    out = shutil.copytree(built, tmp_path / "exp")
    build(out, "rtx", optimization_level=0, plugins=Plugins.resolve([_stand_in_library(tmp_path / "built_with")]), rebuild=True)
    copy = _stand_in_library(tmp_path / "run_with")
    gpu = Device("12.8", "570.1", "NVIDIA RTX 4090", "8.9")  # past the device check, as on a GPU machine
    runner = trt_runner.engine_runner(out / "model_32.onnx", "tensorrt_rtx", plugins=Plugins.resolve([copy]), device=gpu)
    seen = {}

    def check_rtx_engine(runtime, data, what):  # the first step on the engine's bytes, after the plugins load
        seen.update(mapped=_mapped(copy), engine=data)
        raise RuntimeError("stand-in stops here")

    monkeypatch.setattr(trt_runner, "check_rtx_engine", check_rtx_engine)
    assert not _mapped(copy)
    with pytest.raises(RuntimeError, match="stand-in"):
        runner.activate()
    assert seen == {"mapped": True, "engine": (out / "model_32.rtx.engine").read_bytes()}


def test_installed_plugins_resolve_by_entry_point_name():
    sape2 = Plugins.resolve(["sape2"])
    (source,) = sape2.sources
    assert source.kind == "package" and source.module == "deploykit.plugins.sape2" and (source.path / "trt_plugin.py").is_file()
    assert sape2.sha256() == Plugins.resolve(["sape2"]).sha256() and sape2.describe() == ["deploykit.plugins.sape2 (installed)"]
    with pytest.raises(ExportError, match=r"not a directory, a shared library or an installed plugin \(installed: .*sape2"):
        Plugins.resolve(["no-such-plugin"])


def test_an_installed_plugin_is_imported_under_one_name_only(tmp_path):
    # Its package directory or the folder holding it, given as a directory of plugins, would import
    # the same files again as deploykit_plugins.<dir>.sape2 (and register the op twice).
    (source,) = Plugins.resolve(["sape2"]).sources
    for directory in (source.path, source.path.parent):
        with pytest.raises(ExportError, match=r"holds the installed plugin sape2 .*pass --plugins sape2"):
            Plugins.resolve([str(directory)])
    # plugins/ at the top of the repository is installed as deploykit.plugins: one name, one copy.
    assert source.path == Path(deploykit.__file__).parents[1] / "plugins" / "sape2"
    assert Path(importlib.import_module(source.module).__file__).parent == source.path
