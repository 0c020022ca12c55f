"""Throughput mode as served: ``deploykit profile``'s measured stream count is recorded in the
choice, the pipeline opens the chosen runner with it and says so, and the server gives each
resolution's model as many instances as its runner runs calls at once."""

from __future__ import annotations

import json
import shutil
from unittest import mock

import numpy as np
import pytest

import deploykit
from deploykit.export.directory import CHOICE_FILE, ExportDir
from deploykit.export.manifest import Manifest, sha256_file
from deploykit.inputs.resolutions import resolution_tag
from deploykit.profile.choice import Choice
from deploykit.profile.streams import with_measured_streams
from deploykit.runners.streams import usable_cores

TWO_CORES = pytest.mark.skipif(usable_cores() < 2, reason="two streams need two cores (OpenVINO caps streams at the cores)")


def _choose_openvino(export_dir, streams: int = 1) -> None:
    """A choice file naming OpenVINO on the fp32 graphs at every resolution, as profile writes it."""
    manifest = Manifest.read(export_dir)
    choices = {
        resolution_tag(g.resolution): [Choice("openvino", "fp32", 1, 1.0, sha256_file(export_dir / g.file), streams, 1.5).__dict__]
        for g in manifest.graphs_at("fp32")
    }
    (export_dir / CHOICE_FILE).write_text(json.dumps({"choices": choices}))


def test_profile_records_the_measured_streams_in_the_choice(export_dir, tmp_path):
    out = shutil.copytree(export_dir, tmp_path / "exp")
    _choose_openvino(out)
    measured = with_measured_streams(out, ExportDir(out).choices(), round_s=0.05)
    for tag in ("32", "48"):
        (choice,) = measured[tag]
        assert choice.backend == "openvino" and choice.streams >= 1
        assert (choice.streams == 1) == (choice.streams_gain == 1.0)  # more streams only with their measured gain
        assert choice.streams == 1 or choice.streams_gain >= 1.1


@TWO_CORES
def test_serve_opens_the_chosen_plan_with_its_streams_and_says_so(export_dir, tmp_path):
    out = shutil.copytree(export_dir, tmp_path / "exp")
    _choose_openvino(out, streams=2)
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    with deploykit.load(out) as pipe, deploykit.load(export_dir, backend="openvino") as one_stream:
        assert pipe.backends[(32, 32)] == "openvino" and pipe.parallel_calls((32, 32)) == 2
        assert one_stream.parallel_calls((32, 32)) == 1
        (line,) = pipe.describe_backends()
        assert line.startswith("backend openvino with 2 inference streams at 32 (fastest validated plan")
        assert "its streams answered 1.50x one stream's images under concurrent calls" in line
        assert pipe(image).classes == one_stream(image).classes


@TWO_CORES
def test_streams_asked_for_override_the_choice_and_reach_an_explicit_backend(export_dir, tmp_path):
    out = shutil.copytree(export_dir, tmp_path / "exp")
    _choose_openvino(out, streams=2)
    with deploykit.load(out, streams=1) as pipe:  # the choice's plan, on one stream
        assert pipe.backends[(32, 32)] == "openvino" and pipe.parallel_calls((32, 32)) == 1
        assert "streams" not in pipe.describe_backends()[0]
    with deploykit.load(export_dir, backend="ort", streams=2) as pipe:
        assert pipe.parallel_calls((48, 48)) == 2
        assert pipe.describe_backends() == ["backend ort with 2 inference streams (a lone call on all cores) at 32, 48"]


@TWO_CORES
def test_the_server_runs_one_model_instance_per_stream_on_its_share_of_the_cores(export_dir, tmp_path):
    """A CPU plan's ``logits_<res>`` is a Triton Python-backend model: as many instances (stub
    processes, each with a runner) as the chosen plan has streams, the cores split between them."""
    import pytriton.triton as pytriton

    from deploykit.runners.streams import threads_per_stream
    from deploykit.serve.triton_server import ServerOptions, logits_models

    out = shutil.copytree(export_dir, tmp_path / "exp")
    _choose_openvino(out, streams=2)
    triton = mock.create_autospec(pytriton.Triton, instance=True)
    with deploykit.load(out) as pipe:
        names = logits_models(triton, tmp_path / "repo", pipe, ServerOptions())
    assert names == ["logits_32", "logits_48"] and not triton.bind.called
    for name in names:
        config = (tmp_path / "repo" / name / "config.pbtxt").read_text()
        assert "instance_group [ { kind: KIND_CPU count: 2 } ]" in config
        settings = json.loads(json.loads(config.split("string_value: ", 1)[1].rsplit(" }", 2)[0]))
        assert (settings["backend"], settings["streams"], settings["threads"]) == ("openvino", 1, threads_per_stream(2))
        assert (tmp_path / "repo" / name / "1" / "model.py").is_file()


@TWO_CORES
def test_the_server_gives_a_runner_that_spreads_batches_one_instance_with_its_streams(export_dir, tmp_path):
    """ONNX Runtime with streams spreads a merged batch over them itself (``StreamScheduler``): one
    instance, whose runner has the streams and the session of all cores, gets every batch."""
    import pytriton.triton as pytriton

    from deploykit.serve.triton_server import ServerOptions, logits_models

    triton = mock.create_autospec(pytriton.Triton, instance=True)
    with deploykit.load(export_dir, backend="ort", streams=2) as pipe:
        (name, _) = logits_models(triton, tmp_path / "repo", pipe, ServerOptions())
    config = (tmp_path / "repo" / name / "config.pbtxt").read_text()
    assert "instance_group [ { kind: KIND_CPU count: 1 } ]" in config
    settings = json.loads(json.loads(config.split("string_value: ", 1)[1].rsplit(" }", 2)[0]))
    assert (settings["backend"], settings["streams"], settings["threads"]) == ("ort", 2, 0)


def test_serve_keeps_no_runner_of_a_plan_its_triton_stubs_run(export_dir, monkeypatch):
    """Triton's stub processes load the CPU plans' runners of their own, so ``serve`` releases its
    pipeline's copies before it reports ready (Triton here: an autospec of the real class)."""
    from server_process import free_ports

    from deploykit.serve import triton_server
    from deploykit.serve.pipeline import Pipeline

    opened, active_when_ready = [], []
    real_for_server = Pipeline.for_server.__func__
    monkeypatch.setattr(Pipeline, "for_server", classmethod(lambda cls, *a: opened.append(real_for_server(cls, *a)) or opened[-1]))
    server_class = mock.create_autospec(triton_server.TritonServer)
    server_class.return_value.__enter__.return_value = server_class.return_value
    server_class.return_value.ready = mock.sentinel.ready  # set by __enter__ on a real server
    monkeypatch.setattr(triton_server, "TritonServer", server_class)
    http, grpc, metrics = free_ports(3)
    options = triton_server.ServerOptions(http_port=http, grpc_port=grpc, metrics_port=metrics, backend="ort", streams=2)
    triton_server.serve(
        export_dir, options, on_ready=lambda ready: active_when_ready.extend(s.runner.is_active for s in opened[0].served.values())
    )
    (pipeline,) = opened
    assert active_when_ready == [False, False]  # both resolutions, released before ready
    server_class.return_value.serve_forever.assert_called_once()
    assert pipeline.backends[(32, 32)] == "ort" and pipeline.describe_backends()  # the choice is kept
