"""Min-communication partitioning: balanced k-way cuts of the op graph whose stage graph is acyclic.

The idea of compiler-driven model parallelism (arXiv 1906.08168): treat the dataflow graph
as a weighted graph, nodes weighted by compute seconds and edges by transfer seconds, and
split it into ``k`` parts of balanced compute with the least communication, keeping the
quotient graph (parts as nodes) acyclic so the parts can run as stages without deadlock.

The recipe is the multilevel scheme of METIS (Karypis and Kumar, SIAM J. Sci. Comput. 1998)
made acyclic as in Herrmann, Özkaya, Uçar, Kaya and Çatalyürek, "Multilevel algorithms for
acyclic partitioning of directed acyclic graphs" (SIAM J. Sci. Comput. 2019). It works on
units (an op with the parameters, buffers and inputs it reads first):

1. Coarsen by heavy-edge matching along a topological order: only nodes next to each other in
   that order merge, so every coarse node is an interval of it and every coarse graph is a DAG.
2. Partition the coarsest graph by topological-order growth: cut the order into ``k``
   intervals, the cut points chosen by dynamic programming to cross the least weight under
   the compute and memory limits.
3. Uncoarsen, refining boundary nodes at every level Fiduccia-Mattheyses style (Fiduccia and
   Mattheyses, DAC 1982): moves by best gain with a priority queue, locked once moved, with
   roll-back to the best prefix. Parts are kept in execution order and a move is legal only if
   it keeps every edge going from a part to the same or a later part, so no move can create a
   cycle between parts.

Pinned units keep their part; the parts take an order the pins allow, and only nodes with the
same pin bounds merge, so every level stays consistent with the pins. The even-layers split,
refined the same way, competes as a second start: when it is balanced, the result never cuts
more than it. Communication is counted per tensor and destination (connectivity - 1 of the
hyperedge of a tensor and its readers), as the simulator sends it.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.graph import OpGraph
from explorer.core.plan import SCHEDULES, Plan
from explorer.costs.memory import node_memory_bytes
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition import register
from explorer.partition.baselines import contiguous
from explorer.partition.pipeline import (
    COMPARE_MAX_NODES,
    HEADROOMS,
    best_of_baselines,
    default_micro_batches,
    memory_error,
    simulate_if_small,
)
from explorer.simulate.simulator import Prediction

#: stop coarsening at about this many nodes per part
COARSEST_PER_PART = 24
#: stop coarsening when a round shrinks the graph by less than this fraction
MIN_SHRINK = 0.1
#: FM passes per level, and how many moves without improvement end a pass
FM_PASSES = 4
FM_PATIENCE = 64
#: nets with more readers than this do not re-queue their nodes after a move (gains are
#: recomputed when a node is taken from the queue anyway)
WIDE_NET = 64


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


# ------------------------------------------------------------------------------------------
# weights


def node_weights_s(graph: OpGraph, costs: CostModel, device: str) -> list[float]:
    """Compute seconds (forward + backward) of every node on ``device``; 0 for non-ops."""
    out = []
    for i, n in enumerate(graph.nodes):
        if n.kind != "op":
            out.append(0.0)
            continue
        t = costs.fwd_s(i, device)
        if n.requires_grad:
            t += costs.bwd_s(i, device)
        out.append(t)
    return out


def net_weights_s(graph: OpGraph, costs: CostModel, devices: Sequence[str],
                  micro_batches: int = 1) -> list[float]:
    """Seconds to send every node's output to one other device, per step; 0 for inputs.

    Activations go once per micro-batch, weights once per step; both have a gradient coming
    back when they require one. The link is the average over pairs of ``devices`` (latency
    and seconds per byte), as in ``CostModel.transfer_s``.
    """
    cluster = costs.cluster
    pairs = [(a, b) for i, a in enumerate(devices) for b in devices[i + 1:]]
    if pairs:
        lat = sum(cluster.link(a, b).latency_s for a, b in pairs) / len(pairs)
        spb = costs.link_scale * sum(1.0 / cluster.link(a, b).bandwidth_bytes_per_s
                                     for a, b in pairs) / len(pairs)
    else:
        lat = spb = 0.0
    out = []
    for n in graph.nodes:
        if n.kind == "input" or n.out_bytes <= 0:
            out.append(0.0)
            continue
        times = micro_batches if n.kind == "op" else 1
        one = times * lat + n.out_bytes * spb
        out.append(one * (2 if n.requires_grad else 1))
    return out


def cut_seconds(graph: OpGraph, part: Sequence[int], weights: Sequence[float]) -> float:
    """Communication of a placement: per producer, (parts among it and its readers - 1) x
    its weight. Inputs are not sent (every rank loads its own batch)."""
    total = 0.0
    for p, n in enumerate(graph.nodes):
        if n.kind == "input" or not weights[p]:
            continue
        parts = {part[p]} | {part[c] for c in graph.succs[p]}
        total += (len(parts) - 1) * weights[p]
    return total


# ------------------------------------------------------------------------------------------
# the multilevel graph


class _Level:
    """A DAG whose node ids are a topological order, with weights, pins and hyperedges.

    A net is a tensor: its producer ``src[e]`` and its distinct other readers
    ``readers[ptr[e]:ptr[e+1]]`` (sorted), weighing ``net_w[e]`` seconds when cut. Nets with
    the same nodes are merged. ``members``, ``node_nets``, ``preds`` and ``succs`` are lists for
    the refinement's Python loops.
    """

    def __init__(self, w: np.ndarray, mfix: np.ndarray, mact: np.ndarray, pin: np.ndarray,
                 src: np.ndarray, net_of: np.ndarray, rd: np.ndarray, net_w: np.ndarray
                 ) -> None:
        n = len(w)
        self.n = n
        self.w, self.mfix, self.mact, self.pin = w, mfix, mact, pin
        # canonical nets: drop readers equal to the producer, repeated readers, empty nets
        keep = rd != src[net_of]
        key = _sorted_unique(net_of[keep] * n + rd[keep])
        net_of, rd = key // n, key % n
        live = net_of[np.concatenate([[True], net_of[1:] != net_of[:-1]])] if len(net_of) \
            else net_of
        remap = np.full(len(src), -1, dtype=np.int64)
        remap[live] = np.arange(len(live))
        src, net_w, net_of = src[live], net_w[live], remap[net_of]
        counts = np.bincount(net_of, minlength=len(src))
        # merge nets with the same producer and readers (exactly: group by reader count)
        ptr = np.concatenate([[0], np.cumsum(counts)])
        new_src, new_w, new_rd, new_cnt = [], [], [], []
        for c in np.unique(counts):
            ids = np.flatnonzero(counts == c)
            rows = np.empty((len(ids), c + 1), dtype=np.int64)
            rows[:, 0] = src[ids]
            rows[:, 1:] = rd[(ptr[ids][:, None] + np.arange(c)[None, :])]
            uniq, inv = np.unique(rows, axis=0, return_inverse=True)
            new_src.append(uniq[:, 0])
            new_rd.append(uniq[:, 1:].ravel())
            new_w.append(np.bincount(inv.ravel(), weights=net_w[ids], minlength=len(uniq)))
            new_cnt.append(np.full(len(uniq), c, dtype=np.int64))
        if new_src:
            self.src = np.concatenate(new_src)
            self.net_w = np.concatenate(new_w)
            self.rd = np.concatenate(new_rd)
            cnt = np.concatenate(new_cnt)
        else:
            self.src = np.zeros(0, dtype=np.int64)
            self.net_w = np.zeros(0)
            self.rd = np.zeros(0, dtype=np.int64)
            cnt = np.zeros(0, dtype=np.int64)
        e_count = len(self.src)
        self.ptr = np.concatenate([[0], np.cumsum(cnt)])
        self.net_of = np.repeat(np.arange(e_count), cnt)
        # members: producer first, then readers
        mcount = cnt + 1
        self.mem_ptr = np.concatenate([[0], np.cumsum(mcount)])
        mem = np.empty(int(self.mem_ptr[-1]), dtype=np.int64)
        is_src = np.zeros(len(mem), dtype=bool)
        is_src[self.mem_ptr[:-1]] = True
        mem[is_src] = self.src
        mem[~is_src] = self.rd
        self.mem = mem
        self.mem_net = np.repeat(np.arange(e_count), mcount)
        # edges producer -> reader, deduplicated
        ekey = _sorted_unique(self.src[self.net_of] * n + self.rd)
        es, ed = ekey // n, ekey % n
        order = np.argsort(mem, kind="stable")
        self.node_nets = _Rows(self.mem_net[order], np.bincount(mem, minlength=n))
        self.succs = _Rows(ed, np.bincount(es, minlength=n))
        porder = np.argsort(ed * n + es, kind="stable")
        self.preds = _Rows(es[porder], np.bincount(ed, minlength=n))
        self.members = _Rows(mem, mcount)
        self.net_w_list = self.net_w.tolist()
        self.w_list = w.tolist()
        self.mfix_list, self.mact_list = mfix.tolist(), mact.tolist()
        self.set_pins(pin)

    def set_pins(self, pin: np.ndarray) -> None:
        """Pinned part of every node (-1: free)."""
        self.pin = pin
        self.pin_list = pin.tolist()

    def coarsen(self, wcap: float, mcap: float, in_flight: int, k: int
                ) -> tuple[_Level, np.ndarray] | None:
        """Merge pairs of consecutive nodes (heavy-edge matching on the order), or None when
        that would shrink the graph too little.

        With pins, only nodes with the same pin bounds (the parts their pinned ancestors and
        descendants allow) merge: merging joins paths, and this way no coarse node is pulled
        between pins in opposite directions (see :func:`_pin_bounds`).
        """
        n = self.n
        if n < 2:
            return None
        # conn[v]: weight of the nets holding both v and v+1
        key = np.sort(self.mem_net * n + self.mem)
        a, b = key[:-1], key[1:]
        adj = (b - a == 1) & (a // n == b // n)
        conn = np.bincount(a[adj] % n, weights=self.net_w[a[adj] // n], minlength=n)
        nudge = (float(self.net_w.mean()) if len(self.net_w) else 0.0) * 1e-6 + 1e-300
        w, mfix, mact, pin = self.w, self.mfix, self.mact, self.pin
        ok = ((w[:-1] + w[1:] <= wcap)
              & (mfix[:-1] + mfix[1:] + (mact[:-1] + mact[1:]) * in_flight <= mcap)
              & ((pin[:-1] < 0) | (pin[1:] < 0) | (pin[:-1] == pin[1:])))
        if (pin >= 0).any():
            lo, hi = (np.asarray(b) for b in _pin_bounds(self, k))
            ok &= (lo[:-1] == lo[1:]) & (hi[:-1] == hi[1:])
        pw = np.where(ok, conn[:-1] + nudge, -1.0).tolist()
        # maximum-weight matching on the path 0-1-...-(n-1): best[i] covers nodes 0..i-1
        best = [0.0] * (n + 1)
        take = [False] * (n + 1)
        for i in range(2, n + 1):
            x = pw[i - 2]
            if x > 0 and best[i - 2] + x > best[i - 1]:
                best[i] = best[i - 2] + x
                take[i] = True
            else:
                best[i] = best[i - 1]
        starts = np.ones(n, dtype=bool)  # node v starts a coarse node
        i = n
        while i >= 2:
            if take[i]:
                starts[i - 1] = False
                i -= 2
            else:
                i -= 1
        to_coarse = np.cumsum(starts) - 1
        nc = int(to_coarse[-1]) + 1
        if nc > (1 - MIN_SHRINK) * n:
            return None
        cp = np.full(nc, -1, dtype=np.int64)
        pinned = pin >= 0
        cp[to_coarse[pinned]] = pin[pinned]
        lv = _Level(np.bincount(to_coarse, weights=w, minlength=nc),
                    np.bincount(to_coarse, weights=mfix, minlength=nc),
                    np.bincount(to_coarse, weights=mact, minlength=nc), cp,
                    to_coarse[self.src], self.net_of, to_coarse[self.rd], self.net_w)
        return lv, to_coarse

    def cut_parts(self, part: np.ndarray) -> tuple[np.ndarray, float]:
        """Nodes on cut nets, and the cut weight (connectivity - 1), of a partition."""
        if not len(self.src):
            return np.zeros(0, dtype=np.int64), 0.0
        pm = part[self.mem]
        starts = self.mem_ptr[:-1]
        lo = np.minimum.reduceat(pm, starts)
        hi = np.maximum.reduceat(pm, starts)
        cut_nets = lo != hi
        k = int(part.max()) + 1
        distinct = _sorted_unique(self.mem_net * k + pm)
        lam = np.bincount(distinct // k, minlength=len(self.src))
        cut = float(np.dot(self.net_w, lam - 1))
        mark = np.zeros(self.n, dtype=bool)
        mark[self.mem[cut_nets[self.mem_net]]] = True
        return np.flatnonzero(mark), cut


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    if not len(a):
        return a
    a = np.sort(a)
    return a[np.concatenate([[True], a[1:] != a[:-1]])]


class _Rows:
    """Rows of a CSR matrix as Python lists, sliced on demand: ``rows[v]``."""

    __slots__ = ("flat", "ptr")

    def __init__(self, flat: np.ndarray, counts: np.ndarray) -> None:
        self.flat = flat.tolist()
        self.ptr = np.concatenate([[0], np.cumsum(counts)]).tolist()

    def __getitem__(self, v: int) -> list[int]:
        return self.flat[self.ptr[v]:self.ptr[v + 1]]


# ------------------------------------------------------------------------------------------
# partition state and FM refinement


class _State:
    """A k-way partition of a level with part loads and per-net part counts."""

    def __init__(self, lv: _Level, part: Sequence[int], k: int,
                 bounds: tuple[list[float], list[float]], capm: list[float],
                 flight: list[int]) -> None:
        self.lv, self.k = lv, k
        self.part = list(part)
        self.floor, self.capw = bounds
        self.capm, self.flight = capm, flight
        part_np = np.asarray(self.part, dtype=np.int64)
        self.W = np.bincount(part_np, weights=lv.w, minlength=k).tolist()
        fl = np.asarray(flight, dtype=float)
        self.Mem = np.bincount(part_np, weights=lv.mfix + lv.mact * fl[part_np],
                               minlength=k).tolist()
        e_count = len(lv.src)
        cnt = np.zeros((e_count, k), dtype=np.int64)
        if e_count:
            np.add.at(cnt, (lv.mem_net, part_np[lv.mem]), 1)
        self.cnt = cnt.ravel().tolist()  # [e * k + q]: readers/producer of net e in part q
        self.wsum = sum(x for x in self.capw if x < math.inf) or sum(lv.w_list) or 1.0

    def cut(self) -> float:
        return self.lv.cut_parts(np.asarray(self.part, dtype=np.int64))[1]

    def overload(self) -> float:
        """Compute outside the bounds (relative), plus memory over capacity (weighted
        heavily)."""
        return sum(self._part_over(p, 0.0, 0.0) for p in range(self.k))

    def _part_over(self, p: int, dw: float, dm: float) -> float:
        w = self.W[p] + dw
        return ((max(0.0, w - self.capw[p]) + max(0.0, self.floor[p] - w)) / self.wsum
                + 1e3 * max(0.0, self.Mem[p] + dm - self.capm[p]) / max(self.capm[p], 1.0))

    def best_move(self, v: int) -> tuple[float, float, int] | None:
        """(priority, cut gain, destination) of v's best legal move, or None."""
        lv, part = self.lv, self.part
        if lv.pin_list[v] >= 0:
            return None
        p = part[v]
        lo = max((part[u] for u in lv.preds[v]), default=0)
        hi = min((part[u] for u in lv.succs[v]), default=self.k - 1)
        if lo == hi == p or lo > hi:
            return None
        wv = lv.w_list[v]
        if wv > 0.0 and self.W[p] - wv < self.floor[p]:
            return None  # its part would fall below its share's floor
        mf, ma = lv.mfix_list[v], lv.mact_list[v]
        out_p = -(mf + ma * self.flight[p])
        over_p = self._part_over(p, 0.0, 0.0) - self._part_over(p, -wv, out_p)
        base = 0.0
        total = 0.0
        nets = lv.node_nets[v]
        net_w, cnt, k = lv.net_w_list, self.cnt, self.k
        for e in nets:
            we = net_w[e]
            total += we
            if cnt[e * k + p] == 1:
                base += we
        best = None
        for q in range(lo, hi + 1):
            if q == p:
                continue
            dm = mf + ma * self.flight[q]
            if wv > 0.0 and self.W[q] + wv > self.capw[q]:
                continue  # no room for its compute there
            if dm > 0 and self.Mem[q] + dm > self.capm[q]:
                continue  # no room for its memory there
            conn = 0.0
            for e in nets:
                if cnt[e * k + q]:
                    conn += net_w[e]
            gain = base - (total - conn)
            prio = gain + 1e12 * (over_p - (self._part_over(q, wv, dm)
                                             - self._part_over(q, 0.0, 0.0)))
            if best is None or prio > best[0] + 1e-15:
                best = (prio, gain, q)
        return best

    def move(self, v: int, q: int) -> None:
        lv = self.lv
        p = self.part[v]
        self.part[v] = q
        wv, mf, ma = lv.w_list[v], lv.mfix_list[v], lv.mact_list[v]
        self.W[p] -= wv
        self.W[q] += wv
        self.Mem[p] -= mf + ma * self.flight[p]
        self.Mem[q] += mf + ma * self.flight[q]
        cnt, k = self.cnt, self.k
        for e in lv.node_nets[v]:
            cnt[e * k + p] -= 1
            cnt[e * k + q] += 1

    def fm_pass(self) -> bool:
        """One FM pass; True when it improved (cut, or overload)."""
        lv, part = self.lv, self.part
        boundary, _ = lv.cut_parts(np.asarray(part, dtype=np.int64))
        heap: list[tuple[float, int, int]] = []
        for v in boundary.tolist():
            mv = self.best_move(v)
            if mv is not None:
                heap.append((-mv[0], v, mv[2]))
        heapq.heapify(heap)
        locked = bytearray(lv.n)
        log: list[tuple[int, int]] = []
        cum = 0.0
        start_over = over = self.overload()
        best = (over, 0.0, 0)  # (overload, -cut gain, moves kept)
        patience = FM_PATIENCE + len(boundary) // 100
        bad = 0
        while heap and bad < patience:
            negprio, v, _ = heapq.heappop(heap)
            if locked[v]:
                continue
            mv = self.best_move(v)
            if mv is None:
                continue
            if mv[0] < -negprio - 1e-12 * (1.0 + abs(negprio)):
                heapq.heappush(heap, (-mv[0], v, mv[2]))  # stale: it got worse, queue again
                continue
            _, gain, q = mv
            log.append((v, part[v]))
            self.move(v, q)
            locked[v] = 1
            cum += gain
            over = self.overload()
            if over < best[0] - 1e-12 or (over <= best[0] + 1e-12
                                          and cum > -best[1] + 1e-12 * (1.0 + abs(cum))):
                best = (over, -cum, len(log))
                bad = 0
            else:
                bad += 1
            touched: set[int] = set(lv.preds[v]) | set(lv.succs[v])
            for e in lv.node_nets[v]:
                mem = lv.members[e]
                if len(mem) <= WIDE_NET:
                    touched.update(mem)
            for u in sorted(touched):
                if not locked[u]:
                    mu = self.best_move(u)
                    if mu is not None:
                        heapq.heappush(heap, (-mu[0], u, mu[2]))
        for v, p in reversed(log[best[2]:]):
            self.move(v, p)
        return best[2] > 0 and (best[1] < -1e-15 or best[0] < start_over - 1e-12)

    def refine(self) -> None:
        for _ in range(FM_PASSES):
            if not self.fm_pass():
                break


