"""Request JSON read only where Python's ``json`` and Triton's RapidJSON read it the same way.

The front checks a request with Python's ``json``; Triton 2.51 then reads the same bytes with
RapidJSON (``TritonJson::Parse``, flag ``kParseNanAndInfFlag``; a member is found with
``FindMember``, which returns the first of duplicate keys). Where the two could read one text
differently, the text is refused, so what was checked is what runs:

* encoding: UTF-8 only, no byte-order mark (Python's ``json`` also reads UTF-16/32 and skips a
  BOM; RapidJSON reads the bytes as they are), no lone surrogate escape such as ``"\\ud800"``
  (Python keeps it, RapidJSON refuses it);
* objects: no key twice (Python keeps the last value, Triton uses the first);
* numbers: integers within int64/uint64 (RapidJSON reads a larger one as a double, Python
  exactly, and over 4300 digits not at all), no ``NaN``/``Infinity`` (RapidJSON's flag takes
  them), written exponents at most 308 and values finite as doubles (RapidJSON refuses ``1e400``,
  even ``0e400``; Python reads ``inf`` and 0.0), at most ``MAX_NUMBER_CHARS`` characters;
* size: at most ``max_values`` values, bounded on the bytes before anything is built (Python's
  ``json`` makes one Python object per value, tens of bytes for each few characters), nested at most
  ``MAX_JSON_DEPTH`` deep.

Refusals raise ``RequestRejected`` (``requests.py``) with one line.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter

MAX_JSON_DEPTH = 32  # a request is 3 deep ({"inputs": [{...}]}) plus its data's rank; 32 leaves room
MAX_NUMBER_CHARS = 40  # a double needs 17 significant digits, a sign, a point and an exponent
MAX_EXPONENT = 308
INT_MIN, UINT_MAX = -(2**63), 2**64 - 1  # RapidJSON's integers: int64 and uint64
_BOM = b"\xef\xbb\xbf"
# Text that may hold a \uD800-\uDFFF escape: the parsed value is then searched for a lone surrogate
# (a false alarm, such as an escaped backslash before "ud800", costs only that search).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class RequestRejected(ValueError):
    """A request the server does not pass on: the client's error, one line.

    Attributes:
        status: the HTTP status to answer with (400; 413 for a body or JSON over a size limit).
    """

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def json_values_bound(text: bytes | bytearray) -> int:
    """At most how many objects ``json.loads(text)`` makes, from four byte counts.

    Every value but the first follows a ``[``, ``,`` or ``:``, and every object key precedes a
    ``:``; bytes inside strings count too, so this only overestimates.
    """
    return 1 + text.count(b"[") + text.count(b",") + 2 * text.count(b":")


def read_json(text: bytes | bytearray, max_values: int) -> object:
    """Parse request JSON under the rules of the module docstring.

    Args:
        text: the JSON bytes.
        max_values: most values (and keys) the text may hold.

    Raises:
        RequestRejected: any rule broken (413 for more than ``max_values`` values).
    """
    if json_values_bound(text) > max_values:
        raise RequestRejected(
            f"request JSON holds more than {max_values} values; send large tensors as binary data (Inference-Header-Content-Length)",
            status=413,
        )
    if text[:3] == _BOM:
        raise RequestRejected("request JSON starts with a byte-order mark; send UTF-8 without one")
    try:
        decoded = str(text, "utf-8")
    except UnicodeDecodeError as err:
        raise RequestRejected(f"request JSON is not UTF-8 ({err.reason} at byte {err.start})") from None
    try:
        value = json.loads(decoded, parse_int=_integer, parse_float=_real, parse_constant=_constant, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise RequestRejected(f"request JSON is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except json.JSONDecodeError as err:
        raise RequestRejected(f"malformed request JSON: {err.msg} at character {err.pos}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise RequestRejected(f"request JSON is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    if _SURROGATE_ESCAPE.search(text):
        _refuse_lone_surrogates(value)
    return value


def _integer(token: str) -> int:
    if len(token) <= 18:  # fits int64: the common case, without the range check
        return int(token)
    # Checked on the digits before int() reads them: Python refuses over 4300 digits with a ValueError.
    if len(token.lstrip("-")) > 20 or not INT_MIN <= (value := int(token)) <= UINT_MAX:
        raise RequestRejected(f"integer {token[:24]} is beyond 64 bits; Triton would read it as a rounded double")
    return value


def _real(token: str) -> float:
    # RapidJSON refuses a written exponent over 308 whatever the digits before it (even 0e309).
    if len(token) > MAX_NUMBER_CHARS or ("e" in token or "E" in token) and int(token.lower().rpartition("e")[2]) > MAX_EXPONENT:
        raise RequestRejected(f"number {token[:24]} has over {MAX_NUMBER_CHARS} characters or an exponent over {MAX_EXPONENT}")
    value = float(token)
    if not math.isfinite(value):
        raise RequestRejected(f"number {token[:24]} is beyond the double range; send finite numbers")
    return value


def _constant(name: str):
    raise RequestRejected(f"non-finite number {name} in the request; send finite numbers")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    found = dict(pairs)
    if len(found) != len(pairs):
        twice = next(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise RequestRejected(f"key {twice[:40]!r} appears twice in one object; Triton would read the first, this check the last")
    return found


def _depth(value: object) -> int:
    """Nesting depth of parsed JSON, one level at a time (no recursion, containers only)."""
    depth, level = 0, [value] if isinstance(value, (list, dict)) else []
    while level and depth <= MAX_JSON_DEPTH:
        depth += 1
        level = [c for item in level for c in (item.values() if isinstance(item, dict) else item) if isinstance(c, (list, dict))]
    return depth + bool(level)


def _refuse_lone_surrogates(value: object) -> None:
    """Python's ``json`` pairs escaped surrogates into one character; any left alone is refused."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RequestRejected("request JSON holds a lone surrogate escape (\\ud800-\\udfff); Triton refuses those") from None
