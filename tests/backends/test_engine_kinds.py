"""Engines for production GPUs, built by TensorRT-RTX's real builder on this CPU host: several
optimisation profiles, version-compatible, hardware-compatible, refittable and weight-stripped,
each recorded in the fingerprint; and the choices the runner and ``package triton`` make from
what a real build recorded (deserialising an engine needs a GPU; nothing before it does)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from unittest.mock import call, create_autospec

import numpy as np
import pytest

from deploykit.backends.engine_cache import build_settings, engine_paths, read_fingerprint
from deploykit.backends.profiles import ProfileRequest, choose_profile, profiles_from_resolutions
from deploykit.backends.tensorrt import BuildOptions
from deploykit.errors import ConfigError, DeployKitError

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

THREE_PROFILES = ("1-1", "2-8", "9-32")


@pytest.fixture(scope="module")
def three_profiles(zoo_ape_export, tmp_path_factory) -> Path:
    """The zoo model's 48 px graph built by TensorRT-RTX with three batch profiles."""
    from deploykit.cli import main

    exp = shutil.copytree(zoo_ape_export, tmp_path_factory.mktemp("profiles") / "exp")
    args = ["build", str(exp), "--backend", "rtx", "-r", "48", "--opt-level", "0"]
    try:
        main([*args, *(a for p in THREE_PROFILES for a in ("--profile", p))])
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"build with three profiles failed with {exit_.code}"
    return exp


def _build(deploykit_cli, zoo_ape_export, tmp_path, *flags):
    exp = shutil.copytree(zoo_ape_export, tmp_path / "exp")
    code, err = deploykit_cli("build", exp, "--backend", "rtx", "-r", "48", "--opt-level", "0", *flags)
    return exp, code, [line for line in err.splitlines() if line.startswith("error:")]


def test_three_profiles_are_built_and_recorded(three_profiles, deploykit_cli):
    engine, fp_path = engine_paths(three_profiles / "model_48.onnx", "tensorrt_rtx")
    record = read_fingerprint(fp_path)
    # each profile as --profile named it, tuned for the largest batch of its range (--batch 1 lies in the first)
    assert record.profiles == [
        ((1, 3, 48, 48), (1, 3, 48, 48), (1, 3, 48, 48)),
        ((2, 3, 48, 48), (8, 3, 48, 48), (8, 3, 48, 48)),
        ((9, 3, 48, 48), (32, 3, 48, 48), (32, 3, 48, 48)),
    ]
    assert record.fingerprint.shapes == {"images": [list(s) for s in record.profiles[0]]}
    from deploykit.backends.inspection import inspect_path

    assert inspect_path(engine)["profiles"] == [[list(s) for s in p] for p in record.profiles]  # deploykit inspect shows each
    # a runner's loader reads the record back as the same build (for an RTX 4090: a GPU it was built for)
    from deploykit.backends.devices import Device
    from deploykit.backends.engine_cache import EngineFromPath

    rtx_4090 = Device("13.0", "580.65", "NVIDIA GeForce RTX 4090", "8.9")
    assert EngineFromPath(three_profiles / "model_48.onnx", "tensorrt_rtx", device=rtx_4090)() == engine.read_bytes()
    # and so does build: asked again, the engine is kept, not rebuilt
    before = engine.stat().st_mtime_ns
    code, err = deploykit_cli(
        "build", three_profiles, "--backend", "rtx", "-r", "48", "--opt-level", "0", *(a for p in THREE_PROFILES for a in ("--profile", p))
    )
    assert code == 0, err
    assert engine.stat().st_mtime_ns == before
    # asked with other profiles, it is refused as stale, naming the field
    code, err = deploykit_cli("build", three_profiles, "--backend", "rtx", "-r", "48", "--opt-level", "0", "--profile", "1-4")
    assert code == 1 and "build.profiles (built" in err


