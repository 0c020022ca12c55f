"""The one seam to Polygraphy's TensorRT backend: which TensorRT flavour it runs on, and what
TensorRT says while it works.

Flavour. Polygraphy supports TensorRT-RTX through ``polygraphy.config.USE_TENSORRT_RTX``, which
it initialises from the environment variable ``POLYGRAPHY_USE_TENSORRT_RTX`` and reads in two
ways: ``polygraphy.backend.trt`` binds its module-level ``trt`` (``lazy_import_trt()``) from it
when first imported, and several loaders read it again on every call. There is no per-call
argument, so the flavour is one per process. ``backend(module)`` sets that documented config value
here, once, before the first import, from the flavour the caller asked for (an argument in our
code; no environment variable is read or written), and refuses the other flavour later in the
same process in one line, rather than letting Polygraphy drive the wrong library.

Messages. Polygraphy's TensorRT logger forwards every TensorRT message to its ``G_LOGGER``;
``TrtMessages`` routes them through Python ``logging`` (Polygraphy's documented
``use_python_logging_system``) into a list while a call runs, and forwards them afterwards from
the calling thread: TensorRT calls the logger from its own threads, and I/O there (a handler's
flush) has deadlocked TensorRT-RTX builds before (see git log of ``tensorrt.py``). Warnings are
summarised once (a SaPE² build repeats one parser warning about a hundred times); every
message is logged at DEBUG (``deploykit build -v`` shows them).

TensorRT has one logger per process, so runners and builds working at the same time (a server's
runners on their threads) share it. Each block sees only its own messages: a record goes to the
block open on the thread that logged it (TensorRT logs a call's messages on the calling thread),
and Polygraphy's once-per-process filter of repeated warnings is kept per thread, so one runner's
warning never silences another's. A record from a thread with no block open cannot be told
apart and goes to every open block.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from types import ModuleType

from deploykit._lazy import lazy_import
from deploykit.errors import DeployKitError, ExportError, MissingDependencyError, one_line
from deploykit.runners.table import FLAVOURS, flavour

_POLYGRAPHY_LOGGER = "Polygraphy"
_MAX_KINDS = 3  # distinct warnings quoted in the summary


def import_trt(module: str = "tensorrt") -> ModuleType:
    """Import a TensorRT flavour on demand.

    Args:
        module: ``"tensorrt"`` or ``"tensorrt_rtx"``.

    Returns:
        The imported module.

    Raises:
        ValueError: ``module`` is not a TensorRT flavour's (``deploykit.runners.table.FLAVOURS``).
        MissingDependencyError: the module is not installed.
    """
    return lazy_import(module, flavour(module).tag)


def backend(module: str) -> ModuleType:
    """``polygraphy.backend.trt``, running on ``module`` (``"tensorrt"`` or ``"tensorrt_rtx"``).

    Raises:
        MissingDependencyError: the flavour (or polygraphy) is not installed.
        DeployKitError: Polygraphy already runs on the other flavour in this process.
    """
    wanted = flavour(module)
    import_trt(module)  # a missing flavour is our one-line error naming the extra, not Polygraphy's
    try:
        from polygraphy import config
    except ImportError as err:
        raise MissingDependencyError(
            f"polygraphy is not available ({err}); install it with: pip install 'deploykit[{wanted.tag}]'"
        ) from err
    if "polygraphy.backend.trt" not in sys.modules:
        # Polygraphy's documented switch (POLYGRAPHY_USE_TENSORRT_RTX at startup); it must hold
        # before polygraphy.backend.trt is first imported and stay for the whole process.
        config.USE_TENSORRT_RTX = wanted.polygraphy_rtx
        _route_messages()
    elif config.USE_TENSORRT_RTX != wanted.polygraphy_rtx:
        bound = next(f for f in FLAVOURS if f.polygraphy_rtx == config.USE_TENSORRT_RTX)
        raise DeployKitError(
            f"Polygraphy already runs on {bound.title} in this process and drives one TensorRT flavour per process; "
            f"run the {wanted.title} step (--backend {wanted.tag}) in a separate command"
        )
    import polygraphy.backend.trt as pg

    return pg


def _route_messages() -> None:
    from polygraphy.logger import G_LOGGER

    G_LOGGER.use_python_logging_system = True
    G_LOGGER.colors = False
    G_LOGGER.letter = False
    # Only TrtMessages handles these (in the TensorRT thread, append only); the root logger's
    # handlers would write from TensorRT's threads.
    logging.getLogger(_POLYGRAPHY_LOGGER).propagate = False


class _PerThreadOnce(threading.local):
    """What Polygraphy's ``G_LOGGER.once_logged`` holds (the hashes of warnings logged with
    ``LogMode.ONCE``, which it checks, adds to and we clear), kept per thread."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def __contains__(self, item: int) -> bool:
        return item in self.seen

    def add(self, item: int) -> None:
        self.seen.add(item)

    def clear(self) -> None:
        self.seen.clear()


