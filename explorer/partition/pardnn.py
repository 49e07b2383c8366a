"""ParDNN: critical-path clustering of an op graph under device memory limits (Qararyah et al.).

The module also holds the op-level machinery the list-scheduling partitioners share (ParDNN
here, Baechi's m-TOPO / m-ETF / m-SCT in :mod:`explorer.partition.baechi`):

* :class:`OpProblem` -- the graph reduced to *units* (every op, with the parameters, buffers and
  inputs it owns folded into it) as flat numpy arrays: seconds per unit on each device type,
  additive memory bytes per unit (:func:`explorer.costs.memory.node_memory_bytes`), unit-to-unit
  edges
  with the bytes they carry forward and back, device capacities and the link model.
* :func:`schedule_s` -- a fast list-scheduling estimate of a placement's step time (a forward
  pass in topological order, then the backward pass in reverse order, then the optimizer).
* :func:`repair_memory` -- moves the units whose move costs least until every device fits.
* :func:`search` -- the common driver: runs a placement function, compares its plan with the
  ``single`` and ``data-parallel`` baselines (by the shared simulator on graphs up to
  ``simulate_max_nodes`` nodes, by :func:`schedule_s` beyond), and returns the best as a Plan.
"""

from __future__ import annotations

import gc
import math
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from explorer.core.errors import ExplorerError, MemoryExceededError, unknown_name
from explorer.core.graph import OpGraph
from explorer.core.plan import OPTIMIZER_STATE, Plan
from explorer.costs.memory import node_memory_bytes
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition import register
from explorer.partition.baselines import data_parallel, single
from explorer.simulate.simulator import Prediction, simulate

MiB = 2**20
#: how many times a plan is re-placed with tighter memory when the simulator finds a device over
SIMULATED_MEMORY_RETRIES = 5

# ---------------------------------------------------------------------------------------------
# the op-level problem shared by the list-scheduling partitioners


