"""min-comm's partitions of a level: the interval split by DP and Fiduccia-Mattheyses refinement.

Parts stay in execution order: a move is legal only if every edge still goes from a part to
the same or a later part, so no move creates a cycle between parts.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from explorer.partition.mincomm.level import Level, pin_bounds

#: FM passes per level, and how many moves without improvement end a pass
FM_PASSES = 4
FM_PATIENCE = 64
#: nets with more readers than this do not re-queue their nodes after a move (gains are
#: recomputed when a node is taken from the queue anyway)
WIDE_NET = 64


class State:
    """A k-way partition of a level with part loads and per-net part counts."""

    def __init__(self, lv: Level, part: Sequence[int], k: int,
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


def interval_partition(lv: Level, k: int, bounds: tuple[list[float], list[float]],
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


def clamp(lv: Level, part: list[int], k: int) -> list[int]:
    """Move nodes into the range their pins allow; keeps edges going forward (monotone)."""
    if not (lv.pin >= 0).any():
        return list(part)
    lo, hi = pin_bounds(lv, k)
    return [min(max(p, lo[v]), hi[v]) for v, p in enumerate(part)]


__all__ = ["State", "clamp", "interval_partition"]