# ------------------------------------------------------------------------------------------
# initial partition: k intervals of the order, by dynamic programming


def _interval_partition(lv: _Level, k: int, bounds: tuple[list[float], list[float]],
                        capm: list[float], flight: list[int], use_pins: bool
                        ) -> list[int] | None:
    """Cut nodes 0..n-1 into k intervals within the compute bounds (floor, cap) and memory,
    crossing the least net weight; None when no cut fits. Dynamic programming over parts
    with a sliding-window minimum: O(k n)."""
    n = lv.n
    pw = np.concatenate([[0.0], np.cumsum(lv.w)]).tolist()
    pf = np.concatenate([[0.0], np.cumsum(lv.mfix)]).tolist()
    pa = np.concatenate([[0.0], np.cumsum(lv.mact)]).tolist()
    # cross[c]: weight of nets with the producer before c and a reader at or after c
    diff = np.zeros(n + 2)
    if len(lv.src):
        last = np.maximum.reduceat(lv.mem, lv.mem_ptr[:-1])
        np.add.at(diff, lv.src + 1, lv.net_w)
        np.add.at(diff, last + 1, -lv.net_w)
    cross = np.cumsum(diff)[:n + 1].tolist()
    # pins: part j may not end after the first node pinned later, nor start before the last
    # node pinned earlier
    first_after = [n] * k
    last_before = [0] * k
    if use_pins:
        for v in np.flatnonzero(lv.pin >= 0).tolist():
            q = lv.pin_list[v]
            for j in range(q):
                first_after[j] = min(first_after[j], v)
            for j in range(q + 1, k):
                last_before[j] = max(last_before[j], v + 1)
    inf = math.inf
    floor, capw = bounds
    # f[c]: the least crossing weight of parts 0..j-1 covering nodes 0..c-1
    f = [inf] * (n + 1)
    f[0] = 0.0
    back: list[list[int]] = []
    for j in range(k):
        g = [inf] * (n + 1)
        arg = [-1] * (n + 1)
        dq: deque[int] = deque()  # candidate starts c, f[c] increasing
        lo = nxt = last_before[j]
        fw = floor[j] * (1 - 1e-12)
        cw, cm, fl = capw[j], capm[j], flight[j]
        last = j == k - 1
        for c2 in range(n + 1):
            while nxt <= c2 and pw[c2] - pw[nxt] >= fw:  # [nxt, c2) reaches the floor
                if f[nxt] < inf:
                    while dq and f[dq[-1]] >= f[nxt]:
                        dq.pop()
                    dq.append(nxt)
                nxt += 1
            while lo < c2 and (pw[c2] - pw[lo] > cw
                               or pf[c2] - pf[lo] + (pa[c2] - pa[lo]) * fl > cm):
                lo += 1
            while dq and dq[0] < lo:
                dq.popleft()
            if not dq or c2 > first_after[j] or (last and c2 != n):
                continue
            g[c2] = f[dq[0]] + (cross[c2] if c2 < n else 0.0)
            arg[c2] = dq[0]
        back.append(arg)
        f = g
    if f[n] == inf:
        return None
    part = [0] * n
    c2 = n
    for j in range(k - 1, -1, -1):
        c = back[j][c2]
        for v in range(c, c2):
            part[v] = j
        c2 = c
    return part


