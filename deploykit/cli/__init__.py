"""The ``deploykit`` command: parse options, call one library function, print the result.

Every ``DeployKitError`` (bad path, corrupt checkpoint, bad resolution, failed check) becomes a
one-line message on stderr and exit code 1, with no traceback. Library imports happen inside
the commands so ``deploykit --help`` starts fast. Options several commands share are declared
in ``deploykit.cli.options``, with the library's defaults; what a command prints is in
``deploykit.cli.render``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from deploykit.backends import defaults as backend_defaults
from deploykit.cli import render
from deploykit.cli.importers import IMPORTERS
from deploykit.cli.options import (
    EXPORT_DIR,
    FiniteFloat,
    Group,
    ResolutionRange,
    counts_option,
    cpu_fallback_option,
    defaulted,
    int8_options,
    json_option,
    model_options,
    output_option,
    parse_counts,
    path_option,
    plugins_option,
    precision_option,
    resolutions_option,
    set_option,
    show_error,
    verbosity,
    zoo_root_option,
)
from deploykit.cli.serving import package, serve, serve_bench
from deploykit.errors import DeployKitError
from deploykit.export import defaults as export_defaults
from deploykit.inputs.builtin import VALIDATION_NOISE, VALIDATION_REAL, VALIDATION_SEED
from deploykit.profile import defaults as profile_defaults

__all__ = ["cli", "main", "parse_counts"]

OPSETS = export_defaults.SUPPORTED_OPSETS


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deploykit")
def cli():
    """Vision Transformers with novel positional encodings, from PyTorch to served engines.

    Every command takes -q and -v, before or after its name."""
    from deploykit._terminal import configure_logging

    configure_logging(verbosity())  # -q/-v given here were applied as they were parsed; this is the default


@cli.command()
@model_options
@resolutions_option(help="Default: the model's img_size.")
@output_option("Export directory.")
@click.option(
    "--opset",
    type=int,
    default=None,
    help=f"ONNX opset, {OPSETS[0]} to {OPSETS[-1]} (default {export_defaults.DEFAULT_OPSET}; SaPE² needs 18).",
)
@precision_option(
    "Repeatable precision plan written beside fp32: fp16/bf16 (casts), int8 (Q/DQ, calibrated; ORT and TensorRT), "
    "int8-dynamic, int8-mha and fp32-mha (ONNX Runtime only). Tables, rotations, gates, LayerNorm, Softmax, logits stay float.",
    multiple=True,
)
@int8_options
@click.option(
    "--resolution-range",
    "resolution_range",
    type=ResolutionRange(),
    default=None,
    help="Also one graph for any resolution in MIN:OPT:MAX (e.g. 224:384:512; RoPE, GridPE, GeoPE).",
)
@set_option
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
    from deploykit.api import export as export_model
    from deploykit.export.int8_static import CalibrationOptions
    from deploykit.inputs.user import UserCalibration, read_inputs
    from deploykit.profile.choice import CPU_SPEED_PLANS, plans_slower_than_float
    from deploykit.zoo.resolve import resolve_model

    console = render.console()
    model, source = resolve_model(checkpoint=checkpoint, encoding=encoding, model_name=model_name, options=options)
    with render.steps(console, "export") as step:
        manifest = export_model(
            model,
            output,
            resolutions=resolutions or None,  # None: the model's own, unless a range is given
            opset=opset,
            precisions=precisions,  # fp32 is always written; these go beside it
            source=source,
            progress=step,
            resolution_range=resolution_range,
            calibration=CalibrationOptions(
                samples=calibration_samples,
                method=calibration_method,
                min_agreement=min_agreement or None,
                held_out=held_out,
                attention=True if int8_attention else None,
                data=UserCalibration(read_inputs(calibration_data)) if calibration_data else None,
                keep_float=keep_float,
                min_cosine=min_cosine,
                max_relative_error=max_relative_error,
            ),
            force=force,
        ).manifest
    render.exported(console, output, manifest)
    if any(p in CPU_SPEED_PLANS for p in precisions):
        with render.steps(console, "export") as step:
            step("timing the CPU plans against fp32 (ONNX Runtime, batch 1)")
            slower = plans_slower_than_float(output, model=model)
        render.notes(console, slower, " (deploykit profile measures every batch)")


@cli.command()
@EXPORT_DIR
@resolutions_option(help="Default: every exported one.")
@defaulted(
    "--backend",
    "-b",
    "backends",
    multiple=True,
    default=(backend_defaults.RUNNER,),
    help="Repeatable: ort, ort-cuda, openvino (f32 hint), openvino-bf16 (CPUs with bf16), trt, rtx (trt/rtx run the engines "
    "deploykit build wrote).",
)
@precision_option(
    "Which exported plan to check, and its tolerance (int8: cosine and top-1/top-5 agreement on the real inputs).", default="fp32"
)
@path_option(
    "--inputs",
    "inputs_path",
    default=None,
    help="Your real inputs: a folder of images (recursive), a text file listing image paths, or a .npy/.npz of "
    "preprocessed arrays; images are preprocessed as the model's config says, as served.",
)
@defaulted("--num-random", type=click.IntRange(min=0), default=VALIDATION_NOISE, help="Seeded noise inputs per resolution.")
@click.option(
    "--num-real",
    type=click.IntRange(min=0),
    default=None,
    help=f"Real inputs per resolution: a zoo model's test split, else the bundled images ({VALIDATION_REAL}), or text windows; "
    "with --inputs the first N of them (default all).",
)
@defaulted("--seed", type=click.IntRange(min=0), default=VALIDATION_SEED, help="Seed of the noise inputs.")
@path_option("--report", default=None, help="Write the JSON report here.")
@path_option(
    "--bundle",
    default=None,
    help="Also write a replay bundle here: each graph, its inputs and the float64 reference in trtexec's, Polygraphy's "
    "and numpy's forms, with the command lines that replay the check without deploykit (written on failure too).",
)
@plugins_option()
@cpu_fallback_option
def validate(
    export_dir, resolutions, backends, precision, inputs_path, num_random, num_real, seed, report, bundle, plugin_specs, allow_cpu_fallback
):
    """Compare exported graphs with the PyTorch float64 reference; exit 1 on failure."""
    from deploykit._io import check_file_destination, write_output_json
    from deploykit.api import validate as run_validation
    from deploykit.backends.plugins import Plugins

    console = render.console()
    if report:
        check_file_destination(report)  # before the work, not after it
    with render.steps(console, "validate") as step:
        result = run_validation(
            export_dir,
            resolutions=resolutions or None,
            backends=backends,
            precision=precision,
            num_random=num_random,
            num_real=num_real,  # None: every input given, else the bundled set (deploykit.api.validate)
            inputs=inputs_path,
            seed=seed,
            progress=step,
            plugins=Plugins.resolve(plugin_specs) if plugin_specs else None,
            allow_cpu_fallback=allow_cpu_fallback,
            bundle=bundle,
        )
    render.validation(console, result)
    if report:
        write_output_json(report, result.to_json())
        render.say(console, f"report: {report}")
    if bundle:
        render.say(console, f"replay bundle: {bundle} (see its README.md)")
    result.raise_for_failure()


@cli.command(debug_with_v=True)
@EXPORT_DIR
@defaulted(
    "--backend",
    "-b",
    type=click.Choice(backend_defaults.ENGINE_BACKENDS),
    default=backend_defaults.ENGINE_BACKENDS[0],
    help="trt: TensorRT (NVIDIA GPUs); rtx: TensorRT-RTX (RTX GPUs; builds without a GPU).",
)
@click.option(
    "--dynamic",
    is_flag=True,
    help="One batch profile 1..--max-batch tuned for --batch, instead of a static batch (resolution stays static).",
)
@defaulted("--batch", default=backend_defaults.ENGINE_BATCH, help="Static batch, or the batch a --dynamic profile is tuned for.")
@defaulted("--max-batch", default=backend_defaults.ENGINE_MAX_BATCH, help="Largest batch of a --dynamic profile.")
@precision_option(
    "Repeatable; default every exported plan TensorRT can build (int8-dynamic, int8-mha and fp32-mha are ONNX Runtime only).",
    multiple=True,
)
@resolutions_option(help="Default: every exported one.")
@click.option("--workspace", "workspace_mib", type=click.IntRange(min=1), default=None, help="Workspace limit in MiB.")
@click.option("--opt-level", "optimization_level", type=click.IntRange(0, 5), default=None, help="Builder optimization level (default 3).")
@plugins_option()
@click.option(
    "--compute-capability",
    "compute_capabilities",
    multiple=True,
    help="rtx: a GPU's compute capability to build for (repeatable, e.g. 7.5 for Turing); "
    "default every supported one but Turing, or on a Turing GPU 7.5 alone.",
)
@click.option(
    "--profile",
    "profiles",
    multiple=True,
    help="Repeatable: one optimization profile per engine each, as a batch range (1-8) and, for a graph exported over a "
    "resolution range, a resolution bucket (1-8@32-48); each tuned for --batch. The runners pick the one that fits each call.",
)
@click.option(
    "--profiles-from-resolutions",
    is_flag=True,
    help="For a resolution-range graph: one profile per bucket between the exported resolutions inside its range (batches 1..--max-batch).",
)
@click.option("--version-compatible", is_flag=True, help="An engine later TensorRT versions run (VERSION_COMPATIBLE).")
@click.option(
    "--exclude-lean-runtime", is_flag=True, help="With --version-compatible: leave the lean runtime out (the loader must provide it)."
)
@click.option(
    "--hardware-compatibility",
    type=click.Choice(["none", "ampere_plus", "same_compute_capability"]),
    default="none",
    show_default=True,
    help="trt: one engine for several GPU models (TensorRT's hardware compatibility level).",
)
@click.option("--refittable", is_flag=True, help="Weights refittable with identical ones (REFIT_IDENTICAL).")
@click.option(
    "--strip-weights",
    is_flag=True,
    help="A weight-stripped engine (STRIP_PLAN, implies --refittable), refitted when loaded from one weight set (model.TAG.weights) "
    "every resolution's stripped engine shares.",
)
@click.option(
    "--require-user-allocation",
    is_flag=True,
    help="rtx: an engine that never allocates at run time, so CUDA graphs capture every execution (REQUIRE_USER_ALLOCATION).",
)
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
    compute_capabilities,
    profiles,
    profiles_from_resolutions,
    version_compatible,
    exclude_lean_runtime,
    hardware_compatibility,
    refittable,
    strip_weights,
    require_user_allocation,
    rebuild,
):
    """Build one TensorRT engine per exported graph, beside it, with a fingerprint (-v: every
    TensorRT message; otherwise its warnings are summarised once)."""
    from rich.live import Live

    from deploykit.backends.build import BuildSettings
    from deploykit.backends.build import build as build_engines
    from deploykit.backends.plugins import Plugins
    from deploykit.backends.tensorrt import BuildProgress

    settings = BuildSettings(
        dynamic=dynamic,
        batch=batch,
        max_batch=max_batch,
        precisions=precisions,
        resolutions=resolutions,
        workspace_mib=workspace_mib,
        optimization_level=optimization_level,
        rebuild=rebuild,
        compute_capabilities=compute_capabilities,
        profiles=profiles,
        profiles_from_resolutions=profiles_from_resolutions,
        version_compatible=version_compatible,
        exclude_lean_runtime=exclude_lean_runtime,
        hardware_compatibility=hardware_compatibility,
        refittable=refittable,
        strip_weights=strip_weights,
        require_user_allocation=require_user_allocation,
    )
    console = render.console()
    progress = BuildProgress()
    with Live(progress, console=console, transient=True, refresh_per_second=4):
        results = build_engines(export_dir, backend, settings, plugins=Plugins.resolve(plugin_specs), progress=progress)
    render.built(console, results)


@cli.command()
@click.argument("export_dir", type=click.Path(path_type=Path), required=False)
@model_options
@resolutions_option("--resolution", "--resolutions", "-r", help="384 or 384x256 (a length for sequence models); default the model's own.")
@counts_option("--batch", "batches", default=",".join(map(str, profile_defaults.BATCHES)), help="Batch sizes, e.g. 1,8,32.")
@defaulted(
    "--backend",
    "backends",
    multiple=True,
    default=profile_defaults.BACKENDS,
    help="Repeatable or comma list: torch and every ONNX runner (ort, ...); several are compared in one run.",
)
@precision_option(
    "Repeatable: time these plans side by side (EXPORT_DIR's, else built as export would); records get ratio_vs_fp32. "
    "Default: every plan in EXPORT_DIR, else fp32.",
    multiple=True,
)
@defaulted(
    "--duration",
    type=FiniteFloat(min=0, min_open=True),
    default=profile_defaults.DURATION_S,
    help="Seconds of timed calls per measurement.",
)
@click.option(
    "--iterations",
    type=click.IntRange(min=1),
    default=None,
    help="Exactly this many timed calls per measurement (overrides --duration).",
)
@defaulted("--warmup", type=click.IntRange(min=0), default=profile_defaults.WARMUP, help="Untimed calls before each measurement.")
@defaulted(
    "--rounds",
    type=click.IntRange(min=1),
    default=profile_defaults.ROUNDS,
    help="Interleave encodings in this many rounds (shared machines).",
)
@defaulted("--device", default=profile_defaults.DEVICE, help="PyTorch device: auto, cpu, cuda.")
@click.option("--no-ape-baseline", is_flag=True, help="Skip the same trunk with a learned APE.")
@click.option("--no-end-to-end", is_flag=True, help="Time the model only, not preprocessing and copies.")
@json_option()
@path_option("--csv", "csv_path", default=None, help="Write one CSV row per record.")
@path_option("--plot", "plot_path", default=None, help="Latency-vs-resolution PNG (needs matplotlib).")
@plugins_option()
@click.option("--no-cuda-graphs", is_flag=True, help="Engine backends: do not replay CUDA graphs (used where the engine allows).")
@cpu_fallback_option
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
    no_ape_baseline,
    no_end_to_end,
    json_path,
    csv_path,
    plot_path,
    plugin_specs,
    no_cuda_graphs,
    device,
    allow_cpu_fallback,
):
    """Latency per backend × encoding × resolution × batch, and the encoding's cost against APE."""
    from deploykit._io import check_file_destination
    from deploykit._lazy import lazy_import
    from deploykit.backends.plugins import Plugins
    from deploykit.errors import ConfigError
    from deploykit.profile import Budget, ProfileOptions
    from deploykit.profile import profile as run_profile
    from deploykit.profile.output import plot_latency, write_csv
    from deploykit.zoo.resolve import resolve_model

    console = render.console()
    if export_dir and (encoding or model_name or checkpoint):
        raise ConfigError("give an export directory or --encoding/--model/--checkpoint, not both")
    for path in filter(None, (json_path, csv_path, plot_path)):  # before the timing run, not after it
        check_file_destination(path)
    if plot_path:
        lazy_import("matplotlib")
    label = ""
    if not export_dir:
        model, label = resolve_model(checkpoint=checkpoint, encoding=encoding, model_name=model_name)
    options = ProfileOptions(
        resolutions=resolutions,
        batches=batches,
        backends=[b.strip() for value in backends for b in value.split(",")],
        precisions=precisions,
        budget=Budget(duration_s=duration, iterations=iterations, warmup=warmup, rounds=rounds),
        compare_ape=not no_ape_baseline,
        end_to_end=not no_end_to_end,
        device=device,
        label=label,
        plugins=Plugins.resolve(plugin_specs) if plugin_specs else None,
        cuda_graphs=not no_cuda_graphs,
        allow_cpu_fallback=allow_cpu_fallback,
    )
    with render.steps(console, "profile") as step:
        report = run_profile(export_dir or model, options, progress=step)
    label = report.settings["model"]
    render.profiled(console, report, title=f"deploykit profile: {label}")
    if report.choice_file:
        render.wrote(console, report.choice_file, "deploykit serve takes each resolution's fastest validated plan from it")
    writers = (
        (json_path, report.write_json),
        (csv_path, lambda path: write_csv(path, report.records)),
        (plot_path, lambda path: plot_latency(path, report.records, title=label)),
    )
    for path, write in writers:
        if path:
            render.wrote(console, write(path))


