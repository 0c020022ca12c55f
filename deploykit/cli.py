"""The ``deploykit`` command: parse options, call one library function, print the result.

Every ``DeployKitError`` (bad path, corrupt checkpoint, bad resolution, failed check) becomes a
one-line message on stderr and exit code 1, with no traceback. Library imports happen inside
the commands so ``deploykit --help`` starts fast.

Over 400 lines on purpose: one short function per command, and most of the length is click's
option declarations (names, types, help), which read best beside the command they belong to.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from deploykit.cli_options import FiniteFloat, Group, counts_option, parse_counts, resolutions_option, show_error, verbosity
from deploykit.errors import DeployKitError
from deploykit.export import defaults
from deploykit.export.defaults import PLAN_NAMES


class _Resolution(click.ParamType):
    """``224`` or ``384x256`` (height x width)."""

    name = "RESOLUTION"

    def convert(self, value, param, ctx):
        from deploykit.resolutions import parse_resolution

        try:
            return parse_resolution(value)
        except DeployKitError as err:
            self.fail(str(err), param, ctx)


RESOLUTION = _Resolution()


class _ResolutionRange(click.ParamType):
    """``224:384:512`` (min:opt:max; each side may be ``HxW``) → three ``(height, width)``."""

    name = "MIN:OPT:MAX"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        from deploykit.resolutions import parse_resolution

        parts = str(value).split(":")
        if len(parts) != 3:
            self.fail(f"{value!r} is not MIN:OPT:MAX, e.g. 224:384:512", param, ctx)
        try:
            return tuple(parse_resolution(p) for p in parts)
        except DeployKitError as err:
            self.fail(str(err), param, ctx)


CPU_FALLBACK_HELP = "ort-cuda: accept nodes ONNX Runtime runs on the CPU instead of refusing (records name them)."
PLUGINS_HELP = (
    "Repeatable: a directory of Python TensorRT plugins, a plugin library (.so), or an installed plugin's name "
    "(e.g. sape2). An engine runs with the plugins it was built with: installed ones (sape2) load by "
    "themselves; a library or directory must be given again."
)


def _image_limit_options(command):
    """``--max-image-pixels`` / ``--max-image-bytes``: what one image may cost before it is decoded."""
    from deploykit.imaging import MAX_BYTES, MAX_PIXELS

    command = click.option("--max-image-bytes", default=MAX_BYTES, show_default=True, help="Largest encoded image accepted, in bytes.")(
        command
    )
    return click.option(
        "--max-image-pixels",
        default=MAX_PIXELS,
        show_default=True,
        help="Largest image (height x width) decoded; larger ones are refused (HTTP 400) from their header.",
    )(command)


def _console():
    from rich.console import Console

    # soft_wrap: a line is never broken at the console width (80 columns when not a terminal),
    # so logs and greps see whole lines whatever the width and the path lengths.
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _steps(console, title: str):
    """``deploykit._terminal.steps`` at the verbosity of the ``-q``/``-v`` options."""
    from deploykit._terminal import steps

    return steps(console, title, verbosity())


_SET_OPTION = click.option(
    "--set",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Repeatable encoding option, typed and checked against the encoding's config (e.g. antialias=false).",
)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deploykit")
def cli():
    """Vision Transformers with novel positional encodings, from PyTorch to served engines.

    Every command takes -q and -v, before or after its name."""
    from deploykit._terminal import configure_logging

    configure_logging(verbosity())  # -q/-v given here were applied as they were parsed; this is the default


@cli.command()
@click.option("--encoding", "-e", default=None, help="Encoding for a new/default model (ape, rope-axial, rope-mixed, ...).")
@click.option("--model", "model_name", default=None, help="Model size when building from --encoding (default vit_tiny_patch16).")
@click.option(
    "--checkpoint",
    "-c",
    type=click.Path(path_type=Path),
    default=None,
    help="Model directory (config.json + model.safetensors) or weights file (.safetensors, .pt).",
)
@resolutions_option(help="Default: the model's img_size.")
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True, help="Export directory.")
@click.option("--opset", type=int, default=None, help="ONNX opset, 17 to 25 (default 18; SaPE² needs 18).")
@click.option(
    "--precision",
    "precisions",
    type=click.Choice(PLAN_NAMES),
    multiple=True,
    help="Repeatable precision plan written beside fp32: fp16/bf16 (casts), int8 (Q/DQ, calibrated; ORT and TensorRT), "
    "int8-dynamic, int8-mha and fp32-mha (ONNX Runtime only). Tables, rotations, gates, LayerNorm, Softmax, logits stay float.",
)
@click.option(
    "--calibration-data",
    type=click.Path(path_type=Path),
    default=None,
    help="int8: your inputs: a folder of images (recursive), a text file listing image paths, or a .npy/.npz of "
    "preprocessed arrays; split into calibration and held-out inputs (default: a zoo model's dataset, else crops of "
    "the bundled images).",
)
@click.option(
    "--calibration-samples",
    type=click.IntRange(min=1),
    default=defaults.CALIBRATION_SAMPLES,
    show_default=True,
    help="int8: real inputs to calibrate on (the rest of --calibration-data is held out).",
)
@click.option(
    "--calibration-method",
    type=click.Choice(["minmax", "percentile", "entropy"]),
    default=defaults.CALIBRATION_METHOD,
    show_default=True,
    help="int8: how activation ranges are chosen from the calibration inputs.",
)
@click.option(
    "--min-agreement",
    type=click.FloatRange(0, 1),
    default=defaults.MIN_AGREEMENT,
    show_default=True,
    help="int8: top-1 agreement with fp32 to reach on held-out inputs, moving the most sensitive matmuls back to float "
    "(0: quantize every eligible matmul).",
)
@click.option(
    "--held-out",
    type=click.IntRange(min=1),
    default=defaults.HELD_OUT,
    show_default=True,
    help="int8: held-out inputs (a zoo model's val split, else other crops) the plan is checked on.",
)
@click.option(
    "--min-cosine",
    type=click.FloatRange(0, 1, min_open=True),
    default=defaults.MIN_COSINE,
    show_default=True,
    help="int8, features models (num_classes=0): mean per-token cosine with fp32 to reach on held-out inputs.",
)
@click.option(
    "--max-relative-error",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="int8, features models: also a mean per-token relative error with fp32 to stay under.",
)
@click.option(
    "--keep-float",
    "keep_float",
    multiple=True,
    metavar="PATTERN",
    help="int8: repeatable; keep the layers whose module path matches float (wildcards: blocks.*.mlp.fc2, blocks.11.*).",
)
@click.option(
    "--int8-attention",
    is_flag=True,
    help="int8: quantize the attention products too (faster at high resolution; measured to cost top-1 agreement "
    "away from the training resolution, so off by default).",
)
@click.option(
    "--resolution-range",
    "resolution_range",
    type=_ResolutionRange(),
    default=None,
    help="Also one graph for any resolution in MIN:OPT:MAX (e.g. 224:384:512; RoPE, GridPE, GeoPE).",
)
@_SET_OPTION
@click.option(
    "--force",
    is_flag=True,
    help="Delete files in --output that deploykit did not write (each is named); without it the export is refused naming them.",
)
def export(
    encoding,
    model_name,
    checkpoint,
    resolutions,
    output,
    opset,
    precisions,
    calibration_data,
    calibration_samples,
    calibration_method,
    min_agreement,
    held_out,
    min_cosine,
    max_relative_error,
    keep_float,
    int8_attention,
    resolution_range,
    options,
    force,
):
    """Export a model to one ONNX graph per resolution, tables baked in, graph linted."""
    from deploykit.export import DEFAULT_OPSET
    from deploykit.export import export as export_model
    from deploykit.export.int8_static import CalibrationOptions
    from deploykit.inputs import UserCalibration, read_inputs
    from deploykit.profile.choice import CPU_SPEED_PLANS, plans_slower_than_fp32
    from deploykit.resolutions import resolution_tag
    from deploykit.zoo.resolve import resolve_model

    console = _console()
    model, source = resolve_model(checkpoint=checkpoint, encoding=encoding, model_name=model_name, options=options)
    resolutions = resolutions or ([] if resolution_range else [model.default_shape])
    calibration = CalibrationOptions(
        samples=calibration_samples,
        method=calibration_method,
        min_agreement=min_agreement or None,
        held_out=held_out,
        attention=True if int8_attention else None,
        keep_float=keep_float,
        min_cosine=min_cosine,
        max_relative_error=max_relative_error,
        data=UserCalibration(read_inputs(calibration_data)) if calibration_data else None,
    )
    with _steps(console, "export") as step:
        manifest = export_model(
            model,
            resolutions,
            output,
            opset=DEFAULT_OPSET if opset is None else opset,
            precisions=precisions,  # fp32 is always written; these go beside it
            source=source,
            progress=step,
            resolution_range=resolution_range,
            calibration=calibration,
            force=force,
        )
    for graph in manifest.graphs:
        where = resolution_tag(graph.resolution)
        if graph.resolution_range:
            where = f"{' to '.join(resolution_tag(r) for r in graph.resolution_range)}, tuned for {where}"
        console.print(f"[green]✓[/] {output / graph.file}  ({where}, {graph.precision}, opset {graph.opset})", soft_wrap=True)
        _print_plan(console, graph.quantization)
    if any(p in CPU_SPEED_PLANS for p in precisions):
        with _steps(console, "export") as step:
            step("timing the CPU plans against fp32 (ONNX Runtime, batch 1)")
            slower = plans_slower_than_fp32(output)
        for line in slower:
            console.print(f"note: {line} (deploykit profile measures every batch)", soft_wrap=True, markup=False)


def _print_plan(console, details: dict | None) -> None:
    """A quantized graph's plan, indented under its line: what stayed float and why, by module."""
    from deploykit.export.int8_check import describe_plan

    for line in describe_plan(details) if details else []:
        console.print(f"  {line}", soft_wrap=True)


