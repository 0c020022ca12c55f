"""``deploykit package triton``: a Triton model repository for production (GPU) hosts.

For every exported resolution ``<res>`` (``224``, ``384x256``, ...)::

    vit_<res>_trt/       platform tensorrt_plan; 1/model.plan: the TensorRT engine
                         ``deploykit build --backend trt`` wrote (model_<res>.trt.engine, checked
                         against its fingerprint), else to build on the serving host (README)
    vit_<res>_onnx/      platform onnxruntime_onnx; 1/model.onnx (the exported graph)
    vit_<res>_openvino/  backend openvino (CPU instances); 1/model.onnx: the graph deploykit's OpenVINO
                         runner reads (``openvino_source``: model-local functions inlined, since
                         OpenVINO's reader has no rule for SaPE²'s custom node; qkv as three products);
                         INFERENCE_PRECISION_HINT f32 and PERFORMANCE_HINT LATENCY as parameters
    preprocess_<res>/    Python backend: encoded image bytes -> [3, H, W] float32 (deploykit.inputs.imaging,
                         copied beside model.py: the pipeline's own preprocessing)
    classify_<res>_trt/  ensemble: preprocess_<res> -> vit_<res>_trt   (bytes in, logits out)
    classify_<res>_onnx/ ensemble: preprocess_<res> -> vit_<res>_onnx
    classify_<res>_openvino/ ensemble: preprocess_<res> -> vit_<res>_openvino
    README.md            how to build the engines, and SaPE2's custom op under Triton

Every ``config.pbtxt`` is built as Triton's own ``ModelConfig`` protobuf messages (from
``tritonclient``, the ``serve`` extra) and written in protobuf text format. Each has dynamic
batching, an instance group, a zero-data warm-up and (for TensorRT) CUDA graphs for the
preferred batch sizes. The repository is written to a temporary
directory beside ``--output`` and renamed into place, so a failure leaves nothing behind.

TensorRT-RTX engines (``model_<res>.rtx.engine``) are not copied: Triton's ``tensorrt_plan``
platform loads TensorRT engines only. When one is all that was built, the README and a warning
say so and how to build the TensorRT engine instead.

Plugins: an engine whose plugin layers all carry their compiled kernel (an ahead-of-time quickly
deployable plugin, as deploykit's SaPE² plugin, ``--plugins sape2``) needs nothing where Triton
deserializes it: NVIDIA documents that such an engine "does not require any Python modules or
definitions to be present at runtime" and runs on the standard TensorRT runtime (trtexec), so it
is packaged as it is. Other plugin layers need their plugin registered: Triton's TensorRT backend
loads plugin shared libraries (``--backend-config=tensorrt,plugins="a.so;b.so"``), not Python,
so an engine with layers of a Python plugin that runs Python at inference is refused in one line
naming the fix; plugin libraries, given again with ``plugins`` and checked against the engine's
fingerprint, are copied into ``plugins/`` with the server flag to load them in the README. The
README also names the TensorRT version and GPU each engine was built with: Triton's container
must carry that TensorRT.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from deploykit._io import directory_beside
from deploykit._lazy import lazy_import
from deploykit.catalog import OUTPUT_NAME
from deploykit.errors import ConfigError, DeployKitError, unknown_choice
from deploykit.export.manifest import Manifest
from deploykit.inputs import imaging
from deploykit.inputs.resolutions import resolution_tag
from deploykit.serve import defaults
from deploykit.serve.classifier import INPUT_NAME, ImageLimits, read_image_config

PREPROCESS_MODEL_SOURCE = Path(__file__).with_name("triton_preprocess_model.py")
PLUGIN_DIR = "plugins"  # plugin libraries the TensorRT engines need, loaded by tritonserver
IMAGING_MODULE = "deploykit_imaging"  # the name the Python models import deploykit/inputs/imaging.py by

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RepositoryOptions:
    """Settings written into every ``config.pbtxt``.

    Attributes:
        max_batch_size: largest batch per request and per merged execution.
        preferred_batch_sizes: what the dynamic batcher aims for; also the CUDA-graph sizes.
        max_queue_delay_us: how long the batcher waits to fill a batch.
        gpu_instances: model instances per GPU (TensorRT and the GPU ONNX variant).
        onnx_kind: ``"gpu"`` or ``"cpu"`` instances for the ONNX Runtime variant.
        preprocess_instances: CPU instances of the Python preprocessing model.
        limits: the largest image the preprocessing models decode (pixels, encoded bytes).
    """

    max_batch_size: int = defaults.MAX_BATCH_SIZE
    preferred_batch_sizes: tuple[int, ...] = defaults.PREFERRED_BATCH_SIZES
    max_queue_delay_us: int = defaults.MAX_QUEUE_DELAY_US
    gpu_instances: int = defaults.GPU_INSTANCES
    onnx_kind: str = defaults.ONNX_KIND
    preprocess_instances: int = 2
    limits: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        if self.onnx_kind not in defaults.ONNX_KINDS:
            raise ConfigError(unknown_choice("instance kind", self.onnx_kind, defaults.ONNX_KINDS))
        if not all(1 <= b <= self.max_batch_size for b in self.preferred_batch_sizes):
            raise ConfigError(f"preferred batch sizes {self.preferred_batch_sizes} must lie in 1..{self.max_batch_size}")
        if min(self.gpu_instances, self.preprocess_instances) < 1 or self.max_queue_delay_us < 0:
            raise ConfigError("instance counts must be >= 1 and the queue delay >= 0")


def _pb():
    """Triton's ``ModelConfig`` protobuf module (the ``serve`` extra), imported on first use."""
    return lazy_import("tritonclient.grpc.model_config_pb2")