@cli.command("debug-precision")
@EXPORT_DIR
@click.option(
    "--precision", type=click.Choice(["fp16", "bf16"]), default="fp16", show_default=True, help="The cast plan that fails validation."
)
@resolutions_option(help="The resolution to check (default: the first exported).")
def debug_precision_cmd(export_dir, precision, resolutions):
    """Find the smallest set of layers a cast plan must keep fp32 to pass validation (as Polygraphy's
    debug precision does), printed as --keep-float options for deploykit export."""
    from deploykit.validation.precision_debug import debug_precision

    console = render.console()
    with render.steps(console, "debug-precision") as step:
        found = debug_precision(export_dir, precision, resolutions[0] if resolutions else None, progress=step)
    where = "x".join(map(str, found.resolution))
    if not found.kept:
        render.say(console, f"✓ {precision} at {where} passes with every product {precision} ({found.checks} check)")
        return
    kept = ", ".join(f"{module} ({name})" if module else name for module, name in found.kept)
    render.say(
        console, f"{precision} at {where} passes with {len(found.kept)} of {found.products} products fp32 ({found.checks} checks): {kept}"
    )
    render.say(console, "export with: " + " ".join(found.keep_float_args()))


@cli.command("import-plan")
@EXPORT_DIR
@click.argument("graph", type=click.Path(path_type=Path))
def import_plan_cmd(export_dir, graph):
    """Add a Q/DQ graph made elsewhere (ModelOpt's ONNX PTQ, QAT) to EXPORT_DIR as the imported plan,
    once it matches the checkpoint (resolution, architecture, weights) and passes the plan's
    criteria against PyTorch; then validate, build, profile and serve --precision imported."""
    from deploykit.validation.import_plan import import_plan

    console = render.console()
    with render.steps(console, "import-plan") as step:
        done = import_plan(export_dir, graph, progress=step)
    record = done.record
    render.say(
        console,
        f"✓ {done.path}  ({'x'.join(map(str, done.resolution))}, imported: {record.quantized_nodes} products Q/DQ "
        f"{record.qdq_type} over {record.remainder}, from {record.source})",
    )