@cli.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@resolutions_option(help="Default: every exported one.")
@click.option(
    "--backend",
    "-b",
    "backends",
    multiple=True,
    default=("ort",),
    show_default=True,
    help="Repeatable: ort, ort-cuda, openvino (f32 hint), openvino-bf16 (CPUs with bf16), trt, rtx (trt/rtx run the engines "
    "deploykit build wrote).",
)
@click.option(
    "--precision",
    type=click.Choice(PLAN_NAMES),
    default="fp32",
    show_default=True,
    help="Which exported plan to check, and its tolerance (int8: cosine and top-1/top-5 agreement on the real inputs).",
)
@click.option(
    "--inputs",
    "inputs_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Your real inputs: a folder of images (recursive), a text file listing image paths, or a .npy/.npz of "
    "preprocessed arrays; images are preprocessed as the model's config says, as served.",
)
@click.option("--num-random", type=click.IntRange(min=0), default=4, show_default=True, help="Seeded noise inputs per resolution.")
@click.option(
    "--num-real",
    type=click.IntRange(min=0),
    default=None,
    help="Real inputs per resolution: a zoo model's test split, else the bundled images (8), or text windows; "
    "with --inputs the first N of them (default all).",
)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the noise inputs.")
@click.option("--report", type=click.Path(path_type=Path), default=None, help="Write the JSON report here.")
@click.option("--plugins", "plugin_specs", multiple=True, help=PLUGINS_HELP)
@click.option("--allow-cpu-fallback", is_flag=True, help=CPU_FALLBACK_HELP)
def validate(
    export_dir, resolutions, backends, precision, inputs_path, num_random, num_real, seed, report, plugin_specs, allow_cpu_fallback
):
    """Compare exported graphs with the PyTorch float64 reference; exit 1 on failure."""
    from deploykit._io import check_file_destination, write_json_atomic
    from deploykit.backends.plugins import Plugins
    from deploykit.inputs import read_inputs
    from deploykit.validate import validate as run_validation

    console = _console()
    if report:
        check_file_destination(report)  # before the work, not after it
    data = read_inputs(inputs_path) if inputs_path else None
    with _steps(console, "validate") as step:
        result = run_validation(
            export_dir,
            resolutions=resolutions or None,
            backends=backends,
            precision=precision,
            num_random=num_random,
            num_real=num_real if num_real is not None else (len(data) if data else 8),
            inputs=data,
            seed=seed,
            progress=step,
            plugins=Plugins.resolve(plugin_specs) if plugin_specs else None,
            allow_cpu_fallback=allow_cpu_fallback,
        )
    _print_report(console, result)
    for graph in dict.fromkeys(r.graph for r in result.records if r.quantization):
        console.print(f"{graph}:", soft_wrap=True)
        _print_plan(console, next(r.quantization for r in result.records if r.graph == graph))
    if report:
        write_json_atomic(report, result.to_json())
        console.print(f"report: {report}")
    result.raise_for_failure()