def _text(config) -> str:
    """A ``ModelConfig`` message as ``config.pbtxt`` (protobuf text format, as Triton reads it)."""
    from google.protobuf import text_format

    return text_format.MessageToString(config)


def _tensor(cls, name: str, dtype: str, shape):
    """A ``ModelInput``/``ModelOutput`` (``cls``) of that name, ``TYPE_*`` data type and dims."""
    return cls(name=name, data_type=_pb().DataType.Value(dtype), dims=[int(d) for d in shape])


def _batching(opts: RepositoryOptions):
    return _pb().ModelDynamicBatching(
        preferred_batch_size=list(opts.preferred_batch_sizes), max_queue_delay_microseconds=opts.max_queue_delay_us
    )


def _warmup(input_name: str, dtype: str, shape, batch_sizes) -> list:
    pb = _pb()
    sample = pb.ModelWarmup.Input(data_type=pb.DataType.Value(dtype), dims=[int(d) for d in shape], zero_data=True)
    return [pb.ModelWarmup(name=f"zeros_batch{b}", batch_size=b, count=2, inputs={input_name: sample}) for b in batch_sizes]


def vit_config(name: str, platform: str, shape, num_classes: int, kind: str, opts: RepositoryOptions, profiles: int = 1) -> str:
    """``config.pbtxt`` of one inference model (``tensorrt_plan`` or ``onnxruntime_onnx``); an
    engine of several optimization ``profiles`` has every one named in its instance group, since
    Triton runs profile 0 alone unless told (it then picks, per request, the one that fits)."""
    pb = _pb()
    config = pb.ModelConfig(
        name=name,
        platform=platform,
        max_batch_size=opts.max_batch_size,
        input=[_tensor(pb.ModelInput, INPUT_NAME, "TYPE_FP32", shape)],
        output=[_tensor(pb.ModelOutput, OUTPUT_NAME, "TYPE_FP32", [num_classes])],
        instance_group=[
            pb.ModelInstanceGroup(
                kind=pb.ModelInstanceGroup.Kind.Value(f"KIND_{kind.upper()}"),
                count=opts.gpu_instances if kind == "gpu" else 1,
                profile=[str(i) for i in range(profiles)] if profiles > 1 else [],
            )
        ],
        dynamic_batching=_batching(opts),
        model_warmup=_warmup(INPUT_NAME, "TYPE_FP32", shape, [1, max(opts.preferred_batch_sizes)]),
    )
    if platform == "tensorrt_plan":
        # CUDA graphs replay one captured launch sequence per batch size: the kernel-launch
        # overhead of a small ViT's many short kernels is paid once at load instead of per call.
        cuda = pb.ModelOptimizationPolicy.Cuda
        specs = [cuda.GraphSpec(batch_size=b) for b in sorted({1, *opts.preferred_batch_sizes})]
        config.optimization.cuda.CopyFrom(cuda(graphs=True, busy_wait_events=True, graph_spec=specs))
    return _text(config)