def _pin_bounds(lv: _Level, k: int) -> tuple[list[int], list[int]]:
    """Per node, the parts its pinned ancestors and descendants allow: [lo, hi].

    Consistent (lo <= hi everywhere) when the part order follows the pins, as
    :func:`_device_order` makes it. Merging only nodes with equal bounds keeps coarse levels
    consistent: along every coarse edge both bounds still do not decrease.
    """
    lo = [0] * lv.n
    hi = [k - 1] * lv.n
    pin = lv.pin_list
    for v in range(lv.n):
        b = max((lo[u] for u in lv.preds[v]), default=0)
        lo[v] = pin[v] if pin[v] >= 0 else b
    for v in range(lv.n - 1, -1, -1):
        b = min((hi[u] for u in lv.succs[v]), default=k - 1)
        hi[v] = pin[v] if pin[v] >= 0 else b
    return lo, hi


def _clamp(lv: _Level, part: list[int], k: int) -> list[int]:
    """Move nodes into the range their pins allow; keeps edges going forward (monotone)."""
    if not (lv.pin >= 0).any():
        return list(part)
    lo, hi = _pin_bounds(lv, k)
    return [min(max(p, lo[v]), hi[v]) for v, p in enumerate(part)]


# ------------------------------------------------------------------------------------------
# from a graph to the finest level