def _print_report(console, report) -> None:
    from deploykit.resolutions import resolution_tag

    width = max((len(r.backend) for r in report.records), default=5)
    for r in report.records:
        mark = "[green]✓[/]" if r.passed else "[red]✗[/]"
        where = resolution_tag(tuple(r.resolution)) + (f" b{r.batch}" if r.profiled else "") + (" (range)" if r.range_graph else "")
        top_k = f"  top1 {r.top1_agreement:.0%}  top5 {r.top5_agreement:.0%}" if r.top1_agreement is not None else "  (features)"
        line = (
            f"{mark} {r.backend:<{width}} {where:>8}  max|Δ| {r.max_abs:.2e}  mean|Δ| {r.mean_abs:.2e}"
            f"  cos {r.cosine:.8f}{top_k}  NaN/Inf {r.nan_count}/{r.inf_count}"
        )
        if r.first_divergent_block:
            line += f"  first divergence: {r.first_divergent_block}"
        line += f"  on {r.provider}"
        console.print(line, soft_wrap=True)
    passed = sum(r.passed for r in report.records)
    colour = "green" if report else "red"
    console.print(f"[{colour}]{passed}/{len(report.records)} checks passed[/]")


@cli.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option(
    "--backend",
    "-b",
    type=click.Choice(["trt", "rtx"]),
    default="trt",
    show_default=True,
    help="trt: TensorRT (NVIDIA GPUs); rtx: TensorRT-RTX (RTX GPUs; builds without a GPU).",
)
@click.option(
    "--dynamic",
    is_flag=True,
    help="One batch profile 1..--max-batch tuned for --batch, instead of a static batch (resolution stays static).",
)
@click.option("--batch", default=1, show_default=True, help="Static batch, or the batch a --dynamic profile is tuned for.")
@click.option("--max-batch", default=8, show_default=True, help="Largest batch of a --dynamic profile.")
@click.option(
    "--precision",
    "precisions",
    type=click.Choice(PLAN_NAMES),
    multiple=True,
    help="Repeatable; default every exported plan TensorRT can build (int8-dynamic, int8-mha and fp32-mha are ONNX Runtime only).",
)
@resolutions_option(help="Default: every exported one.")
@click.option("--workspace", "workspace_mib", type=click.IntRange(min=1), default=None, help="Workspace limit in MiB.")
@click.option("--opt-level", "optimization_level", type=click.IntRange(0, 5), default=None, help="Builder optimization level (default 3).")
@click.option("--plugins", "plugin_specs", multiple=True, help=PLUGINS_HELP)
@click.option("--rebuild", is_flag=True, help="Replace engines whose fingerprint no longer matches (otherwise refused).")
def build(
    export_dir,
    backend,
    dynamic,
    batch,
    max_batch,
    precisions,
    resolutions,
    workspace_mib,
    optimization_level,
    plugin_specs,
    rebuild,
):
    """Build one TensorRT engine per exported graph, beside it, with a fingerprint (-v: every
    TensorRT message; otherwise its warnings are summarised once)."""
    from rich.live import Live

    from deploykit._terminal import configure_logging
    from deploykit.backends.plugins import Plugins
    from deploykit.backends.tensorrt import BuildProgress
    from deploykit.build import build as build_engines
    from deploykit.build import describe

    console = _console()
    configure_logging(2 if verbosity() > 0 else verbosity())  # build -v: every TensorRT message
    progress = BuildProgress()
    with Live(progress, console=console, transient=True, refresh_per_second=4):
        results = build_engines(
            export_dir,
            backend,
            dynamic=dynamic,
            batch=batch,
            max_batch=max_batch,
            precisions=precisions,
            resolutions=resolutions,
            workspace_mib=workspace_mib,
            optimization_level=optimization_level,
            plugins=Plugins.resolve(plugin_specs),
            rebuild=rebuild,
            progress=progress,
        )
    for result in results:
        console.print(f"[green]✓[/] {describe(result)}", soft_wrap=True)


