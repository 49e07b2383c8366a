"""Model factories: ``"module:function"`` names of the user's code that builds a model.

A plan may record the factory its model came from; an exported script imports and calls it on
every rank to build the model (on the meta device or with real weights, as the function
decides), so no weights are ever pickled into a job folder.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from explorer.core.errors import ExplorerError

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
#: ``package.module:function`` (the function may be an attribute path, ``module:Class.build``)
FACTORY_PATTERN = rf"{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*"

_HOW = ('name a function that builds the model and takes no arguments, as "module:function" '
        '(for example "mypkg.models:build_llama"), importable where the script runs')


class FactoryError(ExplorerError):
    """A model factory name that does not name a callable the explorer can import."""


def check_factory(text: Any) -> str:
    """``text`` if it has the ``module:function`` form, else :class:`FactoryError`."""
    if not isinstance(text, str) or not re.fullmatch(FACTORY_PATTERN, text):
        why = ("has no colon between module and function" if isinstance(text, str)
               and ":" not in text else "is not of the form module:function")
        raise FactoryError(f"model factory {text!r} {why}; {_HOW}")
    return text


def load_factory(text: str) -> Callable[[], Any]:
    """The function ``text`` names, imported; :class:`FactoryError` saying what is wrong."""
    module_name, attr = check_factory(text).split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise FactoryError(f"model factory {text!r}: cannot import module {module_name!r} "
                           f"({exc}); put it on PYTHONPATH or install it, or {_HOW}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FactoryError(f"model factory {text!r}: module {module_name!r} has no "
                               f"{attr!r}; {_HOW}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FactoryError(f"model factory {text!r} names a {type(obj).__name__}, which cannot "
                           f"be called; {_HOW}")
    return obj
