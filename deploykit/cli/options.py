"""What every ``deploykit`` command shares: ``-q``/``-v`` on the command itself, resolutions and
counts as comma lists, one form for every error, and the option groups several commands take
(model selection, plugins, image limits, batching, ...), each declared once here.

Defaults the library also applies are read from its torch-free constants (the ``defaults``
modules of ``deploykit.export``, ``deploykit.backends``, ``deploykit.profile`` and
``deploykit.serve``; ``deploykit.inputs.builtin`` for validation's inputs, ``deploykit.inputs.imaging`` for image
limits), never restated as literals, so ``--help`` shows what the library does.

Exit codes: a command line click cannot parse (an unknown command or option, a missing argument,
a value of the wrong type or outside the range ``--help`` gives) is a usage error, exit 2; a
command that parses but cannot be done (a ``DeployKitError``) exits 1. Either way stderr gets
one ``error:`` line, never click's three-line usage block.
"""

from __future__ import annotations

import math
from pathlib import Path

import click

from deploykit.errors import DeployKitError, one_line

QUIET_HELP = "No progress and no warnings: results and errors only."
VERBOSE_HELP = "Every step as a line with its time, and info logs (-vv: debug logs)."


def _set_verbosity(ctx: click.Context, param: click.Parameter, value) -> None:
    """``-q``/``-v`` given to any command, before or after the subcommand: the last one given wins."""
    from deploykit._terminal import configure_logging

    if not value:
        return
    root = ctx.find_root()
    root.obj = {**(root.obj or {}), "verbosity": -1 if param.name == "quiet" else value}
    configure_logging(root.obj["verbosity"])


def verbosity_options() -> list[click.Option]:
    """``-q``/``-v`` as parameters (not passed to the command's function: read them with ``verbosity()``)."""
    return [
        click.Option(["--quiet", "-q"], is_flag=True, expose_value=False, callback=_set_verbosity, help=QUIET_HELP),
        click.Option(["--verbose", "-v"], count=True, expose_value=False, callback=_set_verbosity, help=VERBOSE_HELP),
    ]


def verbosity() -> int:
    """-1 with ``-q``, 0 by default, 1 with ``-v``, 2 with ``-vv``."""
    return (click.get_current_context().find_root().obj or {}).get("verbosity", 0)