class _Router(logging.Handler):
    """Appends each record to the innermost block open on the thread that logged it (to every
    open block when that thread has none); no I/O, so it is safe on TensorRT's threads."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.blocks: dict[int, list[list[tuple[int, str]]]] = {}  # thread -> its open blocks' records

    def emit(self, record: logging.LogRecord) -> None:
        entry = (record.levelno, record.getMessage())
        own = self.blocks.get(record.thread)
        for stack in [own] if own else list(self.blocks.values()):
            with contextlib.suppress(IndexError):  # another thread's block, closed meanwhile
                stack[-1].append(entry)

    def open_block(self) -> list[tuple[int, str]]:
        records: list[tuple[int, str]] = []
        self.blocks.setdefault(threading.get_ident(), []).append(records)
        return records

    def close_block(self, records: list[tuple[int, str]]) -> None:
        stack = self.blocks[threading.get_ident()]
        del stack[next(i for i, r in enumerate(stack) if r is records)]  # by identity: two empty lists are equal
        if not stack:
            del self.blocks[threading.get_ident()]


_ATTACH = threading.Lock()  # two first blocks on two threads attach one router


def _router() -> _Router:
    """The one router on Polygraphy's logger, attached on first use (with the per-thread filter)."""
    from polygraphy.logger import G_LOGGER

    logger = logging.getLogger(_POLYGRAPHY_LOGGER)
    with _ATTACH:
        router = next((h for h in logger.handlers if isinstance(h, _Router)), None)
        if router is None:
            router = _Router()
            logger.setLevel(logging.DEBUG)
            logger.addHandler(router)
            G_LOGGER.once_logged = _PerThreadOnce()
    return router


class TrtMessages:
    """What TensorRT and Polygraphy said during a ``with`` block.

    Args:
        what: names the step in the summary (``TensorRT-RTX build of model_32.onnx``).
        log: where messages are forwarded when the block ends; None keeps them for the caller
            (``errors``, ``warnings``) only.

    Example:
        >>> with TrtMessages("TensorRT-RTX build", _log) as messages:
        ...     engine = pg.EngineBytesFromNetwork(network, config)()
        >>> messages.errors  # for the one-line error when the step failed
    """

    def __init__(self, what: str, log: logging.Logger | None) -> None:
        self.what, self.log = what, log
        self._records: list[tuple[int, str]] = []
        self._router: _Router | None = None

    def __enter__(self) -> TrtMessages:
        from polygraphy.logger import G_LOGGER

        self._router = _router()
        # Polygraphy passes each distinct TensorRT warning once (LogMode.ONCE, per thread here);
        # a summary is per step, so a second build on this thread hears its warnings too.
        G_LOGGER.once_logged.clear()
        self._records = self._router.open_block()
        return self

    def __exit__(self, *exc) -> None:
        self._router.close_block(self._records)
        if self.log is not None:
            self.forward()

    @property
    def errors(self) -> list[str]:
        return [one_line(m) for level, m in self._records if level >= logging.ERROR]

    @property
    def warnings(self) -> list[str]:
        return [m for level, m in self._records if logging.WARNING <= level < logging.ERROR]

    @contextlib.contextmanager
    def failing_as(self, what: str, error: type[DeployKitError] = ExportError) -> Iterator[None]:
        """Turn Polygraphy's exception (its loaders raise after logging TensorRT's errors) into
        ``error`` with one line: ``what: <TensorRT's errors>``."""
        from polygraphy.exception import PolygraphyException

        try:
            yield
        except PolygraphyException as err:
            detail = "; ".join(self.errors) or one_line(err) or type(err).__name__
            raise error(one_line(f"{what}: {detail}")) from err

    def forward(self) -> None:
        """Every message at DEBUG, then one WARNING line summarising the warnings (errors go into
        the caller's exception instead)."""
        records, self._records[:] = list(self._records), []
        for _, message in records:
            self.log.debug("%s: %s", self.what, message)
        summary = summarise(m for level, m in records if logging.WARNING <= level < logging.ERROR)
        if summary:
            self.log.warning("%s: %s", self.what, summary)


def summarise(warnings, hint: str = " (-v shows each)") -> str | None:
    """``"101 warnings: A node named n99 already exists, … (×101)"``: warnings that differ only in
    numbers (node names such as ``n97``, ``n98``) count as one kind; None without warnings."""
    warnings = [one_line(w) for w in warnings]
    if not warnings:
        return None
    kinds = Counter(re.sub(r"\d+", "#", w) for w in warnings)
    first = {}
    for w in warnings:
        first.setdefault(re.sub(r"\d+", "#", w), w)
    shown = "; ".join(f"{first[k]} (×{n})" if n > 1 else first[k] for k, n in kinds.most_common(_MAX_KINDS))
    more = f"; and {len(kinds) - _MAX_KINDS} more kinds" if len(kinds) > _MAX_KINDS else ""
    plural = "s" if len(warnings) > 1 else ""
    return one_line(f"{len(warnings)} warning{plural}: {shown}{more}{hint}", limit=1000)
