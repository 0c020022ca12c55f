"""A TensorRT wheel built for a newer CUDA than the driver runs (the ``trt``/``rtx`` extras install
CUDA 13 builds, which need an R580+ driver) is refused in one line naming what to install, before
an engine is built or read (issue 42, item 4). The driver is NVML's answer, mocked here; the
wheels are the real ones the test extra installs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tensorrt_rtx as rtx
import tomllib

from deploykit import _nvml
from deploykit.backends import devices
from deploykit.backends.devices import Device, check_cuda_build, cuda_build
from deploykit.errors import DeployKitError

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
RTX_4090 = Device("12.8", "570.133.20", "NVIDIA GeForce RTX 4090", "8.9")


@pytest.fixture
def driver(monkeypatch):
    """Set the driver NVML reports: ``driver("570.133.20", "12.8")``."""

    def set_driver(version: str | None, cuda: str | None) -> None:
        monkeypatch.setattr(_nvml, "driver_version", lambda: version)
        monkeypatch.setattr(_nvml, "cuda_driver_version", lambda: cuda)

    return set_driver


def test_the_installed_wheel_s_cuda_major_is_read_from_its_distribution():
    wheel, version, major = cuda_build("tensorrt_rtx")
    assert (wheel, major) == ("tensorrt_rtx_cu13", 13) and version == rtx.__version__  # what the test extra installs
    assert cuda_build("tensorrt_lean")[2] == 13
    assert cuda_build("deploykit_no_such_module") is None


def test_a_cuda_13_wheel_on_an_r570_driver_is_refused_naming_the_cuda_12_extra(driver):
    driver("570.133.20", "12.8")
    with pytest.raises(DeployKitError) as err:
        check_cuda_build("tensorrt_rtx")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"tensorrt_rtx_cu13 {rtx.__version__} is a CUDA 13 build (NVIDIA driver R580 or newer), ")
    assert "this driver (570.133.20) runs CUDA 12.8 at most" in message
    assert "pip uninstall tensorrt_rtx tensorrt_rtx_cu13 " in message and "pip install 'deploykit[rtx-cu12]'" in message
    # The extra it names exists, and installs TensorRT-RTX's CUDA 12 wheel.
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert any(re.match(r"tensorrt-rtx-cu12\b", req) for req in extras["rtx-cu12"]), extras["rtx-cu12"]
    assert any(re.match(r"tensorrt-cu12\b", req) for req in extras["trt-cu12"]), extras["trt-cu12"]


def test_a_driver_too_old_for_any_build_is_told_to_update(driver):
    driver("470.256.02", "11.4")
    with pytest.raises(
        DeployKitError, match=r"runs CUDA 11\.4 at most: update the driver to R580 \(or R525 and pip install 'deploykit\[rtx-cu12\]'\)$"
    ):
        check_cuda_build("tensorrt_rtx")


@pytest.mark.parametrize("cuda", ["13.0", "13.2", None])  # an R580+ driver, or no driver at all (this CI): nothing to refuse
def test_a_driver_that_runs_the_wheel_passes(driver, cuda):
    driver("580.65.06" if cuda else None, cuda)
    check_cuda_build("tensorrt_rtx")
    assert devices.cuda_build_problem("tensorrt_rtx") is None


def test_the_runner_refuses_before_the_engine_is_read(driver):
    from deploykit.backends.trt_runner import TrtRunner

    def never():
        raise AssertionError("the engine was read on a driver that cannot run the TensorRT-RTX wheel")

    driver("570.133.20", "12.8")
    runner = TrtRunner(never, "tensorrt_rtx", device_info=RTX_4090)
    with pytest.raises(DeployKitError, match=r"^tensorrt_rtx_cu13 .* is a CUDA 13 build"):
        runner.activate()
    assert not runner.is_active


def test_build_refuses_before_reading_the_export(driver, tmp_path):
    from deploykit.backends.build import build

    driver("570.133.20", "12.8")
    with pytest.raises(DeployKitError, match=r"^tensorrt_rtx_cu13 .*'deploykit\[rtx-cu12\]'"):
        build(tmp_path / "not-read", "rtx", device=RTX_4090)


def test_auto_does_not_offer_a_wheel_the_driver_cannot_run(driver, monkeypatch):
    from deploykit.backends import registry

    monkeypatch.setattr(devices, "probe_device", lambda ordinal=0: RTX_4090)
    driver("580.65.06", "13.0")
    assert "rtx" in registry.available_backends()
    driver("570.133.20", "12.8")
    assert "rtx" not in registry.available_backends()
