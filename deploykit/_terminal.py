"""What the CLI shows while it works: its steps, and deploykit's log records.

The library reports progress through ``progress(message)`` callables and logs through the
``deploykit`` loggers; this module renders both on stderr, for a terminal or for a log file, and
keeps third-party loggers (exporters, quantizers, the model hub's client) to their errors around
their calls (``quiet_logger``).
Verbosity: -1 with ``-q``, 0 by default, 1 with ``-v``, 2 with ``-vv``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import click


class EchoHandler(logging.Handler):
    """Log records as ``warning: ...`` lines on the current stderr (looked up per record, so
    in-process callers that swap ``sys.stderr`` see them)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"{record.levelname.lower()}: {self.format(record)}", err=True)


def configure_logging(verbosity: int) -> None:
    """deploykit's records on stderr: errors only with ``-q``, warnings by default, info with
    ``-v``, debug with ``-vv``; one handler however often the CLI runs in one process."""
    logger = logging.getLogger("deploykit")
    for handler in [h for h in logger.handlers if isinstance(h, EchoHandler)]:
        logger.removeHandler(handler)
    logger.addHandler(EchoHandler())
    logger.setLevel({-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG))


@contextlib.contextmanager
def quiet_logger(name: str):
    """Errors only from logger ``name`` (``""``: the root logger) for the block: third-party
    exporters and quantizers log progress and advice that would bury the CLI's own report.

    The logger's handlers are put back as they were too: a module-level ``logging.warning(...)``
    (ONNX Runtime's quantizer has them) calls ``logging.basicConfig()`` on a root logger without
    handlers, whatever the level, and that handler would then print every later ``deploykit``
    warning a second time (``WARNING:deploykit...:``) beside the CLI's ``warning:`` line."""
    logger = logging.getLogger(name)
    level, handlers = logger.level, list(logger.handlers)
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        for handler in [h for h in logger.handlers if h not in handlers]:
            logger.removeHandler(handler)


def counter(progress: Callable[[str], None] | None, what: str, total: int, unit: str = "", updates: int = 10) -> Callable[[int], None]:
    """Progress inside one long step: ``tick(done)`` reports ``"{what}: {done} of {total} {unit}"``
    to ``progress`` (the ``step`` of ``steps``), at most ``updates + 1`` times: the first count,
    each further ``1/updates`` of the way, and the last. A log then gets a few lines per step, not
    one per batch; which counts are shown depends on the counts alone, never on time.

    Args:
        progress: the step callback, or None (then ``tick`` does nothing).
        what: the work, e.g. ``PyTorch reference at 224``.
        total: how many ``done`` will reach.
        unit: what is counted (``inputs``).
        updates: how many parts of the way are reported.
    """
    if progress is None or total < 1:
        return lambda done: None
    shown = [-1]

    def tick(done: int) -> None:
        part = min(done, total) * updates // total
        if part > shown[0]:
            shown[0] = part
            progress(f"{what}: {min(done, total)} of {total}{' ' + unit if unit else ''}")

    return tick


@contextlib.contextmanager
def steps(console, title: str, verbosity: int) -> Iterator[Callable[[str], None]]:
    """Show the steps of long work: yields ``step(message)``. On a terminal a spinner naming
    the current step; otherwise (logs, pipes) one line per step, with the time since the start;
    ``-v`` adds those lines on a terminal too; ``-q`` shows nothing.

    Args:
        console: a rich ``Console`` on stderr.
        title: what the work is (``export``), the prefix of every line.
        verbosity: -1 to 2, as the module docstring says.
    """
    start = time.perf_counter()

    def line(message: str) -> None:
        console.print(f"{title}: {message}  ({time.perf_counter() - start:.0f} s)")

    if verbosity < 0:
        yield lambda message: None
    elif not console.is_terminal:
        yield line
    else:
        with console.status(title) as status:

            def update(message: str) -> None:
                status.update(f"{title}: {message}")
                if verbosity > 0:
                    line(message)

            yield update
