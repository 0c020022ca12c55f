"""What the ``deploykit`` commands print, from the library's typed results.

Results and steps go to stderr through one rich console (``console()``); what a pipe or a file
is meant to receive (the profile table, serve-bench's lines, ``inspect``, ``list``, the zoo's
listings) goes to stdout. Result lines are never wrapped, whatever the width: a log or a grep
sees whole lines. Library imports happen inside the functions, as in the commands.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import click

from deploykit.cli.options import verbosity

OK, FAILED = "[green]✓[/]", "[red]✗[/]"


def console():
    """The console every command reports on (stderr)."""
    from rich.console import Console

    # soft_wrap: a line is never broken at the console width (80 columns when not a terminal),
    # so logs and greps see whole lines whatever the width and the path lengths.
    return Console(stderr=True, highlight=False, soft_wrap=True)


def steps(out, title: str):
    """``deploykit._terminal.steps`` at the verbosity of the ``-q``/``-v`` options."""
    from deploykit._terminal import steps as terminal_steps

    return terminal_steps(out, title, verbosity())


def say(out, line: str) -> None:
    """A plain line (no markup: paths and reasons may hold brackets, ``deploykit[trt]``)."""
    out.print(line, markup=False, soft_wrap=True)


def done(out, line: str) -> None:
    """A ``✓`` result line; ``line`` is text, not markup (a path may hold ``[fp16]``)."""
    from rich.markup import escape

    out.print(f"{OK} {escape(line)}", soft_wrap=True)


def wrote(out, path, why: str = "") -> None:
    say(out, f"wrote {path}{f' ({why})' if why else ''}")


def notes(out, lines: Iterable[str], suffix: str = "") -> None:
    for line in lines:
        say(out, f"note: {line}{suffix}")


def plan(out, details: dict | None) -> None:
    """A quantized graph's plan, indented under its line: what stayed float and why, by module."""
    from deploykit.export.int8_check import describe_plan
    from deploykit.export.metadata import QuantizationRecord

    for line in describe_plan(QuantizationRecord.from_dict(details)) if details else []:
        out.print(f"  {line}", soft_wrap=True)


def exported(out, output: Path, manifest) -> None:
    """One line per graph of an export's ``Manifest`` (range graphs with their range), each
    quantized graph's plan under it."""
    from deploykit.inputs.resolutions import resolution_tag

    for graph in manifest.graphs:
        where = resolution_tag(graph.resolution)
        if graph.resolution_range:
            where = f"{' to '.join(resolution_tag(r) for r in graph.resolution_range)}, tuned for {where}"
        done(out, f"{output / graph.file}  ({where}, {graph.precision}, opset {graph.opset})")
        plan(out, graph.quantization)


def validation(out, report) -> None:
    """A ``ValidationReport``: one ✓/✗ line per check, the count passed, each quantized graph's plan."""
    from deploykit.inputs.resolutions import resolution_tag

    width = max((len(r.backend) for r in report.records), default=5)
    for r in report.records:
        where = resolution_tag(tuple(r.resolution)) + (f" b{r.batch}" if r.profiled else "") + (" (range)" if r.range_graph else "")
        top_k = f"  top1 {r.top1_agreement:.0%}  top5 {r.top5_agreement:.0%}" if r.top1_agreement is not None else "  (features)"
        line = (
            f"{OK if r.passed else FAILED} {r.backend:<{width}} {where:>8}  max|Δ| {r.max_abs:.2e}  mean|Δ| {r.mean_abs:.2e}"
            f"  cos {r.cosine:.8f}{top_k}  NaN/Inf {r.nan_count}/{r.inf_count}"
        )
        if r.first_divergent_block:
            line += f"  first divergence: {r.first_divergent_block}"
        out.print(f"{line}  on {r.provider}", soft_wrap=True)
        if r.first_divergent_layer:
            out.print(f"  first divergent layer: {r.first_divergent_layer.describe()}", soft_wrap=True)
    passed = sum(r.passed for r in report.records)
    colour = "green" if report else "red"
    out.print(f"[{colour}]{passed}/{len(report.records)} checks passed[/]")
    for graph in dict.fromkeys(r.graph for r in report.records if r.quantization):
        out.print(f"{graph}:", soft_wrap=True)
        plan(out, next(r.quantization for r in report.records if r.graph == graph))


def built(out, results) -> None:
    """One line per ``BuiltEngine``."""
    from deploykit.backends.build import describe

    for result in results:
        done(out, describe(result))