class Command(click.Command):
    """A command that takes ``-q``/``-v`` itself (``deploykit export ... -v``), as its group does.

    Args:
        debug_with_v: ``-v`` shows debug records too (``build``: every TensorRT message, which
            the backends log at debug and otherwise summarise in one warning, "-v shows each").
    """

    def __init__(self, *args, debug_with_v: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.debug_with_v = debug_with_v
        self.params.extend(verbosity_options())

    def invoke(self, ctx: click.Context):
        if self.debug_with_v and verbosity() > 0:  # -v given anywhere on the line, before or after the name
            from deploykit._terminal import configure_logging

            configure_logging(2)
        return super().invoke(ctx)


class Group(click.Group):
    """A group whose commands and subgroups are ``Command``/``Group``: ``-q``/``-v`` everywhere."""

    command_class = Command
    group_class = type  # subgroups of this group are of this class too

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params.extend(verbosity_options())


class _Parsed(click.ParamType):
    """A type read by one of deploykit's parsers (``parse``): a ``DeployKitError`` becomes click's
    usage error, and a value already parsed (a default, a value passed in process) passes through."""

    def parse(self, value):
        raise NotImplementedError

    def is_parsed(self, value) -> bool:
        return isinstance(value, tuple)

    def convert(self, value, param, ctx):
        if self.is_parsed(value):
            return value
        try:
            return self.parse(value)
        except DeployKitError as err:
            self.fail(str(err), param, ctx)


class Resolutions(_Parsed):
    """``224``, ``384x256`` or a comma list of them (``224,384x256``) → a tuple of ``(height, width)``."""

    name = "RESOLUTION[,...]"

    def is_parsed(self, value) -> bool:
        return isinstance(value, tuple) and all(isinstance(r, tuple) for r in value)

    def parse(self, value):
        from deploykit.inputs.resolutions import parse_resolutions

        return tuple(parse_resolutions([value]))


def _flatten(ctx, param, values) -> tuple:
    """``(((224, 224),), ((48, 48), (96, 96)))`` → ``((224, 224), (48, 48), (96, 96))``, duplicates dropped."""
    return tuple(dict.fromkeys(r for group in values for r in group))


def resolutions_option(*names: str, help: str):
    """A repeatable resolution option that also takes comma lists (``-r 48,96`` is ``-r 48 -r 96``)."""
    return click.option(
        *(names or ("--resolution", "-r")),
        "resolutions",
        type=Resolutions(),
        multiple=True,
        callback=_flatten,
        help=f"{help} Repeatable, or a comma list (-r 224,384x256).",
    )


def parse_counts(values, what: str) -> list[int]:
    """``["1,8", "32"]`` → ``[1, 8, 32]`` (duplicates dropped); each must be a positive integer.

    Raises:
        ConfigError: a part that is not a positive integer.
    """
    from deploykit.errors import ConfigError

    out = []
    for value in values:
        for part in str(value).split(","):
            try:
                count = int(part)
            except ValueError:
                count = 0
            if count < 1:
                raise ConfigError(f"invalid {what} {part.strip()!r}; expected positive integers such as 1,8,32")
            out.append(count)
    return list(dict.fromkeys(out))


class Counts(_Parsed):
    """``8`` or a comma list of positive integers (``1,8,32``) → a tuple, duplicates dropped."""

    name = "N[,...]"

    def parse(self, value):
        return tuple(parse_counts([value], "count"))


def _flatten_counts(ctx, param, values) -> tuple[int, ...]:
    return tuple(dict.fromkeys(n for group in values for n in group))


def counts_option(*names: str, default: str, help: str):
    """A repeatable option of positive integers that also takes comma lists."""
    return click.option(
        *names,
        type=Counts(),
        multiple=True,
        default=(default,),
        show_default=True,
        callback=_flatten_counts,
        help=f"{help} Comma list or repeated.",
    )


class FiniteFloat(click.FloatRange):
    """``click.FloatRange`` that also refuses NaN and ±Inf (which compare false against any bound)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class Resolution(_Parsed):
    """``224`` or ``384x256`` (height x width)."""

    name = "RESOLUTION"

    def parse(self, value):
        from deploykit.inputs.resolutions import parse_resolution

        return parse_resolution(value)


class ResolutionRange(_Parsed):
    """``224:384:512`` (min:opt:max; each side may be ``HxW``) → three ``(height, width)``."""

    name = "MIN:OPT:MAX"

    def parse(self, value):
        from deploykit.errors import ConfigError
        from deploykit.inputs.resolutions import parse_resolution

        parts = str(value).split(":")
        if len(parts) != 3:
            raise ConfigError(f"{value!r} is not MIN:OPT:MAX, e.g. 224:384:512")
        return tuple(parse_resolution(p) for p in parts)


EXPORT_DIR = click.argument("export_dir", type=click.Path(path_type=Path))


def group(*decorators):
    """Several option decorators as one, applied as if stacked in the order given (``--help``
    lists them in that order)."""

    def apply(command):
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


def defaulted(*names: str, default, help: str | None = None, **kwargs):
    """An option whose default (the library's) is shown in ``--help``."""
    return click.option(*names, default=default, show_default=True, help=help, **kwargs)


def path_option(*names: str, help: str, **kwargs):
    """An option naming a file or directory, as a ``Path``."""
    return click.option(*names, type=click.Path(path_type=Path), help=help, **kwargs)


def output_option(help: str):
    return path_option("--output", "-o", required=True, help=help)


def json_option(help: str = "Write the report as JSON."):
    return path_option("--json", "json_path", default=None, help=help)


def model_options(command):
    """``--encoding``/``--model``/``--checkpoint``: which model a command works on
    (``deploykit.zoo.resolve.resolve_model``; the zoo's APE model when none is given)."""
    return group(
        click.option("--encoding", "-e", default=None, help="Encoding for a new/default model (ape, rope-axial, rope-mixed, ...)."),
        click.option("--model", "model_name", default=None, help="Model size when building from --encoding (default vit_tiny_patch16)."),
        path_option(
            "--checkpoint",
            "-c",
            default=None,
            help="Model directory (config.json + model.safetensors) or weights file (.safetensors, .pt).",
        ),
    )(command)


def precision_option(help: str, *, multiple: bool = False, default: str | None = None):
    """``--precision``: one of the export's plans (``multiple``: repeatable, passed as ``precisions``)."""
    from deploykit.export.defaults import PLAN_NAMES

    name = "precisions" if multiple else "precision"
    return click.option(
        "--precision", name, type=click.Choice(PLAN_NAMES), multiple=multiple, default=default, show_default=default is not None, help=help
    )


PLUGINS_HELP = (
    "Repeatable: a directory of Python TensorRT plugins, a plugin library (.so), or an installed plugin's name "
    "(e.g. sape2). An engine runs with the plugins it was built with: installed ones (sape2) load by "
    "themselves; a library or directory must be given again."
)


def plugins_option(help: str = PLUGINS_HELP):
    """``--plugins``, passed as ``plugin_specs`` (``deploykit.backends.plugins.Plugins.resolve``)."""
    return click.option("--plugins", "plugin_specs", multiple=True, help=help)


cpu_fallback_option = click.option(
    "--allow-cpu-fallback",
    is_flag=True,
    help="ort-cuda: accept nodes ONNX Runtime runs on the CPU instead of refusing (records name them).",
)

set_option = click.option(
    "--set",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Repeatable encoding option, typed and checked against the encoding's config (e.g. antialias=false).",
)


def image_limit_options(command):
    """``--max-image-pixels`` / ``--max-image-bytes``: what one image may cost before it is decoded."""
    from deploykit.inputs.imaging import MAX_BYTES, MAX_PIXELS

    return group(
        defaulted(
            "--max-image-pixels",
            default=MAX_PIXELS,
            help="Largest image (height x width) decoded; larger ones are refused (HTTP 400) from their header.",
        ),
        defaulted("--max-image-bytes", default=MAX_BYTES, help="Largest encoded image accepted, in bytes."),
    )(command)


def batching_options(size_help: str | None = None, delay_help: str | None = None):
    """``--max-batch-size`` / ``--max-queue-delay-us``: Triton's dynamic batching."""
    from deploykit.serve import defaults

    return group(
        defaulted("--max-batch-size", default=defaults.MAX_BATCH_SIZE, help=size_help),
        defaulted("--max-queue-delay-us", default=defaults.MAX_QUEUE_DELAY_US, help=delay_help),
    )


def int8_options(command):
    """How ``export --precision int8`` calibrates and checks its plan (``CalibrationOptions``)."""
    from deploykit.export import defaults

    return group(
        path_option(
            "--calibration-data",
            default=None,
            help="int8: your inputs: a folder of images (recursive), a text file listing image paths, or a .npy/.npz of "
            "preprocessed arrays; split into calibration and held-out inputs (default: a zoo model's dataset, else crops of "
            "the bundled images).",
        ),
        *(
            defaulted(name, type=kind, default=default, help=f"int8{help}")
            for name, kind, default, help in (
                (
                    "--calibration-samples",
                    click.IntRange(min=1),
                    defaults.CALIBRATION_SAMPLES,
                    ": real inputs to calibrate on (the rest of --calibration-data is held out).",
                ),
                (
                    "--calibration-method",
                    click.Choice(defaults.CALIBRATION_METHODS),
                    defaults.CALIBRATION_METHOD,
                    ": how activation ranges are chosen from the calibration inputs.",
                ),
                (
                    "--min-agreement",
                    click.FloatRange(0, 1),
                    defaults.MIN_AGREEMENT,
                    ": top-1 agreement with fp32 to reach on held-out inputs, moving the most sensitive matmuls back to "
                    "float (0: quantize every eligible matmul).",
                ),
                (
                    "--held-out",
                    click.IntRange(min=1),
                    defaults.HELD_OUT,
                    ": held-out inputs (a zoo model's val split, else other crops) the plan is checked on.",
                ),
                (
                    "--min-cosine",
                    click.FloatRange(0, 1, min_open=True),
                    defaults.MIN_COSINE,
                    ", features models (num_classes=0): mean per-token cosine with fp32 to reach on held-out inputs.",
                ),
            )
        ),
        click.option(
            "--max-relative-error",
            type=click.FloatRange(0, min_open=True),
            default=None,
            help="int8, features models: also a mean per-token relative error with fp32 to stay under.",
        ),
        click.option(
            "--keep-float",
            "keep_float",
            multiple=True,
            metavar="PATTERN",
            help="int8, fp8, int8-fp16, fp16, bf16: repeatable; keep the layers whose module path matches float (wildcards: "
            "blocks.*.mlp.fc2, blocks.11.*; deploykit debug-precision finds them for fp16).",
        ),
        click.option(
            "--int8-attention",
            is_flag=True,
            help="int8: quantize the attention products too (faster at high resolution; measured to cost top-1 agreement "
            "away from the training resolution, so off by default; fp8 and int8-fp16 always quantize them).",
        ),
    )(command)


zoo_root_option = click.option(
    "--root", type=click.Path(path_type=Path, file_okay=False), default=None, help="Zoo directory (default models/)."
)


def show_error(err: click.ClickException) -> int:
    """Print a click error as one ``error:`` line (a usage error with where to read the usage);
    return its exit code (2 for usage errors, 1 otherwise)."""
    line = f"error: {one_line(err.format_message())}"
    if isinstance(err, click.UsageError) and err.ctx is not None:
        line = f"{line.rstrip('.')}; see '{err.ctx.command_path} --help'"
    click.echo(line, err=True)
    return err.exit_code