@cli.group("import")
def import_group():
    """Bring a trained model in as a deploykit model directory: from timm, a Hugging Face transformers
    directory (hf), or a paper's own training script (gridpe, mope, wepe)."""


@import_group.command("timm")
@click.argument("name")
@path_option(
    "--weights",
    "-w",
    default=None,
    help="Local .safetensors/.pth checkpoint, read as timm reads it for that model (its checkpoint filter: e.g. DINOv3 in "
    "Meta's format, EVA-02, OpenCLIP) and from training-script containers (default: timm's pretrained weights from the hub).",
)
@click.option("--ema", is_flag=True, help="Take the file's EMA copy of the weights instead of the trained model's.")
@click.option(
    "--model-kwargs",
    "model_kwargs",
    multiple=True,
    metavar="KEY=VALUE",
    help="Repeatable timm.create_model argument (e.g. num_classes=0, global_pool=token).",
)
@set_option
@output_option("Model directory to write (config.json + model.safetensors).")
def import_timm(name, weights, ema, model_kwargs, options, output):
    """Import timm model NAME (ViT, DeiT-III, RoPE-ViT, DINOv3, EVA-02) for export, validate, build, profile and serve."""
    from deploykit.nn.checkpoint import save_model
    from deploykit.nn.from_timm import describe, parse_model_kwargs
    from deploykit.nn.from_timm import import_timm as convert

    model = convert(name, weights, options, ema, **parse_model_kwargs(model_kwargs))
    save_model(model, output, metadata={"source": f"timm:{name}", "weights": str(weights or "pretrained"), "ema": ema})
    render.done(render.console(), f"{output}  ({describe(model, name)})")