def _hosts(graph: OpGraph) -> list[int]:
    """The op each node lives with: itself for ops; for parameters, buffers and inputs the
    op that reads them first (the first op overall when none does)."""
    nodes, succs = graph.nodes, graph.succs
    first_op = next((i for i, nd in enumerate(nodes) if nd.kind == "op"), 0)
    host = list(range(len(nodes)))
    for i, nd in enumerate(nodes):
        if nd.kind == "op":
            continue
        o, steps = i, 0
        while nodes[o].kind != "op" and succs[o] and steps < 64:
            o, steps = succs[o][0], steps + 1
        host[i] = o if nodes[o].kind == "op" else first_op
    return host


def _effective_pins(graph: OpGraph, host: list[int], pins: Mapping[str, str]
                    ) -> tuple[dict[int, str], set[int]]:
    """Pins by node index, with every op that hosts a pinned parameter pinned with it (the
    first such parameter decides when the op itself is not pinned), and the set of pinned
    non-op nodes that cannot join their host (pinned elsewhere) and stand alone."""
    eff: dict[int, str] = {}
    for nm, dev in pins.items():
        i = graph.index[nm]
        if graph.nodes[i].kind == "op":
            eff[i] = dev
    alone: set[int] = set()
    for i in sorted(graph.index[nm] for nm in pins):
        if graph.nodes[i].kind == "op":
            continue
        dev = pins[graph.nodes[i].name]
        eff[i] = dev
        h = host[i]
        if h == i:
            alone.add(i)
        elif h not in eff:
            eff[h] = dev
        elif eff[h] != dev:
            alone.add(i)
    return eff, alone


