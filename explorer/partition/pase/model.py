"""A graph's PaSE problem: layers, pins and costs put together into a :class:`PaseProblem`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.costs.model import CostModel
from explorer.partition.options import first_devices
from explorer.partition.pase.costs import (
    LayerEdge,
    LayerInfo,
    cached_configs,
    edge_matrix,
    feature_limit,
    layer_edges,
    layer_infos,
    missing_fraction,
    node_layers,
    slowest_link,
    unary_cost_s,
)
from explorer.partition.pase.problem import (
    DEFAULT_MAX_CONFIGS,
    TIE_S,
    PaseProblem,
    Shape,
)


@dataclass(frozen=True, eq=False)
class PaseModel:
    """A graph's PaSE problem with the layer facts behind it."""

    problem: PaseProblem
    layers: tuple[tuple[int, ...], ...]
    infos: tuple[LayerInfo, ...]
    ids: tuple[str, ...]
    depth: int | None
    layer_pins: tuple[frozenset[str], ...]  # device ids pinned per layer
    memory_by_device: tuple[int, ...]  # each device's memory, in the order of ids
    edge_list: tuple[LayerEdge, ...] = ()  # the tensors between layers behind problem.edges


def _pinned_layers(graph: OpGraph, layers: Sequence[Sequence[int]],
                   pins: Mapping[str, str]) -> list[set[str]]:
    """The devices pinned in each layer."""
    layer_of = {i: j for j, layer in enumerate(layers) for i in layer}
    pinned: list[set[str]] = [set() for _ in layers]
    for nm, dev in pins.items():
        i = graph.index[nm]
        j = layer_of.get(i, layer_of.get(graph.owner(i), 0))
        pinned[j].add(dev)
    return pinned


def layer_shape(graph: OpGraph, p: int, layers: Sequence[Sequence[int]], max_configs: int,
           pins: Mapping[str, str]) -> Shape:
    """The layer graph's shape as :func:`build_model` would make it, without costing anything:
    enough to tell whether the DP tables fit before paying for the cost table."""
    pinned = _pinned_layers(graph, layers, pins)
    sizes = tuple(len(cached_configs(p, graph.batch_size, feature_limit(graph, layer), max_configs,
                               bool(pinned[j])))
                  for j, layer in enumerate(layers))
    edges = layer_edges(graph, node_layers(graph, layers), len(layers))[0]
    nbrs: list[set[int]] = [set() for _ in layers]
    for a, b in edges:
        nbrs[a].add(b)
        nbrs[b].add(a)
    return Shape(len(layers), sizes, tuple(frozenset(x) for x in nbrs))


def build_model(graph: OpGraph, costs: CostModel, ids: Sequence[str], depth: int | None,
           max_configs: int, optimizer: str, pins: Mapping[str, str],
           headroom: float, batch_only: bool = False,
           layers: Sequence[tuple[int, ...]] | None = None, like: PaseModel | None = None
           ) -> PaseModel:
    """PaSE's problem over ``graph.layers(depth)`` (or ``layers``, when already made).

    ``like``: a model built from the same graph, costs, devices, depth and optimizer, whose
    layer facts are reused (only the configurations offered differ).
    """
    if like is not None:
        layers, infos, edges = like.layers, list(like.infos), list(like.edge_list)
    else:
        if layers is None:
            layers = [tuple(x) for x in graph.layers(depth)]
        infos, edges = layer_infos(graph, costs, ids, layers, optimizer)
    p = len(ids)
    pinned = _pinned_layers(graph, layers, pins)
    configs = tuple(cached_configs(p, graph.batch_size, info.max_feature, max_configs,
                             batch_only or bool(pinned[j]))
                    for j, info in enumerate(infos))
    lat, spb = slowest_link(costs, ids)
    unary = tuple(np.array([unary_cost_s(info, c, lat, spb) + TIE_S * (c.devices - 1)
                            for c in cs])
                  for info, cs in zip(infos, configs, strict=True))
    memory = tuple(np.array([info.fixed_mem_bytes / c.feature + info.act_mem_bytes / c.batch
                             for c in cs]) for info, cs in zip(infos, configs, strict=True))
    fractions: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # by (configs a, configs b)
    mats = []
    for e in edges:
        ca, cb = configs[e.a], configs[e.b]
        if (ca, cb) not in fractions:
            fractions[ca, cb] = (
                np.array([[missing_fraction(x, y) for y in cb] for x in ca]),
                np.array([[missing_fraction(y, x) for y in cb] for x in ca]))
        mats.append((e.a, e.b, edge_matrix(e, *fractions[ca, cb], lat, spb)))
    mem_dev = tuple(costs.cluster.device(d).memory_bytes for d in ids)
    problem = PaseProblem(configs, unary, memory, tuple(mats), min(mem_dev) * headroom)
    return PaseModel(problem, tuple(layers), tuple(infos), tuple(ids), depth,
                  tuple(frozenset(s) for s in pinned), mem_dev, tuple(edges))


def pase_problem(graph: OpGraph, costs: CostModel, *, k: int | None = None,
                 depth: int | None = None, max_configs: int = DEFAULT_MAX_CONFIGS,
                 optimizer: str = "adam", pins: Mapping[str, str] | None = None
                 ) -> PaseProblem:
    """PaSE's cost table for ``graph.layers(depth)`` on the cluster's first ``k`` devices.

    Layer ``j`` of the problem is ``graph.layers(depth)[j]``; its configurations come from
    :func:`layer_configs`, its unary costs from :func:`unary_cost_s`, its memory is what it
    adds to the busiest device, and every pair of layers joined by tensors has an edge whose
    cost is the re-distribution of :func:`missing_fraction` in both directions.
    """
    ids = first_devices(costs.cluster, k)
    pins = dict(pins or {})
    check_pins(pins, graph, ids)
    if max_configs < 1:
        raise ExplorerError(f"pase: max_configs must be >= 1, not {max_configs}")
    return build_model(graph, costs, ids, depth, max_configs, optimizer, pins, 1.0).problem


def data_parallel_choice(problem: PaseProblem) -> tuple[int, ...]:
    """Every layer at its largest batch split (data parallelism as the space allows)."""
    return tuple(max(range(len(cs)), key=lambda i: (cs[i].feature == 1, cs[i].batch))
                 for cs in problem.configs)


def one_weird_trick_choice(problem: PaseProblem, fully_connected: Sequence[bool]
                           ) -> tuple[int, ...]:
    """Krizhevsky's "one weird trick": fully connected layers at their largest feature split
    (model parallelism), every other layer at its largest batch split (data parallelism).

    A fully connected layer offered no feature split (pinned, or ``max_configs`` too small)
    stays data parallel.
    """
    out = list(data_parallel_choice(problem))
    for v, cs in enumerate(problem.configs):
        model_parallel = [i for i, c in enumerate(cs) if c.batch == 1 and c.feature > 1]
        if fully_connected[v] and model_parallel:
            out[v] = max(model_parallel, key=lambda i: cs[i].feature)
    return tuple(out)


def check_pins(pins: Mapping[str, str], graph: OpGraph, ids: Sequence[str]) -> None:
    for nm, dev in pins.items():
        if nm not in graph:
            raise ExplorerError(f"pase: pinned node {nm!r} is not in the graph")
        if dev not in ids:
            raise ExplorerError(f"pase: node {nm!r} is pinned to {dev}, which is not among the "
                                f"devices this plan may use ({', '.join(ids)})")


__all__ = ["PaseModel", "build_model", "check_pins", "data_parallel_choice", "layer_shape",
           "one_weird_trick_choice", "pase_problem"]
