"""The one check of a config's values, before anything is built from them.

A config dataclass (a model's, an encoding's) declares its fields' types in its annotations and
the bounds of its numbers in a ``Range`` table; ``check_values`` holds every value to both: a
bool is not an int, a number is finite, a size lies in its range, a list holds numbers. Every
refusal is one ``ConfigError`` line naming the field, what it must be and what it is, with the
value shown short (``a list of 3 items``), so a hostile ``config.json`` (a 10⁹ width, NaN, lists
nested a thousand deep) is named, never allocated, recursed into or printed whole.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deploykit.errors import ConfigError

# The smallest positive normal float32: an epsilon below it is zero (or denormal) in the graph.
FLOAT32_TINY = 1.1754943508222875e-38
_FLOAT_MAX = sys.float_info.max


@dataclass(frozen=True)
class Range:
    """Allowed values of a number (``low`` excluded when ``low_open``); the ends may be None."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None and not self.low_open:
            return f"from {_number(self.low)} to {_number(self.high)}"
        low = None if self.low is None else f"{'>' if self.low_open else '>='} {_number(self.low)}"
        high = None if self.high is None else f"<= {_number(self.high)}"
        return " and ".join(filter(None, (low, high)))


def check_values(cls: type, values: Mapping[str, Any], ranges: Mapping[str, Range] = {}, prefix: str = "") -> None:
    """Check each of ``values`` (field name → value) against ``cls``'s annotation for that field and
    its ``Range`` in ``ranges`` (applied to every item of a list field).

    Types: ``int`` (not a bool), ``float`` (an int or a float, not a bool, finite), ``bool``,
    ``str``, ``X | None``, and ``tuple[X, ...]`` (a list or tuple of X); fields of other types
    (a nested config) are left to their own checks.

    Raises:
        ConfigError: the first value that does not fit, naming ``prefix + name``.
    """
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if name not in hints:
            continue
        problem = _problem(hints[name], value, ranges.get(name))
        if problem:
            raise ConfigError(f"{prefix}{name} must be {problem}, got {show(value)}")


def json_nesting(text: str) -> tuple[int, str | None]:
    """How deeply JSON ``text`` nests (``{}`` or ``[]`` inside each other), and the top-level key
    under which it is deepest, read without parsing: Python's JSON reader recurses once per
    level, so a file nested deeply enough fails there with a ``RecursionError``."""
    depth = deepest = 0
    key = deepest_key = None
    last_string, in_string, escaped, start = None, False, False, 0
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string, last_string = False, text[start:i]
        elif char == '"':
            in_string, start = True, i + 1
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest, deepest_key = depth, key
        elif char in "]}":
            depth -= 1
        elif char == ":" and depth == 1:
            key = last_string
    return deepest, deepest_key


def dataclass_values(instance) -> dict[str, Any]:
    """A dataclass instance's field values, by name (not recursing into them, unlike ``asdict``)."""
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}


def _problem(annotation, value, bounds: Range | None) -> str | None:
    """What ``value`` should have been, or None when it fits."""
    kinds = (
        typing.get_args(annotation)
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
        else (annotation,)
    )
    optional = type(None) in kinds
    kinds = [k for k in kinds if k is not type(None)]
    if len(kinds) != 1:
        return None
    kind = kinds[0]
    if value is None:
        return None if optional else _expected(kind, bounds)
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        fits = isinstance(value, (list, tuple)) and all(_fits(item, v, bounds) for v in value)
    elif kind in (int, float, bool, str):
        fits = _fits(kind, value, bounds)
    else:
        return None
    return None if fits else ("null or " if optional else "") + _expected(kind, bounds)


def _fits(kind, value, bounds: Range | None) -> bool:
    if kind is bool or kind is str:
        return type(value) is kind
    if kind is int and type(value) is not int:
        return False
    if kind is float and not (type(value) is float and math.isfinite(value) or type(value) is int and abs(value) <= _FLOAT_MAX):
        return False  # an integer too large for a float would overflow wherever it is used as one
    return bounds is None or value in bounds


_NOUNS = {int: "integer", float: "finite number", bool: "boolean", str: "string"}


def _expected(kind, bounds: Range | None) -> str:
    if typing.get_origin(kind) is tuple:
        each = f", each {bounds.describe()}" if bounds else ""
        return f"a list of {_NOUNS[typing.get_args(kind)[0]]}s{each}"
    words = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}[kind]
    return f"{words} {bounds.describe()}" if bounds and kind in (int, float) else words


def _number(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def show(value: Any, limit: int = 40) -> str:
    """``value`` as a config file spells it, short: containers by their size, long text cut."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value) if value.bit_length() < 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item{'s' * (len(value) != 1)}" if len(value) > 4 or _nested(value) else _list(value)
    if isinstance(value, Mapping):
        return f"an object with {len(value)} key{'s' * (len(value) != 1)}"
    text = repr(value) if isinstance(value, str) else type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _nested(items) -> bool:
    return any(isinstance(v, (list, tuple, Mapping)) for v in items)


def _list(items) -> str:
    return "[" + ", ".join(show(v, limit=12) for v in items) + "]"