def _device_order(lv: _Level, ids: Sequence[str], names: Sequence[str]) -> list[str]:
    """Devices in part order. ``lv.pin`` holds device indices into ``ids``.

    Pinned devices come in an order their pins allow (a unit pinned to A that feeds, through
    any path, one pinned to B puts A before B), each near the share of compute before its
    first pinned unit; the other devices fill the remaining places in cluster order. Raises
    :class:`ExplorerError` when the pins force a cycle between devices. ``names`` name the
    units in messages.
    """
    k = len(ids)
    if not (lv.pin >= 0).any():
        return list(ids)
    pin = lv.pin_list
    anc = [0] * lv.n  # bitmask of the devices pinned upstream of each unit
    after: dict[int, set[int]] = {}
    witness: dict[tuple[int, int], int] = {}
    first: dict[int, int] = {}
    for v in range(lv.n):
        m = 0
        for u in lv.preds[v]:
            m |= anc[u] | (1 << pin[u] if pin[u] >= 0 else 0)
        anc[v] = m
        b = pin[v]
        if b < 0:
            continue
        first.setdefault(b, v)
        a = 0
        while m >> a:
            if m >> a & 1 and a != b:
                after.setdefault(a, set()).add(b)
                witness.setdefault((a, b), v)
            a += 1
    devs = sorted(first, key=lambda d: first[d])
    indeg = dict.fromkeys(devs, 0)
    for a in devs:
        for b in after.get(a, ()):
            indeg[b] += 1
    ready = [(first[d], d) for d in devs if indeg[d] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, a = heapq.heappop(ready)
        order.append(a)
        for b in sorted(after.get(a, ())):
            indeg[b] -= 1
            if indeg[b] == 0:
                heapq.heappush(ready, (first[b], b))
    if len(order) < len(devs):
        stuck = [d for d in devs if d not in set(order)]
        a = stuck[0]
        b = next(b for b in sorted(after.get(a, ())) if b in stuck)
        raise ExplorerError(
            f"the pins force a cycle between devices {', '.join(ids[d] for d in stuck)}: e.g. "
            f"{names[witness[(a, b)]]!r} (pinned to {ids[b]}) depends on work pinned to "
            f"{ids[a]}, and work pinned to {ids[b]} feeds work pinned to {ids[a]}; stages in "
            "a cycle could deadlock, and min-comm keeps the stage graph acyclic. Change the "
            "pins, or use an algorithm that places ops freely")
    before = np.concatenate([[0.0], np.cumsum(lv.w)]).tolist()
    total = before[-1] or 1.0
    slots: list[int] = []
    for j, a in enumerate(order):
        want = int(k * before[first[a]] / total)
        lo = slots[-1] + 1 if slots else 0
        hi = k - (len(order) - j)
        slots.append(min(max(want, lo), hi))
    out: list[str | None] = [None] * k
    for a, slot in zip(order, slots, strict=True):
        out[slot] = ids[a]
    placed = set(order)
    rest = iter(d for j, d in enumerate(ids) if j not in placed)
    return [d if d is not None else next(rest) for d in out]


def _finest_level(graph: OpGraph, host: list[int], pin_part: dict[int, int],
                  alone: set[int], w_node: list[float], net_w: list[float],
                  mfix_node: list[int], mact_node: list[int]
                  ) -> tuple[_Level, list[int], list[str]]:
    """Units (an op with the parameters, buffers and inputs it reads first) in topological
    order, and the unit of every node. A pinned node that cannot join its op stands alone,
    just before it."""
    nodes, succs = graph.nodes, graph.succs
    n = len(nodes)
    keys = {i: (h, 0, i) if i in alone else (h, 1, h) for i, h in enumerate(host)}
    order = sorted(set(keys.values()))
    unit_id = {key: u for u, key in enumerate(order)}
    unit_of = np.array([unit_id[keys[i]] for i in range(n)], dtype=np.int64)
    nu = len(order)
    pin = np.full(nu, -1, dtype=np.int64)
    for u, key in enumerate(order):
        pin[u] = pin_part.get(key[2], -1)
    producers = [p for p, nd in enumerate(nodes) if nd.kind != "input" and succs[p]]
    # inputs are not sent (every rank loads its own batch): no dependency between parts
    src = unit_of[np.asarray(producers, dtype=np.int64)] if producers else np.zeros(0, int)
    net_of = np.repeat(np.arange(len(producers)), [len(succs[p]) for p in producers])
    readers = np.fromiter((c for p in producers for c in succs[p]), dtype=np.int64,
                          count=len(net_of))
    lv = _Level(np.bincount(unit_of, weights=np.asarray(w_node), minlength=nu),
                np.bincount(unit_of, weights=np.asarray(mfix_node, dtype=float), minlength=nu),
                np.bincount(unit_of, weights=np.asarray(mact_node, dtype=float), minlength=nu),
                pin, src, net_of, unit_of[readers],
                np.asarray([net_w[p] for p in producers], dtype=float))
    return lv, unit_of.tolist(), [nodes[key[2]].name for key in order]


# ------------------------------------------------------------------------------------------
# the algorithm


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
    n_all = len(cluster)
    k = n_all if k is None else k
    if not 1 <= k <= n_all:
        raise ExplorerError(f"k={k} devices asked for, but the cluster has {n_all}")
    if tolerance < 0:
        raise ExplorerError(f"tolerance must be >= 0, not {tolerance}")
    ids = tuple(cluster.ids[:k])
    pins = dict(pins or {})
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
    host = _hosts(graph)
    eff, alone = _effective_pins(graph, host, pins)
    net_w = net_weights_s(graph, costs, ids, micro_batches)
    frac = 1.0 / micro_batches
    mfix_node = node_memory_bytes(graph, optimizer, 1, 0.0)
    full = node_memory_bytes(graph, optimizer, 1, frac)
    mact_node = [a - b for a, b in zip(full, mfix_node, strict=True)]
    flight = [micro_batches if schedule == "gpipe" else min(k - p, micro_batches)
              for p in range(k)]
    finest, unit_of, unit_names = _finest_level(
        graph, host, {i: ids.index(dev) for i, dev in eff.items()}, alone, w_node, net_w,
        mfix_node, mact_node)
    devices = _device_order(finest, ids, unit_names)
    part_of_dev = np.array([devices.index(d) for d in ids] + [-1], dtype=np.int64)
    finest.set_pins(part_of_dev[finest.pin])  # device index -> part (-1 stays -1)
    # fair shares by device speed (total compute on each device type)
    speed = {key: 1.0 / max(sum(ws), 1e-300) for key, ws in by_type.items()}
    inv = [speed[cluster.device(d).type_key] for d in devices]
    total_w = sum(w_node)
    share = [total_w * x / sum(inv) for x in inv]
    capm = [cluster.device(d).memory_bytes * headroom for d in devices]

    # 1. coarsen
    levels = [finest]
    maps: list[np.ndarray] = []
    wcap = max(tolerance, 0.02) * min(share) if total_w > 0 else math.inf
    mcap = 0.25 * min(capm)
    while levels[-1].n > COARSEST_PER_PART * k:
        res = levels[-1].coarsen(wcap, mcap, max(flight), k)
        if res is None:
            break
        levels.append(res[0])
        maps.append(res[1])

    # 2. initial partitions: intervals of the coarsest order; and even-layers' stages
    def bounds(tol: float) -> tuple[list[float], list[float]]:
        return ([x * max(0.0, 1 - tol) for x in share], [x * (1 + tol) for x in share])

    def split(lv_i: int, tol: float) -> list[int] | None:
        lv, b = levels[lv_i], bounds(tol)
        part = (_interval_partition(lv, k, b, capm, flight, True)
                or _interval_partition(lv, k, b, capm, flight, False))
        return None if part is None else _clamp(lv, part, k)

    strict = bounds(tolerance)
    starts = []
    top = len(levels) - 1
    # the loosest useful tolerance: any part may hold everything
    loose = total_w / max(min(share), 1e-300) if total_w > 0 else 1.0
    found = split(top, tolerance)
    used = tolerance
    if found is None and split(top, loose) is not None:
        # the smallest tolerance the coarsest graph allows, so relaxed splits stay balanced
        lo_t, hi_t = tolerance, loose
        for _ in range(14):
            mid = (lo_t + hi_t) / 2
            if split(top, mid) is None:
                lo_t = mid
            else:
                hi_t = mid
        found, used = split(top, hi_t), hi_t
    if found is not None:
        starts.append(("multilevel", top, found, bounds(used)))
    else:  # too coarse for the memory limits: split the finest level
        found = split(0, loose)
        if found is not None:
            starts.append(("multilevel", 0, found, bounds(loose)))
    even = _clamp(finest, _even_layers_units(graph, finest, unit_of, k), k)
    even_w = np.bincount(np.asarray(even, dtype=np.int64), weights=finest.w,
                         minlength=k).tolist()
    even_ok = all(lo <= x <= hi for x, lo, hi in zip(even_w, *strict, strict=True))
    starts.append(("even-layers", 0, even, strict if even_ok or not starts else starts[0][3]))

    # 3. refine while uncoarsening
    results = []
    for name, lv_i, part, bounds_s in starts:
        for j in range(lv_i, -1, -1):
            st = _State(levels[j], part, k, bounds_s, capm, flight)
            st.refine()
            part = st.part
            if j > 0:
                part = np.asarray(part, dtype=np.int64)[maps[j - 1]].tolist()
        mem_over = any(st.Mem[p] > capm[p] for p in range(k))
        unbalanced = sum(max(0.0, st.W[p] - strict[1][p], strict[0][p] - st.W[p])
                         for p in range(k))
        results.append(((mem_over, unbalanced > 1e-12 * (total_w or 1), unbalanced,
                         st.cut()), name, st))
    results.sort(key=lambda r: r[0])
    (mem_over, _, _, cut), name, st = results[0]
    if mem_over:
        p = max(range(k), key=lambda q: st.Mem[q] - capm[q])
        raise memory_error(
            "min-comm", f"part {p} of {k} (its params, optimizer state and activations of "
            f"{flight[p]} micro-batch(es) in flight)", devices[p], st.Mem[p], capm[p],
            "use more or larger devices, more micro-batches, or a smaller batch")
    part_node = tuple(st.part[u] for u in unit_of)
    floor, limit = strict
    return MinCommResult(
        part=part_node, devices=tuple(devices), cut_s=cut, compute_s=tuple(st.W),
        floor_s=tuple(floor), limit_s=tuple(limit), memory_bytes=tuple(st.Mem),
        capacity_bytes=tuple(capm),
        balanced=all(floor[p] * (1 - 1e-9) <= st.W[p] <= limit[p] * (1 + 1e-9)
                     for p in range(k)),
        levels=len(levels), tolerance=tolerance, start=name)


def _even_layers_units(graph: OpGraph, finest: _Level, unit_of: list[int], k: int) -> list[int]:
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


@register("min-comm")
def min_comm(graph: OpGraph, cluster: Cluster, costs: CostModel,
             pins: Mapping[str, str] | None = None, k: int | None = None,
             tolerance: float = 0.1, micro_batches: int | None = None,
             schedule: str = "1f1b", optimizer: str = "adam",
             compare_baselines: bool = True) -> Plan:
    """Balanced parts with the least communication and an acyclic stage graph (multilevel).

    Follows compiler-driven model parallelism (arXiv 1906.08168): node weights are compute
    seconds, edge weights transfer seconds; ``k`` parts balance compute within ``tolerance``
    while cutting the least transfer time, and parts stay in an order every edge respects, so
    the stage graph is acyclic. Coarsening by heavy-edge matching along a topological order,
    an interval split of the coarsest graph by dynamic programming, and Fiduccia-Mattheyses
    refinement while uncoarsening (moves that would create a cycle are never made); the
    even-layers split, refined the same way, competes as a second start. See
    :func:`min_comm_parts`.

    Parameters
    ----------
    k : int, optional
        Number of devices (parts), the cluster's first ``k`` (default: all).
    tolerance : float
        Allowed compute imbalance: every part holds between ``(1 - tolerance)`` and
        ``(1 + tolerance)`` times its fair share (its device's speed over the total).
        Default 0.1. Relaxed step by step, with a note, when no split meets it (an op
        heavier than a share, fewer ops than devices, pins, memory).
    micro_batches : int, optional
        Micro-batches per step, so the parts run as a pipeline. Default: 4 when the batch
        divides into 4, else 1; on graphs small enough to simulate (see
        ``compare_baselines``) parts for 1 micro-batch are tried as well (per-op overheads
        can make micro-batches cost more than the pipeline bubble saves), the faster kept.
    schedule : {"1f1b", "gpipe"}
        Pipeline schedule; sets the activations each part keeps in flight.
    optimizer : str
        Optimizer whose state counts towards memory (default ``"adam"``).
    compare_baselines : bool
        On graphs up to 5,000 nodes, simulate the plan against ``single`` and
        ``data-parallel`` and return the fastest that fits (a note says when it is a
        baseline). Default True.

    Returns
    -------
    Plan
        One single-device stage per non-empty part, in execution order;
        ``options["cut_s"]`` is the communication per step, ``options["balanced"]`` whether
        the tolerance was met.

    Raises
    ------
    MemoryExceededError
        When no split fits the devices' memory, naming the device and the excess.
    ExplorerError
        When pins force a cycle between devices.

    Pins (node name -> device id) are honoured: a pinned node stays on its device; the order
    of parts follows the pins. Pins that force a cycle between two devices raise
    :class:`ExplorerError`. Runs in seconds on 100,000-node graphs.
    """
    if schedule not in SCHEDULES:
        raise ExplorerError(f"unknown schedule {schedule!r}; choose one of "
                            f"{', '.join(SCHEDULES)}")
    if micro_batches is not None and int(micro_batches) < 1:
        raise ExplorerError(f"micro_batches must be >= 1, not {micro_batches}")
    m_default = default_micro_batches(graph) if micro_batches is None else int(micro_batches)
    small = compare_baselines and len(graph) <= COMPARE_MAX_NODES
    m_choices = (m_default, 1) if micro_batches is None and small and m_default > 1 \
        else (m_default,)
    pins = dict(pins or {})
    found: list[tuple[Plan, Prediction | None]] = []
    failure = ""
    for m in m_choices:
        for headroom in HEADROOMS:
            try:
                res = min_comm_parts(graph, cluster, costs, k, tolerance, pins, m, schedule,
                                     optimizer, headroom)
            except MemoryExceededError as exc:
                failure = failure or str(exc)
                break
            plan = _plan(graph, res, m, schedule, optimizer, pins, tolerance)
            pred = simulate_if_small(graph, plan, costs) if compare_baselines else None
            if pred is None or pred.fits:
                found.append((plan, pred))
                break
            failure = failure or (f"min-comm: its split does not fit the simulator's memory "
                                  f"accounting ({pred.memory_report()})")
    if not compare_baselines:
        if not found:
            raise MemoryExceededError(failure)
        return found[0][0]
    plan, pred = min(found, key=lambda x: x[1].step_s if x[1] is not None else 0.0,
                     default=(None, None))
    ids = cluster.ids[:k] if k is not None else cluster.ids
    return best_of_baselines(graph, cluster, costs, plan, pins, optimizer, "min-comm", ids,
                             failure, pred)


def _plan(graph: OpGraph, res: MinCommResult, m: int, schedule: str, optimizer: str,
          pins: Mapping[str, str], tolerance: float) -> Plan:
    used = sorted(set(res.part))
    stage_of = {p: s for s, p in enumerate(used)}
    notes = [f"{len(used)} parts, communication {res.cut_s:.4g} s per step "
             f"(start: {res.start}, {res.levels} levels)"]
    if not res.balanced:
        ratio = [w / (lim / (1 + tolerance)) if lim > 0 else 1.0
                 for w, lim in zip(res.compute_s, res.limit_s, strict=True)]
        worst = max(range(len(ratio)), key=lambda p: abs(ratio[p] - 1))
        notes.append(f"no split within the {tolerance:.0%} balance tolerance was found; part "
                     f"{worst} holds {ratio[worst]:.2f} x its share")
    return Plan.from_assignment(
        graph, [(res.devices[p],) for p in used],
        {i: stage_of[p] for i, p in enumerate(res.part)}, micro_batches=m, schedule=schedule,
        optimizer=optimizer, algorithm="min-comm",
        options={"k": len(res.devices), "tolerance": tolerance, "micro_batches": m,
                 "schedule": schedule, "cut_s": res.cut_s, "balanced": res.balanced},
        pinned=frozenset(pins), notes=tuple(notes))


__all__ = ["MinCommResult", "cut_seconds", "min_comm", "min_comm_parts", "net_weights_s",
           "node_weights_s"]