# What deploykit's own OpenVINO runner sets (deploykit.backends.openvino): an explicit f32 hint, so
# the served model computes what validate checked, whatever the serving CPU would default to.
OPENVINO_PARAMETERS = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}


def openvino_config(name: str, shape, num_classes: int, opts: RepositoryOptions) -> str:
    """``config.pbtxt`` of one model for Triton's OpenVINO backend (CPU instances, the ONNX file read directly)."""
    pb = _pb()
    config = pb.ModelConfig(
        name=name,
        backend="openvino",
        default_model_filename="model.onnx",
        max_batch_size=opts.max_batch_size,
        input=[_tensor(pb.ModelInput, INPUT_NAME, "TYPE_FP32", shape)],
        output=[_tensor(pb.ModelOutput, OUTPUT_NAME, "TYPE_FP32", [num_classes])],
        instance_group=[pb.ModelInstanceGroup(kind=pb.ModelInstanceGroup.KIND_CPU, count=1)],
        dynamic_batching=_batching(opts),
        model_warmup=_warmup(INPUT_NAME, "TYPE_FP32", shape, [1, max(opts.preferred_batch_sizes)]),
        parameters={k: pb.ModelParameter(string_value=v) for k, v in OPENVINO_PARAMETERS.items()},
    )
    return _text(config)


def preprocess_config(name: str, resolution: tuple[int, int], config, opts: RepositoryOptions) -> str:
    """``config.pbtxt`` of the Python preprocessing model (settings passed as parameters)."""
    pb = _pb()
    params = dict(
        height=resolution[0],
        width=resolution[1],
        preprocessing=json.dumps(config.preprocessing.to_dict()),
        max_pixels=opts.limits.max_pixels,
        max_bytes=opts.limits.max_bytes,
        max_request_pixels=opts.limits.request_pixels,
    )
    return _text(
        pb.ModelConfig(
            name=name,
            backend="python",
            max_batch_size=opts.max_batch_size,
            input=[_tensor(pb.ModelInput, imaging.ENCODED_INPUT, "TYPE_STRING", [1])],
            output=[_tensor(pb.ModelOutput, INPUT_NAME, "TYPE_FP32", (config.in_chans, *resolution))],
            instance_group=[pb.ModelInstanceGroup(kind=pb.ModelInstanceGroup.KIND_CPU, count=opts.preprocess_instances)],
            parameters={k: pb.ModelParameter(string_value=str(v)) for k, v in params.items()},
        )
    )


def ensemble_config(name: str, preprocess: str, model: str, num_classes: int, opts: RepositoryOptions) -> str:
    """``config.pbtxt`` of an ensemble: image bytes → ``preprocess`` → ``model`` → logits."""
    pb = _pb()
    step = pb.ModelEnsembling.Step
    return _text(
        pb.ModelConfig(
            name=name,
            platform="ensemble",
            max_batch_size=opts.max_batch_size,
            input=[_tensor(pb.ModelInput, imaging.ENCODED_INPUT, "TYPE_STRING", [1])],
            output=[_tensor(pb.ModelOutput, OUTPUT_NAME, "TYPE_FP32", [num_classes])],
            ensemble_scheduling=pb.ModelEnsembling(
                step=[
                    step(
                        model_name=preprocess,
                        model_version=-1,
                        input_map={imaging.ENCODED_INPUT: imaging.ENCODED_INPUT},
                        output_map={INPUT_NAME: "preprocessed"},
                    ),
                    step(model_name=model, model_version=-1, input_map={INPUT_NAME: "preprocessed"}, output_map={OUTPUT_NAME: OUTPUT_NAME}),
                ]
            ),
        )
    )