@cli.command()
@click.argument("export_dir", type=click.Path(path_type=Path), required=False)
@click.option("--encoding", "-e", default=None, help="Encoding of the default/new model, as for export.")
@click.option("--model", "model_name", default=None, help="Model size when building from --encoding.")
@click.option("--checkpoint", "-c", type=click.Path(path_type=Path), default=None, help="Model directory or weights file, as for export.")
@resolutions_option("--resolution", "--resolutions", "-r", help="384 or 384x256 (a length for sequence models); default the model's own.")
@counts_option("--batch", "batches", default="1", help="Batch sizes, e.g. 1,8,32.")
@click.option(
    "--backend",
    "backends",
    multiple=True,
    default=("torch", "ort"),
    show_default=True,
    help="Repeatable or comma list: torch and every ONNX runner (ort, ...); several are compared in one run.",
)
@click.option(
    "--precision",
    "precisions",
    type=click.Choice(PLAN_NAMES),
    multiple=True,
    help="Repeatable: time these plans side by side (EXPORT_DIR's, else built as export would; default fp32); records get ratio_vs_fp32.",
)
@click.option(
    "--duration",
    type=FiniteFloat(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Seconds of timed calls per measurement.",
)
@click.option(
    "--iterations",
    type=click.IntRange(min=1),
    default=None,
    help="Exactly this many timed calls per measurement (overrides --duration).",
)
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True, help="Untimed calls before each measurement.")
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Interleave encodings in this many rounds (shared machines).",
)
@click.option("--device", default="auto", show_default=True, help="PyTorch device: auto, cpu, cuda.")
@click.option("--no-ape-baseline", is_flag=True, help="Skip the same trunk with a learned APE.")
@click.option("--no-end-to-end", is_flag=True, help="Time the model only, not preprocessing and copies.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write the report as JSON.")
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), default=None, help="Write one CSV row per record.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None, help="Latency-vs-resolution PNG (needs matplotlib).")
@click.option("--plugins", "plugin_specs", multiple=True, help=PLUGINS_HELP)
@click.option("--no-cuda-graphs", is_flag=True, help="Engine backends: do not replay CUDA graphs (used where the engine allows).")
@click.option("--allow-cpu-fallback", is_flag=True, help=CPU_FALLBACK_HELP)
def profile(
    export_dir,
    encoding,
    model_name,
    checkpoint,
    resolutions,
    batches,
    backends,
    precisions,
    duration,
    iterations,
    warmup,
    rounds,
    device,
    no_ape_baseline,
    no_end_to_end,
    json_path,
    csv_path,
    plot_path,
    plugin_specs,
    no_cuda_graphs,
    allow_cpu_fallback,
):
    """Latency per backend × encoding × resolution × batch, and the encoding's cost against APE."""
    from rich.console import Console

    from deploykit import profile as prof
    from deploykit._io import check_file_destination
    from deploykit._lazy import lazy_import
    from deploykit.backends.plugins import Plugins
    from deploykit.errors import ConfigError
    from deploykit.profile.choice import write_choice
    from deploykit.profile.output import plot_latency, render_table, write_csv
    from deploykit.zoo.resolve import resolve_model

    console = _console()
    if export_dir and (encoding or model_name or checkpoint):
        raise ConfigError("give an export directory or --encoding/--model/--checkpoint, not both")
    for path in filter(None, (json_path, csv_path, plot_path)):  # before the timing run, not after it
        check_file_destination(path)
    if plot_path:
        lazy_import("matplotlib")
    budget = prof.Budget(duration_s=duration, iterations=iterations, warmup=warmup, rounds=rounds)
    backend_names = [b.strip() for value in backends for b in value.split(",")]
    if export_dir:
        subject, label = prof.Subject.from_export_dir(export_dir, precisions or ("fp32",)), str(export_dir)
    else:
        model, label = resolve_model(checkpoint=checkpoint, encoding=encoding, model_name=model_name)
        subject = prof.Subject(model)
    res = list(resolutions) or subject.resolutions or [subject.model.default_shape]
    with _steps(console, "profile") as step:
        report = prof.profile(
            subject,
            resolutions=res,
            batches=list(batches),
            backends=backend_names,
            budget=budget,
            precisions=precisions or ("fp32",),
            compare_ape=not no_ape_baseline,
            end_to_end=not no_end_to_end,
            device=device,
            label=label,
            progress=step,
            plugins=Plugins.resolve(plugin_specs) if plugin_specs else None,
            cuda_graphs=not no_cuda_graphs,
            allow_cpu_fallback=allow_cpu_fallback,
        )
    table, out = render_table(report, title=f"deploykit profile: {label}"), Console(highlight=False)
    if not out.is_terminal:  # piped: the table's own width (caption included), never squeezed or wrapped to 80 columns
        table.min_width, out.width = len(report.environment_line), 1 << 16  # measured without a width limit
        out.width = max(out.measure(table).maximum, len(table.title))
    out.print(table)
    for note in report.notes:
        console.print(f"note: {note}", soft_wrap=True, markup=False)
    for line in report.advice:
        console.print(line, soft_wrap=True, markup=False)
    if export_dir and (written := write_choice(export_dir, report.records, subject.encoding, subject.graph_hashes())):
        console.print(f"wrote {written} (deploykit serve takes each resolution's fastest validated plan from it)", soft_wrap=True)
    writers = (
        (json_path, report.write_json),
        (csv_path, lambda path: write_csv(path, report.records)),
        (plot_path, lambda path: plot_latency(path, report.records, title=label)),
    )
    for path, write in writers:
        if path:
            console.print(f"wrote {write(path)}")


