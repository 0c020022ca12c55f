"""What every ``deploykit`` command shares: ``-q``/``-v`` on the command itself, resolutions and
counts as comma lists, and one form for every error.

Exit codes: a command line click cannot parse (an unknown command or option, a missing argument,
a value of the wrong type or outside the range ``--help`` gives) is a usage error, exit 2; a
command that parses but cannot be done (a ``DeployKitError``) exits 1. Either way stderr gets
one ``error:`` line, never click's three-line usage block.
"""

from __future__ import annotations

import math

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
    """A command that takes ``-q``/``-v`` itself (``deploykit export ... -v``), as its group does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params.extend(verbosity_options())


class Group(click.Group):
    """A group whose commands and subgroups are ``Command``/``Group``: ``-q``/``-v`` everywhere."""

    command_class = Command
    group_class = type  # subgroups of this group are of this class too

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params.extend(verbosity_options())


class Resolutions(click.ParamType):
    """``224``, ``384x256`` or a comma list of them (``224,384x256``) → a tuple of ``(height, width)``."""

    name = "RESOLUTION[,...]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple) and all(isinstance(r, tuple) for r in value):
            return value
        from deploykit.resolutions import parse_resolutions

        try:
            return tuple(parse_resolutions([value]))
        except DeployKitError as err:
            self.fail(str(err), param, ctx)


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


class Counts(click.ParamType):
    """``8`` or a comma list of positive integers (``1,8,32``) → a tuple, duplicates dropped."""

    name = "N[,...]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return tuple(parse_counts([value], "count"))
        except DeployKitError as err:
            self.fail(str(err), param, ctx)


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


def show_error(err: click.ClickException) -> int:
    """Print a click error as one ``error:`` line (a usage error with where to read the usage);
    return its exit code (2 for usage errors, 1 otherwise)."""
    line = f"error: {one_line(err.format_message())}"
    if isinstance(err, click.UsageError) and err.ctx is not None:
        line = f"{line.rstrip('.')}; see '{err.ctx.command_path} --help'"
    click.echo(line, err=True)
    return err.exit_code
