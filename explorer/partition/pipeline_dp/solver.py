"""The stage DP: the best split of a :class:`StageCostTable`'s layers into contiguous stages.

Alpa-style dynamic programming over (stages, layers, device positions), with dense tables of
every stage's costs built once per device range (:class:`StageTables`, :func:`stage_matrices`).
"""

from __future__ import annotations

import numpy as np

from explorer.core.errors import ExplorerError
from explorer.partition.pipeline_dp.table import (
    Stage,
    StageCostTable,
    StageSolution,
    replicated_bytes,
)


def _rect_table(size: int, rows0, rows1, cols0, cols1, weights) -> np.ndarray:
    """Sum of ``weights`` over axis-aligned rectangles (inclusive bounds), as a dense table."""
    diff = np.zeros((size + 1, size + 1))
    if len(weights):
        r0, r1 = np.asarray(rows0), np.asarray(rows1) + 1
        c0, c1 = np.asarray(cols0), np.asarray(cols1) + 1
        w = np.asarray(weights, dtype=float)
        np.add.at(diff, (r0, c0), w)
        np.add.at(diff, (r1, c0), -w)
        np.add.at(diff, (r0, c1), -w)
        np.add.at(diff, (r1, c1), w)
    return diff.cumsum(0).cumsum(1)[:size, :size]


class StageTables:
    """Dense (L+1) x (L+1) tables of the crossing terms, indexed [j0, j1], and prefix sums."""

    def __init__(self, t: StageCostTable) -> None:
        n = t.n_layers
        size = n + 1
        m = t.micro_batches
        pre = lambda a: np.concatenate([[0.0], np.cumsum(np.asarray(a, dtype=float))])  # noqa: E731
        self.fixed = [pre(row) for row in t.fixed_s]
        self.var = [pre(row) for row in t.var_s]
        self.opt = [pre(row) for row in t.optimizer_s]
        self.param = pre(t.param_bytes)
        self.act = pre(t.act_bytes)
        self.sharded = None if t.sharded_bytes is None else pre(t.sharded_bytes)
        self.working = None if t.working_bytes is None else pre(t.working_bytes)
        self.grad = pre(t.grad_bytes)
        # received by stage [j0, j1): nets from before j0 with a consumer in [j0, j1); for
        # j0 in (c_{i-1}, c_i] the first consumer at or after j0 is c_i, so any j1 > c_i counts
        rr0, rr1, rc0, rc1 = [], [], [], []
        w_cnt, w_b, w_act, w_par = [], [], [], []
        gr0, gr1, gc0, gc1, g_cnt, g_b = [], [], [], [], [], []
        for net in t.nets:
            times = m if net.per_micro_batch else 1
            prev = net.producer
            for c in net.consumers:
                rr0.append(prev + 1)
                rr1.append(c)
                rc0.append(c + 1)
                rc1.append(n)
                w_cnt.append(times)
                w_b.append(net.nbytes)
                w_act.append(net.nbytes if net.per_micro_batch else 0)
                w_par.append(0 if net.per_micro_batch else net.nbytes * (2 if net.grad else 1))
                prev = c
            if net.grad:  # sent back to stage [j0, j1) when j0 <= producer < j1 <= last consumer
                gr0.append(0)
                gr1.append(net.producer)
                gc0.append(net.producer + 1)
                gc1.append(net.consumers[-1])
                g_cnt.append(times)
                g_b.append(net.nbytes)
        self.recv_cnt = _rect_table(size, rr0, rr1, rc0, rc1, w_cnt)
        self.recv_b = _rect_table(size, rr0, rr1, rc0, rc1, w_b)
        self.recv_act = _rect_table(size, rr0, rr1, rc0, rc1, w_act)
        self.recv_par = _rect_table(size, rr0, rr1, rc0, rc1, w_par)
        self.grad_cnt = _rect_table(size, gr0, gr1, gc0, gc1, g_cnt)
        self.grad_b = _rect_table(size, gr0, gr1, gc0, gc1, g_b)
        self.empty = np.tril(np.ones((size, size), dtype=bool))  # j1 <= j0: no stage
        # pins
        keys = sorted(set().union(*(t.pins_of(j) for j in range(n)))) if t.layer_pins else []
        self.has_pins = bool(keys)
        if not self.has_pins:
            return
        if t.pins_by_position:
            lo = np.full(n, np.inf)
            hi = np.full(n, -np.inf)
            for j in range(n):
                if t.pins_of(j):
                    lo[j] = min(t.pins_of(j))
                    hi[j] = max(t.pins_of(j))
            self.pin_lo = np.full((size, size), np.inf)
            self.pin_hi = np.full((size, size), -np.inf)
            for j0 in range(n):
                self.pin_lo[j0, j0 + 1:] = np.minimum.accumulate(lo[j0:])
                self.pin_hi[j0, j0 + 1:] = np.maximum.accumulate(hi[j0:])
        else:
            span = {k: [n, -1] for k in keys}
            for j in range(n):
                for k in t.pins_of(j):
                    span[k][0] = min(span[k][0], j)
                    span[k][1] = max(span[k][1], j)
            cut_ok = np.ones(size, dtype=bool)  # a cut before layer c splits no pinned span
            before = np.zeros(size)  # labels whose layers all lie before c
            for a, b in span.values():
                cut_ok[a + 1:b + 1] = False
                before[b + 1:] += 1
            self.pin_ok = cut_ok[:, None] & cut_ok[None, :]
            self.pin_count = before[None, :] - before[:, None]

    def diff(self, prefix: np.ndarray) -> np.ndarray:
        return prefix[None, :] - prefix[:, None]

    def span(self, prefix: np.ndarray | None) -> np.ndarray | None:
        """:meth:`diff` of a table that may be missing (None)."""
        return None if prefix is None else self.diff(prefix)


