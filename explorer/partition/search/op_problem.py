"""The op-level problem ParDNN and Baechi's placers share: the graph as units in numpy arrays.

A unit is an op with the parameters, buffers and inputs it owns folded into it; an
:class:`OpProblem` holds seconds per unit on each device type, additive memory bytes per unit
(:func:`explorer.costs.memory.node_memory_bytes`), unit-to-unit edges with the bytes they
carry forward and back, device capacities and the link model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.graph import OpGraph
from explorer.core.plan import StageSettings
from explorer.costs.memory import node_memory_bytes
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.search.fallback import memory_error


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
    @cached_property
    def w_comb(self) -> np.ndarray:
        """[t, u] forward plus backward seconds."""
        return self.w_fwd + self.w_bwd

    @property
    def n(self) -> int:
        """How many units."""
        return len(self.rep)

    @property
    def k(self) -> int:
        """How many devices."""
        return len(self.device_ids)

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

    def over_memory(self, algorithm: str, d: int, used: int, what: str,
                    reason: str = "") -> MemoryExceededError:
        """The error for device ``d`` holding ``used`` bytes (``what``) over its capacity."""
        return memory_error(
            algorithm, what, self.device_ids[d], used, int(self.cap[d]),
            (f"{reason}; " if reason else "") + "use more devices or devices with more "
            "memory, a lighter optimizer, or a smaller batch")


def op_problem(graph: OpGraph, cluster: Cluster, costs: CostModel, device_ids: Sequence[str],
               pins: Mapping[str, str] | None = None, optimizer: str = "adam",
               memory_fraction: float = 1.0, memory: StageSettings | None = None
               ) -> OpProblem:
    """Reduce ``graph`` to units on ``device_ids`` (see :class:`OpProblem`).

    A unit is an op, together with the parameters, buffers and inputs whose first consumer it
    is (``graph.owner``): a parameter always lives with a consumer, so its weight never crosses
    a link unless another consumer sits elsewhere. Pinned nodes and nodes without consumers
    are units of their own. Inputs carry no edges (every rank loads its own batch). Memory
    follows the ``memory`` settings of every stage (one device each: ZeRO changes nothing).
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
    kind = cluster.device(device_ids[0]).kind if device_ids else "cuda"
    np.add.at(mem, unit_of_node, np.array(node_memory_bytes(graph, optimizer, settings=memory,
                                                            device_kind=kind), dtype=np.int64))
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
    lat_s, spb = link_tables(costs, device_ids)
    probe = 1 << 20
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


def link_tables(costs: CostModel, device_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """[d, d] latency and seconds per byte between the devices (0 on the diagonal), read off
    ``costs.transfer_s``, which depends only on the link of a pair: once per distinct link
    (the cluster's default and its overrides), not per pair."""
    K = len(device_ids)
    lat_s = np.zeros((K, K))
    spb = np.zeros((K, K))
    if K < 2:
        return lat_s, spb
    probe = 1 << 20
    terms: dict = {}

    def fill(rows: np.ndarray, cols: np.ndarray, a: str, b: str) -> None:
        link = costs.cluster.link(a, b)
        if link not in terms:
            t1 = costs.transfer_s(a, b, 1)
            t2 = costs.transfer_s(a, b, 1 + probe)
            per_byte = (t2 - t1) / probe
            terms[link] = (max(t1 - per_byte, 0.0), per_byte)
        lat_s[rows, cols], spb[rows, cols] = terms[link]

    index = {d: j for j, d in enumerate(device_ids)}
    over: dict[frozenset[str], tuple[str, str]] = {}
    for a, b, _ in costs.cluster.links:
        if a in index and b in index and a != b:
            over[frozenset((a, b))] = (a, b)
    if len(over) < K * (K - 1) // 2:  # some pair takes the default link: fill with it first
        a, b = next((a, b) for j, a in enumerate(device_ids) for b in device_ids[j + 1:]
                    if frozenset((a, b)) not in over)
        fill(slice(None), slice(None), a, b)
        np.fill_diagonal(lat_s, 0.0)
        np.fill_diagonal(spb, 0.0)
    for a, b in over.values():
        i, j = index[a], index[b]
        fill(np.array([i, j]), np.array([j, i]), a, b)
    return lat_s, spb


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


__all__ = ["OpProblem", "link_tables", "node_seconds", "op_problem"]