@import_group.command("hf")
@click.argument("directory", type=click.Path(path_type=Path))
@output_option("Model directory to write (config.json + model.safetensors).")
def import_hf(directory, output):
    """Import a Hugging Face transformers save_pretrained DIRECTORY (ViT, DeiT, DINOv2 with or without registers,
    DINOv3), with the preprocessing of its preprocessor_config.json."""
    from deploykit.nn.checkpoint import save_model
    from deploykit.nn.from_transformers import import_transformers

    imported = import_transformers(directory)
    described = imported.describe()  # everything read is shown before anything is written
    save_model(imported.model, output, metadata={"source": imported.source})
    render.done(render.console(), f"{output}  ({described})")


def _paper_import_command(importer) -> None:
    """``deploykit import <paper> CHECKPOINT -o DIR``: one command per official repository
    (``deploykit.cli.importers.IMPORTERS``), its options those the file does not hold."""

    def run(checkpoint, ema, options, output, **assumed):
        from deploykit.nn.checkpoint import save_model

        imported = importer.convert(checkpoint, ema, options, **assumed)
        described = imported.describe()  # everything read is shown before anything is written
        save_model(imported.model, output, metadata={"source": imported.source, "ema": ema})
        render.done(render.console(), f"{output}  ({described})")

    run.__doc__ = f"Import {importer.paper}: {importer.writes}, read as saved ({importer.repository})."
    for assumption in reversed(importer.assumptions):
        flag = "--" + assumption.name.replace("_", "-")
        run = click.option(flag, assumption.name, default=assumption.default, show_default=True, help=assumption.help)(run)
    run = output_option("Model directory to write (config.json + model.safetensors).")(run)
    run = set_option(run)
    run = click.option("--ema", is_flag=True, help="Take the file's EMA copy of the weights instead of the trained model's.")(run)
    run = click.argument("checkpoint", type=click.Path(path_type=Path))(run)
    import_group.command(importer.name)(run)


