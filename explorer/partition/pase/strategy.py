"""PaSE's best strategy for a graph: the finest depth whose DP fits, solved, with references."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.graph import OpGraph
from explorer.costs.model import CostModel
from explorer.partition.options import first_devices
from explorer.partition.pase.model import (
    PaseModel,
    build_model,
    check_pins,
    data_parallel_choice,
    layer_shape,
    one_weird_trick_choice,
)
from explorer.partition.pase.problem import (
    DEFAULT_MAX_CONFIGS,
    DEFAULT_MAX_TABLE,
    Config,
    PaseSolution,
    Shape,
    TooDenseError,
)
from explorer.partition.pase.solver import dependent_order, solve
from explorer.partition.search.fallback import memory_error


@dataclass(frozen=True)
class PaseResult:
    """PaSE's strategy for a graph: a configuration per layer, its cost and the references.

    ``configs[j]`` is layer ``j``'s ``(batch, feature)`` split (layers as in
    ``layer_names``, from ``graph.layers(depth)``); ``cost_s`` its cost under PaSE's model,
    ``data_parallel_s`` and ``one_weird_trick_s`` the cost of those two strategies under the
    same model (inf when they do not fit). ``dependent_set`` is the DP's largest dependent set
    ``M``, ``table_entries`` its largest table; ``memory_bytes`` what the busiest device holds
    (of ``capacity_bytes``). ``exact`` is False when memory forced the Lagrangian search.
    """

    configs: tuple[Config, ...]
    layer_names: tuple[str, ...]
    cost_s: float
    data_parallel_s: float
    one_weird_trick_s: float
    dependent_set: int
    table_entries: int
    memory_bytes: float
    capacity_bytes: float
    exact: bool
    depth: int | None
    devices: tuple[str, ...]
    order: tuple[int, ...] = field(repr=False, default=())

    @property
    def feature_split(self) -> bool:
        """Whether any layer splits its features (which a Plan cannot express)."""
        return any(c.feature > 1 for c in self.configs)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON: what ``plan.options["pase_strategy"]`` holds."""
        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {"configs": [[c.batch, c.feature] for c in self.configs],
                "layers": list(self.layer_names), "cost_s": num(self.cost_s),
                "data_parallel_s": num(self.data_parallel_s),
                "one_weird_trick_s": num(self.one_weird_trick_s),
                "dependent_set": self.dependent_set, "table_entries": self.table_entries,
                "exact": self.exact, "depth": self.depth, "devices": list(self.devices)}


def _depths(graph: OpGraph, depth: int | None) -> list[int | None]:
    if depth is not None:
        return [depth]
    return [None, *range(graph.module_depth() - 1, 0, -1)]


def model_and_solution(graph: OpGraph, costs: CostModel, ids: Sequence[str],
                        depth: int | None, max_configs: int, max_table: float,
                        optimizer: str, pins: Mapping[str, str], headroom: float
                        ) -> tuple[PaseModel, PaseSolution]:
    """Build and solve at ``depth``; with ``depth=None`` the finest depth whose table fits."""
    if max_configs < 1:
        raise ExplorerError(f"pase: max_configs must be >= 1, not {max_configs}")
    refused: list[tuple[int | None, Shape | TooDenseError]] = []  # depths too dense
    seen: set[int] = set()
    for dp in _depths(graph, depth):
        layers = [tuple(x) for x in graph.layers(dp)]
        if len(layers) in seen:  # the same layers as a finer depth already tried
            continue
        seen.add(len(layers))
        # the order needs only the layer graph's shape: refuse a dense depth before costing it
        shape = layer_shape(graph, len(ids), layers, max_configs, pins)
        order, _, entries = dependent_order(shape, limit=max_table)
        if entries > max_table:
            refused.append((dp, shape))
            continue
        model = build_model(graph, costs, ids, dp, max_configs, optimizer, pins, headroom,
                       layers=layers)
        try:
            return model, solve(model.problem, max_table, order=order)
        except TooDenseError as exc:
            refused.append((dp, exc))
    tried: list[str] = []
    first: TooDenseError | None = None
    for dp, what in refused:  # say how large each depth's tables are, finest first
        if isinstance(what, TooDenseError):
            m, entries = what.dependent_set, what.table_entries
        else:
            _, m, entries = dependent_order(what)  # the whole order, for the message
        first = first or TooDenseError("", m, entries)
        tried.append(f"depth={dp}: M={m}, {entries:,} entries")
    assert first is not None
    coarser = "..."
    if depth is not None:  # a coarser depth whose table fits, if any
        for dp in range(min(depth, graph.module_depth() + 1) - 1, 0, -1):
            layers = [tuple(x) for x in graph.layers(dp)]
            shape = layer_shape(graph, len(ids), layers, max_configs, pins)
            if dependent_order(shape, limit=max_table)[2] <= max_table:
                coarser = str(dp)
                break
    k = max(1, int(max_table ** (1 / (first.dependent_set + 1))))
    raise TooDenseError(
        f"graph too dense for PaSE: dependent set of {first.dependent_set} layers needs "
        f"{first.table_entries:,} table entries, over max_table={max_table:,.0f} "
        f"({'; '.join(tried)}); use depth={coarser} (coarser layers: fewer, bigger vertices) "
        f"or max_configs={min(k, max_configs - 1) if max_configs > 1 else 1} (fewer "
        "configurations per layer), or raise max_table", first.dependent_set,
        first.table_entries)