@dataclass(frozen=True)
class FoundEngines:
    """What ``deploykit build`` wrote beside one graph, as packaging uses it.

    Attributes:
        engine: the TensorRT engine, None when not built.
        batches: its profile's ``(min, max)`` batch.
        built_with: ``TensorRT <version> on <GPU> (compute capability <cc>)``.
        libraries: plugin libraries the engine's plugin layers need (given, hash-checked).
        rtx_engine: a TensorRT-RTX engine beside the graph, None when not built.
        embedded_plugin_layers: plugin layers that carry their kernel (they need no plugin in Triton).
        profiles: how many optimization profiles the engine has (``batches`` spans them all).
    """

    engine: Path | None = None
    batches: tuple[int, int] | None = None
    built_with: str = ""
    libraries: tuple[Path, ...] = ()
    rtx_engine: Path | None = None
    embedded_plugin_layers: int = 0
    profiles: int = 1


def _find_engines(graph: Path, plugins) -> FoundEngines:
    """The engines ``deploykit build`` wrote beside ``graph``. A TensorRT engine must match its
    fingerprint's hashes (the graph it was built from, and its own bytes), and an engine whose
    plugin layers need their plugin at load the plugins it was built with, as libraries Triton
    can load; or packaging is refused."""
    from deploykit.backends.engine_cache import engine_paths, read_fingerprint
    from deploykit.backends.plugins import check_plugins
    from deploykit.errors import StaleEngineError
    from deploykit.export.manifest import sha256_file

    trt_engine, fp_path = engine_paths(graph, "tensorrt")
    rtx_engine = engine_paths(graph, "tensorrt_rtx")[0]
    rtx_engine = rtx_engine if rtx_engine.is_file() else None
    if not trt_engine.is_file():
        return FoundEngines(rtx_engine=rtx_engine)
    record = read_fingerprint(fp_path)
    stored = record.fingerprint
    hint = f"rebuild with: deploykit build {graph.parent} --backend trt --rebuild"
    if stored.onnx_sha256 != sha256_file(graph):
        raise StaleEngineError(f"{trt_engine}: the graph changed since the engine was built; {hint}")
    if record.engine_sha256 != sha256_file(trt_engine):
        raise StaleEngineError(f"{trt_engine} changed since it was built; {hint}")
    if record.weights_stripped:  # Triton deserializes the engine as it is: a stripped one would run without its weights
        raise DeployKitError(
            f"{trt_engine.name} is weight-stripped (deploykit build --strip-weights), and Triton's TensorRT backend loads an engine "
            f"as it is, without refitting it; for Triton, build it with its weights (deploykit build {graph.parent} --backend trt "
            "--rebuild), or serve it with deploykit serve, which refits it"
        )
    libraries: tuple[Path, ...] = ()
    if record.plugin_layers and not record.self_contained:
        if record.installed_plugins or any(s.kind != "library" for s in plugins.sources):
            raise DeployKitError(
                f"{trt_engine.name} runs {record.plugin_layers - record.embedded_plugin_layers} layer(s) as TensorRT Python plugins "
                f"({', '.join(record.plugins)}) that do not carry their kernel (run at inference, or recorded before deploykit "
                "recorded it), which Triton's TensorRT backend cannot load (it loads plugin libraries); for Triton, rebuild it "
                f"(deploykit build {graph.parent} --backend trt --rebuild: with an ahead-of-time plugin such as --plugins sape2 "
                "the kernel is embedded; without --plugins TensorRT inlines the op's ONNX body), or serve it with deploykit serve"
            )
        check_plugins(trt_engine, stored.plugin_sha256, record.plugins, plugins, f"pass them to package triton with --plugins; {hint}")
        libraries = tuple(s.path for s in plugins.sources)
    from deploykit.backends.profiles import batch_range

    profiles = record.profiles  # every profile's [min, opt, max] of the input
    built_with = f"TensorRT {stored.trt_version} on {stored.gpu} (compute capability {stored.compute_capability})"
    embedded = record.plugin_layers if record.self_contained else 0
    return FoundEngines(trt_engine, batch_range(profiles), built_with, libraries, rtx_engine, embedded, len(profiles))


