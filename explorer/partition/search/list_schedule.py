"""List scheduling on the op-level problem: levels, a step-time estimate and memory repair.

Shared by ParDNN and Baechi's placers (:mod:`explorer.partition.search.op_problem`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from explorer.partition.search.op_problem import OpProblem


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
    n, K = p.n, p.k
    free = [0.0] * K
    links = (d_of, typ, p.lat_s.tolist(), p.s_per_byte.tolist(), free)
    fin = _list_pass(range(n), pv, pe, p.fwd_bytes.tolist(), wf, None, links, True)
    _list_pass(range(n - 1, -1, -1), sv, se, p.bwd_bytes.tolist(), wb, fin, links, False)
    pbytes = np.bincount(dev, weights=p.param_bytes, minlength=K)
    ptens = np.bincount(dev, weights=p.param_tensors, minlength=K)
    opt = pbytes * p.opt_s_per_byte + ptens * p.opt_s_per_tensor
    return float(max((free[d] + (opt[d] if ptens[d] else 0.0) for d in range(K)), default=0.0))


def _list_pass(units: Sequence[int], nbr_v: list[list[int]], nbr_e: list[list[int]],
               nbytes: list[int], w: list[list[float]], start: list[float] | None,
               links: tuple, keep_empty: bool) -> list[float]:
    """One pass of :func:`schedule_s` over ``units`` in order: each unit starts when its device
    is free (``free``, updated) and what it waits for has arrived (``nbr_v`` finished, plus
    the transfer of ``nbytes`` from another device), not before ``start[u]``. Edges without
    bytes are waited for only with ``keep_empty``. Returns each unit's finish time."""
    d_of, typ, lat, spb, free = links
    fin = [0.0] * len(d_of)
    for u in units:
        d = d_of[u]
        r = start[u] if start is not None else 0.0
        for v, e in zip(nbr_v[u], nbr_e[u], strict=True):
            b = nbytes[e]
            if b <= 0 and not keep_empty:
                continue
            t = fin[v]
            dv = d_of[v]
            if dv != d and b > 0:
                t += lat[dv][d] + b * spb[dv][d]
            if t > r:
                r = t
        s = free[d] if free[d] > r else r
        fin[u] = s + w[typ[d]][u]
        free[d] = fin[u]
    return fin


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
            reason = (f"no other device has room for any of its {movable} movable nodes"
                      if movable else "everything on it is pinned there")
            raise p.over_memory(algorithm, d, int(used[d]), f"its part of {p.graph_name}",
                                reason)


__all__ = ["bottom_levels", "repair_memory", "schedule_s", "top_levels"]