def profile_table(report, title: str) -> None:
    """A ``ProfileReport``'s table on stdout; piped, at its own full width (caption included),
    never squeezed or wrapped to 80 columns."""
    from rich.console import Console

    from deploykit.profile.output import render_table

    table, out = render_table(report, title=title), Console(highlight=False)
    if not out.is_terminal:
        table.min_width, out.width = len(report.environment_line), 1 << 16  # measured without a width limit
        out.width = max(out.measure(table).maximum, len(table.title))
    out.print(table)


def profiled(out, report, title: str) -> None:
    """The table, then the report's notes and advice."""
    profile_table(report, title)
    notes(out, report.notes)
    for line in report.advice:
        say(out, line)


def serving(out, ready) -> None:
    """A started Triton server (``ServerReady``): what runs each resolution, then its endpoints."""
    for line in ready.backends:
        say(out, line)
    done(out, f"serving {', '.join(ready.models)}: http://{ready.http}  grpc {ready.grpc}  metrics http://{ready.metrics}/metrics")


def serving_on_ray(out, backends: Iterable[str], host: str, port: int) -> None:
    for line in backends:
        say(out, line)
    done(out, f"Ray Serve: POST image bytes to http://{host}:{port}/")


def bench(report) -> None:
    """Per level of a ``BenchReport``: one stdout line for both sides, then one line per Triton
    model (its share of the served time), then the p99 searches."""
    for level in report.levels:
        local, served = level.in_process, level.served
        batch = "" if level.mean_merged_batch is None else f", mean merged batch {level.mean_merged_batch:.1f}"
        open_loop = f", dropped {served.dropped}, late {served.late}" if level.load.kind == "rate" else ""
        click.echo(
            f"{level.load.label()}: in-process {local.throughput_rps:.1f} req/s, p50 {local.p50_ms:.2f} ms, "
            f"p99 {local.p99_ms:.2f} ms | served {served.throughput_rps:.1f} req/s, p50 {served.p50_ms:.2f} ms, "
            f"p99 {served.p99_ms:.2f} ms{batch}{open_loop} | served/in-process {level.served_vs_in_process:.2f}"
        )
        for m in level.models:
            click.echo(
                f"    triton {m.model}: {m.requests} requests in {m.executions} executions (mean batch {m.mean_batch:.1f}); "
                f"per request: queue {m.queue_ms:.2f} ms, input {m.compute_input_ms:.2f} ms, "
                f"infer {m.compute_infer_ms:.2f} ms, output {m.compute_output_ms:.2f} ms"
            )
    for search in report.searches:
        side = search.side.replace("_", "-")
        found = search.result.best
        answer = (
            f"none: p99 beyond {search.result.limit_ms:g} ms at the lowest {search.kind}"
            if found is None
            else f"{search.kind} {found:g} ({search.best_throughput_rps:.1f} req/s)"
        )
        click.echo(f"largest {search.kind} with p99 <= {search.result.limit_ms:g} ms, {side}: {answer}")


def repository(out, repo: Path) -> None:
    """A written Triton model repository."""
    models = len([p for p in repo.iterdir() if p.is_dir()])
    done(out, f"{repo}  ({models} models; see {repo / 'README.md'})")


def inspection(info: dict) -> None:
    from deploykit.backends.inspection import render

    click.echo("\n".join(render(info)))


def catalog() -> None:
    """Registered encodings and model sizes (the torch-free catalog)."""
    from deploykit import catalog

    click.echo("encodings: " + ", ".join(catalog.encodings()))
    click.echo("models:    " + ", ".join(catalog.models()))


def zoo_cards(cards: Iterable[dict]) -> None:
    """One line per evaluated zoo card: accuracy at each resolution."""
    for card in cards:
        accs = "  ".join(f"{r}px {a:.1%}" for r, a in zip(card["resolutions"], card["test_accuracy"]))
        click.echo(f"{card['name']:<20} {accs}  (n={card['num_test']})")


def zoo_entries(entries: Iterable[tuple[str, str, bool]]) -> None:
    """One line per zoo entry: name, encoding, whether it is trained."""
    for name, encoding, trained in entries:
        click.echo(f"{name:<20} {encoding:<12} {'trained' if trained else 'not trained'}")


def trained(out, result) -> None:
    """A ``TrainResult``."""
    done(out, f"{result.directory}  val {result.val_accuracy:.1%}  ({result.steps} steps, {result.seconds:.0f} s)")


def training_progress(name: str, bar, task):
    """The ``progress`` callback of ``deploykit.zoo.train.train``: a bar on a terminal, and in a
    log a line now and then."""

    def report(step, total, metrics, every=100):
        line = f"loss {metrics['loss']:.3f}  val {metrics['val_acc']:.1%}"
        bar.update(task, completed=step, total=total, metrics=line)
        if step % every == 0 and not bar.console.is_terminal:
            bar.console.print(f"{name} step {step}/{total}  {line}")

    return report
