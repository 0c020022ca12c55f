"""Serving an engine built with plugins (defect 5): the pipeline loads the installed plugin
packages the engine's fingerprint names, and never falls back to ONNX Runtime in silence."""

from __future__ import annotations

import json
import logging
import shutil
from functools import partial

import pytest

from deploykit.backends.build import build
from deploykit.backends.devices import Device
from deploykit.backends.plugins import Plugins
from deploykit.backends.trt_runner import engine_runner
from deploykit.errors import DeployKitError
from deploykit.serve.pipeline import Pipeline

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
RTX_4090 = Device("12.8", "570.1", "NVIDIA GeForce RTX 4090", "8.9")


@pytest.fixture(scope="module")
def built_with_sape2(export_dir, tmp_path_factory):
    """An export whose 32 px engine records the installed SaPE² plugin as ``deploykit build
    --backend trt --plugins sape2`` does (TensorRT-RTX builds here on CPU; it takes no Python
    plugins, so the record is written as TensorRT's build writes it)."""
    out = shutil.copytree(export_dir, tmp_path_factory.mktemp("plugins") / "exp")
    build(out, "rtx", resolutions=[(32, 32)], optimization_level=0)
    fp_path = out / "model_32.rtx.json"
    record = json.loads(fp_path.read_text())
    sape2 = Plugins.resolve(["sape2"])
    record.update(plugins=sape2.describe(), installed_plugins=list(sape2.installed), plugin_layers=1)
    record["fingerprint"]["plugin_sha256"] = sape2.sha256()
    fp_path.write_text(json.dumps(record))
    return out


def test_the_pipeline_loads_the_installed_plugin_the_engine_names(built_with_sape2, monkeypatch):
    """No --plugins given: the runner resolves ``sape2`` by its entry point (hash-checked) and
    loads it before deserializing. Here its registration needs full TensorRT, which is not
    installed, so the load itself is what fails: proof it was attempted, named in one line."""
    import deploykit.plugins.sape2.trt_plugin as trt_plugin

    monkeypatch.setattr(trt_plugin, "_registered", False)
    factories = {"rtx": partial(engine_runner, module="tensorrt_rtx", device=RTX_4090)}
    with pytest.raises(
        DeployKitError, match=r"rtx: plugin deploykit.plugins.sape2 failed to register: MissingDependencyError: .*deploykit\[trt\]"
    ) as err:
        Pipeline(built_with_sape2, backend="rtx", factories=factories)
    assert "\n" not in str(err.value)


def test_given_other_plugins_the_engine_is_refused(built_with_sape2, tmp_path):
    library = tmp_path / "libother.so"
    library.write_bytes(b"\x7fELF")
    factories = {"rtx": partial(engine_runner, module="tensorrt_rtx", device=RTX_4090, plugins=Plugins.resolve([library]))}
    with pytest.raises(DeployKitError, match="built with other plugins than the ones given"):
        Pipeline(built_with_sape2, backend="rtx", factories=factories)


def test_auto_says_why_it_did_not_use_a_built_engine(built_with_sape2, caplog):
    with caplog.at_level(logging.WARNING, logger="deploykit"):
        with Pipeline(built_with_sape2) as pipe:
            assert pipe.backends[(32, 32)] == "ort"
    warned = [r.getMessage() for r in caplog.records if "engine built for it was not used" in r.getMessage()]
    assert warned == [
        f"model_32.onnx: the rtx engine built for it was not used: {pipe.skipped[(32, 32)]['rtx']}"
    ]  # 48 px: none built, no warning
