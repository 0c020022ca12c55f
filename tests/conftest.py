"""Fixtures shared across the suite (light imports only: the CLI module imports click alone)."""

from __future__ import annotations

import pytest


@pytest.fixture
def deploykit_cli(capsys):
    """Run ``deploykit ARGS`` in-process (as the console script does): returns (exit code, stderr)."""
    from deploykit.cli import main

    def run(*args) -> tuple[int, str]:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
        except SystemExit as exit_:
            return exit_.code, capsys.readouterr().err
        return 0, capsys.readouterr().err

    return run


@pytest.fixture(scope="session")
def encoding_export(tmp_path_factory):
    """``name -> export directory`` of ``tests.encoding_params.encoding_model(name)`` at
    ``EXPORT_RESOLUTIONS`` in ``EXPORT_PLANS``, written on first use (shared: copy it before
    modifying)."""
    from deploykit.export import export
    from tests.encoding_params import EXPORT_PLANS, EXPORT_RESOLUTIONS, encoding_model

    written = {}

    def get(name: str):
        if name not in written:
            out = tmp_path_factory.mktemp(f"encoding-{name.replace('+', '_')}") / "exp"
            export(encoding_model(name), list(EXPORT_RESOLUTIONS), out, precisions=list(EXPORT_PLANS))
            written[name] = out
        return written[name]

    return get


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """A small model directory: config.json + model.safetensors (``tests.test_cli.small_model``)."""
    from deploykit.nn import save_model
    from tests.test_cli import small_model

    return save_model(small_model(), tmp_path_factory.mktemp("ckpt") / "small")


@pytest.fixture(scope="module")
def good_export(tmp_path_factory, ckpt_dir):
    """One successful export of the small model at 32x32 (shared; copy it before modifying)."""
    from deploykit.cli import main
    from tests.test_cli import RES

    out = tmp_path_factory.mktemp("export") / "out"
    try:
        main(["export", "--checkpoint", str(ckpt_dir), "-r", str(RES), "--output", str(out)])
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"export of the small model failed with {exit_.code}"
    return out


@pytest.fixture(scope="session")
def zoo_int8_export(tmp_path_factory):
    """The default zoo model as ``deploykit export --precision int8`` writes it at its card's
    resolutions (1x, 1.5x, 2x), default calibration and fallback: its fp32 and int8 graphs, exported
    once for the zoo card tests and OpenVINO's int8 test, each of which exported (or replanned) it
    again (shared: copy it before modifying)."""
    import json

    from deploykit.cli import main
    from deploykit.zoo.cards import CARD_JSON
    from deploykit.zoo.registry import DEFAULT_ZOO_MODEL, model_dir

    directory = model_dir(DEFAULT_ZOO_MODEL)
    if not (directory / CARD_JSON).is_file():
        pytest.fail(
            f"zoo model {DEFAULT_ZOO_MODEL} has no card; run: deploykit zoo train {DEFAULT_ZOO_MODEL} && deploykit zoo eval {DEFAULT_ZOO_MODEL}"
        )
    resolutions = json.loads((directory / CARD_JSON).read_text())["resolutions"]
    out = tmp_path_factory.mktemp("zoo-int8") / "exp"
    try:
        main(["export", "-c", str(directory), *(a for r in resolutions for a in ("-r", str(r))), "--precision", "int8", "-o", str(out)])
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"export of {DEFAULT_ZOO_MODEL} with its int8 plan failed with {exit_.code}"
    return out


@pytest.fixture(scope="session")
def zoo_ape_export(tmp_path_factory):
    """The zoo's APE model (``models/shapes-ape``, trained at 48 px) exported at 32 and 48 px, once
    (shared: copy it before modifying)."""
    from deploykit.export import export
    from deploykit.zoo.resolve import resolve_model

    model, _ = resolve_model(encoding="ape")
    out = tmp_path_factory.mktemp("zoo-ape") / "exp"
    export(model, [(32, 32), (48, 48)], out)
    return out


@pytest.fixture(scope="session")
def zoo_gpu_export(tmp_path_factory):
    """The trained default zoo model at its training resolution (48) in fp8 and int8-fp16, the
    fallback on (default 99.5% target) on 200 held-out val images (shared: copy before modifying)."""
    from deploykit.cli import main
    from deploykit.zoo.registry import DEFAULT_ZOO_MODEL, model_dir

    out = tmp_path_factory.mktemp("zoo-gpu") / "exp"
    args = ["export", "-c", str(model_dir(DEFAULT_ZOO_MODEL)), "-r", "48", "--precision", "fp8", "--precision", "int8-fp16"]
    try:
        main([*args, "--calibration-samples", "32", "--held-out", "200", "-o", str(out)])
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"export of {DEFAULT_ZOO_MODEL} in the GPU plans failed with {exit_.code}"
    return out


@pytest.fixture(scope="session")
def sape2_export(tmp_path_factory):
    """A two-block SaPE² ViT at 32x32 exported once: ``model_32.onnx`` holds two
    ``deploykit::SaPE2Bias`` nodes and their model-local function (shared; copy before modifying)."""
    import torch

    from deploykit.export import export
    from deploykit.nn import create_model

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("sape2") / "exp"
    export(create_model("vit_tiny_patch16", encoding="sape2", depth=2, img_size=32, num_classes=10), [(32, 32)], out)
    return out


@pytest.fixture
def stand_in_backend(monkeypatch):
    """``add(name, runner, bisect=None, **fields)``: a backend of the table for this test, with
    ``runner(onnx_path, RunnerOptions)`` and ``bisect(onnx_path, marked, RunnerOptions)`` as its
    factories and any other ``Backend`` fields given: the one of that name changed so (an engine
    backend stays one), else a new graph backend on the CPU, last."""
    import dataclasses

    from deploykit.runners import table

    def add(name, runner, bisect=None, **fields):
        fields.update(
            runner=lambda backend, path, options: runner(path, options),
            bisect=None if bisect is None else lambda backend, path, marked, options: bisect(path, marked, options),
        )
        old = table.find(name)
        entry = dataclasses.replace(old or table.Backend(name, table.GRAPH, table.CPU, runner=runner), **fields)
        rows = [entry if b.name == name else b for b in table.BACKENDS]
        monkeypatch.setattr(table, "BACKENDS", tuple(rows if old is not None else [*rows, entry]))
        return entry

    return add
