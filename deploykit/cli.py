"""The ``deploykit`` command: parse options, call one library function, print the result.

Every ``DeployKitError`` (bad path, corrupt checkpoint, bad resolution, failed check) becomes a
one-line message on stderr and exit code 1, with no traceback. Library imports happen inside
the commands so ``deploykit --help`` starts fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from deploykit.errors import DeployKitError


class _Resolution(click.ParamType):
    """``224`` or ``384x256`` (height x width)."""

    name = "RESOLUTION"

    def convert(self, value, param, ctx):
        from deploykit.export.onnx_export import parse_resolution

        try:
            return parse_resolution(value)
        except DeployKitError as err:
            self.fail(str(err), param, ctx)


RESOLUTION = _Resolution()


def _console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deploykit")
def cli():
    """Vision Transformers with novel positional encodings, from PyTorch to served engines."""


@cli.command()
@click.option("--encoding", "-e", default=None, help="Encoding for a new/default model (ape, rope-axial, rope-mixed, ...).")
@click.option("--model", "model_name", default=None, help="Model size when building from --encoding (default vit_tiny_patch16).")
@click.option("--checkpoint", "-c", type=click.Path(path_type=Path), default=None,
              help="Model directory (config.json + model.safetensors) or weights file (.safetensors, .pt).")
@click.option("--resolution", "-r", "resolutions", type=RESOLUTION, multiple=True, help="Repeatable; default the model's img_size.")
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True, help="Export directory.")
@click.option("--opset", type=int, default=None, help="ONNX opset (default 18).")
@click.option("--precision", "precisions", type=click.Choice(["fp32", "fp16", "bf16"]), multiple=True,
              help="Repeatable precision plan: matmuls in this type, tables/LayerNorm/Softmax/logits fp32 (default fp32).")
def export(encoding, model_name, checkpoint, resolutions, output, opset, precisions):
    """Export a model to one ONNX graph per resolution, tables baked in, graph linted."""
    from deploykit.export import DEFAULT_OPSET, resolution_tag
    from deploykit.export import export as export_model
    from deploykit.nn.resolve import resolve_model

    console = _console()
    model, source = resolve_model(checkpoint=checkpoint, encoding=encoding, model_name=model_name)
    resolutions = resolutions or [model.default_shape]
    with console.status("exporting") as status:
        manifest = export_model(model, resolutions, output, opset=opset or DEFAULT_OPSET, precisions=precisions or ("fp32",),
                                source=source, progress=lambda msg: status.update(msg))
    for graph in manifest.graphs:
        console.print(f"[green]✓[/] {output / graph.file}  ({resolution_tag(graph.resolution)}, {graph.precision}, opset {graph.opset})")


@cli.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--resolution", "-r", "resolutions", type=RESOLUTION, multiple=True, help="Repeatable; default every exported one.")
@click.option("--backend", "-b", "backends", multiple=True, default=("ort",), show_default=True, help="Repeatable: ort, ort-cuda, trt, rtx (trt/rtx run the engines deploykit build wrote).")
@click.option("--precision", default="fp32", show_default=True, help="Which exported plan to check, and its tolerance: fp32, fp16, bf16.")
@click.option("--num-random", default=4, show_default=True, help="Seeded noise inputs per resolution.")
@click.option("--num-real", default=8, show_default=True, help="Bundled real images per resolution.")
@click.option("--seed", default=0, show_default=True)
@click.option("--report", type=click.Path(path_type=Path), default=None, help="Write the JSON report here.")
def validate(export_dir, resolutions, backends, precision, num_random, num_real, seed, report):
    """Compare exported graphs with the PyTorch float64 reference; exit 1 on failure."""
    from deploykit._io import write_json_atomic
    from deploykit.validate import validate as run_validation

    console = _console()
    with console.status("validating") as status:
        result = run_validation(export_dir, resolutions=resolutions or None, backends=backends, precision=precision,
                                num_random=num_random, num_real=num_real, seed=seed, progress=lambda m: status.update(m))
    _print_report(console, result)
    if report:
        write_json_atomic(report, result.to_json())
        console.print(f"report: {report}")
    result.raise_for_failure()


def _print_report(console, report) -> None:
    from deploykit.export import resolution_tag

    for r in report.records:
        mark = "[green]✓[/]" if r.passed else "[red]✗[/]"
        line = (f"{mark} {r.backend:<5} {resolution_tag(tuple(r.resolution)):>8}  max|Δ| {r.max_abs:.2e}  mean|Δ| {r.mean_abs:.2e}"
                f"  cos {r.cosine:.8f}  top1 {r.top1_agreement:.0%}  top5 {r.top5_agreement:.0%}  NaN/Inf {r.nan_count}/{r.inf_count}")
        if r.first_divergent_block:
            line += f"  first divergence: {r.first_divergent_block}"
        console.print(line, soft_wrap=True)
    passed = sum(r.passed for r in report.records)
    colour = "green" if report else "red"
    console.print(f"[{colour}]{passed}/{len(report.records)} checks passed[/]")


@cli.command()
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--backend", "-b", type=click.Choice(["trt", "rtx"]), default="trt", show_default=True,
              help="trt: TensorRT (NVIDIA GPUs); rtx: TensorRT-RTX (RTX GPUs; builds without a GPU).")
@click.option("--dynamic", is_flag=True,
              help="One batch profile 1..--max-batch tuned for --batch, instead of a static batch (resolution stays static).")
@click.option("--batch", default=1, show_default=True, help="Static batch, or the batch a --dynamic profile is tuned for.")
@click.option("--max-batch", default=8, show_default=True, help="Largest batch of a --dynamic profile.")
@click.option("--precision", "precisions", type=click.Choice(["fp32", "fp16", "bf16"]), multiple=True, help="Repeatable; default every exported plan.")
@click.option("--resolution", "-r", "resolutions", type=RESOLUTION, multiple=True, help="Repeatable; default every exported one.")
@click.option("--workspace", "workspace_mib", type=click.IntRange(min=1), default=None, help="Workspace limit in MiB.")
@click.option("--opt-level", "optimization_level", type=click.IntRange(0, 5), default=None, help="Builder optimization level (default 3).")
@click.option("--plugins", "plugin_dirs", type=click.Path(path_type=Path, file_okay=False), multiple=True,
              help="Directory of Python TensorRT plugins to import (default ./plugins when it exists; trt only).")
@click.option("--rebuild", is_flag=True, help="Replace engines whose fingerprint no longer matches (otherwise refused).")
def build(export_dir, backend, dynamic, batch, max_batch, precisions, resolutions, workspace_mib, optimization_level, plugin_dirs, rebuild):
    """Build one TensorRT engine per exported graph, beside it, with a fingerprint."""
    from rich.live import Live

    from deploykit.backends.tensorrt import BuildProgress
    from deploykit.build import build as build_engines
    from deploykit.build import describe

    console = _console()
    if not plugin_dirs and backend == "trt" and Path("plugins").is_dir():
        plugin_dirs = (Path("plugins"),)
    progress = BuildProgress()
    with Live(progress, console=console, transient=True, refresh_per_second=4):
        results = build_engines(export_dir, backend, dynamic=dynamic, batch=batch, max_batch=max_batch, precisions=precisions,
                                resolutions=resolutions, workspace_mib=workspace_mib, optimization_level=optimization_level,
                                plugin_dirs=plugin_dirs, rebuild=rebuild, progress=progress)
    for result in results:
        console.print(f"[green]✓[/] {describe(result)}", soft_wrap=True)


@cli.command("list")
def list_cmd():
    """List registered encodings and model sizes."""
    from deploykit.encodings import list_encodings
    from deploykit.nn import list_models

    click.echo("encodings: " + ", ".join(list_encodings()))
    click.echo("models:    " + ", ".join(list_models()))


@cli.group()
def zoo():
    """Model zoo: small ViTs trained here for every encoding, with accuracy cards."""


@zoo.command("train")
@click.argument("name")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Override the entry's step count.")
@click.option("--root", type=click.Path(path_type=Path, file_okay=False), default=None, help="Zoo directory (default models/).")
def zoo_train(name, steps, root):
    """Train zoo model NAME (seeded, reproducible) and save it to models/NAME."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from deploykit.zoo.registry import get_entry
    from deploykit.zoo.train import train

    get_entry(name)  # an unknown name is one error line, before any progress bar
    columns = (TextColumn(f"{name}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"))
    with Progress(*columns, console=_console()) as bar:
        task = bar.add_task("train", total=None, metrics="")

        def report(step, total, metrics, every=100):
            line = f"loss {metrics['loss']:.3f}  val {metrics['val_acc']:.1%}"
            bar.update(task, completed=step, total=total, metrics=line)
            if step % every == 0 and not bar.console.is_terminal:  # a log file gets a line now and then
                bar.console.print(f"{name} step {step}/{total}  {line}")

        result = train(name, root=root, steps=steps, progress=report)
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
    """Entry point: run the CLI; a DeployKitError exits 1 with one line on stderr."""
    try:
        cli.main(args=argv, prog_name="deploykit", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except DeployKitError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(1)
