"""Baseline partitioners: one device, data parallel, and contiguous stages by layers or parameters.

These are what users compare every automatic plan against, and what pipeline libraries do by
default (equal layer counts, or equal parameter bytes per stage).
"""

from __future__ import annotations

from collections.abc import Mapping

from explorer.core.errors import PlanError
from explorer.core.graph import OpGraph
from explorer.core.plan import INTERLEAVED, Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.guard import most_replicas, replicated
from explorer.partition.options import first_devices
from explorer.partition.registry import register
from explorer.partition.search.layers import in_turn


@register("single", guarded=False)
def single(graph: OpGraph, cluster: Cluster, costs: CostModel, pins: Mapping | None = None,
           device: str | None = None, optimizer: str = "adam") -> Plan:
    """Everything on one device: the reference every other plan is compared with.

    ``device`` defaults to the cluster's first device.
    """
    dev = device or cluster.ids[0]
    cluster.device(dev)
    return Plan.single(graph, dev, algorithm="single", optimizer=optimizer,
                       options={"device": dev})


@register("data-parallel", guarded=False)
def data_parallel(graph: OpGraph, cluster: Cluster, costs: CostModel,
                  pins: Mapping | None = None, k: int | None = None, micro_batches: int = 1,
                  schedule: str | None = None, optimizer: str = "adam") -> Plan:
    """The whole model replicated on ``k`` devices, the batch split k ways, gradients all-reduced.

    Gradients are all-reduced with a ring (2(k-1)/k x gradient bytes over the slowest link) in
    buckets that overlap the backward pass, as PyTorch DDP does. A batch of fewer samples than
    ``k`` is split over as many devices as it has samples (a note says so). With
    ``micro_batches``, each replica accumulates the gradients of that many micro-batches of its
    share before the all-reduce (gradient accumulation, DDP's ``no_sync``); ``schedule``
    defaults to 1F1B then, each micro-batch's backward right after its forward, so one
    micro-batch's activations are held at a time.
    """
    devs = first_devices(cluster, k)
    used = devs[:most_replicas(graph, len(devs))]
    notes = () if used == devs else (
        f"data-parallel: the batch of {graph.batch_size} samples splits over at most "
        f"{len(used)} replicas, so {len(used)} of the {len(devs)} devices are used",)
    if schedule is None:
        schedule = "1f1b" if micro_batches > 1 else "gpipe"
    return replicated(graph, used, algorithm="data-parallel", optimizer=optimizer,
                      micro_batches=micro_batches, schedule=schedule,
                      options={"k": len(used)}, notes=notes)


def _staged(graph: OpGraph, cluster: Cluster, k: int | None, depth: int | None,
            weigh, name: str, micro_batches: int, schedule: str | None, optimizer: str,
            virtual_stages: int = 1) -> Plan:
    """Contiguous chunks of near-equal weight, ``virtual_stages`` per device, taken in turn
    around the devices (one chunk each: a plain pipeline)."""
    devs = first_devices(cluster, k)
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) \
            or virtual_stages < 1:
        raise PlanError(f"virtual_stages must be a whole number of chunks per device, 1 or "
                        f"more, not {virtual_stages!r}")
    layers = graph.layers(depth)
    chunks = len(devs) * virtual_stages
    if virtual_stages > 1 and len(layers) < chunks:
        raise PlanError(f"{len(devs)} devices with {virtual_stages} virtual stages each need "
                        f"{chunks} chunks of layers, but the graph has {len(layers)} layers "
                        "at this depth: use fewer virtual stages or devices, or a finer depth")
    stage_of_layer = in_turn([weigh(layer) for layer in layers], len(devs), virtual_stages)
    assign = {i: s for layer, s in zip(layers, stage_of_layer, strict=True) for i in layer}
    used = max(stage_of_layer, default=0) + 1
    if schedule is None:
        schedule = INTERLEAVED if virtual_stages > 1 else "gpipe"
    options = {"k": len(devs), "depth": depth}
    if virtual_stages > 1:
        options["virtual_stages"] = virtual_stages
    return Plan.from_assignment(
        graph, [(d,) for d in devs[:used]], assign, algorithm=name,
        micro_batches=micro_batches, schedule=schedule, optimizer=optimizer, options=options)


@register("even-layers", guarded=False)
def even_layers(graph: OpGraph, cluster: Cluster, costs: CostModel, pins: Mapping | None = None,
                k: int | None = None, depth: int | None = None, micro_batches: int = 1,
                schedule: str | None = None, optimizer: str = "adam",
                virtual_stages: int = 1) -> Plan:
    """Contiguous stages with equal numbers of layers, one stage per device.

    A layer is a run of ops of one module, cut to ``depth`` levels of the module path (None:
    the leaf module). What pipeline libraries do by default (e.g. GPipe's balance by count).
    With ``virtual_stages`` v > 1, the layers are cut into v chunks per device that go round
    the devices in turn (Megatron-LM's virtual pipeline stages), and the schedule defaults
    to interleaved 1F1B (micro-batches a multiple of the devices); else to GPipe.
    """
    return _staged(graph, cluster, k, depth, lambda layer: 1.0, "even-layers",
                   micro_batches, schedule, optimizer, virtual_stages)


@register("balanced-params", guarded=False)
def balanced_params(graph: OpGraph, cluster: Cluster, costs: CostModel,
                    pins: Mapping | None = None, k: int | None = None, depth: int | None = None,
                    micro_batches: int = 1, schedule: str | None = None,
                    optimizer: str = "adam", virtual_stages: int = 1) -> Plan:
    """Contiguous stages with near-equal parameter bytes, one stage per device.

    Balances memory for weights, gradients and optimizer state, not compute: convolutional
    layers with few parameters but many FLOPs end up crowded on one stage.
    ``virtual_stages`` as for ``even-layers``.
    """
    nodes = graph.nodes
    return _staged(graph, cluster, k, depth,
                   lambda layer: float(sum(nodes[i].param_bytes for i in layer
                                           if nodes[i].kind != "buffer")),
                   "balanced-params", micro_batches, schedule, optimizer, virtual_stages)


__all__ = ["balanced_params", "data_parallel", "even_layers", "single"]