@cli.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address every endpoint binds to.")
@click.option("--port", default=8000, show_default=True, help="HTTP port (KServe v2).")
@click.option("--grpc-port", default=8001, show_default=True, help="gRPC port (KServe v2).")
@click.option("--metrics-port", default=8002, show_default=True, help="Prometheus metrics port.")
@click.option("--max-batch-size", default=32, show_default=True, help="Largest batch per request and per merged execution.")
@click.option("--max-queue-delay-us", default=2000, show_default=True, help="Dynamic batcher wait to fill a batch.")
@click.option("--backend", "-b", default="auto", show_default=True, help="auto (TensorRT if usable, else ONNX Runtime) or a backend name.")
@click.option(
    "--precision",
    type=click.Choice(PLAN_NAMES),
    default=None,
    help="Precision plan to serve: its graphs (or engines) at every resolution the export holds for it "
    "[default: fp32, or on a CPU the fastest validated plan deploykit profile chose for the directory].",
)
@click.option("--top-k", default=5, show_default=True, help="Classes returned per image.")
@_image_limit_options
@click.option(
    "--max-request-bytes",
    type=click.IntRange(min=1),
    default=64 * 2**20,  # deploykit.serve.triton_server.MAX_REQUEST_BYTES
    show_default=True,
    help="Largest HTTP request body or gRPC message accepted (Triton behind it never sees a larger one).",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="On SIGTERM / Ctrl-C: seconds to answer the requests in flight before exiting.",
)
@click.option("--ray", "use_ray", is_flag=True, help="Serve on Ray Serve instead (HTTP on --host/--port; POST image bytes).")
@click.option("--replicas", default=2, show_default=True, help="Ray Serve replicas (with --ray).")
@click.option("--ray-address", default=None, help="Existing Ray cluster to join (with --ray); default: start a local one.")
def serve(
    export_dir,
    host,
    port,
    grpc_port,
    metrics_port,
    max_batch_size,
    max_queue_delay_us,
    backend,
    precision,
    top_k,
    max_image_pixels,
    max_image_bytes,
    max_request_bytes,
    drain_timeout,
    use_ray,
    replicas,
    ray_address,
):
    """Serve an export directory with Triton Inference Server (KServe v2 over HTTP and gRPC), or Ray Serve."""
    import signal

    from deploykit.serve.classifier import ImageLimits

    console = _console()
    limits = ImageLimits(max_pixels=max_image_pixels, max_bytes=max_image_bytes)

    def _say_backends(lines):  # once per server: what runs each resolution, and why the others were skipped
        for line in lines:
            console.print(line, markup=False, soft_wrap=True)  # reasons hold brackets: pip install 'deploykit[trt]'

    def _interrupt(signum, frame):  # SIGTERM shuts down like Ctrl-C: the server stops, then the process exits
        raise KeyboardInterrupt

    if use_ray:
        from deploykit.serve.ray_serve import RayOptions, serve_ray
        from deploykit.serve.triton_server import warn_if_exposed

        warn_if_exposed(host)

        ray_options = RayOptions(
            num_replicas=replicas,
            max_batch_size=max_batch_size,
            batch_wait_timeout_s=max_queue_delay_us / 1e6,
            backend=backend,
            precision=precision,
            top_k=top_k,
            host=host,
            port=port,
            limits=limits,
        )

        def ray_ready(backends):
            _say_backends(backends)
            console.print(f"[green]✓[/] Ray Serve: POST image bytes to http://{host}:{port}/", soft_wrap=True)

        serve_ray(export_dir, ray_options, address=ray_address, on_ready=ray_ready)
        return
    import threading

    from deploykit.serve.triton_server import ServerOptions
    from deploykit.serve.triton_server import serve as run_server

    options = ServerOptions(
        host=host,
        http_port=port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        max_batch_size=max_batch_size,
        max_queue_delay_us=max_queue_delay_us,
        backend=backend,
        precision=precision,
        top_k=top_k,
        limits=limits,
        max_request_bytes=max_request_bytes,
        drain_timeout_s=drain_timeout,
        verbosity=verbosity(),
    )
    stop = threading.Event()  # SIGTERM or Ctrl-C: stop taking requests, answer those in flight, exit 0
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    def triton_ready(ready):
        _say_backends(ready.backends)
        console.print(
            f"[green]✓[/] serving {', '.join(ready.models)}: http://{ready.http}  grpc {ready.grpc}  "
            f"metrics http://{ready.metrics}/metrics",
            soft_wrap=True,
        )

    run_server(export_dir, options, on_ready=triton_ready, stop=stop)
    console.print("stopped", soft_wrap=True)


