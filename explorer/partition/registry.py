"""The registry of partitioners: register them by name, look them up, run one with pins honoured.

A partitioner is a plain function ``(graph, cluster, costs, pins=..., **options) -> Plan``;
its keyword arguments after ``pins`` are its options, their defaults read off its signature and
their types off its annotations (the default's type where there is none): an option of the wrong
type is refused before the partitioner runs, with a message naming it.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import pkgutil
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from explorer.core.errors import ExplorerError, unknown_name
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.guard import BASELINE_SWITCHES, apply_pins, never_slower
from explorer.partition.options import first_devices


@dataclass(frozen=True)
class Algorithm:
    """A registered partitioner: its function, one-line summary and options with defaults."""

    name: str
    fn: Callable[..., Plan]
    summary: str
    options: Mapping[str, Any] = field(default_factory=dict)
    exact: bool = False  # an exhaustive/DP search: may refuse graphs that are too large
    #: its plan goes through the final never-slower-than-the-baselines check (see
    #: :mod:`explorer.partition.guard`); False for the baselines themselves
    guarded: bool = True


_REGISTRY: dict[str, Algorithm] = {}


def register(name: str, exact: bool = False, guarded: bool = True
             ) -> Callable[[Callable[..., Plan]], Callable[..., Plan]]:
    """Decorator adding a partitioner to the registry under ``name`` (``exact`` and
    ``guarded`` as in :class:`Algorithm`)."""

    def wrap(fn: Callable[..., Plan]) -> Callable[..., Plan]:
        sig = inspect.signature(fn)
        opts = {k: p.default for k, p in list(sig.parameters.items())[3:]
                if p.default is not inspect.Parameter.empty and k != "pins"}
        doc = (inspect.getdoc(fn) or name).splitlines()[0]
        _REGISTRY[name] = Algorithm(name, fn, doc, opts, exact, guarded)
        return fn

    return wrap


def algorithms() -> list[str]:
    """Names of the registered partitioners."""
    _load_builtin()
    return sorted(_REGISTRY)


def algorithm(name: str) -> Algorithm:
    """The registered partitioner ``name`` (raises, listing the known names, if unknown)."""
    _load_builtin()
    if name not in _REGISTRY:
        raise unknown_name("algorithm", name, _REGISTRY)
    return _REGISTRY[name]


def partition(graph: OpGraph, cluster: Cluster, costs: CostModel, algorithm_name: str,
              pins: Mapping[str, str] | None = None, **options: Any) -> Plan:
    """Run the partitioner ``algorithm_name`` and return its plan, with pins honoured.

    A guarded partitioner's plan (every one but the baselines and WAP) is returned only when
    the simulator finds it at least as fast as the ``single`` and ``data-parallel`` plans on
    its devices that fit; otherwise the fastest of those, with a note saying so
    (:func:`explorer.partition.guard.never_slower`). Its ``compare_baselines`` or
    ``baselines`` option set to False skips that check.
    """
    alg = algorithm(algorithm_name)
    costs.check(graph)
    # (what a compiled backward keeps, where priced compiled, in the precision planned with)
    memory = options.get("memory")
    half = isinstance(memory, Mapping) and memory.get("precision", "fp32") != "fp32"
    graph = costs.as_run(graph, half=half)
    unknown = sorted(set(options) - set(alg.options))
    if unknown:
        raise ExplorerError(f"{algorithm_name} has no option {unknown[0]!r}; its options are "
                            f"{', '.join(alg.options) or 'none'}")
    options = checked_options(alg, options)
    pins = dict(pins or {})
    for nm, dev in pins.items():
        if nm not in graph:
            raise ExplorerError(f"pinned node {nm!r} is not in the graph")
        cluster.device(dev)  # raises for unknown devices, listing the known ones
    plan = alg.fn(graph, cluster, costs, pins=pins, **options)
    plan = apply_pins(graph, plan, pins)
    chosen = {**alg.options, **options}
    if alg.guarded and all(chosen.get(s, True) for s in BASELINE_SWITCHES):
        ids = first_devices(cluster, chosen.get("k"))
        plan = never_slower(graph, costs, plan, alg.name, ids, pins,
                            chosen.get("memory_fraction", 1.0))
    plan.validate(graph, cluster)
    return plan


def checked_options(alg: Algorithm, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options, numbers made plain Python ones (a NumPy integer becomes an int); refuse one
    whose value is not of the type the partitioner declares for it (an int where a float is
    wanted is fine; a bool is not a number; a list stands for a tuple)."""
    try:
        hints = typing.get_type_hints(alg.fn)
    except Exception:  # annotations that do not resolve: fall back on the defaults' types
        hints = {}
    for key, value in options.items():
        default = alg.options[key]
        hint = hints.get(key, Any if default is None else type(default))
        if _accepts(hint, value) is False:
            raise ExplorerError(
                f"{alg.name}: option {key!r} needs {_type_words(hint)}, got "
                f"{type(value).__name__} {value!r}; its default is {default!r}")
    return {k: _plain(v) for k, v in options.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _accepts(hint: Any, value: Any) -> bool | None:
    """Whether ``value`` fits the annotation ``hint``; None when the annotation is too rich
    to tell (the partitioner is left to judge)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        verdicts = [_accepts(a, value) for a in args]
        return None if None in verdicts and True not in verdicts else any(verdicts)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if origin is typing.Literal:
        return value in args
    if origin in (tuple, list, Sequence):
        if not isinstance(value, (tuple, list)):
            return False
        items = [a for a in args if a is not Ellipsis]
        return all(_accepts(items[0], v) is not False for v in value) if len(items) == 1 \
            else True
    if isinstance(hint, type):
        return isinstance(value, hint)
    return None


def _type_words(hint: Any) -> str:
    """An annotation in words: "an int or None", "a list of str"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is None or hint is type(None):
        return "None"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_words(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (tuple, list, Sequence):
        items = [a for a in args if a is not Ellipsis]
        return "a list" + (f" of {_type_words(items[0]).split(' ', 1)[-1]}" if len(items) == 1
                           else "")
    name = getattr(hint, "__name__", str(hint))
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _load_builtin() -> None:
    """Import every module of the partition package: each registers its partitioners on import."""
    package = __name__.rpartition(".")[0]
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{package}.{mod.name}")


__all__ = ["Algorithm", "algorithm", "algorithms", "partition", "register"]
