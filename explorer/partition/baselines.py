"""Baseline partitioners: one device, data parallel, and contiguous stages by layers or parameters.

These are what users compare every automatic plan against, and what pipeline libraries do by
default (equal layer counts, or equal parameter bytes per stage).
"""

from __future__ import annotations

from collections.abc import Mapping

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition import register


def _devices(cluster: Cluster, k: int | None) -> tuple[str, ...]:
    k = len(cluster) if k is None else k
    if not 1 <= k <= len(cluster):
        raise ExplorerError(f"k={k} devices asked for, but the cluster has {len(cluster)}")
    return cluster.ids[:k]


@register("single")
def single(graph: OpGraph, cluster: Cluster, costs: CostModel, pins: Mapping | None = None,
           device: str | None = None, optimizer: str = "adam") -> Plan:
    """Everything on one device: the reference every other plan is compared with.

    ``device`` defaults to the cluster's first device.
    """
    dev = device or cluster.ids[0]
    cluster.device(dev)
    return Plan.single(graph, dev, algorithm="single", optimizer=optimizer,
                       options={"device": dev})


@register("data-parallel")
def data_parallel(graph: OpGraph, cluster: Cluster, costs: CostModel,
                  pins: Mapping | None = None, k: int | None = None,
                  optimizer: str = "adam") -> Plan:
    """The whole model replicated on ``k`` devices, the batch split k ways, gradients all-reduced.

    Gradients are all-reduced with a ring (2(k-1)/k x gradient bytes over the slowest link) in
    buckets that overlap the backward pass, as PyTorch DDP does.
    """
    devs = _devices(cluster, k)
    return Plan.from_assignment(graph, [devs], {i: 0 for i in range(len(graph))},
                                algorithm="data-parallel", optimizer=optimizer,
                                options={"k": len(devs)})


def contiguous(weights: list[float], k: int) -> list[int]:
    """Cut a sequence of weighted layers into ``k`` contiguous runs of near-equal weight.

    Returns the stage of each layer. A new stage starts when the middle of a layer passes the
    next ``j/k`` share of the total; every stage gets at least one layer when there are enough.

    >>> contiguous([1, 1, 1, 1], 2)
    [0, 0, 1, 1]
    >>> contiguous([3, 1, 1, 1], 2)
    [0, 1, 1, 1]
    """
    n = len(weights)
    k = max(1, min(k, n))
    w = [float(x) for x in weights] if any(weights) else [1.0] * n
    total = sum(w)
    out: list[int] = []
    acc, s = 0.0, 0
    for j, x in enumerate(w):
        if s < k - 1 and out and out[-1] == s:
            must_move = n - j <= k - 1 - s  # later stages would otherwise stay empty
            if must_move or acc + x / 2 > total * (s + 1) / k:
                s += 1
        out.append(s)
        acc += x
    return out


def _staged(graph: OpGraph, cluster: Cluster, k: int | None, depth: int | None,
            weigh, name: str, micro_batches: int, schedule: str, optimizer: str) -> Plan:
    devs = _devices(cluster, k)
    layers = graph.layers(depth)
    stage_of_layer = contiguous([weigh(layer) for layer in layers], len(devs))
    assign = {i: s for layer, s in zip(layers, stage_of_layer, strict=True) for i in layer}
    used = max(stage_of_layer, default=0) + 1
    return Plan.from_assignment(
        graph, [(d,) for d in devs[:used]], assign, algorithm=name,
        micro_batches=micro_batches, schedule=schedule, optimizer=optimizer,
        options={"k": len(devs), "depth": depth})


@register("even-layers")
def even_layers(graph: OpGraph, cluster: Cluster, costs: CostModel, pins: Mapping | None = None,
                k: int | None = None, depth: int | None = None, micro_batches: int = 1,
                schedule: str = "gpipe", optimizer: str = "adam") -> Plan:
    """Contiguous stages with equal numbers of layers, one stage per device.

    A layer is a run of ops of one module, cut to ``depth`` levels of the module path (None:
    the leaf module). What pipeline libraries do by default (e.g. GPipe's balance by count).
    """
    return _staged(graph, cluster, k, depth, lambda layer: 1.0, "even-layers",
                   micro_batches, schedule, optimizer)


@register("balanced-params")
def balanced_params(graph: OpGraph, cluster: Cluster, costs: CostModel,
                    pins: Mapping | None = None, k: int | None = None, depth: int | None = None,
                    micro_batches: int = 1, schedule: str = "gpipe",
                    optimizer: str = "adam") -> Plan:
    """Contiguous stages with near-equal parameter bytes, one stage per device.

    Balances memory for weights, gradients and optimizer state, not compute: convolutional
    layers with few parameters but many FLOPs end up crowded on one stage.
    """
    nodes = graph.nodes
    return _staged(graph, cluster, k, depth,
                   lambda layer: float(sum(nodes[i].param_bytes for i in layer
                                           if nodes[i].kind != "buffer")),
                   "balanced-params", micro_batches, schedule, optimizer)
