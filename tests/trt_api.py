"""Autospecs of TensorRT's real classes that check arguments too.

``unittest.mock.create_autospec(cls, instance=True)`` on a TensorRT class refuses an attribute the
class does not have, but accepts any arguments: TensorRT's methods are pybind11 builtins, which
carry no Python signature. pybind11 writes each method's signatures into its docstring
(``execute_async_v3(self: IExecutionContext, stream_handle: SupportsInt) -> bool``, one line per
overload), so ``strict_autospec`` reads them there: the spec is a subclass of the real class
whose methods carry those signatures, so the mock still passes ``isinstance`` checks against the
real class (Polygraphy's), and a call that fits none of a method's overloads raises
``TypeError``. Nothing here is written by hand: every attribute and signature is the class's own.
"""

from __future__ import annotations

import inspect
import re
from unittest import mock

_SIGNATURE = re.compile(r"^(?:\d+\.\s+)?(?P<name>\w+)\((?P<params>.*)\)\s*->", re.M)


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[(<{":
            depth += 1
        elif ch in "])>}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _signature(params: str) -> inspect.Signature:
    parameters, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for param in _split_top_level(params)[1:]:  # [0] is self
        if param == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        if param.startswith("**"):
            parameters.append(inspect.Parameter(param[2:].split(":")[0], inspect.Parameter.VAR_KEYWORD))
            continue
        if param.startswith("*"):
            parameters.append(inspect.Parameter(param[1:].split(":")[0], inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        name = param.split(":")[0].split("=")[0].strip()
        has_default = re.search(r"\s=\s", param) is not None
        parameters.append(inspect.Parameter(name, kind, default=None if has_default else inspect.Parameter.empty))
    # pybind11 lets a required parameter follow defaulted ones (add_scale_nd's channel_axis), which
    # Python cannot say: those defaulted ones become required (strict rather than lax).
    required = [i for i, p in enumerate(parameters) if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is p.empty]
    last = required[-1] if required else -1
    parameters = [p.replace(default=p.empty) if i < last and p.kind == p.POSITIONAL_OR_KEYWORD else p for i, p in enumerate(parameters)]
    return inspect.Signature(parameters)


def signatures(method) -> list[inspect.Signature]:
    """A pybind11 method's signatures (one per overload), from its docstring; [] when it has none."""
    name = getattr(method, "__name__", "")
    return [_signature(m.group("params")) for m in _SIGNATURE.finditer(method.__doc__ or "") if m.group("name") == name]


def _shadow(cls: type) -> tuple[type, dict[str, list[inspect.Signature]]]:
    methods, overloads = {}, {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        attr = getattr(cls, name)
        if isinstance(attr, property) or not callable(attr) or isinstance(attr, type):
            continue
        sigs = signatures(attr)
        if not sigs:
            continue

        def method(self, *args, **kwargs):  # never called: the spec only lends its signature
            raise NotImplementedError

        method.__name__ = name
        method.__signature__ = inspect.Signature(
            [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY), *sigs[0].parameters.values()]
        )
        methods[name] = method
        if len(sigs) > 1:
            overloads[name] = sigs
    return type(cls.__name__, (cls,), methods), overloads


def strict_autospec(cls: type, **attributes):
    """``create_autospec(cls, instance=True)`` that also checks each call against the method's
    signatures as TensorRT documents them; ``attributes`` are set on the mock (properties)."""
    shadow, overloads = _shadow(cls)
    spec = mock.create_autospec(shadow, spec_set=True, instance=True)
    for name, sigs in overloads.items():

        def check(self, /, *args, _sigs=sigs, _name=name, **kwargs):
            for sig in _sigs:
                try:
                    sig.bind(*args, **kwargs)
                    return
                except TypeError:
                    continue
            raise TypeError(f"{cls.__name__}.{_name}{args + tuple(kwargs.items())} fits none of its signatures {[str(s) for s in _sigs]}")

        type(getattr(spec, name))._mock_check_sig = check
    for name, value in attributes.items():
        setattr(spec, name, value)
    return spec