@cli.group("import")
def import_group():
    """Bring a trained model from another library in as a deploykit model directory."""


@import_group.command("timm")
@click.argument("name")
@click.option(
    "--weights",
    "-w",
    type=click.Path(path_type=Path),
    default=None,
    help="Local .safetensors or .pth state dict of that timm model (default: timm's pretrained weights from the hub).",
)
@click.option(
    "--model-kwargs",
    "model_kwargs",
    multiple=True,
    metavar="KEY=VALUE",
    help="Repeatable timm.create_model argument (e.g. num_classes=0, global_pool=token).",
)
@_SET_OPTION
@click.option(
    "--output", "-o", type=click.Path(path_type=Path), required=True, help="Model directory to write (config.json + model.safetensors)."
)
def import_timm(name, weights, model_kwargs, options, output):
    """Import timm model NAME (ViT, DeiT-III, RoPE-ViT, DINOv3) for export, validate, build, profile and serve."""
    from deploykit.nn.checkpoint import save_model
    from deploykit.nn.from_timm import describe, parse_model_kwargs
    from deploykit.nn.from_timm import import_timm as convert

    model = convert(name, weights, options, **parse_model_kwargs(model_kwargs))
    save_model(model, output, metadata={"source": f"timm:{name}", "weights": str(weights or "pretrained")})
    _console().print(f"[green]✓[/] {output}  ({describe(model, name)})", soft_wrap=True)


