"""Model factories: ``"module:function"`` names of the user's code that builds a model.

A plan may record the factory its model came from; an exported script imports and calls it on
every rank to build the model (on the meta device or with real weights, as the function
decides), so no weights are ever pickled into a job folder.

A factory is code. The explorer imports one only when the user names it (``factory=``,
``--factory``, the widget's factory box), never because a plan file names it
(:func:`untrusted_factory` is the error that says so), and imports it as named: a module in
the current folder does not stand in for an installed module of the same name.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
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


def untrusted_factory(asked: str, how: str) -> FactoryError:
    """The error for a factory that only a plan names (the user did not): ``how`` says how
    the user names it where they are (an argument, a command-line option, a box)."""
    return FactoryError(
        f"the plan asks for model factory {asked!r}: using it imports that module and calls "
        "the function (here and on every rank), and a plan file is data, so the explorer "
        f"runs no code it names. If you trust that code, name it yourself: {how}")


def _shadowing(top: str) -> str | None:
    """Why importing top-level module ``top`` would take a file of the current folder in
    place of an installed module of that name (None when it would not)."""
    if top in sys.modules:
        return None
    cwd = os.path.realpath(os.getcwd())
    here = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or ".") == cwd]
    if not here:
        return None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.has_location or not spec.origin:
        return None
    path = os.path.realpath(spec.origin)
    if spec.submodule_search_locations is not None:  # a package: the folder of __init__.py
        path = os.path.dirname(path)
    if os.path.dirname(path) != cwd:
        return None
    others = [p for p in sys.path if isinstance(p, str) and p not in here]
    installed = importlib.machinery.PathFinder.find_spec(top, others)
    if installed is None:
        return None
    return (f"{os.path.basename(path)} in the current folder ({cwd}) hides "
            f"the installed module {top!r} ({installed.origin}); rename the local file or "
            "start from another folder")


def load_factory(text: str) -> Callable[[], Any]:
    """The function ``text`` names, imported; :class:`FactoryError` saying what is wrong.
    Call it only with a name the user gave (never one read from a plan file)."""
    module_name, attr = check_factory(text).split(":")
    shadow = _shadowing(module_name.split(".")[0])
    if shadow:
        raise FactoryError(f"model factory {text!r}: {shadow}")
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
