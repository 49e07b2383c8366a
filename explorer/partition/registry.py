"""The registry of partitioners: register them by name, look them up, run one with pins honoured.

A partitioner is a plain function ``(graph, cluster, costs, pins=..., **options) -> Plan``;
its keyword arguments after ``pins`` are its options, their defaults read off its signature.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from explorer.core.errors import ExplorerError, unknown_name
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster


@dataclass(frozen=True)
class Algorithm:
    """A registered partitioner: its function, one-line summary and options with defaults."""

    name: str
    fn: Callable[..., Plan]
    summary: str
    options: Mapping[str, Any] = field(default_factory=dict)
    exact: bool = False  # an exhaustive/DP search: may refuse graphs that are too large


_REGISTRY: dict[str, Algorithm] = {}


def register(name: str, exact: bool = False
             ) -> Callable[[Callable[..., Plan]], Callable[..., Plan]]:
    """Decorator adding a partitioner to the registry under ``name``."""

    def wrap(fn: Callable[..., Plan]) -> Callable[..., Plan]:
        sig = inspect.signature(fn)
        opts = {k: p.default for k, p in list(sig.parameters.items())[3:]
                if p.default is not inspect.Parameter.empty and k != "pins"}
        doc = (inspect.getdoc(fn) or name).splitlines()[0]
        _REGISTRY[name] = Algorithm(name, fn, doc, opts, exact)
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
    """Run the partitioner ``algorithm_name`` and return its plan, with pins honoured."""
    alg = algorithm(algorithm_name)
    costs.check(graph)
    unknown = sorted(set(options) - set(alg.options))
    if unknown:
        raise ExplorerError(f"{algorithm_name} has no option {unknown[0]!r}; its options are "
                            f"{', '.join(alg.options) or 'none'}")
    pins = dict(pins or {})
    for nm, dev in pins.items():
        if nm not in graph:
            raise ExplorerError(f"pinned node {nm!r} is not in the graph")
        cluster.device(dev)  # raises for unknown devices, listing the known ones
    plan = alg.fn(graph, cluster, costs, pins=pins, **options)
    plan = apply_pins(graph, plan, pins)
    plan.validate(graph, cluster)
    return plan


def apply_pins(graph: OpGraph, plan: Plan, pins: Mapping[str, str]) -> Plan:
    """Move pinned nodes to the stage of their device (adding a stage if the plan lacks it)."""
    if not pins:
        return plan
    stages = [list(s) for s in plan.stages]
    placement = dict(plan.placement)
    for nm, dev in pins.items():
        where = next((k for k, s in enumerate(stages) if dev in s), None)
        if where is None:
            stages.append([dev])
            where = len(stages) - 1
        placement[nm] = where
    return plan.with_settings(stages=tuple(tuple(s) for s in stages), placement=placement,
                              pinned=frozenset(pins) | plan.pinned)


def _load_builtin() -> None:
    """Import every module of the partition package: each registers its partitioners on import."""
    package = __name__.rpartition(".")[0]
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{package}.{mod.name}")


__all__ = ["Algorithm", "algorithm", "algorithms", "apply_pins", "partition", "register"]
