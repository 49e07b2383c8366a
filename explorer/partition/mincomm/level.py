"""min-comm's multilevel graph: units in topological order with nets, coarsened by matching."""

from __future__ import annotations

import numpy as np

#: stop coarsening when a round shrinks the graph by less than this fraction
MIN_SHRINK = 0.1


class Level:
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
        key = sorted_unique(net_of[keep] * n + rd[keep])
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
        ekey = sorted_unique(self.src[self.net_of] * n + self.rd)
        es, ed = ekey // n, ekey % n
        order = np.argsort(mem, kind="stable")
        self.node_nets = Rows(self.mem_net[order], np.bincount(mem, minlength=n))
        self.succs = Rows(ed, np.bincount(es, minlength=n))
        porder = np.argsort(ed * n + es, kind="stable")
        self.preds = Rows(es[porder], np.bincount(ed, minlength=n))
        self.members = Rows(mem, mcount)
        self.net_w_list = self.net_w.tolist()
        self.w_list = w.tolist()
        self.mfix_list, self.mact_list = mfix.tolist(), mact.tolist()
        self.set_pins(pin)

    def set_pins(self, pin: np.ndarray) -> None:
        """Pinned part of every node (-1: free)."""
        self.pin = pin
        self.pin_list = pin.tolist()

    def coarsen(self, wcap: float, mcap: float, in_flight: int, k: int
                ) -> tuple[Level, np.ndarray] | None:
        """Merge pairs of consecutive nodes (heavy-edge matching on the order), or None when
        that would shrink the graph too little.

        With pins, only nodes with the same pin bounds (the parts their pinned ancestors and
        descendants allow) merge: merging joins paths, and this way no coarse node is pulled
        between pins in opposite directions (see :func:`pin_bounds`).
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
            lo, hi = (np.asarray(b) for b in pin_bounds(self, k))
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
        lv = Level(np.bincount(to_coarse, weights=w, minlength=nc),
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
        distinct = sorted_unique(self.mem_net * k + pm)
        lam = np.bincount(distinct // k, minlength=len(self.src))
        cut = float(np.dot(self.net_w, lam - 1))
        mark = np.zeros(self.n, dtype=bool)
        mark[self.mem[cut_nets[self.mem_net]]] = True
        return np.flatnonzero(mark), cut


def sorted_unique(a: np.ndarray) -> np.ndarray:
    if not len(a):
        return a
    a = np.sort(a)
    return a[np.concatenate([[True], a[1:] != a[:-1]])]


class Rows:
    """Rows of a CSR matrix as Python lists, sliced on demand: ``rows[v]``."""

    __slots__ = ("flat", "ptr")

    def __init__(self, flat: np.ndarray, counts: np.ndarray) -> None:
        self.flat = flat.tolist()
        self.ptr = np.concatenate([[0], np.cumsum(counts)]).tolist()

    def __getitem__(self, v: int) -> list[int]:
        return self.flat[self.ptr[v]:self.ptr[v + 1]]


def pin_bounds(lv: Level, k: int) -> tuple[list[int], list[int]]:
    """Per node, the parts its pinned ancestors and descendants allow: [lo, hi].

    Consistent (lo <= hi everywhere) when the part order follows the pins, as
    :func:`device_order` makes it. Merging only nodes with equal bounds keeps coarse levels
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


__all__ = ["Level", "Rows", "pin_bounds", "sorted_unique"]