@cli.command("serve-bench")
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option(
    "--concurrency", "concurrency", multiple=True, default=("1,8,32",), show_default=True, help="Levels, comma-separated or repeated."
)
@click.option("--requests", default=256, show_default=True, help="Requests per level and side.")
@click.option("--resolution", "-r", type=RESOLUTION, default=None, help="Exported resolution to load (default: the first).")
@click.option("--backend", "-b", default="ort", show_default=True, help="Backend of both sides.")
@click.option("--max-batch-size", default=32, show_default=True, help="The server's dynamic batching limit.")
@click.option("--max-queue-delay-us", default=2000, show_default=True, help="The server's dynamic batching wait.")
@click.option(
    "--client",
    type=click.Choice(["auto", "perf_analyzer", "builtin"]),
    default="auto",
    show_default=True,
    help="Load generator of the served side: Triton's perf_analyzer when installed, else our own.",
)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write the report as JSON.")
def serve_bench(export_dir, concurrency, requests, resolution, backend, max_batch_size, max_queue_delay_us, client, json_path):
    """Served (Triton, dynamic batching) vs in-process throughput and p50/p99 latency per concurrency."""
    from deploykit.serve.bench import BenchOptions, bench_serving

    console = _console()
    options = BenchOptions(
        concurrency=tuple(parse_counts(concurrency, "concurrency")),
        requests=requests,
        resolution=resolution,
        backend=backend,
        max_batch_size=max_batch_size,
        max_queue_delay_us=max_queue_delay_us,
        client=client,
    )
    with _steps(console, "serve-bench") as step:
        report = bench_serving(export_dir, options, progress=step)
    for level in report.levels:
        local, served = level["in_process"], level["served"]
        click.echo(
            f"concurrency {level['concurrency']:>3}: in-process {local['throughput_rps']:.1f} req/s, p50 {local['p50_ms']:.2f} ms, "
            f"p99 {local['p99_ms']:.2f} ms | served {served['throughput_rps']:.1f} req/s, p50 {served['p50_ms']:.2f} ms, "
            f"p99 {served['p99_ms']:.2f} ms, mean merged batch {served['mean_merged_batch']:.1f} | "
            f"served/in-process {level['served_vs_in_process_throughput']:.2f}"
        )
    if json_path:
        console.print(f"wrote {report.write_json(json_path)}", markup=False, soft_wrap=True)


@cli.group()
def package():
    """Package an export directory for a serving system."""


@package.command("triton")
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True, help="Model repository to create.")
@click.option("--max-batch-size", default=32, show_default=True)
@click.option(
    "--preferred-batch-size",
    "preferred",
    type=int,
    multiple=True,
    default=(8, 16),
    show_default=True,
    help="Repeatable; also the CUDA-graph batch sizes.",
)
@click.option("--max-queue-delay-us", default=2000, show_default=True)
@click.option("--gpu-instances", default=1, show_default=True, help="Instances per GPU of each inference model.")
@click.option(
    "--onnx-kind", type=click.Choice(["gpu", "cpu"]), default="gpu", show_default=True, help="Instance kind of the ONNX Runtime variant."
)
@_image_limit_options
@click.option("--plugins", "plugin_specs", multiple=True, help="Repeatable: plugin libraries (.so) the TensorRT engines were built with.")
def package_triton(
    export_dir,
    output,
    max_batch_size,
    preferred,
    max_queue_delay_us,
    gpu_instances,
    onnx_kind,
    max_image_pixels,
    max_image_bytes,
    plugin_specs,
):
    """Write a Triton model repository: TensorRT, ONNX Runtime and OpenVINO models per resolution, preprocessing ensembles."""
    from deploykit.backends.plugins import Plugins
    from deploykit.serve.classifier import ImageLimits
    from deploykit.serve.triton_repo import RepositoryOptions
    from deploykit.serve.triton_repo import package_triton as write_repository

    options = RepositoryOptions(
        max_batch_size=max_batch_size,
        preferred_batch_sizes=tuple(preferred),
        max_queue_delay_us=max_queue_delay_us,
        gpu_instances=gpu_instances,
        onnx_kind=onnx_kind,
        limits=ImageLimits(max_pixels=max_image_pixels, max_bytes=max_image_bytes),
    )
    repo = write_repository(export_dir, output, options, Plugins.resolve(plugin_specs))
    _console().print(f"[green]✓[/] {repo}  ({len([p for p in repo.iterdir() if p.is_dir()])} models; see {repo / 'README.md'})")


