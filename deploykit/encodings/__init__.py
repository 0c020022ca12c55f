"""Positional encodings: one module per paper, all behind one registry.

``create_encoding(get_config("rope-axial"), dims)`` builds an encoding module; ``list_encodings()`` names
what is available. Each module registers itself with ``@register_encoding``.
"""

from deploykit.encodings._registry import (
    config_from_dict,
    config_to_dict,
    create_encoding,
    encoding_name,
    get_config,
    list_encodings,
    parse_options,
    register_encoding,
)
from deploykit.encodings.base import EncodingConfig, Hook, KeepsFloat, PETables, PositionalEncoding, QKChannelOrder, TrunkDims

# Importing the modules registers them.
from deploykit.encodings import ape, geope, gridpe, mope, rope, sape2, wepe  # noqa: F401  isort: skip  (after base: they import it)

__all__ = [
    "EncodingConfig",
    "Hook",
    "KeepsFloat",
    "PETables",
    "PositionalEncoding",
    "QKChannelOrder",
    "TrunkDims",
    "config_from_dict",
    "config_to_dict",
    "create_encoding",
    "encoding_name",
    "get_config",
    "list_encodings",
    "parse_options",
    "register_encoding",
]