def stage_matrices(t: StageCostTable, tb: StageTables, d: int, r: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Time, memory parts and the allowed mask of every stage [j0, j1) on positions d..d+r-1."""
    m = t.micro_batches
    types = sorted({t.device_type[p] for p in range(d, d + r)})
    comp = None
    for k in types:
        c = m * tb.diff(tb.fixed[k]) + tb.diff(tb.var[k]) / r + tb.diff(tb.opt[k])
        comp = c if comp is None else np.maximum(comp, c)
    time = comp
    if d > 0:
        time = time + t.link_latency_s[d - 1] * tb.recv_cnt + t.link_s_per_byte[d - 1] * (
            tb.recv_b / r)
    else:
        time = np.where(tb.recv_cnt > 0, np.inf, time)
    if d + r < t.n_devices:
        e = d + r - 1
        time = time + t.link_latency_s[e] * tb.grad_cnt + t.link_s_per_byte[e] * (tb.grad_b / r)
    else:
        time = np.where(tb.grad_cnt > 0, np.inf, time)
    if r > 1:
        gb = tb.diff(tb.grad)
        time = time + np.where(gb > 0, t.allreduce_latency_s[d, r]
                               + t.allreduce_s_per_byte[d, r] * gb, 0.0)
    allowed = ~tb.empty
    if tb.has_pins:
        if t.pins_by_position:
            allowed = allowed & (tb.pin_lo >= d) & (tb.pin_hi < d + r)
        else:
            allowed = allowed & tb.pin_ok & (tb.pin_count <= r)
    fixed_mem = replicated_bytes(tb.diff(tb.param), tb.span(tb.sharded), tb.span(tb.working),
                                 r) + tb.recv_par
    act_mem = tb.diff(tb.act) + tb.recv_act
    return time, fixed_mem, act_mem, allowed


def solve_stages(table: StageCostTable, objective: str = "time") -> StageSolution:
    """The split of ``table``'s layers into contiguous stages with the best score.

    Exact for the cost model of :class:`StageCostTable`: for every number of stages ``S`` it
    finds the smallest possible slowest-stage time, then picks the ``S`` with the smallest
    ``bottleneck x (M + S - 1) / M`` (fewer stages on ties). With ``objective="memory"`` it
    instead minimises the largest ``memory - capacity`` of any stage, ignoring memory limits
    (to say how far from fitting the best split is).

    Work and memory: about ``(L+1)^2 x R x (S + 8)`` table cells for ``L`` layers, ``R`` device
    ranges ``(d, r)`` (``D (D+1) / 2`` with replicas, ``D`` without) and ``S <= D`` stage
    counts, and ten ``(L+1)^2`` tables of float64. 1,000 layers on 8 devices take a few
    seconds.
    """
    if objective not in ("time", "memory"):
        raise ExplorerError(f"unknown objective {objective!r}; use 'time' or 'memory'")
    n, n_dev, m = table.n_layers, table.n_devices, table.micro_batches
    max_stages = min(n, n_dev)
    tb = StageTables(table)
    inf = np.inf
    # f[stages, layer, devices], Alpa-style: f[t, j, d] is the smallest slowest-stage time
    # for layers j..L-1 on device positions d..D-1 cut into exactly t stages. The first of
    # them has stage index S - t, so under 1F1B it keeps min(t, M) micro-batches in flight
    # whatever S is. f[0, L, d] = 0 (nothing left to place; devices may stay unused).
    f = np.full((max_stages + 1, n + 1, n_dev + 1), inf)
    f[0, n, :] = 0.0
    # choice_end[t, j, d], choice_r[t, j, d]: the first stage of that optimum is layers
    # j..choice_end-1 on choice_r devices
    choice_end = np.zeros((max_stages + 1, n + 1, n_dev + 1), dtype=np.int64)
    choice_r = np.zeros((max_stages + 1, n + 1, n_dev + 1), dtype=np.int64)
    rows = np.arange(n + 1)
    # a stage's cost depends on its position only through these; identical devices share
    cache: dict[tuple, dict[int, np.ndarray]] = {}
    for d in range(n_dev - 1, -1, -1):  # later positions first: f[t, :, d] needs f[t-1, :, >d]
        for r in table.replicas:
            if d + r > n_dev:
                continue
            key = _position_key(table, d, r)
            by_flight = cache.setdefault(key, {})
            parts = None
            for t_left in range(1, max_stages + 1):
                nxt = f[t_left - 1, :, d + r]
                if not np.isfinite(nxt).any():
                    continue
                flight = table.in_flight(t_left)
                cost = by_flight.get(flight)
                if cost is None:
                    if parts is None:
                        parts = stage_matrices(table, tb, d, r)
                    time, fixed_mem, act_mem, allowed = parts
                    cap = table.stage_capacity_bytes(d, r)
                    mem = fixed_mem + act_mem * (flight / (r * m))
                    if objective == "time":
                        cost = np.where(allowed & (mem <= cap), time, inf)
                    else:
                        cost = np.where(allowed & np.isfinite(time), mem - cap, inf)
                    by_flight[flight] = cost
                # the first stage starts at layer 0 on position 0: only that row matters
                top = 1 if d == 0 else n + 1
                cand = np.maximum(cost[:top], nxt[None, :])
                best = cand.argmin(axis=1)
                val = cand[rows[:top], best]
                better = val < f[t_left, :top, d]
                f[t_left, :top, d][better] = val[better]
                choice_end[t_left, :top, d][better] = best[better]
                choice_r[t_left, :top, d][better] = r
    best_by = tuple(float(f[s, 0, 0]) for s in range(1, max_stages + 1))
    if objective == "time":
        scores = [b * (m + s - 1) / m for s, b in enumerate(best_by, start=1)]
    else:
        scores = list(best_by)
    if not scores or not np.isfinite(min(scores)):
        return StageSolution((), inf, inf, best_by)
    s_best = int(np.argmin(scores)) + 1
    stages = []
    j0, d = 0, 0
    for t_left in range(s_best, 0, -1):
        j1 = int(choice_end[t_left, j0, d])
        r = int(choice_r[t_left, j0, d])
        stages.append(Stage(j0, j1, d, r, table.stage_time_s(j0, j1, d, r),
                            table.stage_memory_bytes(j0, j1, d, r, t_left),
                            table.stage_capacity_bytes(d, r)))
        j0, d = j1, d + r
    return StageSolution(tuple(stages), best_by[s_best - 1], float(scores[s_best - 1]), best_by)


def _position_key(t: StageCostTable, d: int, r: int) -> tuple:
    """Everything a stage's cost takes from its device positions d..d+r-1."""
    n_dev = t.n_devices
    link_in = (t.link_latency_s[d - 1], t.link_s_per_byte[d - 1]) if d > 0 else None
    link_out = ((t.link_latency_s[d + r - 1], t.link_s_per_byte[d + r - 1])
                if d + r < n_dev else None)
    pins = (d, r) if t.layer_pins and t.pins_by_position else r
    return (tuple(sorted({t.device_type[p] for p in range(d, d + r)})), link_in, link_out,
            float(t.allreduce_latency_s[d, r]), float(t.allreduce_s_per_byte[d, r]),
            t.stage_capacity_bytes(d, r), pins)


def dp_cells(n_layers: int, n_devices: int, replicate: bool) -> float:
    """The solver's work in table cells, to refuse tables that would take too long."""
    ranges = n_devices * (n_devices + 1) / 2 if replicate else n_devices
    return (n_layers + 1) ** 2 * ranges * (min(n_layers, n_devices) + 8)


__all__ = ["StageTables", "dp_cells", "solve_stages", "stage_matrices"]
