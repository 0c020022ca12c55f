"""Name → (module class, config) registry for positional encodings."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from deploykit._fields import check_values, show
from deploykit.encodings.base import EncodingConfig, PositionalEncoding, TrunkDims
from deploykit.errors import ConfigError, unknown_choice


@dataclasses.dataclass(frozen=True)
class _Entry:
    module_cls: type[PositionalEncoding]
    config_cls: type[EncodingConfig]
    variant: Mapping[str, Any]  # fields whose values identify this name
    defaults: Mapping[str, Any]  # further defaults, freely overridable


_ENCODINGS: dict[str, _Entry] = {}


def register_encoding(
    name: str, config_cls: type[EncodingConfig], *, variant: Mapping[str, Any] | None = None, **defaults: Any
) -> Callable[[type[PositionalEncoding]], type[PositionalEncoding]]:
    """Class decorator registering an encoding under ``name``.

    Args:
        name: the command-line name (``ape``, ``rope-axial``, ...).
        config_cls: frozen dataclass of options.
        variant: when one class backs several names (axial and mixed RoPE), the field values
            that identify this name; fixed for the name and used to name a saved config.
        **defaults: overrides of the config's field defaults for this name.
    """

    def wrap(module_cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
        if name in _ENCODINGS:
            raise ValueError(f"encoding {name!r} is already registered")
        _ENCODINGS[name] = _Entry(module_cls, config_cls, dict(variant or {}), dict(defaults))
        return module_cls

    return wrap


def list_encodings() -> list[str]:
    """Registered encoding names, sorted."""
    return sorted(_ENCODINGS)


def _entry(name: str) -> _Entry:
    try:
        return _ENCODINGS[name]
    except KeyError:
        raise ConfigError(unknown_choice("encoding", name, list_encodings(), show)) from None


def get_config(name: str, **options: Any) -> EncodingConfig:
    """The config for ``name`` with ``options`` applied.

    Raises:
        ConfigError: unknown name, or an option the encoding does not have.
    """
    entry = _entry(name)
    fields = {f.name for f in dataclasses.fields(entry.config_cls)} - set(entry.variant)
    unknown = sorted(set(options) - fields)
    if unknown:
        more = f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise ConfigError(f"encoding {name!r} has no option(s) {', '.join(map(show, unknown[:5]))}{more}; valid options: {sorted(fields)}")
    check_values(entry.config_cls, options, prefix=f"encoding {name!r} option ")  # types first: the checks below compare values
    try:
        return entry.config_cls(**{**entry.defaults, **options, **entry.variant})
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid option for encoding {name!r}: {err}") from err


def parse_options(name: str, assignments: Iterable[str]) -> dict[str, Any]:
    """Command-line ``key=value`` options of encoding ``name``, each parsed to its config field's
    type (``true``/``false`` for booleans, ``none`` for an optional field).

    Raises:
        ConfigError: unknown encoding, an assignment without ``=``, a key the encoding does not
            have (the valid ones are listed), or a value of the wrong type.
    """
    entry = _entry(name)
    hints = typing.get_type_hints(entry.config_cls)
    valid = sorted(f.name for f in dataclasses.fields(entry.config_cls) if f.name not in entry.variant)
    options = {}
    for text in assignments:
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"--set {text!r} is not key=value; options of {name!r}: {', '.join(valid)}")
        if key not in valid:
            raise ConfigError(f"encoding {name!r} has no option {key!r}; valid options: {', '.join(valid)}")
        options[key] = _parse_value(key, value.strip(), hints[key])
    return options


def _parse_value(key: str, text: str, annotation: Any) -> Any:
    kinds = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if type(None) in kinds and text.lower() in ("none", "null"):
        return None
    kind = next(k for k in kinds if k is not type(None))
    if kind is bool:
        table = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
        if text.lower() in table:
            return table[text.lower()]
    elif kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    elif typing.get_origin(kind) is tuple:  # a grid as the command line writes one: 16x16 (or 16,16)
        item = typing.get_args(kind)[0]
        try:
            return tuple(item(part) for part in text.replace(",", "x").split("x"))
        except ValueError:
            pass
    else:
        return kind(text)
    what = "grid (e.g. 16x16)" if typing.get_origin(kind) is tuple else getattr(kind, "__name__", kind)
    raise ConfigError(f"option {key}={text!r} is not a valid {what}")


def config_from_dict(data: Mapping[str, Any]) -> EncodingConfig:
    """Inverse of ``config_to_dict``: the registry name under ``"name"``, the fields beside it."""
    data = dict(data)
    name = data.pop("name", None)
    if name is None:
        raise ConfigError("encoding config has no 'name'")
    if type(name) is not str:
        raise ConfigError(f"encoding name must be a string, one of: {', '.join(list_encodings())}; got {show(name)}")
    variant = _entry(name).variant
    clash = {k: v for k, v in data.items() if k in variant and variant[k] != v}
    if clash:
        said = ", ".join(f"{k} {show(v)}" for k, v in clash.items())
        raise ConfigError(f"encoding config {name!r} contradicts its name: {said} (the name {name!r} means {dict(variant)})")
    return get_config(name, **{k: v for k, v in data.items() if k not in variant})


def create_encoding(config: EncodingConfig, dims: TrunkDims) -> PositionalEncoding:
    """Build the encoding module for ``config`` (from ``get_config``)."""
    return _entry(encoding_name(config)).module_cls(config, dims)


def encoding_name(config: EncodingConfig) -> str:
    """The registry name of a config: the entry of its class whose ``variant`` fields it holds."""
    for name, entry in _ENCODINGS.items():
        if type(config) is entry.config_cls and all(getattr(config, k) == v for k, v in entry.variant.items()):
            return name
    raise ConfigError(f"{type(config).__name__} matches no registered encoding")


def config_to_dict(config: EncodingConfig) -> dict[str, Any]:
    """The config as JSON-ready data, with its registry name under ``"name"`` (variant fields
    stay in the data so a saved config reads on its own)."""
    return {"name": encoding_name(config), **dataclasses.asdict(config)}
