"""Baechi's memory-constrained placers m-TOPO, m-ETF and m-SCT (Jeon et al., SoCC 2020).

All three work on the op-level problem of :mod:`explorer.partition.search.op_problem` (ops
with the parameters, buffers and inputs they own folded in, additive memory per op) and run in
the driver they share with ParDNN (:mod:`explorer.partition.search.driver`), which compares
each plan with the ``single`` and ``data-parallel`` baselines.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.units import MiB
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.options import Options
from explorer.partition.registry import register
from explorer.partition.search.driver import search
from explorer.partition.search.list_schedule import bottom_levels
from explorer.partition.search.op_problem import OpProblem

#: what a device holds when the nodes pinned to it alone overfill it
_PINNED_ONLY = "the nodes pinned to it"


def _no_room(algorithm: str, p: OpProblem, u: int, used: Sequence[int]) -> MemoryExceededError:
    """The error for a unit that fits on no device, naming the device with the most room."""
    d = max(range(p.k), key=lambda x: (int(p.cap[x]) - used[x], -x))
    need = int(p.mem[u])
    left = int(p.cap[d]) - int(used[d])
    return MemoryExceededError(
        f"{algorithm}: no device has room for node {p.unit_names[u]!r} of {p.graph_name} "
        f"({need / MiB:,.1f} MiB with its parameters and optimizer state): device "
        f"{p.device_ids[d]}, the one with the most room, has {left / MiB:,.1f} MiB left of "
        f"{int(p.cap[d]) / MiB:,.1f} MiB (short by {(need - left) / MiB:,.1f} MiB). Use more "
        "devices or devices with more memory, a lighter optimizer, or a smaller batch")


# ---------------------------------------------------------------------------------------------
# m-TOPO


@register("m-topo")
def m_topo(graph: OpGraph, cluster: Cluster, costs: CostModel,
           pins: Mapping[str, str] | None = None, k: int | None = None,
           optimizer: str = "adam", memory_fraction: float = 1.0, baselines: bool = True,
           sweep_devices: bool = True, simulate_max_nodes: int = 5000) -> Plan:
    """Baechi's m-TOPO: ops in topological order fill each device up to its memory share.

    After Jeon et al., "Baechi: fast device placement of machine learning graphs", SoCC 2020.
    Each device's share is the graph's total memory (additive estimate of
    :func:`explorer.costs.memory.node_memory_bytes`) split in proportion to the devices' memory;
    ops go to the current device until the next would pass its share, then to the next
    device. Pinned ops stay on their devices and count against their memory. Raises
    :class:`MemoryExceededError` naming a device when an op fits nowhere.

    On graphs up to ``simulate_max_nodes`` nodes the plan, the same placer on the fastest 2,
    4, ... devices (``sweep_devices``) and the ``single`` / ``data-parallel`` baselines
    (``baselines``) are simulated and the fastest plan that fits is returned; larger graphs
    are compared by a list-scheduling estimate
    (:func:`explorer.partition.search.list_schedule.schedule_s`), and the plan chosen is
    simulated against the baselines by the registry's final check at every size.

    Parameters
    ----------
    pins : dict, optional
        Node name -> device id; pinned nodes never move.
    k, optimizer, memory_fraction, baselines, sweep_devices, simulate_max_nodes
        The options the op-level partitioners share: see
        :class:`explorer.partition.options.Options`.

    Returns
    -------
    Plan
        One stage per used device (or a baseline's stages when a baseline wins), with
        ``algorithm`` set to this partitioner's name and ``options`` to the options used.

    Examples
    --------
    >>> from explorer.devices.cluster import Cluster
    >>> from explorer.models.synthetic import layered_dag, roofline_costs
    >>> g = layered_dag(100)
    >>> cl = Cluster.preset("2xT4")
    >>> c = roofline_costs(g, cl)
    >>> [place(g, cl, c).algorithm for place in (m_topo, m_etf, m_sct)]
    ['m-topo', 'm-etf', 'm-sct']
    """
    opts = Options(k=k, optimizer=optimizer, memory_fraction=memory_fraction,
                   baselines=baselines, sweep_devices=sweep_devices,
                   simulate_max_nodes=simulate_max_nodes)
    return search(graph, cluster, costs, "m-topo", topo_placement, pins, opts)


def topo_placement(p: OpProblem) -> tuple[np.ndarray, tuple[str, ...]]:
    """Fill devices in order, in topological order of the ops, each up to its memory share.

    A device's share is the total memory of the graph split over the devices in proportion to
    their capacities (never more than the capacity). The last device takes what is left up to
    its capacity; what still does not fit goes to the device with the most room.
    """
    n, K = p.n, p.k
    mem = p.mem.tolist()
    cap = p.cap.tolist()
    pinned = p.pinned.tolist()
    dev = list(pinned)
    used = [0] * K
    for u in range(n):
        if pinned[u] >= 0:
            used[pinned[u]] += mem[u]
    total = int(p.mem.sum())
    cap_total = max(sum(cap), 1)
    share = [min(c, -(-total * c // cap_total)) for c in cap]
    cur = 0
    for u in range(n):
        if dev[u] >= 0:
            continue
        m = mem[u]
        while cur < K - 1 and used[cur] > 0 and used[cur] + m > share[cur]:
            cur += 1
        d = cur
        if used[d] + m > cap[d]:
            d = max(range(K), key=lambda x: (cap[x] - used[x], -x))
            if used[d] + m > cap[d]:
                raise _no_room("m-topo", p, u, used)
        dev[u] = d
        used[d] += m
    for d in range(K):
        if used[d] > cap[d]:  # pinned nodes alone overfill it
            raise p.over_memory("m-topo", d, used[d], _PINNED_ONLY)
    return np.asarray(dev, dtype=np.int64), ()


# ---------------------------------------------------------------------------------------------
# m-ETF (and the list scheduler m-SCT reuses)


@register("m-etf")
def m_etf(graph: OpGraph, cluster: Cluster, costs: CostModel,
          pins: Mapping[str, str] | None = None, k: int | None = None,
          optimizer: str = "adam", memory_fraction: float = 1.0, baselines: bool = True,
          sweep_devices: bool = True, simulate_max_nodes: int = 5000) -> Plan:
    """Baechi's m-ETF: list scheduling, each op on the device where it can start earliest.

    After Jeon et al., "Baechi: fast device placement of machine learning graphs", SoCC 2020,
    building on Hwang et al.'s earliest-task-first (ETF) scheduling (SIAM J. Comput. 1989).
    Ready ops are taken in the order their inputs complete (larger bottom level first among
    equals); each goes to the device, among those with memory left for it, where it can start
    earliest, counting the transfer of its inputs from other devices (forward activation and
    gradient back; latency + bytes / bandwidth of that link). Node times are forward +
    backward seconds on each device's type. Pinned ops stay on their devices. Raises
    :class:`MemoryExceededError` naming a device when an op fits nowhere.

    Candidates, scoring, options and what it returns as in :func:`m_topo`.
    """
    opts = Options(k=k, optimizer=optimizer, memory_fraction=memory_fraction,
                   baselines=baselines, sweep_devices=sweep_devices,
                   simulate_max_nodes=simulate_max_nodes)
    return search(graph, cluster, costs, "m-etf", etf_placement, pins, opts)


def etf_placement(p: OpProblem, favourite_parent: Sequence[int] | None = None,
                  algorithm: str = "m-etf") -> tuple[np.ndarray, tuple[str, ...]]:
    """Earliest-task-first list scheduling among devices with memory left.

    Ready ops are taken in the order their inputs are complete (ties: favourite children
    first, then larger bottom level, then graph order); each goes to the device where it can
    start earliest, counting the transfers of its inputs from other devices (latency + bytes /
    bandwidth, forward and gradient), among the devices that still have memory for it (ties:
    earliest finish, then cluster order). Taking ready ops in that order stands in for ETF's
    scan of every (ready op, device) pair, which would cost the number of ready ops each step.
    With ``favourite_parent`` (m-SCT), an op whose favourite parent is placed goes to that
    parent's device when it has room.
    """
    n, K = p.n, p.k
    pv, pe, sv, se = p.adjacency
    typ = p.dev_type.tolist()
    wt = [row.tolist() for row in p.w_comb]
    lat = p.lat_s.tolist()
    spb = p.s_per_byte.tolist()
    nlat = p.n_latencies.tolist()
    nbytes = (p.fwd_bytes + p.bwd_bytes).tolist()
    mem = p.mem.tolist()
    cap = p.cap.tolist()
    pinned = p.pinned.tolist()
    comm = p.comm_ref.tolist()
    bl = bottom_levels(p.w_ref.tolist(), sv, [[comm[e] for e in es] for es in se])
    fav = list(favourite_parent) if favourite_parent is not None else [-1] * n

    used = [0] * K
    for u in range(n):
        if pinned[u] >= 0:
            used[pinned[u]] += mem[u]
    for d in range(K):
        if used[d] > cap[d]:
            raise p.over_memory(algorithm, d, used[d], _PINNED_ONLY)
    dev = [-1] * n
    fin = [0.0] * n
    free = [0.0] * K
    ready_at = [0.0] * n
    waiting = [len(x) for x in pv]
    # ready queue: (inputs complete at, 0 for a favourite child (taken first, as SCT's urgent
    # tasks) else 1, minus bottom level, unit)
    heap = [(0.0, 1, -bl[u], u) for u in range(n) if waiting[u] == 0]
    heapq.heapify(heap)
    all_devices = list(range(K))
    while heap:
        u = heapq.heappop(heap)[3]
        m = mem[u]
        if pinned[u] >= 0:
            cands = [pinned[u]]
        else:
            cands = []
            f = fav[u]
            if f >= 0 and used[dev[f]] + m <= cap[dev[f]]:
                cands = [dev[f]]
            if not cands:
                cands = [d for d in all_devices if used[d] + m <= cap[d]]
            if not cands:
                raise _no_room(algorithm, p, u, used)
        best_d, best_s, best_f = -1, 0.0, 0.0
        preds = list(zip(pv[u], pe[u], strict=True))
        for d in cands:
            r = 0.0
            for v, e in preds:
                t = fin[v]
                dv = dev[v]
                if dv != d:
                    t += nlat[e] * lat[dv][d] + nbytes[e] * spb[dv][d]
                if t > r:
                    r = t
            s = free[d] if free[d] > r else r
            f_ = s + wt[typ[d]][u]
            if best_d < 0 or s < best_s or (s == best_s and f_ < best_f):
                best_d, best_s, best_f = d, s, f_
        d = best_d
        dev[u] = d
        if pinned[u] < 0:
            used[d] += m
        fin[u] = best_f
        free[d] = best_f
        for v in sv[u]:
            if best_f > ready_at[v]:
                ready_at[v] = best_f
            waiting[v] -= 1
            if waiting[v] == 0:
                heapq.heappush(heap, (ready_at[v], 0 if fav[v] >= 0 else 1, -bl[v], v))
    return np.asarray(dev, dtype=np.int64), ()


# ---------------------------------------------------------------------------------------------
# m-SCT


def favourite_children(p: OpProblem, lp_max_nodes: int = 2000) -> tuple[list[int], str]:
    """Favourite parent of each unit (-1: none) from the SCT LP relaxation, and a note.

    The LP (Hanen and Munier's relaxation of scheduling with small communication times):
    minimise the makespan ``T`` over start times ``s`` and edge variables ``x`` in [0, 1], with
    ``s_j >= s_i + w_i + c_ij x_ij`` on every edge, ``T >= s_i + w_i``, and at most one child
    (and at most one parent) per node with ``x < 1``: ``sum_j x_ij >= outdeg(i) - 1`` and
    ``sum_i x_ij >= indeg(j) - 1``. An edge with ``x < 1/2`` after solving names j the
    favourite child of i; the constraints make that at most one per node either way.

    Beyond ``lp_max_nodes`` units the LP is solved on a coarsened graph: runs of ops of one
    module (module paths cut shorter until there are at most ``lp_max_nodes`` runs, then
    neighbouring runs merged). Inside a run each op's favourite child is its heaviest-edge
    child in the same run; across runs, its heaviest-edge child in the run the LP chose as
    the favourite of its own run.
    """
    n = p.n
    if n == 0:
        return [], "m-sct: no ops"
    w = p.w_ref
    comm = p.comm_ref
    if n <= lp_max_nodes:
        group = np.arange(n)
        note = f"m-sct: LP over {n} ops"
    else:
        group = coarse_groups(p, lp_max_nodes)
        note = (f"m-sct: the graph has {n} ops, more than lp_max_nodes={lp_max_nodes}; the LP "
                f"was solved on {int(group.max()) + 1} groups of consecutive ops")
    G = int(group.max()) + 1
    gw = np.bincount(group, weights=w, minlength=G)
    gs, gd = group[p.src], group[p.dst]
    cross = gs != gd
    key = gs[cross] * G + gd[cross]
    keys, inv = np.unique(key, return_inverse=True)
    gc = np.bincount(inv, weights=comm[cross], minlength=len(keys))
    ga, gb = keys // G, keys % G
    fav_edge, status = _sct_lp(G, gw, ga, gb, gc)
    if status:
        note += f"; the LP solver gave up ({status}), so no favourite children were used"
    fav_group_child = np.full(G, -1, dtype=np.int64)
    fav_group_child[ga[fav_edge]] = gb[fav_edge]

    # unit level: each unit picks its heaviest eligible child not yet taken by another parent
    order = np.lexsort((p.dst, -comm, p.src))  # by parent, heaviest edge first
    parent = [-1] * n
    has_child = [False] * n
    grp = group.tolist()
    fgc = fav_group_child.tolist()
    for e in order.tolist():
        a, b = int(p.src[e]), int(p.dst[e])
        if has_child[a] or parent[b] >= 0:
            continue
        if grp[a] == grp[b] or fgc[grp[a]] == grp[b]:
            parent[b] = a
            has_child[a] = True
    return parent, note


def _sct_lp(G: int, w: np.ndarray, a: np.ndarray, b: np.ndarray,
            c: np.ndarray) -> tuple[np.ndarray, str]:
    """Solve the SCT relaxation on G nodes and edges (a, b, c); favourite-edge mask, status."""
    E = len(a)
    if E == 0:
        return np.zeros(0, dtype=bool), ""
    # variables: s_0..s_{G-1}, x_0..x_{E-1}, T
    nv = G + E + 1
    rows, cols, vals, rhs = [], [], [], []
    r = 0
    e_idx = np.arange(E)
    # s_a - s_b + c x <= -w_a
    rows += [np.full(E, 0) + e_idx] * 3
    cols += [a, b, G + e_idx]
    vals += [np.ones(E), -np.ones(E), c]
    rhs.append(-w[a])
    r += E
    # s_i - T <= -w_i for sinks
    sinks = np.setdiff1d(np.arange(G), a)
    rows += [r + np.arange(len(sinks))] * 2
    cols += [sinks, np.full(len(sinks), nv - 1)]
    vals += [np.ones(len(sinks)), -np.ones(len(sinks))]
    rhs.append(-w[sinks])
    r += len(sinks)
    # -sum x over out-edges <= 1 - outdeg, and over in-edges <= 1 - indeg (degree >= 2)
    for end in (a, b):
        deg = np.bincount(end, minlength=G)
        nodes = np.flatnonzero(deg >= 2)
        row_of = np.full(G, -1)
        row_of[nodes] = r + np.arange(len(nodes))
        m = deg[end] >= 2
        rows.append(row_of[end[m]])
        cols.append(G + e_idx[m])
        vals.append(-np.ones(int(m.sum())))
        rhs.append(1.0 - deg[nodes])
        r += len(nodes)
    A = sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                          shape=(r, nv))
    cost = np.zeros(nv)
    cost[-1] = 1.0
    bounds = [(0, None)] * G + [(0, 1)] * E + [(0, None)]
    res = linprog(cost, A_ub=A, b_ub=np.concatenate(rhs), bounds=bounds, method="highs")
    if res.status != 0 or res.x is None:
        return np.zeros(E, dtype=bool), res.message
    return res.x[G:G + E] < 0.5 - 1e-9, ""


def coarse_groups(p: OpProblem, limit: int) -> np.ndarray:
    """[u] group of each unit: runs of consecutive units of one module, at most ``limit``.

    Module paths are cut to fewer components until the runs number at most ``limit``; past
    that, neighbouring runs are merged. Runs are consecutive in topological order, so the
    graph of groups has no cycles. Units without a module (inputs, pinned parameters) join the
    run before them.
    """
    paths = p.unit_paths
    depth = max((x.count(".") + 1 for x in paths if x), default=0)
    run = np.zeros(p.n, dtype=np.int64)
    for cut in [None, *range(depth - 1, 0, -1)]:
        keys = paths if cut is None else [
            x if x is None else ".".join(x.split(".")[:cut]) for x in paths]
        r, last, started = 0, None, False
        for u, key in enumerate(keys):
            if key is not None and (not started or key != last):
                r += started
                started, last = True, key
            run[u] = r
        if r + 1 <= limit:
            return run
    runs = int(run.max()) + 1
    return run * limit // runs


def sct_placement(p: OpProblem, lp_max_nodes: int = 2000) -> tuple[np.ndarray, tuple[str, ...]]:
    """m-SCT: favourite children from the LP relaxation, then ETF honouring them."""
    parent, note = favourite_children(p, lp_max_nodes)
    dev, notes = etf_placement(p, parent, "m-sct")
    return dev, (note, *notes)


@register("m-sct")
def m_sct(graph: OpGraph, cluster: Cluster, costs: CostModel,
          pins: Mapping[str, str] | None = None, k: int | None = None,
          optimizer: str = "adam", memory_fraction: float = 1.0, baselines: bool = True,
          sweep_devices: bool = True, simulate_max_nodes: int = 5000,
          lp_max_nodes: int = 2000) -> Plan:
    """Baechi's m-SCT: an LP relaxation picks favourite children, then ETF keeps them together.

    After Jeon et al., "Baechi: fast device placement of machine learning graphs", SoCC 2020,
    using Hanen and Munier's small-communication-time relaxation (Discrete Appl. Math. 1995).
    The LP (``scipy.optimize.linprog``, HiGHS) chooses for each op at most one favourite child
    (and each op has at most one favourite parent): the edge worth keeping on one device to
    avoid its transfer. The ETF of :func:`m_etf` then runs, placing an op whose favourite
    parent is placed on that parent's device when it has memory for it.

    The LP has a variable per edge and per node; beyond ``lp_max_nodes`` ops it is solved on a
    coarsened graph whose nodes are runs of consecutive ops of one module (module paths cut
    shorter until there are at most ``lp_max_nodes`` runs, then neighbouring runs merged); op
    favourites then follow the heaviest edge inside a run and into the run the LP favoured.
    This keeps the solve well under a second at 100,000 ops.

    Candidates, scoring, pins, the shared options and what it returns as in :func:`m_topo`.

    Parameters
    ----------
    lp_max_nodes : int
        Largest number of LP nodes; bigger graphs are coarsened to this many groups.
    """
    if lp_max_nodes < 1:
        raise ExplorerError(f"lp_max_nodes must be at least 1, not {lp_max_nodes!r}")
    opts = Options(k=k, optimizer=optimizer, memory_fraction=memory_fraction,
                   baselines=baselines, sweep_devices=sweep_devices,
                   simulate_max_nodes=simulate_max_nodes)

    def place(p: OpProblem) -> tuple[np.ndarray, tuple[str, ...]]:
        return sct_placement(p, lp_max_nodes)

    return search(graph, cluster, costs, "m-sct", place, pins, opts,
                  {"lp_max_nodes": lp_max_nodes})


__all__ = ["coarse_groups", "etf_placement", "favourite_children", "m_etf", "m_sct", "m_topo",
           "sct_placement", "topo_placement"]
