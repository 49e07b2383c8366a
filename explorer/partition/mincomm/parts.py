"""min-comm's k-way split: coarsen, split the coarsest level, refine while uncoarsening."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.costs.memory import node_memory_bytes
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.mincomm.level import Level
from explorer.partition.mincomm.refine import State, clamp, interval_partition
from explorer.partition.mincomm.units import (
    device_order,
    effective_pins,
    finest_level,
    hosts,
    net_weights_s,
    node_weights_s,
)
from explorer.partition.options import first_devices
from explorer.partition.search.fallback import memory_error
from explorer.partition.search.layers import contiguous

#: stop coarsening at about this many nodes per part
COARSEST_PER_PART = 24


@dataclass(frozen=True)
class MinCommResult:
    """A partition of every node into ``k`` parts, parts in execution order.

    ``cut_s`` is the communication: for every tensor, (parts it touches - 1) x its transfer
    seconds (forward and gradient, every micro-batch). A part's ``compute_s`` is measured on
    the reference device (the first one); ``floor_s`` and ``limit_s`` are ``(1 - tolerance)``
    and ``(1 + tolerance)`` times its fair share (proportional to its device's speed).
    ``balanced``: every part between its floor and its limit.
    """

    part: tuple[int, ...]  # per graph node
    devices: tuple[str, ...]  # per part
    cut_s: float
    compute_s: tuple[float, ...]
    floor_s: tuple[float, ...]
    limit_s: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    capacity_bytes: tuple[float, ...]
    balanced: bool
    levels: int
    tolerance: float
    start: str  # which initial partition won: "multilevel" or "even-layers"


def min_comm_parts(graph: OpGraph, cluster: Cluster, costs: CostModel, k: int | None = None,
                   tolerance: float = 0.1, pins: Mapping[str, str] | None = None,
                   micro_batches: int = 1, schedule: str = "1f1b", optimizer: str = "adam",
                   headroom: float = 1.0) -> MinCommResult:
    """Split ``graph`` into ``k`` parts of balanced compute with the least communication,
    keeping the graph of parts acyclic (see the module docstring for the method).

    Memory is the additive estimate of :func:`explorer.costs.memory.node_memory_bytes` with the
    micro-batches a part keeps in flight (``schedule``), against ``headroom`` x each device's
    memory; it is a hard limit. Balance is a soft one: when no split within ``tolerance``
    exists (an op heavier than a share, pins), the bounds are relaxed and ``balanced`` is
    False.
    Raises :class:`MemoryExceededError` when no split fits the memory.

    >>> from explorer.devices.cluster import Cluster
    >>> from explorer.models.synthetic import layered_dag, roofline_costs
    >>> g, cl = layered_dag(500), Cluster.preset("4xH100")
    >>> res = min_comm_parts(g, cl, roofline_costs(g, cl))
    >>> res.balanced, res.devices
    (True, ('H100:0', 'H100:1', 'H100:2', 'H100:3'))
    """
    ids = first_devices(cluster, k)
    if tolerance < 0:
        raise ExplorerError(f"tolerance must be >= 0, not {tolerance}")
    problem = _problem(graph, cluster, costs, ids, tolerance=tolerance, pins=dict(pins or {}),
                       micro_batches=micro_batches, schedule=schedule, optimizer=optimizer,
                       headroom=headroom)
    problem.coarsen()
    (mem_over, _, _, cut), name, st = min(
        (problem.refined(start) for start in problem.starts(graph)), key=lambda r: r[0])
    k, capm, devices = problem.k, problem.capacity, problem.devices
    if mem_over:
        p = max(range(k), key=lambda q: st.Mem[q] - capm[q])
        raise memory_error(
            "min-comm", f"part {p} of {k} (its params, optimizer state and activations of "
            f"{problem.flight[p]} micro-batch(es) in flight)", devices[p], st.Mem[p], capm[p],
            "use more or larger devices, more micro-batches, or a smaller batch")
    floor, limit = problem.strict
    return MinCommResult(
        part=tuple(st.part[u] for u in problem.unit_of), devices=tuple(devices), cut_s=cut,
        compute_s=tuple(st.W), floor_s=tuple(floor), limit_s=tuple(limit),
        memory_bytes=tuple(st.Mem), capacity_bytes=tuple(capm),
        balanced=all(floor[p] * (1 - 1e-9) <= st.W[p] <= limit[p] * (1 + 1e-9)
                     for p in range(k)),
        levels=len(problem.levels), tolerance=tolerance, start=name)


#: an initial partition to refine: its name, the level it is of, a part per unit of that
#: level, and the (floor, limit) compute bounds to refine it within
_Start = tuple[str, int, list[int], tuple[list[float], list[float]]]


@dataclass
class _Problem:
    """What min-comm splits: the finest level of units and its coarsenings, the parts'
    devices in execution order, their fair compute shares, memory and micro-batches in
    flight."""

    k: int
    devices: list[str]
    #: per part: its fair share of the compute (proportional to its device's speed), its
    #: memory and the micro-batches it keeps in flight
    share: list[float]
    capacity: list[float]
    flight: list[int]
    tolerance: float
    total_w: float
    #: the unit of the finest level each graph node is in
    unit_of: list[int]
    levels: list[Level]
    #: per coarsening, the coarser level's unit of each unit of the finer level
    maps: list[np.ndarray]

    def bounds(self, tolerance: float) -> tuple[list[float], list[float]]:
        """(floor, limit) per part at ``tolerance`` around its share."""
        return ([x * max(0.0, 1 - tolerance) for x in self.share],
                [x * (1 + tolerance) for x in self.share])

    @property
    def strict(self) -> tuple[list[float], list[float]]:
        """(floor, limit) per part at the asked tolerance."""
        return self.bounds(self.tolerance)

    def coarsen(self) -> None:
        """Coarsen the finest level while it has more than :data:`COARSEST_PER_PART` units
        a part and a coarsening is possible."""
        wcap = max(self.tolerance, 0.02) * min(self.share) if self.total_w > 0 else math.inf
        mcap = 0.25 * min(self.capacity)
        while self.levels[-1].n > COARSEST_PER_PART * self.k:
            got = self.levels[-1].coarsen(wcap, mcap, max(self.flight), self.k)
            if got is None:
                break
            self.levels.append(got[0])
            self.maps.append(got[1])

    def split(self, level: int, tolerance: float) -> list[int] | None:
        """An interval partition of ``level`` within ``tolerance`` that fits the memory, if
        one exists."""
        lv, b = self.levels[level], self.bounds(tolerance)
        part = (interval_partition(lv, self.k, b, self.capacity, self.flight, True)
                or interval_partition(lv, self.k, b, self.capacity, self.flight, False))
        return None if part is None else clamp(lv, part, self.k)

    def starts(self, graph: OpGraph) -> list[_Start]:
        """The initial partitions: intervals of the coarsest level (at the smallest tolerance
        it allows, or of the finest level where the coarsest is too coarse for the memory)
        and even-layers' stages."""
        starts: list[_Start] = []
        top = len(self.levels) - 1
        # the loosest useful tolerance: any part may hold everything
        loose = self.total_w / max(min(self.share), 1e-300) if self.total_w > 0 else 1.0
        found, used = self.split(top, self.tolerance), self.tolerance
        if found is None and self.split(top, loose) is not None:
            # the smallest tolerance the coarsest graph allows, so relaxed splits stay balanced
            lo_t, hi_t = self.tolerance, loose
            for _ in range(14):
                mid = (lo_t + hi_t) / 2
                if self.split(top, mid) is None:
                    lo_t = mid
                else:
                    hi_t = mid
            found, used = self.split(top, hi_t), hi_t
        if found is not None:
            starts.append(("multilevel", top, found, self.bounds(used)))
        else:  # too coarse for the memory limits: split the finest level
            found = self.split(0, loose)
            if found is not None:
                starts.append(("multilevel", 0, found, self.bounds(loose)))
        finest = self.levels[0]
        even = clamp(finest, _even_layers_units(graph, finest, self.unit_of, self.k), self.k)
        even_w = np.bincount(np.asarray(even, dtype=np.int64), weights=finest.w,
                             minlength=self.k).tolist()
        strict = self.strict
        even_ok = all(lo <= x <= hi for x, lo, hi in zip(even_w, *strict, strict=True))
        starts.append(("even-layers", 0, even,
                       strict if even_ok or not starts else starts[0][3]))
        return starts

    def refined(self, start: _Start) -> tuple[tuple[bool, bool, float, float], str, State]:
        """``start`` refined at its level and each finer one, with its ranking key (over
        the memory, unbalanced, by how much, communication: lower is better)."""
        name, level, part, bounds = start
        for j in range(level, -1, -1):
            st = State(self.levels[j], part, self.k, bounds, self.capacity, self.flight)
            st.refine()
            part = st.part
            if j > 0:
                part = np.asarray(part, dtype=np.int64)[self.maps[j - 1]].tolist()
        mem_over = any(st.Mem[p] > self.capacity[p] for p in range(self.k))
        floor, limit = self.strict
        unbalanced = sum(max(0.0, st.W[p] - limit[p], floor[p] - st.W[p])
                         for p in range(self.k))
        return ((mem_over, unbalanced > 1e-12 * (self.total_w or 1), unbalanced, st.cut()),
                name, st)


def _problem(graph: OpGraph, cluster: Cluster, costs: CostModel, ids: tuple[str, ...], *,
             tolerance: float, pins: dict[str, str], micro_batches: int, schedule: str,
             optimizer: str, headroom: float) -> _Problem:
    """The finest level of units (pins applied) and the parts' devices, shares, memory and
    micro-batches in flight."""
    k = len(ids)
    by_type: dict[str, list[float]] = {}  # compute seconds of every node per device type
    for d in ids:
        key = cluster.device(d).type_key
        if key not in by_type:
            by_type[key] = node_weights_s(graph, costs, d)
    w_node = by_type[cluster.device(ids[0]).type_key]  # the reference: the first device
    for nm, dev in pins.items():
        if dev not in ids:
            raise ExplorerError(f"node {nm!r} is pinned to {dev}, which is not among the "
                                f"devices this plan may use ({', '.join(ids)})")
    host = hosts(graph)
    eff, alone = effective_pins(graph, host, pins)
    net_w = net_weights_s(graph, costs, ids, micro_batches)
    mfix_node = node_memory_bytes(graph, optimizer, 1, 0.0)
    full = node_memory_bytes(graph, optimizer, 1, 1.0 / micro_batches)
    mact_node = [a - b for a, b in zip(full, mfix_node, strict=True)]
    flight = [micro_batches if schedule == "gpipe" else min(k - p, micro_batches)
              for p in range(k)]
    finest, unit_of, unit_names = finest_level(
        graph, host, {i: ids.index(dev) for i, dev in eff.items()}, alone, w_node, net_w,
        mfix_node, mact_node)
    devices = device_order(finest, ids, unit_names)
    part_of_dev = np.array([devices.index(d) for d in ids] + [-1], dtype=np.int64)
    finest.set_pins(part_of_dev[finest.pin])  # device index -> part (-1 stays -1)
    # fair shares by device speed (total compute on each device type)
    speed = {key: 1.0 / max(sum(ws), 1e-300) for key, ws in by_type.items()}
    inv = [speed[cluster.device(d).type_key] for d in devices]
    total_w = sum(w_node)
    return _Problem(k=k, devices=devices, share=[total_w * x / sum(inv) for x in inv],
                    capacity=[cluster.device(d).memory_bytes * headroom for d in devices],
                    flight=flight, tolerance=tolerance, total_w=total_w, unit_of=unit_of,
                    levels=[finest], maps=[])


def _even_layers_units(graph: OpGraph, finest: Level, unit_of: list[int], k: int) -> list[int]:
    """The even-layers baseline's stages (equal layer counts), per unit."""
    layers = graph.layers(None)
    stage = contiguous([1.0] * len(layers), k)
    part = [0] * finest.n
    for layer, s in zip(layers, stage, strict=True):
        for i in layer:
            if graph.nodes[i].kind == "op":
                part[unit_of[i]] = s
    # units without an op (pinned parameters on their own) sit just before their reader
    for u in range(finest.n - 2, -1, -1):
        if finest.w[u] == 0.0 and finest.succs[u]:
            part[u] = min(part[s] for s in finest.succs[u])
    return part


__all__ = ["COARSEST_PER_PART", "MinCommResult", "min_comm_parts"]