def _write_openvino_graph(graph: Path, dest: Path) -> None:
    """The graph deploykit's OpenVINO runner reads (``openvino_source``): the file itself, or as
    rewritten in memory for OpenVINO."""
    from deploykit.backends.openvino import openvino_source

    source = openvino_source(graph, "f32").graph
    if isinstance(source, bytes):
        dest.write_bytes(source)
    else:
        shutil.copyfile(graph, dest)


def _fit_to_engine(opts: RepositoryOptions, batches: tuple[int, int], engine: Path) -> RepositoryOptions:
    """The TensorRT model's settings within the engine's batch range: Triton refuses a
    ``max_batch_size`` above the engine's profile, and sends any batch from 1."""
    low, high = batches
    if low > 1:
        raise ConfigError(
            f"{engine} takes batches {low}-{high} only, but Triton sends any batch from 1; build it with --dynamic (a batch profile from 1)"
        )
    preferred = tuple(b for b in opts.preferred_batch_sizes if b <= high) or (high,)
    return dataclasses.replace(opts, max_batch_size=min(opts.max_batch_size, high), preferred_batch_sizes=preferred)


def copy_python_model(source: Path, version_dir: Path) -> None:
    """Copy a Python-backend model into ``version_dir`` as ``model.py``, with ``deploykit/inputs/imaging.py``
    beside it (the Python backend puts the version directory on ``sys.path``)."""
    shutil.copyfile(source, version_dir / "model.py")
    shutil.copyfile(imaging.__file__, version_dir / f"{IMAGING_MODULE}.py")


def _write_resolution(repo: Path, export_dir: Path, entry, config, opts: RepositoryOptions, plugins) -> dict:
    """Write the five models of one resolution; return what the README should say about it."""
    found = _find_engines(export_dir / entry.file, plugins)
    engine, batches, rtx_engine = found.engine, found.batches, found.rtx_engine
    for library in found.libraries:  # one copy per library, shared by every engine that needs it
        (repo / PLUGIN_DIR).mkdir(exist_ok=True)
        shutil.copyfile(library, repo / PLUGIN_DIR / library.name)
    trt_opts = _fit_to_engine(opts, batches, engine) if engine else opts
    res, tag = tuple(entry.resolution), resolution_tag(tuple(entry.resolution))
    shape = (config.in_chans, *res)
    names = {"trt": f"vit_{tag}_trt", "onnx": f"vit_{tag}_onnx", "openvino": f"vit_{tag}_openvino", "pre": f"preprocess_{tag}"}
    files = {
        f"{names['trt']}/config.pbtxt": vit_config(
            names["trt"], "tensorrt_plan", shape, config.num_classes, "gpu", trt_opts, found.profiles
        ),
        f"{names['onnx']}/config.pbtxt": vit_config(names["onnx"], "onnxruntime_onnx", shape, config.num_classes, opts.onnx_kind, opts),
        f"{names['openvino']}/config.pbtxt": openvino_config(names["openvino"], shape, config.num_classes, opts),
        f"{names['pre']}/config.pbtxt": preprocess_config(names["pre"], res, config, opts),
    }
    for variant, variant_opts in (("trt", trt_opts), ("onnx", opts), ("openvino", opts)):
        name = f"classify_{tag}_{variant}"
        files[f"{name}/config.pbtxt"] = ensemble_config(name, names["pre"], names[variant], config.num_classes, variant_opts)
        (repo / name / "1").mkdir(parents=True)  # ensembles need an (empty) version directory
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    (repo / names["onnx"] / "1").mkdir()
    shutil.copyfile(export_dir / entry.file, repo / names["onnx"] / "1" / "model.onnx")
    (repo / names["openvino"] / "1").mkdir()
    _write_openvino_graph(export_dir / entry.file, repo / names["openvino"] / "1" / "model.onnx")
    (repo / names["pre"] / "1").mkdir()
    copy_python_model(PREPROCESS_MODEL_SOURCE, repo / names["pre"] / "1")
    (repo / names["trt"] / "1").mkdir()
    if engine:
        shutil.copyfile(engine, repo / names["trt"] / "1" / "model.plan")
    elif rtx_engine:
        _log.warning(
            "%s is a TensorRT-RTX engine; Triton's tensorrt_plan needs a TensorRT engine, so %s/1/model.plan is "
            "left to build (see the repository's README)",
            rtx_engine.name,
            names["trt"],
        )
    return {
        "tag": tag,
        "res": res,
        "onnx": entry.file,
        "trt": names["trt"],
        "engine": engine.name if engine else None,
        "built_with": found.built_with,
        "libraries": [library.name for library in found.libraries],
        "embedded": found.embedded_plugin_layers,
        "rtx_engine": rtx_engine.name if rtx_engine and not engine else None,
    }


