"""The build's plugin hook, progress display and CLI, checked with TensorRT-RTX on CPU."""

import os
import sys

import pytest

from deploykit.backends.plugins import Plugins, load_plugin_modules
from deploykit.backends.tensorrt import BuildProgress
from deploykit.errors import ExportError

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


def _plugin_dir(tmp_path, marker):
    root = tmp_path / "plugins"
    (root / "sape2").mkdir(parents=True)
    (root / "sape2" / "__init__.py").write_text(
        f"from .kernel import VALUE\nLOADS = [{marker!r}]\nREGISTERED = []\ndef register():\n    REGISTERED.append(1)\n"
    )
    (root / "sape2" / "kernel.py").write_text("VALUE = 42\n")
    (root / "_private.py").write_text("raise RuntimeError('never imported')\n")
    (root / "notes.txt").write_text("not a plugin\n")
    return root


def test_plugin_packages_are_imported_once(tmp_path):
    root = _plugin_dir(tmp_path, "first")
    (name,) = load_plugin_modules([root])
    module = sys.modules[name]
    assert module.VALUE == 42 and module.LOADS == ["first"]  # relative imports resolve
    assert module.REGISTERED == [1]  # its register() ran once
    assert load_plugin_modules([root]) == [name] and sys.modules[name] is module and module.REGISTERED == [1]  # not re-registered


def test_broken_or_missing_plugin_is_one_line_error(tmp_path):
    root = tmp_path / "bad"
    root.mkdir()
    (root / "boom.py").write_text("raise ValueError('no kernel\\nfor you')\n")
    with pytest.raises(ExportError, match="boom.py failed to import: ValueError: no kernel for you"):
        load_plugin_modules([root])
    (root / "boom.py").unlink()
    (root / "late.py").write_text("def register():\n    raise ImportError('tensorrt missing')\n")
    with pytest.raises(ExportError, match="late.py failed to register: ImportError: tensorrt missing"):
        load_plugin_modules([root])
    with pytest.raises(ExportError, match="does not exist"):
        load_plugin_modules([tmp_path / "nope"])


def test_plugin_hash_follows_sources(tmp_path):
    root = _plugin_dir(tmp_path, "a")
    before = Plugins.resolve([root]).sha256()
    assert Plugins().sha256() is None and Plugins.resolve([root]).sha256() == before
    (root / "sape2" / "kernel.py").write_text("VALUE = 43\n")
    assert Plugins.resolve([root]).sha256() != before


def test_progress_records_phases_from_rtx_build(tmp_path):
    import torch
    from rich.console import Console

    from deploykit.backends.tensorrt import BuildOptions, EngineFromOnnx

    seen = []

    class Recording(BuildProgress):
        def start(self, phase, steps):
            seen.append(phase)
            super().start(phase, steps)

    path = tmp_path / "lin.onnx"
    torch.onnx.export(torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),), str(path), dynamo=True, opset_version=18)
    progress = Recording("lin.onnx")
    EngineFromOnnx(path, BuildOptions(module="tensorrt_rtx", max_batch=2), progress)()
    assert seen and progress.phases == {}  # every started phase finished
    progress.start("Building engine", 3)
    progress.step("Building engine", 0)
    console = Console(record=True, width=200)
    console.print(progress)
    assert "building lin.onnx: Building engine 1/3" in console.export_text()


@pytest.mark.slow
def test_cli_build_and_refusal(tmp_path, capsys, ckpt_dir):
    from deploykit.cli import main

    out = tmp_path / "exp"
    # conftest.py's one-block model: what is checked (the build's file names, its cache and its
    # refusal of a changed batch) does not depend on depth, and a twelve-block export cost most of the test.
    main(["export", "-c", str(ckpt_dir), "-r", "32", "--precision", "fp16", "-o", str(out)])
    # build checks shapes and the fp16 plan only here
    main(["build", str(out), "--backend", "rtx", "--opt-level", "0"])
    assert (out / "model_32_fp16.rtx.engine").is_file() and (out / "model_32_fp16.rtx.json").is_file()
    assert "model_32_fp16.rtx.engine  (built in" in capsys.readouterr().err
    main(["build", str(out), "--backend", "rtx", "--opt-level", "0"])
    assert "(cached)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["build", str(out), "--backend", "rtx", "--batch", "2"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "build.opt_batch (built 1, now 2)" in err and "\n" not in err


def test_tensorrt_warnings_are_summarised_once(sape2_export, tmp_path):
    """A SaPE² graph inlines its function body once per block; TensorRT-RTX's parser warns about
    every repeated node name. One summary line, not one line per node; -v shows each. (Fresh
    processes: the parser gives each such warning once per process.)"""
    import shutil
    import subprocess

    out = shutil.copytree(sape2_export, tmp_path / "exp")

    def build(*flags):
        cmd = [sys.executable, "-m", "deploykit", "build", str(out), "--backend", "rtx", "--opt-level", "0", "--rebuild", *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "40"})
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stderr.splitlines() if "already exists" in line]

    each = [line for line in build("-v") if line.startswith("debug: ")]
    (summary,) = build()
    assert len(each) > 10 and summary.startswith("warning: ") and f"{len(each)} warnings: " in summary
    assert summary.endswith(f"(×{len(each)}) (-v shows each)")  # whole, even at 40 columns
