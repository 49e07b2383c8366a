"""From a graph to a :class:`StageCostTable`: layers, costs, memory, links and pins.

Also chooses the layers the stage DP cuts (the finest module depth it can handle).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import StageSettings
from explorer.costs.memory import node_memory_bytes, zero_sharded_bytes, zero_working_bytes
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.bounds import FULL_SEARCH_DEVICES, distinct_links
from explorer.partition.pipeline_dp.solver import dp_cells
from explorer.partition.pipeline_dp.table import StageCostTable, StageNet

#: the DP refuses more layers than this: its tables are (layers + 1)^2 floats each
MAX_LAYERS = 1500
#: and more work than this many table cells (layers^2 x device ranges x (stages + 8))
MAX_DP_CELLS = 4e9
#: on a cluster of more than FULL_SEARCH_DEVICES devices (replica counts powers of two, only
#: the positions its stages can reach): at most this many cells, a few seconds
WIDE_DP_CELLS = 2e8


def _homogeneous(cluster: Cluster, ids: Sequence[str]) -> bool:
    if len({cluster.device(i).type_key for i in ids}) > 1:
        return False
    links = {(lk.latency_s, lk.bandwidth_bytes_per_s) for lk in distinct_links(cluster, ids)}
    return len(links) <= 1


def linear_fit(fn: Callable[[float], float], x: float = float(2**20)) -> tuple[float, float]:
    """(intercept, slope) of a cost that is linear in its byte count for positive counts."""
    y1, y2 = fn(x), fn(2 * x)
    slope = (y2 - y1) / x
    return y1 - slope * x, slope


def stage_cost_table(graph: OpGraph, costs: CostModel, ids: Sequence[str],
                     layers: Sequence[Sequence[int]], micro_batches: int, schedule: str,
                     optimizer: str, replicate: bool = True,
                     pins: Mapping[str, str] | None = None, headroom: float = 1.0,
                     settings: StageSettings | None = None,
                     wide: bool | None = None) -> StageCostTable:
    """The :class:`StageCostTable` of ``graph``'s ``layers`` on devices ``ids``.

    Costs come from ``costs`` (a node's time at a batch fraction is linear in it), memory from
    :func:`explorer.costs.memory.node_memory_bytes`, device capacity times ``headroom``. Replica
    counts are limited to those that divide the batch into whole micro-batches. Memory follows
    the memory ``settings`` of every stage (default: none). With ``wide`` (default: on more
    than FULL_SEARCH_DEVICES devices), replica counts are powers of two.
    """
    cluster = costs.cluster
    layer_of = np.zeros(len(graph.nodes), dtype=np.int64)
    for j, layer in enumerate(layers):
        layer_of[list(layer)] = j
    type_keys = list(dict.fromkeys(cluster.device(dev).type_key for dev in ids))
    # one device of each type, in order of first appearance: the rows of the time tables
    rep = [next(dev for dev in ids if cluster.device(dev).type_key == key)
           for key in type_keys]
    fixed, var = _layer_times(graph, costs, rep, layer_of, len(layers))
    opt, grad_bytes = _optimizer_times(graph, costs, rep, layer_of, len(layers), optimizer)
    memory = _layer_memory(graph, layer_of, len(layers), optimizer, settings,
                           cluster.device(ids[0]).kind)
    n_dev = len(ids)
    wide = n_dev > FULL_SEARCH_DEVICES if wide is None else wide
    links = [cluster.link(ids[d], ids[d + 1]) for d in range(n_dev - 1)]
    ar_lat, ar_spb = _allreduce_fits(graph, costs, ids, replicate, wide)
    return StageCostTable(
        fixed_s=fixed, var_s=var, optimizer_s=opt, param_bytes=memory.param_bytes,
        act_bytes=memory.act_bytes, grad_bytes=grad_bytes, nets=_nets(graph, layer_of),
        device_type=tuple(type_keys.index(cluster.device(dev).type_key) for dev in ids),
        capacity_bytes=tuple(cluster.device(dev).memory_bytes * headroom for dev in ids),
        # (as CostModel.transfer_s: latency + bytes / bandwidth x scale)
        link_latency_s=tuple(lk.latency_s for lk in links),
        link_s_per_byte=tuple(costs.link_scale / lk.bandwidth_bytes_per_s for lk in links),
        allreduce_latency_s=ar_lat, allreduce_s_per_byte=ar_spb,
        micro_batches=micro_batches, schedule=schedule,
        replicas=allowed_replicas(graph.batch_size, n_dev, micro_batches, replicate, wide),
        layer_pins=_layer_pins(graph, ids, layer_of, len(layers), pins),
        pins_by_position=not _homogeneous(cluster, ids),
        sharded_bytes=memory.sharded_bytes, working_bytes=memory.working_bytes)


def _layer_times(graph: OpGraph, costs: CostModel, rep: Sequence[str], layer_of: np.ndarray,
                 n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per device type (``rep``: one device of each) and layer, the forward and backward
    seconds that do not shrink with the batch (at fraction 0) and those that do (the rest at
    the whole batch)."""
    fixed = np.zeros((len(rep), n))
    var = np.zeros((len(rep), n))
    for k, dev in enumerate(rep):
        for i, nd in enumerate(graph.nodes):
            if nd.kind != "op":
                continue
            f0, f1 = costs.fwd_s(i, dev, 0.0), costs.fwd_s(i, dev, 1.0)
            b0 = b1 = 0.0
            if nd.requires_grad:
                b0, b1 = costs.bwd_s(i, dev, 0.0), costs.bwd_s(i, dev, 1.0)
            fixed[k, layer_of[i]] += f0 + b0
            var[k, layer_of[i]] += (f1 - f0) + (b1 - b0)
    return fixed, var


def _optimizer_times(graph: OpGraph, costs: CostModel, rep: Sequence[str],
                     layer_of: np.ndarray, n: int, optimizer: str
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Per device type and layer the optimizer step's seconds, and per layer the gradient
    bytes a replicated stage all-reduces."""
    tensor_bytes = np.zeros(n)
    tensor_count = np.zeros(n)
    grad_bytes = np.zeros(n)
    for i, nd in enumerate(graph.nodes):
        if nd.param_bytes and nd.kind != "buffer":  # what the simulator's optimizer steps
            tensor_bytes[layer_of[i]] += nd.param_bytes
            tensor_count[layer_of[i]] += 1
        if nd.kind == "param" and nd.requires_grad:  # what it all-reduces
            grad_bytes[layer_of[i]] += nd.out_bytes
    opt = np.zeros((len(rep), n))
    for k, dev in enumerate(rep):  # optimizer_s is linear in bytes and tensors, zero at zero
        per_byte = costs.optimizer_s(dev, optimizer, 1, 0)
        per_tensor = costs.optimizer_s(dev, optimizer, 0, 1)
        opt[k] = tensor_bytes * per_byte + tensor_count * per_tensor
    return opt, grad_bytes


@dataclass(frozen=True)
class _LayerMemory:
    """Per layer: what stays all step on one device (weights, gradients, optimizer state,
    buffers), the saved activations of one micro-batch at the whole batch, and what ZeRO
    shards and adds over a stage's replicas (None without ZeRO)."""

    param_bytes: np.ndarray
    act_bytes: np.ndarray
    sharded_bytes: np.ndarray | None
    working_bytes: np.ndarray | None


def _layer_memory(graph: OpGraph, layer_of: np.ndarray, n: int, optimizer: str,
                  settings: StageSettings | None, device_kind: str) -> _LayerMemory:
    """The layers' memory under the memory ``settings`` every stage gets."""
    fixed_mem = node_memory_bytes(graph, optimizer, 1, 0.0, settings, 1, device_kind)
    full_mem = node_memory_bytes(graph, optimizer, 1, 1.0, settings, 1, device_kind)
    sharded = working = None
    if settings is not None and settings.zero:
        sharded, working = np.zeros(n), np.zeros(n)
        np.add.at(sharded, layer_of, zero_sharded_bytes(graph, optimizer, settings.zero,
                                                        settings.precision))
        np.add.at(working, layer_of, zero_working_bytes(graph, settings.zero,
                                                        settings.precision))
    param_bytes = np.zeros(n)
    act_bytes = np.zeros(n)
    for i in range(len(graph.nodes)):
        param_bytes[layer_of[i]] += fixed_mem[i]
        act_bytes[layer_of[i]] += full_mem[i] - fixed_mem[i]
    return _LayerMemory(param_bytes, act_bytes, sharded, working)


def _nets(graph: OpGraph, layer_of: np.ndarray) -> tuple[StageNet, ...]:
    """Every tensor read by a later layer than the one making it (the batch excepted: every
    rank loads its own copy)."""
    nodes = graph.nodes
    nets = []
    for p, nd in enumerate(nodes):
        if nd.kind == "input" or nd.out_bytes <= 0:
            continue
        a = int(layer_of[p])
        cons = sorted({int(layer_of[c]) for c in graph.succs[p]} - {a})
        if not cons:
            continue
        grad = nd.requires_grad and any(nodes[c].requires_grad for c in graph.succs[p])
        nets.append(StageNet(a, tuple(cons), nd.out_bytes, nd.kind == "op", grad))
    return tuple(nets)


def _allreduce_fits(graph: OpGraph, costs: CostModel, ids: Sequence[str], replicate: bool,
                    wide: bool) -> tuple[np.ndarray, np.ndarray]:
    """[d, r] (latency, seconds per byte) of the all-reduce over the ``r`` devices from
    position ``d``, for the replica counts any micro-batch count allows (those of one)."""
    n_dev = len(ids)
    ar_lat = np.zeros((n_dev, n_dev + 1))
    ar_spb = np.zeros((n_dev, n_dev + 1))
    for r in allowed_replicas(graph.batch_size, n_dev, 1, replicate, wide):
        for d in range(n_dev - r + 1) if r > 1 else ():
            group = tuple(ids[d:d + r])
            ar_lat[d, r], ar_spb[d, r] = linear_fit(lambda x, g=group: costs.allreduce_s(g, int(x)))
    return ar_lat, ar_spb


def _layer_pins(graph: OpGraph, ids: Sequence[str], layer_of: np.ndarray, n: int,
                pins: Mapping[str, str] | None) -> tuple[frozenset[int], ...]:
    """Per layer, the device positions (labels, on identical devices and links) its pinned
    nodes must be on; empty without pins."""
    if not pins:
        return ()
    key_of = {dev: j for j, dev in enumerate(ids)}  # positions, or labels
    per_layer: list[set[int]] = [set() for _ in range(n)]
    for name, dev in pins.items():
        if dev not in key_of:
            raise ExplorerError(f"node {name!r} is pinned to {dev}, which is not among the "
                                f"devices this plan may use ({', '.join(ids)})")
        per_layer[int(layer_of[graph.index[name]])].add(key_of[dev])
    return tuple(frozenset(s) for s in per_layer)


def allowed_replicas(batch_size: int, n_devices: int, micro_batches: int,
                     replicate: bool, powers_of_two: bool = False) -> tuple[int, ...]:
    """Replica counts r whose r x micro_batches divides the batch (1 always); with
    ``powers_of_two`` (on a cluster of more than FULL_SEARCH_DEVICES), only powers of two."""
    reps = tuple(r for r in (range(1, n_devices + 1) if replicate else (1,))
                 if (batch_size <= 0 or batch_size % (r * micro_batches) == 0)
                 and (not powers_of_two or r & (r - 1) == 0))
    return reps or (1,)


def dp_positions(n_layers: int, n_devices: int, replicas: Sequence[int]) -> int:
    """How many device positions the DP's stages can reach: at most ``min(layers, devices)``
    stages of at most the largest replica count each (the rest stay unused in every plan)."""
    return min(n_devices, min(n_layers, n_devices) * max(replicas, default=1))


def wide_dp_cells(n_layers: int, n_devices: int, batch_size: int, replicate: bool) -> float:
    """The DP's work in table cells on a cluster of more than FULL_SEARCH_DEVICES devices:
    power-of-two replica counts, over the positions its stages can reach."""
    reps = allowed_replicas(batch_size, n_devices, 1, replicate, True)
    d = dp_positions(n_layers, n_devices, reps)
    return (n_layers + 1) ** 2 * d * len(reps) * (min(n_layers, d) + 8)


def choose_layers(graph: OpGraph, depth: int | None, max_layers: int, n_devices: int,
                  replicate: bool) -> tuple[list[list[int]], int | None]:
    """The layers the DP cuts: at ``depth``, or with ``depth=None`` the finest module depth
    whose layer count the DP can handle. Raises :class:`ExplorerError` when none can.

    On a cluster of more than FULL_SEARCH_DEVICES devices the DP's work is
    :func:`wide_dp_cells`, at most :data:`WIDE_DP_CELLS`."""
    wide = n_devices > FULL_SEARCH_DEVICES

    def cells_ok(n_layers: int) -> bool:
        if wide:
            return wide_dp_cells(n_layers, n_devices, graph.batch_size,
                                 replicate) <= WIDE_DP_CELLS
        return dp_cells(n_layers, n_devices, replicate) <= MAX_DP_CELLS

    def fits(layers: list[list[int]]) -> bool:
        return len(layers) <= max_layers and cells_ok(len(layers))

    if depth is not None:
        layers = graph.layers(depth)
        if not fits(layers):
            raise ExplorerError(
                f"pipeline-dp: {len(layers):,} layers at depth={depth} are too many for the "
                f"stage DP (at most "
                f"{_layer_limit(max_layers, n_devices, replicate, graph.batch_size):,} on "
                f"{n_devices} devices; its work grows as layers^2 x devices^3); pass a smaller "
                "depth to cut at coarser modules, or use min-comm for op-level placement")
        return layers, depth
    tried = []
    counts = _layer_counts(graph)
    for dp in [None, *range(graph.module_depth() - 1, 0, -1)]:
        tried.append(f"{counts[dp]:,} at depth {dp}")
        if counts[dp] <= max_layers and cells_ok(counts[dp]):
            layers = graph.layers(dp)
            if fits(layers):
                return layers, dp
    raise ExplorerError(
        f"pipeline-dp: the graph has too many layers for the stage DP at every module depth "
        f"({'; '.join(tried)}; the limit is "
        f"{_layer_limit(max_layers, n_devices, replicate, graph.batch_size):,} "
        f"on {n_devices} devices); use min-comm, which places ops directly")


def _layer_counts(graph: OpGraph) -> dict[int | None, int]:
    """len(graph.layers(depth)) for every depth at once: runs of equal module prefixes."""
    top = graph.module_depth()
    counts: dict[int | None, int] = dict.fromkeys([None, *range(1, top + 1)], 0)
    last: dict[int | None, object] = dict.fromkeys(counts, object())
    for n in graph.nodes:
        if n.kind != "op":
            continue
        parts = n.module_path.split(".") if n.module_path else []
        for dp in counts:
            key = n.module_path if dp is None else ".".join(parts[:dp])
            if key != last[dp]:
                counts[dp] += 1
                last[dp] = key
    return {dp: max(c, 1) for dp, c in counts.items()}


def _layer_limit(max_layers: int, n_devices: int, replicate: bool,
                 batch_size: int = 0) -> int:
    lim = max_layers
    while lim > 1 and (
            wide_dp_cells(lim, n_devices, batch_size, replicate) > WIDE_DP_CELLS
            if n_devices > FULL_SEARCH_DEVICES
            else dp_cells(lim, n_devices, replicate) > MAX_DP_CELLS):
        lim = int(lim * 0.9)
    return lim


__all__ = ["MAX_DP_CELLS", "MAX_LAYERS", "WIDE_DP_CELLS", "allowed_replicas", "choose_layers",
           "dp_positions", "linear_fit", "stage_cost_table", "wide_dp_cells"]
