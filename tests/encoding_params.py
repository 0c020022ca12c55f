"""Every encoding as a fixture parameter, with the quick test set (``pytest -q``) keeping a
representative two and the rest marked ``slow``: each parameter costs an export, and the whole
suite (``-m ""``, what CI runs) still checks every encoding."""

from __future__ import annotations

import pytest

from deploykit.encodings import list_encodings

# A learned table added to the tokens, and a content-dependent attention bias exported as a custom op.
QUICK_ENCODINGS = ("ape", "sape2")


def encoding_params() -> list:
    return [name if name in QUICK_ENCODINGS else pytest.param(name, marks=pytest.mark.slow) for name in list_encodings()]