class _Recorded:
    """What a runner's profile choice needs from an activated engine, taken from a real build's
    record: the profiles, and an executor autospecced from Polygraphy's ``TrtRunner``."""

    @staticmethod
    def runner(profiles):
        from deploykit.backends._polygraphy import backend
        from deploykit.backends.trt_runner import TrtRunner

        executor = create_autospec(backend("tensorrt_rtx").TrtRunner, instance=True)
        executor.is_active = True  # an instance attribute Polygraphy's runner sets when activated
        executor.infer.side_effect = lambda feed: {"logits": feed["images"].reshape(len(feed["images"]), -1)[:, :4] * 2}

        class Runner(TrtRunner):
            def _activate(self):
                self._state = dict(executor=executor, inputs=["images"], profiles=profiles, profile=0, note="not requested")
                self._state["batch_range"] = (min(p[0][0] for p in profiles), max(p[2][0] for p in profiles))

        return Runner(b"", module="tensorrt_rtx"), executor


def test_runner_runs_each_call_in_the_profile_that_fits_it(three_profiles):
    record = read_fingerprint(engine_paths(three_profiles / "model_48.onnx", "tensorrt_rtx")[1])
    runner, executor = _Recorded.runner(record.profiles)
    rng = np.random.default_rng(0)
    with runner:
        for batch in (1, 5, 10, 1, 40):
            images = rng.standard_normal((batch, 3, 48, 48)).astype(np.float32)
            np.testing.assert_array_equal(runner.infer({"images": images})["logits"], images.reshape(batch, -1)[:, :4] * 2)
    # 1 → profile 0 (where the context starts); 5 → 1; 10 → 2; 1 → 0; 40 → 32 in profile 2, then 8 in profile 1
    assert executor.set_profile.call_args_list == [call(1), call(2), call(0), call(2), call(1)]
    assert [len(c.args[0]["images"]) for c in executor.infer.call_args_list] == [1, 5, 10, 1, 32, 8]
    executor.deactivate.assert_called_once_with()


def test_choice_is_the_tightest_profile_and_a_misfit_is_named():
    profiles = [((1, 3, 48, 48), (8, 3, 48, 48), (32, 3, 48, 48)), ((2, 3, 48, 48), (4, 3, 48, 48), (8, 3, 48, 48))]
    assert choose_profile(profiles, (4, 3, 48, 48)) == 1  # both fit: the one tuned nearer
    assert choose_profile(profiles, (9, 3, 48, 48)) == 0
    with pytest.raises(DeployKitError, match=r"no optimization profile of the engine takes an input of shape \[4, 3, 32, 32\]"):
        choose_profile(profiles, (4, 3, 32, 32))


