"""PaSE's cost table: configurations, unary and pairwise costs, and the solver's answer.

Everything the dependent-set DP needs, no graph and no cost model, so the DP can be tested
against brute force on hand-made tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from explorer.core.errors import ExplorerError

#: configurations kept per layer (the DP costs about max_configs^(M+1))
DEFAULT_MAX_CONFIGS = 8
#: the DP refuses steps whose table (dependent set plus the new layer) has more entries
DEFAULT_MAX_TABLE = 2_000_000
#: seconds added per extra device a configuration uses (and per extra stage of a plan's
#: layout): breaks ties between equally cheap strategies towards fewer devices and stages
TIE_S = 1e-9


class Config(NamedTuple):
    """How one layer is split: ``batch`` ways over the batch, ``feature`` ways over outputs."""

    batch: int
    feature: int

    @property
    def devices(self) -> int:
        return self.batch * self.feature


class TooDenseError(ExplorerError):
    """The layer graph's dependent sets make the DP table larger than ``max_table``."""

    def __init__(self, message: str, dependent_set: int, table_entries: int) -> None:
        super().__init__(message)
        self.dependent_set = dependent_set
        self.table_entries = table_entries


@dataclass(frozen=True, eq=False)
class PaseProblem:
    """PaSE's cost table over ``n`` layers: unary costs per configuration, pairwise per edge.

    ``unary_s[v][i]`` is layer ``v``'s cost under ``configs[v][i]``; ``memory_bytes[v][i]``
    what it adds to the busiest device (position 0); ``edges`` are ``(a, b, cost_s)`` with
    ``cost_s[i, j]`` the cost of the edge when ``a`` takes its ``i``-th and ``b`` its ``j``-th
    configuration (``inf`` forbids the pair). A strategy's cost is the sum of its unary and
    edge costs (:meth:`cost_s`); it fits when its memory (:meth:`memory`) is at most
    ``capacity_bytes``.
    """

    configs: tuple[tuple[Config, ...], ...]
    unary_s: tuple[np.ndarray, ...]
    memory_bytes: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int, np.ndarray], ...]
    capacity_bytes: float = math.inf

    def __post_init__(self) -> None:
        n = len(self.configs)
        if len(self.unary_s) != n or len(self.memory_bytes) != n:
            raise ExplorerError("PaseProblem: configs, unary_s and memory_bytes differ in length")
        for v in range(n):
            k = len(self.configs[v])
            if k == 0:
                raise ExplorerError(f"PaseProblem: layer {v} has no configuration")
            if np.shape(self.unary_s[v]) != (k,) or np.shape(self.memory_bytes[v]) != (k,):
                raise ExplorerError(f"PaseProblem: layer {v} needs {k} unary costs and sizes")
        for a, b, c in self.edges:
            if not (0 <= a < n and 0 <= b < n and a != b):
                raise ExplorerError(f"PaseProblem: edge ({a}, {b}) is not between two layers")
            if np.shape(c) != (len(self.configs[a]), len(self.configs[b])):
                raise ExplorerError(f"PaseProblem: edge ({a}, {b}) has the wrong shape")

    @property
    def n_layers(self) -> int:
        return len(self.configs)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Configurations per layer (``K_v``)."""
        return tuple(len(c) for c in self.configs)

    def cost_s(self, choice: Sequence[int]) -> float:
        """The cost of one strategy (a configuration index per layer)."""
        total = sum(float(self.unary_s[v][i]) for v, i in enumerate(choice))
        return total + sum(float(c[choice[a], choice[b]]) for a, b, c in self.edges)

    def memory(self, choice: Sequence[int]) -> float:
        """Bytes on the busiest device (position 0) under one strategy."""
        return sum(float(self.memory_bytes[v][i]) for v, i in enumerate(choice))

    def index(self, v: int, config: Config) -> int:
        """Position of ``config`` among layer ``v``'s configurations (ValueError if absent)."""
        return self.configs[v].index(config)

    def neighbours(self) -> list[set[int]]:
        out: list[set[int]] = [set() for _ in range(self.n_layers)]
        for a, b, _ in self.edges:
            out[a].add(b)
            out[b].add(a)
        return out


@dataclass(frozen=True)
class PaseSolution:
    """The DP's answer: a configuration index per layer, its cost, memory and the DP's size.

    ``exact`` is False when memory forced the Lagrangian search (the strategy fits but may not
    be the cheapest that fits). ``fits`` is False when even the strategy needing the least
    memory does not fit; ``choice`` is then that strategy. ``dependent_set`` is the largest
    dependent set ``M`` along ``order`` and ``table_entries`` the largest table the DP built.
    """

    choice: tuple[int, ...]
    cost_s: float
    memory_bytes: float
    fits: bool
    exact: bool
    dependent_set: int
    table_entries: int
    order: tuple[int, ...]


class Shape(NamedTuple):
    """What :func:`dependent_order` needs of a problem (no costs): configurations per layer
    and the layers each layer shares tensors with."""

    n_layers: int
    sizes: tuple[int, ...]
    nbrs: tuple[frozenset[int], ...]

    def neighbours(self) -> list[set[int]]:
        return [set(x) for x in self.nbrs]


__all__ = ["DEFAULT_MAX_CONFIGS", "DEFAULT_MAX_TABLE", "TIE_S", "Config", "PaseProblem",
           "PaseSolution", "Shape", "TooDenseError"]