@dataclass(frozen=True)
class OpProblem:
    """A graph reduced to units (ops with what they own) on an ordered set of devices.

    Units are numbered in topological order and every edge runs from a lower to a higher unit.
    Arrays indexed ``[u]`` are per unit, ``[d]`` per device of :attr:`device_ids`, ``[e]`` per
    edge, ``[t]`` per device type.
    """

    graph_name: str
    unit_names: tuple[str, ...]  # [u] name of the unit's representative node
    unit_paths: tuple[str | None, ...]  # [u] module path of an op unit, None for other units
    device_ids: tuple[str, ...]
    unit_of_node: np.ndarray  # [node] -> unit
    rep: np.ndarray  # [u] graph index of the unit's representative node (its op)
    w_fwd: np.ndarray  # [t, u] forward seconds on device type t
    w_bwd: np.ndarray  # [t, u] backward seconds on device type t
    dev_type: np.ndarray  # [d] -> t
    mem: np.ndarray  # [u] additive bytes (int64)
    cap: np.ndarray  # [d] bytes the plan may use (int64)
    pinned: np.ndarray  # [u] device index the unit is pinned to, -1 when free
    src: np.ndarray  # [e] producer unit
    dst: np.ndarray  # [e] consumer unit (> src)
    fwd_bytes: np.ndarray  # [e] activation (or weight) bytes sent forward
    bwd_bytes: np.ndarray  # [e] gradient bytes sent back (0: no gradient flows)
    lat_s: np.ndarray  # [d, d] link latency (0 on the diagonal)
    s_per_byte: np.ndarray  # [d, d] link seconds per byte (0 on the diagonal)
    opt_s_per_byte: np.ndarray  # [d] optimizer seconds per trainable parameter byte
    opt_s_per_tensor: np.ndarray  # [d] optimizer seconds per trainable tensor
    param_bytes: np.ndarray  # [u] trainable parameter bytes the unit owns
    param_tensors: np.ndarray  # [u] trainable tensors the unit owns

    # -- sizes and derived weights -------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.rep)

    @property
    def k(self) -> int:
        return len(self.device_ids)

    @cached_property
    def w_comb(self) -> np.ndarray:
        """[t, u] forward plus backward seconds."""
        return self.w_fwd + self.w_bwd

    @cached_property
    def ref_type(self) -> int:
        """The fastest device type (least total work): node weights are measured on it."""
        return int(np.argmin(self.w_comb.sum(axis=1)))

    @cached_property
    def w_ref(self) -> np.ndarray:
        """[u] forward + backward seconds on the reference device type."""
        return self.w_comb[self.ref_type]

    @cached_property
    def speed_order(self) -> list[int]:
        """Device indices, fastest type first (stable: cluster order among equals)."""
        total = self.w_comb.sum(axis=1)
        return sorted(range(self.k), key=lambda d: (total[self.dev_type[d]], d))

    @cached_property
    def n_latencies(self) -> np.ndarray:
        """[e] transfers per edge when cut: one forward, plus one back when a gradient flows."""
        return (self.fwd_bytes > 0).astype(np.float64) + (self.bwd_bytes > 0)

    @cached_property
    def comm_ref(self) -> np.ndarray:
        """[e] seconds of a cut edge on an average link (forward and gradient back)."""
        if self.k < 2:
            return np.zeros(len(self.src))
        off = ~np.eye(self.k, dtype=bool)
        lat, spb = self.lat_s[off].mean(), self.s_per_byte[off].mean()
        return self.n_latencies * lat + (self.fwd_bytes + self.bwd_bytes) * spb

    @cached_property
    def adjacency(self) -> tuple[list[list[int]], list[list[int]], list[list[int]],
                                 list[list[int]]]:
        """(pred units, pred edges, succ units, succ edges) as Python lists, for loops."""
        e_all = np.arange(len(self.src))

        def csr(key: np.ndarray, other: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
            order = np.argsort(key, kind="stable")
            ends = np.cumsum(np.bincount(key, minlength=self.n)).tolist()
            nb, es = other[order].tolist(), e_all[order].tolist()
            starts = [0, *ends[:-1]]
            return ([nb[i:j] for i, j in zip(starts, ends, strict=True)],
                    [es[i:j] for i, j in zip(starts, ends, strict=True)])

        pv, pe = csr(self.dst, self.src)
        sv, se = csr(self.src, self.dst)
        return pv, pe, sv, se

    def _derive(self, **changes: Any) -> OpProblem:
        """A copy with ``changes``, keeping the cached values that do not depend on devices."""
        new = replace(self, **changes)
        for key in ("adjacency", "w_comb"):
            if key in self.__dict__:
                new.__dict__[key] = self.__dict__[key]
        return new

    def restrict(self, devices: Sequence[int]) -> OpProblem:
        """The same units on a subset of the devices (which must hold every pinned unit)."""
        idx = np.asarray(devices, dtype=np.int64)
        remap = np.full(self.k, -1, dtype=np.int64)
        remap[idx] = np.arange(len(idx))
        pinned = np.where(self.pinned >= 0, remap[np.maximum(self.pinned, 0)], -1)
        if np.any((self.pinned >= 0) & (pinned < 0)):
            raise ExplorerError("a device subset must keep the devices of pinned nodes")
        return self._derive(device_ids=tuple(self.device_ids[i] for i in idx),
                            dev_type=self.dev_type[idx], cap=self.cap[idx], pinned=pinned,
                            lat_s=self.lat_s[np.ix_(idx, idx)],
                            s_per_byte=self.s_per_byte[np.ix_(idx, idx)],
                            opt_s_per_byte=self.opt_s_per_byte[idx],
                            opt_s_per_tensor=self.opt_s_per_tensor[idx])

    def with_cap(self, cap: np.ndarray) -> OpProblem:
        return self._derive(cap=np.asarray(cap, dtype=np.int64))

    def used_bytes(self, dev: np.ndarray) -> np.ndarray:
        """[d] additive bytes a placement puts on each device."""
        return np.bincount(dev, weights=self.mem, minlength=self.k).astype(np.int64)


def op_problem(graph: OpGraph, cluster: Cluster, costs: CostModel, device_ids: Sequence[str],
               pins: Mapping[str, str] | None = None, optimizer: str = "adam",
               memory_fraction: float = 1.0) -> OpProblem:
    """Reduce ``graph`` to units on ``device_ids`` (see :class:`OpProblem`).

    A unit is an op, together with the parameters, buffers and inputs whose first consumer it
    is (``graph.owner``): a parameter always lives with a consumer, so its weight never crosses
    a link unless another consumer sits elsewhere. Pinned nodes and nodes without consumers
    are units of their own. Inputs carry no edges (every rank loads its own batch).
    """
    nodes = graph.nodes
    N = len(nodes)
    pins = dict(pins or {})
    dev_index = {d: j for j, d in enumerate(device_ids)}
    pinned_nodes = {graph.index[nm]: dev_index[dv] for nm, dv in pins.items()}
    # unit heads: ops, pinned nodes, nodes owned by nobody; the rest join their owner's unit
    head = [n.kind == "op" or i in pinned_nodes or graph.owner(i) == i
            for i, n in enumerate(nodes)]
    unit_of_node = np.full(N, -1, dtype=np.int64)
    rep = [i for i in range(N) if head[i]]
    unit_of_node[rep] = np.arange(len(rep))
    for i in range(N):
        if unit_of_node[i] < 0:
            j, chain = i, set()
            while not head[j] and j not in chain:
                chain.add(j)
                j = graph.owner(j)
            unit_of_node[i] = unit_of_node[j] if head[j] else unit_of_node[rep[0]]
    n = len(rep)
    uon = unit_of_node.tolist()

    # seconds per unit on each device type
    types: dict[str, int] = {}
    type_rep: list[str] = []
    for d in device_ids:
        tk = cluster.device(d).type_key
        if tk not in types:
            types[tk] = len(type_rep)
            type_rep.append(d)
    dev_type = np.array([types[cluster.device(d).type_key] for d in device_ids], dtype=np.int64)
    w_fwd = np.zeros((len(type_rep), n))
    w_bwd = np.zeros((len(type_rep), n))
    for t, d in enumerate(type_rep):
        f, b = node_seconds(costs, d)
        np.add.at(w_fwd[t], unit_of_node, f)
        np.add.at(w_bwd[t], unit_of_node, b)

    mem = np.zeros(n, dtype=np.int64)
    np.add.at(mem, unit_of_node, np.array(node_memory_bytes(graph, optimizer), dtype=np.int64))
    trainable = [n_.param_bytes if n_.param_bytes and n_.kind != "buffer" else 0 for n_ in nodes]
    param_bytes = np.zeros(n, dtype=np.int64)
    np.add.at(param_bytes, unit_of_node, np.array(trainable, dtype=np.int64))
    param_tensors = np.zeros(n, dtype=np.int64)
    np.add.at(param_tensors, unit_of_node, (np.array(trainable) > 0).astype(np.int64))

    # edges: one transfer per (producer node, consumer unit), summed per unit pair
    seen: set[tuple[int, int]] = set()
    f_bytes: dict[tuple[int, int], int] = {}
    b_bytes: dict[tuple[int, int], int] = {}
    for c, ps in enumerate(graph.preds):
        uc = uon[c]
        for p in ps:
            pn = nodes[p]
            up = uon[p]
            # inputs: every rank loads its own batch; up > uc only for odd non-op readers
            if pn.kind == "input" or up >= uc or (p, uc) in seen:
                continue
            seen.add((p, uc))
            key = (up, uc)
            f_bytes[key] = f_bytes.get(key, 0) + pn.out_bytes
            grad = pn.out_bytes if pn.requires_grad and nodes[c].requires_grad else 0
            b_bytes[key] = b_bytes.get(key, 0) + grad
    pairs = sorted(f_bytes)
    src = np.array([a for a, _ in pairs], dtype=np.int64)
    dst = np.array([b for _, b in pairs], dtype=np.int64)
    fwd_bytes = np.array([f_bytes[x] for x in pairs], dtype=np.int64)
    bwd_bytes = np.array([b_bytes[x] for x in pairs], dtype=np.int64)

    # links: latency and seconds per byte, read off the cost model's transfer_s
    K = len(device_ids)
    lat_s = np.zeros((K, K))
    spb = np.zeros((K, K))
    probe = 1 << 20
    for a in range(K):
        for b in range(K):
            if a != b:
                t1 = costs.transfer_s(device_ids[a], device_ids[b], 1)
                t2 = costs.transfer_s(device_ids[a], device_ids[b], 1 + probe)
                spb[a, b] = (t2 - t1) / probe
                lat_s[a, b] = max(t1 - spb[a, b], 0.0)
    opt_pb = np.array([costs.optimizer_s(d, optimizer, probe, 0) / probe for d in device_ids])
    opt_pt = np.array([costs.optimizer_s(d, optimizer, 0, 1) for d in device_ids])
    cap = np.array([int(cluster.device(d).memory_bytes * memory_fraction) for d in device_ids],
                   dtype=np.int64)
    pinned = np.full(n, -1, dtype=np.int64)
    for i, j in pinned_nodes.items():
        pinned[uon[i]] = j
    return OpProblem(graph.name, tuple(nodes[i].name for i in rep),
                     tuple(nodes[i].module_path if nodes[i].kind == "op" else None for i in rep),
                     tuple(device_ids),
                     unit_of_node, np.array(rep, dtype=np.int64), w_fwd,
                     w_bwd, dev_type, mem, cap, pinned, src, dst, fwd_bytes, bwd_bytes, lat_s,
                     spb, opt_pb, opt_pt, param_bytes, param_tensors)


def node_seconds(costs: CostModel, device_id: str,
                 fraction: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """[node] forward and backward seconds on a device, as ``costs.fwd_s`` / ``bwd_s`` give them.

    Vectorised over the device type's cost table (fixed overhead plus the rest scaled by
    ``fraction``, times ``compute_scale``, plus ``extra_op_s``); checked against the cost model
    on a sample of nodes, and read node by node from it should the two ever differ.
    """
    dc = costs.per_type[costs.cluster.device(device_id).type_key]
    out = []
    for table, exact in ((dc.fwd_s, costs.fwd_s), (dc.bwd_s, costs.bwd_s)):
        t = np.asarray(table, dtype=np.float64)
        ovh = np.minimum(dc.overhead_s, t)
        s = np.where(t > 0, (ovh + (t - ovh) * fraction) * costs.compute_scale
                     + costs.extra_op_s, 0.0)
        sample = range(0, len(t), max(1, len(t) // 64))
        if not all(math.isclose(s[i], exact(i, device_id, fraction), rel_tol=1e-9,
                                abs_tol=1e-15) for i in sample):
            s = np.array([exact(i, device_id, fraction) for i in range(len(t))])
        out.append(s)
    return out[0], out[1]


# ---------------------------------------------------------------------------------------------
# levels, scheduling and memory repair


def bottom_levels(w: Sequence[float], succ_v: list[list[int]], succ_c: list[list[float]],
                  skip: Sequence[bool] | None = None) -> list[float]:
    """Longest path from each unit to a sink: its weight plus the heaviest (edge + successor).

    Units with ``skip[u]`` true are left out (level 0, and no path runs through them).
    """
    n = len(w)
    bl = [0.0] * n
    for u in range(n - 1, -1, -1):
        if skip is not None and skip[u]:
            continue
        best = 0.0
        for v, c in zip(succ_v[u], succ_c[u], strict=True):
            x = c + bl[v]  # skipped successors have level 0 and add nothing past the edge
            if x > best and (skip is None or not skip[v]):
                best = x
        bl[u] = w[u] + best
    return bl


def top_levels(w: Sequence[float], pred_v: list[list[int]],
               pred_c: list[list[float]]) -> list[float]:
    """Earliest start of each unit with unlimited devices and every edge cut."""
    tl = [0.0] * len(w)
    for u in range(len(w)):
        best = 0.0
        for v, c in zip(pred_v[u], pred_c[u], strict=True):
            x = tl[v] + w[v] + c
            if x > best:
                best = x
        tl[u] = best
    return tl


def schedule_s(p: OpProblem, dev: np.ndarray) -> float:
    """List-scheduling estimate of one step's seconds for a placement (``dev[u]``).

    Forward: units in topological order, each on its device as soon as the device is free and
    its inputs have arrived (transfers: latency + bytes x seconds per byte, no link contention).
    Backward: in reverse order, after the unit's forward and its consumers' gradients. Then each
    device runs its optimizer step. A search score, cheaper and rougher than the simulator.
    """
    pv, pe, sv, se = p.adjacency
    d_of = dev.tolist()
    typ = p.dev_type.tolist()
    wf = [row.tolist() for row in p.w_fwd]
    wb = [row.tolist() for row in p.w_bwd]
    lat = p.lat_s.tolist()
    spb = p.s_per_byte.tolist()
    fb = p.fwd_bytes.tolist()
    bb = p.bwd_bytes.tolist()
    n, K = p.n, p.k
    free = [0.0] * K
    fin = [0.0] * n
    for u in range(n):
        d = d_of[u]
        r = 0.0
        for v, e in zip(pv[u], pe[u], strict=True):
            t = fin[v]
            dv = d_of[v]
            if dv != d and fb[e] > 0:
                t += lat[dv][d] + fb[e] * spb[dv][d]
            if t > r:
                r = t
        s = free[d] if free[d] > r else r
        fin[u] = s + wf[typ[d]][u]
        free[d] = fin[u]
    finb = [0.0] * n
    for u in range(n - 1, -1, -1):
        d = d_of[u]
        r = fin[u]
        for v, e in zip(sv[u], se[u], strict=True):
            if bb[e] <= 0:
                continue
            t = finb[v]
            dv = d_of[v]
            if dv != d:
                t += lat[dv][d] + bb[e] * spb[dv][d]
            if t > r:
                r = t
        s = free[d] if free[d] > r else r
        finb[u] = s + wb[typ[d]][u]
        free[d] = finb[u]
    pbytes = np.bincount(dev, weights=p.param_bytes, minlength=K)
    ptens = np.bincount(dev, weights=p.param_tensors, minlength=K)
    opt = pbytes * p.opt_s_per_byte + ptens * p.opt_s_per_tensor
    return float(max((free[d] + (opt[d] if ptens[d] else 0.0) for d in range(K)), default=0.0))


def memory_error(algorithm: str, p: OpProblem, d: int, used: int,
                 detail: str = "") -> MemoryExceededError:
    """The error for device ``d`` holding ``used`` bytes against its capacity."""
    cap = int(p.cap[d])
    return MemoryExceededError(
        f"{algorithm}: device {p.device_ids[d]} cannot hold its part of {p.graph_name}: it needs "
        f"{used / MiB:,.1f} MiB but may use {cap / MiB:,.1f} MiB (over by "
        f"{(used - cap) / MiB:,.1f} MiB){detail}. Use more devices or devices with more "
        "memory, a lighter optimizer, or a smaller batch")


def repair_memory(p: OpProblem, dev: np.ndarray, algorithm: str = "pardnn") -> np.ndarray:
    """Move units off over-full devices until every device fits its capacity.

    One over-full device at a time (the most over first): every movable unit on it gets a cost
    per target device, the cut-edge seconds the move adds minus those it removes, plus how far
    the target's total work would rise above the busiest device's; units are moved cheapest
    per byte freed first, each to its cheapest device with room, until the device fits. Costs
    are recomputed for each round. Raises :class:`MemoryExceededError` naming the device when
    no unit can move anywhere.
    """
    dev = dev.copy()
    K = p.k
    used = p.used_bytes(dev)
    busy = np.bincount(dev, weights=p.w_ref, minlength=K)
    comm = p.comm_ref
    while True:
        over = used - p.cap
        if not np.any(over > 0):
            return dev
        d = int(np.argmax(over))
        cand = np.flatnonzero((dev == d) & (p.pinned < 0) & (p.mem > 0))
        moved = False
        if len(cand):
            local = np.full(p.n, -1, dtype=np.int64)
            local[cand] = np.arange(len(cand))
            tie = np.zeros((len(cand), K))  # [candidate, device] cut seconds to that device
            m = local[p.src] >= 0
            np.add.at(tie, (local[p.src[m]], dev[p.dst[m]]), comm[m])
            m = local[p.dst] >= 0
            np.add.at(tie, (local[p.dst[m]], dev[p.src[m]]), comm[m])
            w = p.w_ref[cand]
            cost = tie[:, [d]] - tie + np.maximum(busy[None, :] + w[:, None] - busy.max(), 0.0)
            room = p.cap - used
            cost[:, d] = np.inf
            cost[p.mem[cand][:, None] > room[None, :]] = np.inf
            best = np.argmin(cost, axis=1)
            best_cost = cost[np.arange(len(cand)), best]
            ok = np.isfinite(best_cost)
            per_byte = best_cost / p.mem[cand]
            order = np.lexsort((cand, per_byte))
            for j in order.tolist():
                if used[d] <= p.cap[d]:
                    break
                if not ok[j]:
                    continue
                u, mu = int(cand[j]), int(p.mem[cand[j]])
                e = int(best[j])
                if used[e] + mu > p.cap[e]:  # filled up earlier in this round
                    free = np.flatnonzero(used + mu <= p.cap)
                    free = free[free != d]
                    if not len(free):
                        continue
                    e = int(free[np.argmin(cost[j, free])]) if np.isfinite(
                        cost[j, free]).any() else int(free[0])
                dev[u] = e
                used[d] -= mu
                used[e] += mu
                busy[d] -= p.w_ref[u]
                busy[e] += p.w_ref[u]
                moved = True
        if not moved:
            movable = cand.size
            detail = (f", and no other device has room for any of its {movable} movable nodes"
                      if movable else ", and everything on it is pinned there")
            raise memory_error(algorithm, p, d, int(used[d]), detail)


# ---------------------------------------------------------------------------------------------
# the shared driver


Placement = Callable[[OpProblem], tuple[np.ndarray, tuple[str, ...]]]


@dataclass(frozen=True)
class _Candidate:
    label: str
    make: Callable[[], Plan]  # builds the plan (only the chosen one is built for large graphs)
    fits: bool
    score_s: float


def search(graph: OpGraph, cluster: Cluster, costs: CostModel, name: str, place: Placement,
           pins: Mapping[str, str] | None, options: Mapping[str, Any], *, k: int | None,
           optimizer: str, memory_fraction: float, baselines: bool, sweep_devices: bool,
           simulate_max_nodes: int) -> Plan:
    """Run ``place`` and return the best plan among it and the baselines (see module docs).

    Graphs with at most ``simulate_max_nodes`` nodes: every candidate goes through
    :func:`explorer.simulate`; a placement the simulator finds over memory is placed
    again with that device's capacity reduced by the excess (up to
    ``SIMULATED_MEMORY_RETRIES`` times); with ``sweep_devices`` the algorithm also runs on the
    fastest 2, 4, ... devices. Larger graphs: the algorithm runs once on all devices and
    candidates are compared by :func:`schedule_s` and additive memory.
    """
    with paused_gc():
        return _search(graph, cluster, costs, name, place, pins, options, k=k,
                       optimizer=optimizer, memory_fraction=memory_fraction,
                       baselines=baselines, sweep_devices=sweep_devices,
                       simulate_max_nodes=simulate_max_nodes)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a search builds its many small lists.

    The search makes no reference cycles, yet on a 100,000-node graph the collector's full
    passes over the graph's objects triggered by those allocations cost as much as the search.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _search(graph: OpGraph, cluster: Cluster, costs: CostModel, name: str, place: Placement,
            pins: Mapping[str, str] | None, options: Mapping[str, Any], *, k: int | None,
            optimizer: str, memory_fraction: float, baselines: bool, sweep_devices: bool,
            simulate_max_nodes: int) -> Plan:
    costs.check(graph)
    if optimizer not in OPTIMIZER_STATE:
        raise unknown_name("optimizer", optimizer, OPTIMIZER_STATE)
    if not 0 < memory_fraction <= 1:
        raise ExplorerError(f"memory_fraction must be in (0, 1], not {memory_fraction!r}")
    pins = dict(pins or {})
    for nm, dv in pins.items():
        if nm not in graph:
            raise ExplorerError(f"pinned node {nm!r} is not in the graph")
        cluster.device(dv)
    if k is not None and not 1 <= k <= len(cluster):
        raise ExplorerError(f"k={k} devices asked for, but the cluster has {len(cluster)}")
    devs = list(cluster.ids[: len(cluster) if k is None else k])
    devs += [d for d in dict.fromkeys(pins.values()) if d not in devs]
    base = op_problem(graph, cluster, costs, devs, pins, optimizer, memory_fraction)
    total, room = int(base.mem.sum()), int(base.cap.sum())
    if total > room:
        raise MemoryExceededError(
            f"{name}: {graph.name} needs {total / MiB:,.1f} MiB (parameters, gradients, "
            f"optimizer state, saved activations) but devices {', '.join(devs)} may hold "
            f"{room / MiB:,.1f} MiB together (" + ", ".join(
                f"{d} {int(c) / MiB:,.1f} MiB" for d, c in zip(devs, base.cap, strict=True))
            + f"): short by {(total - room) / MiB:,.1f} MiB wherever the nodes go. Use more "
            "devices or devices with more memory, a lighter optimizer, or a smaller batch")
    by_sim = len(graph) <= simulate_max_nodes
    settings = {"algorithm": name, "optimizer": optimizer, "options": dict(options),
                "pinned": frozenset(pins)}

    # device subsets: all devices; with sweep, the fastest 2, 4, ... plus pinned devices
    must = sorted({int(j) for j in base.pinned if j >= 0})
    subsets = [list(range(base.k))]
    if by_sim and sweep_devices:
        size = 2
        while size < base.k:
            sub = sorted(set(base.speed_order[:size]) | set(must))
            if len(sub) < base.k and sub not in subsets:
                subsets.append(sub)
            size *= 2

    cands: list[_Candidate] = []
    first_error: MemoryExceededError | None = None
    for sub in subsets:
        prob = base.restrict(sub) if len(sub) < base.k else base
        try:
            cand = _own_candidate(graph, costs, prob, place, settings, by_sim, name,
                                  "all devices" if len(sub) == base.k else f"{len(sub)} devices",
                                  memory_fraction)
        except MemoryExceededError as exc:
            first_error = first_error or exc
            continue
        cands.append(cand)
    if baselines:
        cands += _baseline_candidates(graph, cluster, costs, base, pins, devs, settings,
                                      by_sim, sweep_devices, memory_fraction)
    fitting = [c for c in cands if c.fits]
    if not fitting:
        if first_error is not None:
            raise first_error
        raise MemoryExceededError(f"{name}: no placement of {graph.name} fits the devices' "
                                  "memory; use more devices or devices with more memory")
    best = fitting[0]
    for c in fitting[1:]:
        if c.score_s < best.score_s - 1e-12:
            best = c
    how = "simulated" if by_sim else "estimated by list scheduling"
    notes = [f"{name}: chose {best.label} ({how} step {best.score_s * 1e3:.4g} ms)"]
    others = [c for c in fitting if c is not best]
    if others:
        notes.append("other candidates: " + ", ".join(
            f"{c.label} {c.score_s * 1e3:.4g} ms" for c in others))
    plan = best.make()
    notes.extend(plan.notes)
    return plan.with_settings(notes=tuple(notes), **settings)


def _fits(pred: Prediction, memory_fraction: float) -> bool:
    """Whether every device's simulated peak stays within its allowed fraction of memory."""
    return all(pred.peak_bytes[d] <= int(c * memory_fraction)
               for d, c in pred.capacity_bytes.items())


def _own_candidate(graph: OpGraph, costs: CostModel, prob: OpProblem, place: Placement,
                   settings: dict[str, Any], by_sim: bool, name: str, where: str,
                   memory_fraction: float) -> _Candidate:
    """The algorithm's plan on ``prob``'s devices, placed again with less memory should the
    simulator find a device over (the additive estimate misses short-lived tensors)."""
    cap = prob.cap.copy()
    label = f"{name} on {where}"
    attempt = 0
    while True:
        p = prob.with_cap(cap)
        dev, notes = place(p)
        if not by_sim:
            return _Candidate(label, _maker(graph, p, dev, notes, settings), True,
                              schedule_s(p, dev))
        plan = plan_from_placement(graph, p, dev, notes=notes, **settings)
        pred = simulate(graph, plan, costs)
        if _fits(pred, memory_fraction):
            return _Candidate(label, lambda plan=plan: plan, True, pred.step_s)
        over = {d: b - int(c * memory_fraction) for d, c in pred.capacity_bytes.items()
                if (b := pred.peak_bytes[d]) > int(c * memory_fraction)}
        if attempt == SIMULATED_MEMORY_RETRIES:
            raise MemoryExceededError(
                f"{name}: its plan on {where} stays over memory in the simulator after "
                f"{attempt} tries with tighter limits: " + "; ".join(
                    f"{d} over by {b / MiB:,.1f} MiB" for d, b in over.items()))
        attempt += 1
        for dv, b in over.items():  # the excess, plus a growing margin
            j = p.device_ids.index(dv)
            cap[j] = max(int(cap[j] - b - prob.cap[j] * 0.01 * attempt), 0)


def _maker(graph: OpGraph, p: OpProblem, dev: np.ndarray, notes: Sequence[str],
           settings: dict[str, Any]) -> Callable[[], Plan]:
    return lambda: plan_from_placement(graph, p, dev, notes=notes, **settings)


def _baseline_candidates(graph: OpGraph, cluster: Cluster, costs: CostModel, base: OpProblem,
                         pins: Mapping[str, str], devs: list[str], settings: dict[str, Any],
                         by_sim: bool, sweep_devices: bool,
                         memory_fraction: float) -> list[_Candidate]:
    """``single`` (on the fastest device; pinned nodes stay put) and ``data-parallel``."""
    out: list[_Candidate] = []
    optimizer = settings["optimizer"]
    fastest = base.speed_order[0]
    dev = np.where(base.pinned >= 0, base.pinned, fastest)
    if pins:
        make = _maker(graph, base, dev, (), settings)
    else:
        def make() -> Plan:
            return single(graph, cluster, costs, device=base.device_ids[fastest],
                          optimizer=optimizer)
    if by_sim:
        plan = make()
        pred = simulate(graph, plan, costs)
        out.append(_Candidate("single", lambda plan=plan: plan, _fits(pred, memory_fraction),
                              pred.step_s))
    else:
        fits = bool(np.all(base.used_bytes(dev) <= base.cap))
        if pins:
            score = schedule_s(base, dev)
        else:  # one device runs everything back to back, then its optimizer step
            score = float(base.w_comb[base.dev_type[fastest]].sum()) + float(
                base.param_bytes.sum() * base.opt_s_per_byte[fastest]
                + base.param_tensors.sum() * base.opt_s_per_tensor[fastest])
        out.append(_Candidate("single", make, fits, score))
    # data parallel over a prefix of the cluster (not with pins: replicas cannot honour them)
    if pins or devs != list(cluster.ids[: len(devs)]) or len(devs) < 2:
        return out
    sizes = [len(devs)]
    if by_sim and sweep_devices:
        sizes += [s for s in (2, 4, 8, 16, 32, 64) if s < len(devs)]
    for kk in sizes:
        def make_dp(kk: int = kk) -> Plan:
            return data_parallel(graph, cluster, costs, k=kk, optimizer=optimizer)
        label = f"data-parallel on {kk}"
        if by_sim:
            plan = make_dp()
            pred = simulate(graph, plan, costs)
            out.append(_Candidate(label, lambda plan=plan: plan, _fits(pred, memory_fraction),
                                  pred.step_s))
        else:
            mem = node_memory_bytes(graph, optimizer, batch_fraction=1.0 / kk)
            fits = sum(mem) <= int(base.cap[:kk].min())
            out.append(_Candidate(label, make_dp, fits,
                                  _data_parallel_s(graph, costs, cluster.ids[:kk], optimizer)))
    return out


def _data_parallel_s(graph: OpGraph, costs: CostModel, devs: Sequence[str],
                     optimizer: str) -> float:
    """Data parallel without overlap: compute on 1/k of the batch, all-reduce, optimizer."""
    kk = len(devs)
    d = devs[0]
    f, b = node_seconds(costs, d, 1.0 / kk)
    trainable = [n.param_bytes for n in graph.nodes if n.param_bytes and n.kind != "buffer"]
    grads = sum(n.param_bytes for n in graph.nodes if n.kind == "param" and n.requires_grad)
    return (float(f.sum() + b.sum()) + costs.allreduce_s(tuple(devs), grads)
            + costs.optimizer_s(d, optimizer, sum(trainable), len(trainable)))


def plan_from_placement(graph: OpGraph, p: OpProblem, dev: np.ndarray,
                        notes: Sequence[str] = (), **settings: Any) -> Plan:
    """A Plan with one stage per used device (cluster order) from a device per unit."""
    used = sorted(set(dev.tolist()))
    stage_of_dev = np.full(p.k, -1, dtype=np.int64)
    stage_of_dev[used] = np.arange(len(used))
    stage = stage_of_dev[dev[p.unit_of_node]].tolist()
    return Plan.from_assignment(graph, [(p.device_ids[d],) for d in used],
                                dict(enumerate(stage)), notes=tuple(notes), **settings)


# ---------------------------------------------------------------------------------------------
# ParDNN


class _Fenwick:
    """Prefix sums of per-device load over time positions (a Fenwick / binary indexed tree).

    ``tree[i, d]`` holds the load of device d over a block of positions ending at i (1-based).
    """

    def __init__(self, values: np.ndarray) -> None:  # values: (n, K), position-major
        n = values.shape[0]
        self.n = n
        tree = np.zeros((n + 1, values.shape[1]))
        tree[1:] = values
        step = 1
        while step <= n:  # linear-time build: push each block into its parent block
            i = np.arange(step, n + 1, 2 * step)
            j = i + step
            keep = j <= n
            tree[j[keep]] += tree[i[keep]]
            step *= 2
        self.tree = tree

    def range_sum(self, a: int, b: int) -> np.ndarray:
        """[d] load over positions a+1..b."""
        idx: list[int] = []
        sign: list[float] = []
        while b > a:  # walk both ends down until they meet
            idx.append(b)
            sign.append(1.0)
            b -= b & -b
        while a > b:
            idx.append(a)
            sign.append(-1.0)
            a -= a & -a
        return np.dot(sign, self.tree[idx]) if idx else np.zeros(self.tree.shape[1])

    def add(self, positions: Sequence[int], d: int, values: Sequence[float]) -> None:
        n = self.n
        col = self.tree[:, d]
        if len(positions) == 1:
            i, x = positions[0], values[0]
            while i <= n:
                col[i] += x
                i += i & -i
            return
        idx, val = [], []
        for i, x in zip(positions, values, strict=True):
            while i <= n:
                idx.append(i)
                val.append(x)
                i += i & -i
        np.add.at(col, idx, val)


def _follow(start: int, visited: list[bool], succ_v: list[list[int]],
            succ_c: list[list[float]], level: list[float]) -> list[int]:
    """A path from ``start`` through unvisited units, each time to the heaviest successor."""
    path = [start]
    visited[start] = True
    u = start
    while True:
        best, nxt = -1.0, -1
        for v, c in zip(succ_v[u], succ_c[u], strict=True):
            if not visited[v]:
                x = c + level[v]
                if x > best:
                    best, nxt = x, v
        if nxt < 0:
            return path
        path.append(nxt)
        visited[nxt] = True
        u = nxt


def pardnn_placement(p: OpProblem) -> tuple[np.ndarray, tuple[str, ...]]:
    """ParDNN's clustering, mapping and memory repair on an :class:`OpProblem`."""
    n, K = p.n, p.k
    if n == 0:
        return p.pinned.copy(), ()
    w = p.w_ref.tolist()
    comm = p.comm_ref.tolist()
    pv, pe, sv, se = p.adjacency
    sc = [[comm[e] for e in es] for es in se]
    pc = [[comm[e] for e in es] for es in pe]
    dev = p.pinned.copy()
    visited = (dev >= 0).tolist()

    # 1. primary clusters: the K heaviest paths, each over what the previous left
    bl_static = bottom_levels(w, sv, sc)
    primaries: list[list[int]] = []
    for j in range(K):
        level = bl_static if j == 0 and not any(visited) else bottom_levels(w, sv, sc, visited)
        lv = np.where(visited, -np.inf, level)
        if not np.isfinite(lv.max()):
            break
        primaries.append(_follow(int(np.argmax(lv)), visited, sv, sc, level))
    free = list(p.speed_order)
    # each primary, heaviest first, to the free device its placed neighbours (pinned nodes,
    # earlier primaries) talk to most; the fastest free device when none
    for path in primaries:
        tie = [0.0] * K
        for u in path:
            for v, c in zip(pv[u] + sv[u], pc[u] + sc[u], strict=True):
                if dev[v] >= 0:
                    tie[dev[v]] += c
        d = max(free, key=lambda x: (tie[x], -free.index(x)))
        free.remove(d)
        dev[path] = d

    # secondary clusters: the remaining paths, heads by static bottom level
    secondaries: list[list[int]] = []
    for u in np.lexsort((np.arange(n), -np.asarray(bl_static))).tolist():
        if not visited[u]:
            secondaries.append(_follow(u, visited, sv, sc, bl_static))

    # 2. map each secondary to the device whose load over its time span is least, net of the
    #    communication it saves by joining that device
    if secondaries:
        tl = top_levels(w, pv, pc)
        tla = np.asarray(tl)
        pos_order = np.argsort(tla, kind="stable")
        pos = np.empty(n, dtype=np.int64)
        pos[pos_order] = np.arange(1, n + 1)
        posl = pos.tolist()
        sorted_tl = tla[pos_order].tolist()
        # loads in each device's own seconds, so a slower device looks as busy as it is
        wt = [row.tolist() for row in p.w_comb]
        typ = p.dev_type.tolist()
        vals = np.zeros((n, K))
        placed = np.flatnonzero(dev >= 0)
        vals[pos[placed] - 1, dev[placed]] = p.w_comb[p.dev_type[dev[placed]], placed]
        fen = _Fenwick(vals)
        dl = dev.tolist()
        ranked = list(enumerate(p.speed_order))
        for cl in secondaries:
            t0 = min(tl[u] for u in cl)
            t1 = max(tl[u] + w[u] for u in cl)
            wc = [sum(row[u] for u in cl) for row in wt]  # [t] the cluster's seconds
            load = fen.range_sum(bisect_left(sorted_tl, t0), bisect_left(sorted_tl, t1)).tolist()
            tie = [0.0] * K
            for u in cl:
                for v, c in zip(pv[u], pc[u], strict=True):
                    if dl[v] >= 0:
                        tie[dl[v]] += c
                for v, c in zip(sv[u], sc[u], strict=True):
                    if dl[v] >= 0:
                        tie[dl[v]] += c
            span = t1 - t0
            best, best_key = 0, None
            for rank, d in ranked:
                key = (max(load[d] + wc[typ[d]] - span, 0.0) - tie[d], -tie[d], rank)
                if best_key is None or key < best_key:
                    best, best_key = d, key
            for u in cl:
                dl[u] = best
            fen.add([posl[u] for u in cl], best, [wt[typ[best]][u] for u in cl])
        dev = np.asarray(dl, dtype=np.int64)

    # 3. parameters stay with their consumers: they are folded into their first consumer's unit
    # 4. memory repair
    notes: tuple[str, ...] = ()
    if np.any(p.used_bytes(dev) > p.cap):
        before = dev.copy()
        dev = repair_memory(p, dev, "pardnn")
        notes = (f"pardnn: moved {int((before != dev).sum())} nodes to fit device memory",)
    return dev, notes


@register("pardnn")
def pardnn(graph: OpGraph, cluster: Cluster, costs: CostModel,
           pins: Mapping[str, str] | None = None, k: int | None = None,
           optimizer: str = "adam", memory_fraction: float = 1.0, baselines: bool = True,
           sweep_devices: bool = True, simulate_max_nodes: int = 5000) -> Plan:
    """Critical-path clustering under memory limits (ParDNN), for graphs of 100,000+ ops.

    After Qararyah et al., "A computational-graph partitioning method for training
    memory-constrained DNNs", Parallel Computing 104 (2021). Node weight: forward + backward
    seconds on the fastest device type; edge weight: latency + bytes / bandwidth for the
    activation and its gradient.

    1. The heaviest path by bottom level (the critical path) is the first primary cluster; the
       heaviest path through what is left is the next, until there are as many primaries as
       devices. Each goes to its own device, the critical path to the fastest.
    2. The remaining nodes form secondary clusters (paths, heaviest head first). Each joins the
       device whose load over the cluster's time span (top levels; Fenwick trees keep range
       loads cheap) leaves the least overlap, net of the cut edges it saves by joining it.
    3. Parameters, buffers and inputs are folded into their first consumer, so they stay with it.
    4. Memory repair: while a device exceeds its memory (additive estimate of
       :func:`explorer.costs.memory.node_memory_bytes`), the nodes whose move costs least per byte
       go to devices with room; if nothing can move, :class:`MemoryExceededError` names the
       device and how far over it is.
    5. Scoring: up to ``simulate_max_nodes`` nodes, the plan, the same algorithm on the fastest
       2, 4, ... devices (``sweep_devices``) and the ``single`` and ``data-parallel``
       baselines (``baselines``) go through the shared simulator and the fastest that fits is
       returned, so the result is never slower than those baselines. Larger graphs are scored
       by a list-scheduling estimate (:func:`schedule_s`) and additive memory instead.

    Parameters
    ----------
    pins : dict, optional
        Node name -> device id. Pinned nodes never move; the clusters form around them.
    k : int, optional
        Use the first ``k`` devices of the cluster (default: all).
    optimizer : str
        Optimizer whose state counts in memory ("adam": 2 extra bytes per parameter byte).
    memory_fraction : float
        Fraction of each device's memory a plan may fill (1.0: all of it).
    baselines : bool
        Also consider the ``single`` and ``data-parallel`` plans and return the best.
    sweep_devices : bool
        On graphs scored by simulation, also try the fastest 2, 4, ... devices.
    simulate_max_nodes : int
        Largest graph whose candidates are compared with the simulator.

    Returns
    -------
    Plan
        One stage per used device (or a baseline's stages when a baseline wins), with
        ``algorithm="pardnn"``.

    Examples
    --------
    >>> from explorer.devices.cluster import Cluster
    >>> from explorer.models.synthetic import layered_dag, roofline_costs
    >>> g = layered_dag(200)
    >>> cl = Cluster.preset("4xH100")
    >>> plan = pardnn(g, cl, roofline_costs(g, cl))
    >>> plan.algorithm, len(plan.placement) == len(g)
    ('pardnn', True)
    """
    options = {"k": k, "optimizer": optimizer, "memory_fraction": memory_fraction,
               "baselines": baselines, "sweep_devices": sweep_devices,
               "simulate_max_nodes": simulate_max_nodes}
    return search(graph, cluster, costs, "pardnn", pardnn_placement, pins, options, k=k,
                  optimizer=optimizer, memory_fraction=memory_fraction, baselines=baselines,
                  sweep_devices=sweep_devices, simulate_max_nodes=simulate_max_nodes)