def test_package_triton_names_every_profile(three_profiles, tmp_path):
    """Triton packages TensorRT engines only, which do not install here: the stand-in TensorRT
    record carries the profiles the real TensorRT-RTX build recorded."""
    import tritonclient.grpc.model_config_pb2 as model_config_pb2
    from google.protobuf import text_format

    from deploykit.backends.engine_cache import write_fingerprint
    from deploykit.export.manifest import sha256_file
    from deploykit.serve.triton_repo import RepositoryOptions, package_triton

    exp = shutil.copytree(three_profiles, tmp_path / "exp")
    rtx_record = read_fingerprint(engine_paths(exp / "model_48.onnx", "tensorrt_rtx")[1])
    engine, fp_path = engine_paths(exp / "model_48.onnx", "tensorrt")
    engine.write_bytes(b"serialized TensorRT engine")
    fingerprint = dataclasses.replace(rtx_record.fingerprint, module="tensorrt", gpu="NVIDIA L4", compute_capability="8.9")
    write_fingerprint(fp_path, fingerprint, sha256_file(engine))
    repo = package_triton(exp, tmp_path / "repo", RepositoryOptions(max_batch_size=64, preferred_batch_sizes=(8, 32)))
    config = text_format.Parse((repo / "vit_48_trt/config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert [list(g.profile) for g in config.instance_group] == [["0", "1", "2"]]
    assert config.max_batch_size == 32  # the largest batch of any profile
    single = text_format.Parse((repo / "vit_48_onnx/config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert [list(g.profile) for g in single.instance_group] == [[]]


def test_version_compatible_engine(zoo_ape_export, tmp_path, deploykit_cli):
    # TensorRT-RTX 1.7 embeds its lean runtime, whose library its wheel does not ship: refused, saying what to do
    exp, code, errors = _build(deploykit_cli, zoo_ape_export, tmp_path, "--version-compatible")
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith("error: TensorRT-RTX refused to build the engine with VERSION_COMPATIBLE: ")
    assert "libnvinfer_lean" in errors[0] and errors[0].endswith("build with --exclude-lean-runtime")
    assert not engine_paths(exp / "model_48.onnx", "tensorrt_rtx")[0].exists()
    shutil.rmtree(exp)
    exp, code, errors = _build(deploykit_cli, zoo_ape_export, tmp_path, "--version-compatible", "--exclude-lean-runtime")
    assert code == 0, errors
    record = read_fingerprint(engine_paths(exp / "model_48.onnx", "tensorrt_rtx")[1])
    assert record.fingerprint.build["version_compatible"] is True and record.fingerprint.build["exclude_lean_runtime"] is True
    assert record.lean_runtime.startswith("lean runtime not embedded: load libnvinfer_lean.so.1 of TensorRT-RTX 1.x")


@pytest.mark.parametrize(
    "flags, named",
    [(("--refittable",), "REFIT_IDENTICAL"), (("--strip-weights",), "REFIT_IDENTICAL, STRIP_PLAN")],
)
def test_rtx_refuses_refittable_engines_on_a_cpu_host(zoo_ape_export, tmp_path, deploykit_cli, flags, named):
    """TensorRT-RTX 1.7 takes the flags (they read back set) but its builder fails compiling the
    refittable graph without CUDA (Myelin's ``CHECK(status == CUDA_SUCCESS)``): one line, no engine."""
    exp, code, errors = _build(deploykit_cli, zoo_ape_export, tmp_path, *flags)
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith(f"error: TensorRT-RTX refused to build the engine with {named}: ")
    assert "CUDA_SUCCESS" in errors[0]
    assert not engine_paths(exp / "model_48.onnx", "tensorrt_rtx")[0].exists()


def test_refit_and_strip_flags_are_set_on_the_real_builder_config():
    """The TensorRT path of the flags, on a real ``IBuilderConfig`` (TensorRT-RTX's has
    TensorRT's ``BuilderFlag`` members for them), read back after deploykit sets them."""
    import tensorrt_rtx as trt

    from deploykit.backends.tensorrt import _apply_engine_kind

    config = trt.Builder(trt.Logger(trt.Logger.ERROR)).create_builder_config()
    options = BuildOptions(module="tensorrt_rtx", refittable=True, strip_weights=True, version_compatible=True)
    _apply_engine_kind(trt, config, options, "TensorRT-RTX")
    flags = trt.BuilderFlag
    assert [config.get_flag(f) for f in (flags.REFIT_IDENTICAL, flags.STRIP_PLAN, flags.VERSION_COMPATIBLE)] == [True] * 3
    assert not config.get_flag(flags.REFIT)  # REFIT_IDENTICAL, as TensorRT 11.3's release notes advise, not REFIT


def test_rtx_has_no_hardware_compatibility_level(zoo_ape_export, tmp_path, deploykit_cli):
    exp, code, errors = _build(deploykit_cli, zoo_ape_export, tmp_path, "--hardware-compatibility", "ampere_plus")
    assert code == 1
    assert errors == [
        "error: TensorRT-RTX does not build hardware-compatible engines (--hardware-compatibility ampere_plus); "
        "name the GPUs with --compute-capability instead"
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--profile", "8-2"), "--profile '8-2': each range needs 1 <= low <= high"),
        (("--profile", "1-8@32"), "--profile '1-8@32' is not BATCH-BATCH or BATCH-BATCH@RES-RES (e.g. 1-8 or 1-8@32-48)"),
        (("--profile", "1-8@32-48"), "--profile 1-8@32-48: a resolution bucket needs a graph exported over a resolution range"),
        (("--exclude-lean-runtime",), "exclude_lean_runtime (--exclude-lean-runtime) applies to version-compatible engines"),
        (("--profiles-from-resolutions",), "--profiles-from-resolutions needs a graph exported over a resolution range"),
        (("--dynamic", "--profile", "1-8"), "--dynamic is one batch profile; with --profile or --profiles-from-resolutions each"),
    ],
)
def test_bad_engine_requests_are_one_line_before_any_build(zoo_ape_export, tmp_path, deploykit_cli, flags, message):
    exp, code, errors = _build(deploykit_cli, zoo_ape_export, tmp_path, *flags)
    assert code == 1 and len(errors) == 1 and errors[0].startswith(f"error: {message}")
    assert not list(exp.glob("*.engine"))


def test_resolution_buckets_of_a_range_graph():
    graph_range = ((32, 32), (64, 64))
    requests = profiles_from_resolutions([(32, 32), (48, 48), (64, 64), (96, 96)], graph_range, (1, 8))
    assert [r.describe() for r in requests] == ["1-8@32-48", "1-8@48-64"]
    shapes = requests[1].shapes((3, 0, 0), opt_batch=4, graph_range=graph_range, tuned=(48, 48))
    assert shapes == ((1, 3, 48, 48), (4, 3, 48, 48), (8, 3, 64, 64))
    with pytest.raises(ConfigError, match="leaves the graph's range"):
        ProfileRequest.parse("1-8@16-48").shapes((3, 0, 0), 4, graph_range, (48, 48))


def test_engines_of_the_default_kind_keep_their_fingerprint():
    # Fingerprints written before these options existed hold none of them, and must still match.
    assert set(build_settings(BuildOptions())) == {"workspace_mib", "optimization_level", "min_batch", "opt_batch", "max_batch"}
    asked = build_settings(BuildOptions(refittable=True, hardware_compatibility="ampere_plus"))
    assert json.loads(json.dumps(asked))["refittable"] is True and asked["hardware_compatibility"] == "ampere_plus"


def test_a_weight_stripped_engine_is_refitted_from_its_graph(zoo_ape_export):
    """Deserialising needs a GPU, so the refit runs against TensorRT-RTX's real ``Refitter`` and
    ``OnnxParserRefitter`` classes, autospecced (their signatures are the real ones)."""
    import types

    import tensorrt_rtx as trt

    from deploykit.backends.trt_runner import refit_from_onnx

    graph = zoo_ape_export / "model_48.onnx"
    refitter, parser = create_autospec(trt.Refitter, instance=True), create_autospec(trt.OnnxParserRefitter, instance=True)
    module = types.SimpleNamespace(Refitter=create_autospec(trt.Refitter, return_value=refitter))
    module.OnnxParserRefitter = create_autospec(trt.OnnxParserRefitter, return_value=parser)
    engine, logger = object(), trt.Logger(trt.Logger.ERROR)
    parser.refit_from_file.return_value, refitter.refit_cuda_engine.return_value = True, True
    refit_from_onnx(module, engine, graph, logger)
    module.Refitter.assert_called_once_with(engine, logger)
    parser.refit_from_file.assert_called_once_with(str(graph))
    refitter.refit_cuda_engine.assert_called_once_with()
    refitter.refit_cuda_engine.return_value, refitter.get_missing_weights.return_value = False, ["blocks.0.attn.qkv.weight"]
    with pytest.raises(
        DeployKitError, match=r"did not refit the engine from model_48.onnx \(weights missing: \['blocks.0.attn.qkv.weight'\]\)"
    ):
        refit_from_onnx(module, engine, graph, logger)


def test_rtx_builds_an_engine_that_never_allocates_at_run_time(zoo_ape_export, tmp_path, deploykit_cli):
    """REQUIRE_USER_ALLOCATION (TensorRT-RTX 1.2+): no execution allocates at run time, so each can
    be captured into a CUDA graph. TensorRT-RTX's real builder builds it here; the record says so,
    and the runner made from that record judges capture by it."""
    from deploykit.backends.devices import Device
    from deploykit.backends.trt_runner import engine_runner

    exp, code, errors = _build(deploykit_cli, zoo_ape_export, tmp_path, "--require-user-allocation")
    assert code == 0, errors
    record = read_fingerprint(engine_paths(exp / "model_48.onnx", "tensorrt_rtx")[1])
    assert record.fingerprint.build["require_user_allocation"] is True and record.capture_guaranteed
    rtx_4090 = Device("13.0", "580.65", "NVIDIA GeForce RTX 4090", "8.9")
    assert engine_runner(exp / "model_48.onnx", "tensorrt_rtx", cuda_graph=True, device=rtx_4090).capture_guaranteed
    # an engine built without it carries no such guarantee, and its record keeps the fingerprint it had
    plain, code, errors = _build(deploykit_cli, zoo_ape_export, tmp_path / "plain")
    assert code == 0, errors
    record = read_fingerprint(engine_paths(plain / "model_48.onnx", "tensorrt_rtx")[1])
    assert "require_user_allocation" not in record.fingerprint.build and not record.capture_guaranteed
    assert not engine_runner(plain / "model_48.onnx", "tensorrt_rtx", cuda_graph=True, device=rtx_4090).capture_guaranteed


def test_tensorrt_has_no_require_user_allocation_flag():
    """TensorRT 11.4's BuilderFlag (the lean wheel's: the same enum as full TensorRT's) has no
    REQUIRE_USER_ALLOCATION: asked of it, the build is refused in one line before it starts."""
    import tensorrt_lean as lean
    import tensorrt_rtx as rtx

    from deploykit.backends.tensorrt import _apply_engine_kind
    from deploykit.errors import ExportError
    from tests.trt_api import strict_autospec

    assert not hasattr(lean.BuilderFlag, "REQUIRE_USER_ALLOCATION") and hasattr(rtx.BuilderFlag, "REQUIRE_USER_ALLOCATION")
    config = strict_autospec(rtx.IBuilderConfig)  # TensorRT's own builder config does not install here
    with pytest.raises(ExportError, match="^TensorRT has no builder flag REQUIRE_USER_ALLOCATION; build this engine with the other"):
        _apply_engine_kind(lean, config, BuildOptions(require_user_allocation=True), "TensorRT")
    config.set_flag.assert_not_called()


def test_the_tensorrt_path_sets_each_engine_kind_with_tensorrt_s_own_members():
    """TensorRT itself does not install here; its 11.4 enums do (the lean wheel's ``BuilderFlag``
    and ``HardwareCompatibilityLevel`` are full TensorRT's). Every kind deploykit asks of it is set
    with TensorRT's own member, on a builder config autospecced from the real class, and read back."""
    import tensorrt_lean as lean
    import tensorrt_rtx as rtx

    from deploykit.backends.tensorrt import _apply_engine_kind
    from tests.trt_api import strict_autospec

    config = strict_autospec(rtx.IBuilderConfig)  # TensorRT's own builder config class does not install here
    held = set()
    config.set_flag.side_effect, config.get_flag.side_effect = held.add, held.__contains__
    options = BuildOptions(
        refittable=True, strip_weights=True, version_compatible=True, exclude_lean_runtime=True, hardware_compatibility="ampere_plus"
    )
    _apply_engine_kind(lean, config, options, "TensorRT")
    names = ("VERSION_COMPATIBLE", "EXCLUDE_LEAN_RUNTIME", "REFIT_IDENTICAL", "STRIP_PLAN")
    assert held == {getattr(lean.BuilderFlag, n) for n in names} and options.engine_flags == names
    assert config.hardware_compatibility_level == lean.HardwareCompatibilityLevel.AMPERE_PLUS
    config.get_flag.side_effect = lambda flag: False  # a config that did not take a flag is refused before the build
    from deploykit.errors import ExportError

    with pytest.raises(ExportError, match="^TensorRT did not take the builder flag VERSION_COMPATIBLE$"):
        _apply_engine_kind(lean, config, options, "TensorRT")
