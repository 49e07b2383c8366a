"""ParDNN: critical-path clustering of an op graph under device memory limits (Qararyah et al.).

After Qararyah et al., "A computational-graph partitioning method for training
memory-constrained DNNs", Parallel Computing 104 (2021). The op-level problem, the
list-scheduling estimate, memory repair and the search driver it runs in are shared with
Baechi's placers (:mod:`explorer.partition.search`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence

import numpy as np

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.options import Options
from explorer.partition.registry import register
from explorer.partition.search.driver import search
from explorer.partition.search.list_schedule import bottom_levels, repair_memory, top_levels
from explorer.partition.search.op_problem import OpProblem


class Fenwick:
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
        fen = Fenwick(vals)
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
       by a list-scheduling estimate
       (:func:`explorer.partition.search.list_schedule.schedule_s`) and additive memory
       instead; the plan chosen is then simulated against the baselines by the registry's
       final check (:mod:`explorer.partition.guard`), at every size.

    Parameters
    ----------
    pins : dict, optional
        Node name -> device id. Pinned nodes never move; the clusters form around them.
    k, optimizer, memory_fraction, baselines, sweep_devices, simulate_max_nodes
        See :class:`explorer.partition.options.Options`.

    Returns
    -------
    Plan
        A stage for each device it uses, or the stages of the baseline that beat it; its
        ``algorithm`` is ``"pardnn"``.

    Examples
    --------
    >>> from explorer.devices.cluster import Cluster
    >>> from explorer.models.synthetic import layered_dag, roofline_costs
    >>> g, cl = layered_dag(200), Cluster.preset("4xH100")
    >>> plan = pardnn(g, cl, roofline_costs(g, cl))
    >>> plan.algorithm, len(plan.placement) == len(g)
    ('pardnn', True)
    """
    opts = Options(k=k, optimizer=optimizer, memory_fraction=memory_fraction,
                   baselines=baselines, sweep_devices=sweep_devices,
                   simulate_max_nodes=simulate_max_nodes)
    return search(graph, cluster, costs, "pardnn", pardnn_placement, pins, opts)


__all__ = ["Fenwick", "pardnn", "pardnn_placement"]