def package_triton(
    export_dir: str | os.PathLike, output: str | os.PathLike, options: RepositoryOptions = RepositoryOptions(), plugins=None
) -> Path:
    """Write a Triton model repository for every resolution of an export directory.

    Args:
        export_dir: written by ``deploykit export``.
        output: the repository directory to create; must not exist or be empty.
        options: batching, instances, warm-up settings.
        plugins: the plugin libraries the TensorRT engines were built with (``Plugins``), copied
            into the repository; none by default.

    Returns:
        The repository path.

    Raises:
        DeployKitError: not an export directory, ``output`` exists and is not empty, or an
            engine needs plugins Triton cannot load (Python ones) or that were not given.
    """
    from deploykit.backends.plugins import Plugins
    from deploykit.export.directory import ExportDir

    export_dir, output = Path(export_dir), Path(output)
    manifest = ExportDir(export_dir).manifest()
    config = read_image_config(export_dir, manifest)
    entries = [(entry, ExportDir(export_dir).graph(entry, manifest.encoding)) for entry in manifest.graphs_at("fp32")]
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DeployKitError(f"{output} already exists and is not an empty directory; choose another --output")
    tmp = directory_beside(output)
    try:
        notes = [_write_resolution(tmp, export_dir, entry, config, options, plugins or Plugins()) for entry, _ in entries]
        (tmp / "README.md").write_text(_readme(manifest, notes, options))
        if output.exists():
            output.rmdir()  # empty (checked above)
        os.replace(tmp, output)
    except OSError as err:
        raise DeployKitError(f"cannot write {output}: {err.strerror or err}") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def _readme(manifest: Manifest, notes: list[dict], opts: RepositoryOptions) -> str:
    libraries = sorted({name for n in notes for name in n["libraries"]})
    # Triton's TensorRT backend takes several libraries as one ';'-separated value, quoted (its
    # README: plugins="/path/plugin1.so;/path2/plugin2.so"): an unquoted ';' ends the shell command.
    paths = ";".join(f"$PWD/{PLUGIN_DIR}/{name}" for name in libraries)
    load = f' --backend-config=tensorrt,plugins="{paths}"' if libraries else ""
    lines = [
        "# Triton model repository (written by `deploykit package triton`)",
        "",
        f"Encoding `{manifest.encoding}`, weights sha256 `{manifest.weights_sha256[:16]}…`. Serve with",
        "",
        f"    tritonserver --model-repository=$PWD{load}",
        "",
        "Send encoded image bytes (input `image`, TYPE_STRING) to `classify_<res>_trt`, `classify_<res>_onnx` or",
        "`classify_<res>_openvino`; preprocessed float32 `[B, 3, H, W]` tensors (input `images`) to `vit_<res>_trt` /",
        "`vit_<res>_onnx` / `vit_<res>_openvino`. The `_openvino` models run on CPU with Triton's OpenVINO backend,",
        f"{', '.join(f'{k} {v}' for k, v in OPENVINO_PARAMETERS.items())} (what `deploykit validate --backend openvino` checked).",
        "",
        "The `preprocess_<res>` models run `deploykit_imaging.py` beside their `model.py`: the preprocessing deploykit",
        "validates with (Triton's Python backend needs numpy and Pillow). Bytes that are not an image, or an image over",
        f"{opts.limits.max_pixels} pixels or {opts.limits.max_bytes} bytes, get HTTP 400 / INVALID_ARGUMENT.",
        "",
        "## TensorRT engines",
        "",
        "An engine is specific to its GPU and TensorRT version, so build it on the serving host, and run it in a Triton",
        "container whose TensorRT is the version it was built with (NGC's Triton release notes list each container's):",
        "",
    ]
    for n in notes:
        h, w = n["res"]
        if n["engine"]:
            needs = f"; needs `{', '.join(n['libraries'])}` (in `{PLUGIN_DIR}/`, loaded by the command above)" if n["libraries"] else ""
            if n["embedded"]:
                needs = f"; its {n['embedded']} plugin layer(s) carry their compiled kernel, so it needs no plugin"
            lines.append(
                f"- `{n['trt']}/1/model.plan`: copied from `{n['engine']}` of the export directory, built with {n['built_with']}{needs}."
            )
        else:
            if n["rtx_engine"]:
                lines.append(
                    f"- `{n['rtx_engine']}` (TensorRT-RTX) was not copied: Triton's `tensorrt_plan` platform loads "
                    "TensorRT engines only. Build a TensorRT engine (`deploykit build <export> --backend trt`, "
                    "then package again) or:"
                )
            lines.append(
                f"- `{n['trt']}/1/model.plan`: `trtexec --onnx=vit_{n['tag']}_onnx/1/model.onnx --saveEngine={n['trt']}/1/model.plan "
                f"--minShapes=images:1x3x{h}x{w} --optShapes=images:{max(opts.preferred_batch_sizes)}x3x{h}x{w} "
                f"--maxShapes=images:{opts.max_batch_size}x3x{h}x{w} --stronglyTyped` (precision is decided in the ONNX graph)"
            )
    lines += [
        "",
        "## SaPE² plugin",
        "",
        "Graphs with SaPE² carry the custom op `deploykit::SaPE2Bias`, a model-local ONNX function. deploykit's plugin for it",
        "(`deploykit build --plugins sape2`) is a TensorRT quickly deployable plugin with an ahead-of-time implementation: its",
        "kernel is compiled to PTX for the GPU the engine is built on and embedded in the engine, which then needs no plugin",
        "library, Python or Triton where it is loaded (NVIDIA: such an engine runs on the standard TensorRT runtime, as in",
        "trtexec), so Triton's TensorRT backend loads it as it is. Built without `--plugins`, TensorRT inlines the op's",
        "plain-ONNX body. ONNX Runtime always runs the function body, so the `_onnx` variants need no plugin. An engine",
        "built with a plugin library of your own (`deploykit build --plugins lib.so`) is packaged with `--plugins lib.so`:",
        "the library is copied into `plugins/` and loaded by the command at the top.",
        f"This export's encoding: `{manifest.encoding}`"
        + (" (has the op)." if manifest.encoding.startswith("sape2") else " (no custom op)."),
    ]
    return "\n".join(lines) + "\n"