def pase_result(model: PaseModel, sol: PaseSolution) -> PaseResult:
    pr = model.problem
    fc = [info.fully_connected for info in model.infos]

    def ref(choice: tuple[int, ...]) -> float:
        return pr.cost_s(choice) if pr.memory(choice) <= pr.capacity_bytes else math.inf

    return PaseResult(
        tuple(pr.configs[v][i] for v, i in enumerate(sol.choice)),
        tuple(info.name for info in model.infos), sol.cost_s,
        ref(data_parallel_choice(pr)), ref(one_weird_trick_choice(pr, fc)), sol.dependent_set,
        sol.table_entries, sol.memory_bytes, pr.capacity_bytes, sol.exact, model.depth,
        model.ids, sol.order)


def pase_search(graph: OpGraph, costs: CostModel, *, k: int | None = None,
                depth: int | None = None, max_configs: int = DEFAULT_MAX_CONFIGS,
                max_table: float = DEFAULT_MAX_TABLE, optimizer: str = "adam",
                pins: Mapping[str, str] | None = None) -> PaseResult:
    """PaSE's best per-layer strategy for ``graph`` on the first ``k`` devices of the cluster.

    Builds the layer graph from ``graph.layers(depth)``, offers each layer up to
    ``max_configs`` configurations (:func:`layer_configs`), costs them as the module docstring
    says and runs the DP (:func:`solve`). Layers holding a pinned node split the batch only.

    Parameters
    ----------
    k : int, optional
        Devices ``p``: the cluster's first ``k`` (default: all).
    depth : int, optional
        Module depth of the layers; ``None``: the leaf modules, or the finest coarser depth
        whose DP table fits under ``max_table``.
    max_configs : int
        Configurations kept per layer (default 8).
    max_table : float
        Largest DP table allowed, in entries (default 2,000,000).
    optimizer : str
        Optimizer whose state counts towards memory and whose step counts towards time.
    pins : mapping, optional
        Node name -> device id; the pinned nodes' layers are restricted to batch splits.

    Returns
    -------
    PaseResult
        The strategy, its cost and the data-parallel and one-weird-trick references.

    Raises
    ------
    TooDenseError
        (an :class:`ExplorerError`) when the dependent sets need tables over ``max_table``.
    MemoryExceededError
        When no strategy fits the smallest device, naming it.
    """
    ids = first_devices(costs.cluster, k)
    pins = dict(pins or {})
    check_pins(pins, graph, ids)
    model, sol = model_and_solution(graph, costs, ids, depth, max_configs, max_table,
                                     optimizer, pins, 1.0)
    if not sol.fits:
        raise no_fit_error(model, sol)
    return pase_result(model, sol)


def no_fit_error(model: PaseModel, sol: PaseSolution, what: str = "") -> MemoryExceededError:
    """Nothing fits: name the smallest device (any device may take position 0)."""
    d = min(range(len(model.ids)), key=lambda x: (model.memory_by_device[x], x))
    if not what:
        cfg = sorted({f"({c.batch}, {c.feature})" for c in
                      (model.problem.configs[v][i] for v, i in enumerate(sol.choice))})
        what = (f"the {model.problem.n_layers} layers of the strategy that needs least memory "
                f"(configurations {', '.join(cfg)}; position 0 takes part in every layer)")
    return memory_error(
        "pase", what, model.ids[d], sol.memory_bytes, model.problem.capacity_bytes,
        "use more or larger devices, a smaller batch, or SGD")


__all__ = ["PaseResult", "model_and_solution", "no_fit_error", "pase_result", "pase_search"]