for _importer in IMPORTERS.values():
    _paper_import_command(_importer)


@cli.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@json_option("Also write the description as JSON.")
def inspect_cmd(path, json_path):
    """Describe an exported graph (encoding, tables, precision plan, opset, custom ops, TensorRT-RTX's
    parse) or a built engine (fingerprint, profile shapes, layers and their precisions)."""
    from deploykit._io import check_file_destination, write_output_json
    from deploykit.backends.inspection import inspect_path

    if json_path:
        check_file_destination(json_path)
    info = inspect_path(path)
    render.inspection(info)
    if json_path:
        write_output_json(json_path, info)


@cli.command("list")
def list_cmd():
    """List registered encodings and model sizes."""
    render.catalog()


@cli.group()
def zoo():
    """Model zoo: small ViTs trained here for every encoding, with accuracy cards."""


@zoo.command("train")
@click.argument("name")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Override the entry's step count.")
@zoo_root_option
@click.option("--force", is_flag=True, help="Replace the trained model already in models/NAME.")
def zoo_train(name, steps, root, force):
    """Train zoo model NAME (seeded, reproducible) and save it to models/NAME (refused if trained, unless --force)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from deploykit.zoo.train import check_destination, train

    check_destination(name, root, force)  # an unknown name or a trained model: one error line, before any progress bar
    columns = (TextColumn(f"{name}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"))
    with Progress(*columns, console=render.console()) as bar:
        task = bar.add_task("train", total=None, metrics="")
        result = train(name, root=root, steps=steps, progress=render.training_progress(name, bar, task), force=force)
    render.trained(render.console(), result)


@zoo.command("eval")
@click.argument("names", nargs=-1)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Evaluate the first N test samples only (and write no card).")
@click.option("--no-int8", is_flag=True, help="With --limit: PyTorch accuracy only, without planning the int8 graphs (quick).")
@zoo_root_option
def zoo_eval(names, limit, no_int8, root):
    """Test accuracy at 1×, 1.5× and 2× the training resolution; writes card.md/card.json and
    models/README.md (on the full test split). Default: every trained zoo model."""
    from deploykit.zoo.cards import evaluate_zoo

    render.zoo_cards(evaluate_zoo(names, root=root, limit=limit, int8=not no_int8))


@zoo.command("cards")
@zoo_root_option
def zoo_cards(root):
    """Regenerate every card.md and models/README.md from the card.json files (no evaluation)."""
    from deploykit.zoo.cards import rewrite_cards

    click.echo(rewrite_cards(root))


@zoo.command("list")
def zoo_list():
    """List zoo entries and whether each is trained."""
    from deploykit.zoo.registry import ZOO, model_dir

    render.zoo_entries((name, entry.encoding, (model_dir(name) / "model.safetensors").is_file()) for name, entry in ZOO.items())


for _command in (serve, serve_bench, package):
    cli.add_command(_command)


def main(argv=None) -> None:
    """Entry point: run the CLI; a usage error exits 2 and a DeployKitError 1, each with one
    ``error:`` line on stderr (``deploykit.cli.options``)."""
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
