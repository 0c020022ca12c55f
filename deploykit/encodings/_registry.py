"""Name → (module class, config) registry for positional encodings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from deploykit.encodings.base import EncodingConfig, PositionalEncoding, TrunkDims
from deploykit.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class _Entry:
    module_cls: type[PositionalEncoding]
    config_cls: type[EncodingConfig]
    defaults: Mapping[str, Any]


_ENCODINGS: dict[str, _Entry] = {}


def register_encoding(
    name: str, config_cls: type[EncodingConfig], **defaults: Any
) -> Callable[[type[PositionalEncoding]], type[PositionalEncoding]]:
    """Class decorator registering an encoding under ``name``.

    Args:
        name: the command-line name (``ape``, ``rope-axial``, ...).
        config_cls: frozen dataclass of options; ``defaults`` override its field defaults for
            this name (one class may back several names, e.g. axial and mixed RoPE).
    """

    def wrap(module_cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
        if name in _ENCODINGS:
            raise ValueError(f"encoding {name!r} is already registered")
        _ENCODINGS[name] = _Entry(module_cls, config_cls, dict(defaults))
        return module_cls

    return wrap


def list_encodings() -> list[str]:
    """Registered encoding names, sorted."""
    return sorted(_ENCODINGS)


def _entry(name: str) -> _Entry:
    try:
        return _ENCODINGS[name]
    except KeyError:
        raise ConfigError(f"unknown encoding {name!r}; choose one of: {', '.join(list_encodings())}") from None


def get_config(name: str, **options: Any) -> EncodingConfig:
    """The config for ``name`` with ``options`` applied.

    Raises:
        ConfigError: unknown name, or an option the encoding does not have.
    """
    entry = _entry(name)
    fields = {f.name for f in dataclasses.fields(entry.config_cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(f"encoding {name!r} has no option(s) {unknown}; valid options: {sorted(fields)}")
    return entry.config_cls(**{**entry.defaults, **options})


def config_from_dict(data: Mapping[str, Any]) -> EncodingConfig:
    """Inverse of ``EncodingConfig.to_dict``."""
    data = dict(data)
    name = data.pop("name", None)
    if name is None:
        raise ConfigError("encoding config has no 'name'")
    return get_config(name, **data)


def create_encoding(config: EncodingConfig, dims: TrunkDims) -> PositionalEncoding:
    """Build the encoding module for ``config`` (from ``get_config``)."""
    return _entry(encoding_name(config)).module_cls(config, dims)


def encoding_name(config: EncodingConfig) -> str:
    """The registry name of a config: the entry of its class whose registered defaults it holds.

    Entries that pin more fields win, so ``RopeConfig(mode="mixed")`` is ``rope-mixed``.
    """
    matches = [
        (len(entry.defaults), name)
        for name, entry in _ENCODINGS.items()
        if type(config) is entry.config_cls
        and all(getattr(config, key) == value for key, value in entry.defaults.items())
    ]
    if not matches:
        raise ConfigError(f"{type(config).__name__} matches no registered encoding")
    return max(matches)[1]


def config_to_dict(config: EncodingConfig) -> dict[str, Any]:
    """The config as JSON-ready data, with its registry name under ``"name"``."""
    return {"name": encoding_name(config), **dataclasses.asdict(config)}