@cli.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Also write the description as JSON.")
def inspect_cmd(path, json_path):
    """Describe an exported graph (encoding, tables, precision plan, opset, custom ops, TensorRT-RTX's
    parse) or a built engine (fingerprint, profile shapes, layers and their precisions)."""
    from deploykit._io import write_json_atomic
    from deploykit.inspection import inspect_path, render

    info = inspect_path(path)
    click.echo("\n".join(render(info)))
    if json_path:
        write_json_atomic(json_path, info)


@cli.command("list")
def list_cmd():
    """List registered encodings and model sizes."""
    from deploykit.catalog import ENCODINGS, MODELS

    click.echo("encodings: " + ", ".join(ENCODINGS))
    click.echo("models:    " + ", ".join(MODELS))


@cli.group()
def zoo():
    """Model zoo: small ViTs trained here for every encoding, with accuracy cards."""


@zoo.command("train")
@click.argument("name")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Override the entry's step count.")
@click.option("--root", type=click.Path(path_type=Path, file_okay=False), default=None, help="Zoo directory (default models/).")
@click.option("--force", is_flag=True, help="Replace the trained model already in models/NAME.")
def zoo_train(name, steps, root, force):
    """Train zoo model NAME (seeded, reproducible) and save it to models/NAME (refused if trained, unless --force)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from deploykit.zoo.train import check_destination, train

    check_destination(name, root, force)  # an unknown name or a trained model: one error line, before any progress bar
    columns = (TextColumn(f"{name}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"))
    with Progress(*columns, console=_console()) as bar:
        task = bar.add_task("train", total=None, metrics="")

        def report(step, total, metrics, every=100):
            line = f"loss {metrics['loss']:.3f}  val {metrics['val_acc']:.1%}"
            bar.update(task, completed=step, total=total, metrics=line)
            if step % every == 0 and not bar.console.is_terminal:  # a log file gets a line now and then
                bar.console.print(f"{name} step {step}/{total}  {line}")

        result = train(name, root=root, steps=steps, progress=report, force=force)
    _console().print(f"[green]✓[/] {result.directory}  val {result.val_accuracy:.1%}  ({result.steps} steps, {result.seconds:.0f} s)")


@zoo.command("eval")
@click.argument("names", nargs=-1)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Evaluate the first N test samples only (and write no card).")
@click.option("--root", type=click.Path(path_type=Path, file_okay=False), default=None, help="Zoo directory (default models/).")
def zoo_eval(names, limit, root):
    """Test accuracy at 1×, 1.5× and 2× the training resolution; writes card.md/card.json and
    models/README.md (on the full test split). Default: every trained zoo model."""
    from deploykit.zoo.cards import evaluate_zoo

    for card in evaluate_zoo(names, root=root, limit=limit):
        accs = "  ".join(f"{r}px {a:.1%}" for r, a in zip(card["resolutions"], card["test_accuracy"]))
        click.echo(f"{card['name']:<20} {accs}  (n={card['num_test']})")


@zoo.command("cards")
@click.option("--root", type=click.Path(path_type=Path, file_okay=False), default=None, help="Zoo directory (default models/).")
def zoo_cards(root):
    """Regenerate every card.md and models/README.md from the card.json files (no evaluation)."""
    from deploykit.zoo.cards import rewrite_cards

    click.echo(rewrite_cards(root))


@zoo.command("list")
def zoo_list():
    """List zoo entries and whether each is trained."""
    from deploykit.zoo.registry import ZOO, model_dir

    for name, entry in ZOO.items():
        trained = (model_dir(name) / "model.safetensors").is_file()
        click.echo(f"{name:<20} {entry.encoding:<12} {'trained' if trained else 'not trained'}")


def main(argv=None) -> None:
    """Entry point: run the CLI; a usage error exits 2 and a DeployKitError 1, each with one
    ``error:`` line on stderr (``deploykit.cli_options``)."""
    try:
        cli.main(args=argv, prog_name="deploykit", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as err:  # `deploykit` alone: the help, not an error line
        err.show()
        sys.exit(err.exit_code)
    except click.ClickException as err:
        sys.exit(show_error(err))
    except DeployKitError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(1)
