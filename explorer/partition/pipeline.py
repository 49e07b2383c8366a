"""Pipeline stages by dynamic programming: contiguous layer stages with replicas (PipeDream, Alpa).

The layers of the graph (runs of ops of one module, in topological order) are cut into ``S``
contiguous stages; each stage runs on a group of consecutive devices that replicate it (data
parallelism inside the stage). The split minimises the slowest stage's time per step, subject
to every stage's memory, exactly for the cost model of :class:`StageCostTable`.

Sources: Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
SOSP 2019 (dynamic programming over layers and replicated stages, slowest stage as the
objective); Zheng et al., "Alpa: Automating Inter- and Intra-Operator Parallelism", OSDI 2022
(stage construction as a DP over (stages, layers, devices) on a cost table, separate from
profiling). The solver :func:`solve_stages` is a pure function of a :class:`StageCostTable`,
so it can be tested against brute force on random tables with no graph and no hardware.

This module also holds :func:`best_of_baselines`, the guard every partitioner here uses to
never return a plan slower than the ``single`` and ``data-parallel`` baselines on graphs small
enough to simulate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.graph import OpGraph
from explorer.core.plan import SCHEDULES, Plan
from explorer.costs.memory import node_memory_bytes
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition import apply_pins, register
from explorer.simulate.simulator import Prediction, simulate

#: graphs with at most this many nodes are simulated against the ``single`` and
#: ``data-parallel`` baselines, and the fastest plan that fits is returned
COMPARE_MAX_NODES = 5000
#: memory headroom factors tried in turn when the simulator finds a plan over memory that the
#: additive estimate said would fit (graphs up to COMPARE_MAX_NODES only)
HEADROOMS = (1.0, 0.85, 0.7)
#: the DP refuses more layers than this: its tables are (layers + 1)^2 floats each
MAX_LAYERS = 1500
#: and more work than this many table cells (layers^2 x device ranges x (stages + 8))
MAX_DP_CELLS = 4e9

GiB = 2**30


# ------------------------------------------------------------------------------------------
# the cost table: everything the solver needs, no graph, no cost model


@dataclass(frozen=True)
class StageNet:
    """A tensor that may cross stage boundaries, in layer terms.

    ``producer`` is the producing layer, ``consumers`` the distinct later layers that read it
    (sorted, all > producer). Activations (``per_micro_batch``) are sent once per micro-batch;
    weights once per step. ``grad`` says whether a gradient flows back to the producer.
    """

    producer: int
    consumers: tuple[int, ...]
    nbytes: int
    per_micro_batch: bool = True
    grad: bool = True


@dataclass(frozen=True, eq=False)
class StageCostTable:
    """The stage DP's cost model, per layer ``j`` (``L`` layers) and device position ``d``.

    A stage is ``(j0, j1, d, r)``: layers ``j0..j1-1`` on the ``r`` devices at positions
    ``d..d+r-1``, each replica running ``1/(r*M)`` of the batch per micro-batch. Its time for
    one step (:meth:`stage_time_s`) is

    * compute: ``max`` over the device types in the group of
      ``M * fixed + var / r + optimizer`` summed over its layers (the slowest replica sets
      the pace; fixed per-op costs do not shrink with the batch);
    * transfers it receives: activations from earlier stages (one per tensor, destination
      stage and micro-batch: latency + bytes/r over the link from position ``d-1``), and
      gradients from later stages (over the link to position ``d+r``), weights once per step;
    * the ring all-reduce of its gradients when ``r > 1``.

    Its memory (:meth:`stage_memory_bytes`) is its parameters (with gradients and optimizer
    state) plus saved and received activations of the micro-batches in flight at batch
    fraction ``1/(r*M)``, plus copies of weights it receives; in flight are all ``M`` with
    GPipe, ``min(S - stage index, M)`` with 1F1B. The score of a split into ``S`` stages is the
    slowest stage's time times ``(M + S - 1) / M``, the pipeline bubble.

    ``layer_pins[j]`` are the pinned device keys of layer ``j``. With ``pins_by_position`` the
    keys are device positions that must lie in the stage's group; otherwise (identical
    devices and links, where positions are interchangeable) they are device labels: every
    layer pinned to one label must be in one stage, and a stage needs at least as many
    replicas as labels pinned to it.
    """

    fixed_s: np.ndarray  # (types, L): per micro-batch, the per-op costs that do not shrink
    var_s: np.ndarray  # (types, L): per step at the whole batch, the part that shrinks
    optimizer_s: np.ndarray  # (types, L): the optimizer step of the layer's parameters
    param_bytes: np.ndarray  # (L,): params, gradients, optimizer state, buffers
    act_bytes: np.ndarray  # (L,): saved activations of one micro-batch at the whole batch
    grad_bytes: np.ndarray  # (L,): gradient bytes all-reduced when the stage is replicated
    nets: tuple[StageNet, ...]
    device_type: tuple[int, ...]  # (D,): row of fixed_s/var_s/optimizer_s for each position
    capacity_bytes: tuple[float, ...]  # (D,)
    link_latency_s: tuple[float, ...]  # (D-1,): link between positions d and d+1
    link_s_per_byte: tuple[float, ...]  # (D-1,)
    allreduce_latency_s: np.ndarray  # (D, D+1): [d, r] ring over positions d..d+r-1
    allreduce_s_per_byte: np.ndarray  # (D, D+1)
    micro_batches: int = 1
    schedule: str = "1f1b"
    replicas: tuple[int, ...] = (1,)
    layer_pins: tuple[frozenset[int], ...] = ()
    pins_by_position: bool = True

    @property
    def n_layers(self) -> int:
        return int(self.param_bytes.shape[0])

    @property
    def n_devices(self) -> int:
        return len(self.device_type)

    def in_flight(self, remaining: int) -> int:
        """Micro-batches whose activations a stage keeps, ``remaining`` = S - stage index."""
        m = self.micro_batches
        return m if self.schedule == "gpipe" else min(remaining, m)

    def pins_of(self, j: int) -> frozenset[int]:
        return self.layer_pins[j] if self.layer_pins else frozenset()

    # -- the cost function, stage by stage (reference implementation) --------------------
    def _crossing(self, j0: int, j1: int) -> tuple[float, float, float, float, float, float]:
        """(recv count, recv bytes, recv activation bytes, recv weight bytes, grad count,
        grad bytes) for stage j0..j1-1, straight from the nets."""
        m = self.micro_batches
        rc = rb = ract = rpar = gc = gb = 0.0
        for net in self.nets:
            times = m if net.per_micro_batch else 1
            if net.producer < j0 and any(j0 <= c < j1 for c in net.consumers):
                rc += times
                rb += net.nbytes
                if net.per_micro_batch:
                    ract += net.nbytes
                else:
                    rpar += net.nbytes * (2 if net.grad else 1)
            if net.grad and j0 <= net.producer < j1 and net.consumers[-1] >= j1:
                gc += times
                gb += net.nbytes
        return rc, rb, ract, rpar, gc, gb

    def stage_time_s(self, j0: int, j1: int, d: int, r: int) -> float:
        """Seconds per step of stage ``(j0, j1, d, r)`` (inf when it cannot exist)."""
        if not (0 <= j0 < j1 <= self.n_layers and r >= 1 and 0 <= d and d + r <= self.n_devices):
            return math.inf
        m = self.micro_batches
        types = sorted({self.device_type[p] for p in range(d, d + r)})
        comp = max(m * float(self.fixed_s[k, j0:j1].sum()) + float(self.var_s[k, j0:j1].sum()) / r
                   + float(self.optimizer_s[k, j0:j1].sum()) for k in types)
        rc, rb, _, _, gc, gb = self._crossing(j0, j1)
        xfer = 0.0
        if rc:
            if d == 0:
                return math.inf
            xfer += self.link_latency_s[d - 1] * rc + self.link_s_per_byte[d - 1] * rb / r
        if gc:
            if d + r >= self.n_devices:
                return math.inf
            e = d + r - 1
            xfer += self.link_latency_s[e] * gc + self.link_s_per_byte[e] * gb / r
        ar = 0.0
        nbytes = float(self.grad_bytes[j0:j1].sum())
        if r > 1 and nbytes > 0:
            ar = float(self.allreduce_latency_s[d, r]) + float(
                self.allreduce_s_per_byte[d, r]) * nbytes
        return comp + xfer + ar

    def stage_memory_bytes(self, j0: int, j1: int, d: int, r: int, remaining: int) -> float:
        """Estimated peak bytes on each device of stage ``(j0, j1, d, r)``."""
        _, _, ract, rpar, _, _ = self._crossing(j0, j1)
        frac = self.in_flight(remaining) / (r * self.micro_batches)
        return (float(self.param_bytes[j0:j1].sum())
                + (float(self.act_bytes[j0:j1].sum()) + ract) * frac + rpar)

    def stage_capacity_bytes(self, d: int, r: int) -> float:
        return min(self.capacity_bytes[d:d + r])

    def stage_allowed(self, j0: int, j1: int, d: int, r: int) -> bool:
        """Replica count and pins allow the stage (memory aside)."""
        if r not in self.replicas or d + r > self.n_devices:
            return False
        keys = set().union(*(self.pins_of(j) for j in range(j0, j1)))
        if self.pins_by_position:
            return all(d <= k < d + r for k in keys)
        if len(keys) > r:
            return False
        return all(all(j0 <= j < j1 for j in range(self.n_layers) if k in self.pins_of(j))
                   for k in keys)

    def stage_feasible(self, j0: int, j1: int, d: int, r: int, remaining: int) -> bool:
        return (self.stage_allowed(j0, j1, d, r)
                and self.stage_memory_bytes(j0, j1, d, r, remaining)
                <= self.stage_capacity_bytes(d, r))

    def score(self, stages: Sequence[tuple[int, int, int, int]]) -> float:
        """The objective of a whole split: slowest stage x (M + S - 1) / M; inf if invalid."""
        s_count = len(stages)
        if not s_count or stages[0][0] != 0 or stages[-1][1] != self.n_layers:
            return math.inf
        worst = 0.0
        pos = 0
        for idx, (j0, j1, d, r) in enumerate(stages):
            if d != pos or (idx and stages[idx - 1][1] != j0):
                return math.inf
            pos = d + r
            if not self.stage_feasible(j0, j1, d, r, s_count - idx):
                return math.inf
            worst = max(worst, self.stage_time_s(j0, j1, d, r))
        m = self.micro_batches
        return worst * (m + s_count - 1) / m


@dataclass(frozen=True)
class Stage:
    """One stage of a solution: layers ``first_layer..end_layer-1`` on ``replicas`` devices
    starting at position ``first_device``."""

    first_layer: int
    end_layer: int
    first_device: int
    replicas: int
    time_s: float
    memory_bytes: float
    capacity_bytes: float


@dataclass(frozen=True)
class StageSolution:
    """The solver's answer: the chosen stages, and the best bottleneck for every stage count."""

    stages: tuple[Stage, ...]
    bottleneck_s: float
    score_s: float  # bottleneck x (M + S - 1) / M: what the split was chosen by
    best_by_stages_s: tuple[float, ...]  # [S-1]: the smallest bottleneck with S stages

    @property
    def feasible(self) -> bool:
        return bool(self.stages)


# ------------------------------------------------------------------------------------------
# the solver


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


class _Tables:
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


def _stage_matrices(t: StageCostTable, tb: _Tables, d: int, r: int
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
    fixed_mem = tb.diff(tb.param) + tb.recv_par
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
    tb = _Tables(table)
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
                        parts = _stage_matrices(table, tb, d, r)
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


# ------------------------------------------------------------------------------------------
# from a graph to a table


def default_micro_batches(graph: OpGraph) -> int:
    """4 micro-batches when the batch divides into 4, else 1."""
    return 4 if graph.batch_size >= 4 and graph.batch_size % 4 == 0 else 1


def _homogeneous(cluster: Cluster, ids: Sequence[str]) -> bool:
    if len({cluster.device(i).type_key for i in ids}) > 1:
        return False
    links = {(lk.latency_s, lk.bandwidth_bytes_per_s)
             for a_i, a in enumerate(ids) for b in ids[a_i + 1:]
             for lk in [cluster.link(a, b)]}
    return len(links) <= 1


def _linear(fn: Callable[[float], float], x: float = float(2**20)) -> tuple[float, float]:
    """(intercept, slope) of a cost that is linear in its byte count for positive counts."""
    y1, y2 = fn(x), fn(2 * x)
    slope = (y2 - y1) / x
    return y1 - slope * x, slope


def stage_cost_table(graph: OpGraph, costs: CostModel, ids: Sequence[str],
                     layers: Sequence[Sequence[int]], micro_batches: int, schedule: str,
                     optimizer: str, replicate: bool = True,
                     pins: Mapping[str, str] | None = None, headroom: float = 1.0
                     ) -> StageCostTable:
    """The :class:`StageCostTable` of ``graph``'s ``layers`` on devices ``ids``.

    Costs come from ``costs`` (a node's time at a batch fraction is linear in it), memory from
    :func:`explorer.costs.memory.node_memory_bytes`, device capacity times ``headroom``. Replica
    counts are limited to those that divide the batch into whole micro-batches.
    """
    cluster = costs.cluster
    nodes = graph.nodes
    n = len(layers)
    layer_of = [0] * len(nodes)
    for j, layer in enumerate(layers):
        for i in layer:
            layer_of[i] = j
    type_keys: list[str] = []
    rep: list[str] = []
    for dev in ids:
        key = cluster.device(dev).type_key
        if key not in type_keys:
            type_keys.append(key)
            rep.append(dev)
    device_type = tuple(type_keys.index(cluster.device(dev).type_key) for dev in ids)
    fixed = np.zeros((len(rep), n))
    var = np.zeros((len(rep), n))
    opt = np.zeros((len(rep), n))
    for k, dev in enumerate(rep):
        for i, nd in enumerate(nodes):
            if nd.kind != "op":
                continue
            f0, f1 = costs.fwd_s(i, dev, 0.0), costs.fwd_s(i, dev, 1.0)
            b0 = b1 = 0.0
            if nd.requires_grad:
                b0, b1 = costs.bwd_s(i, dev, 0.0), costs.bwd_s(i, dev, 1.0)
            fixed[k, layer_of[i]] += f0 + b0
            var[k, layer_of[i]] += (f1 - f0) + (b1 - b0)
    tensor_bytes = np.zeros(n)
    tensor_count = np.zeros(n)
    grad_bytes = np.zeros(n)
    for i, nd in enumerate(nodes):
        if nd.param_bytes and nd.kind != "buffer":  # what the simulator's optimizer steps
            tensor_bytes[layer_of[i]] += nd.param_bytes
            tensor_count[layer_of[i]] += 1
        if nd.kind == "param" and nd.requires_grad:  # what it all-reduces
            grad_bytes[layer_of[i]] += nd.out_bytes
    for k, dev in enumerate(rep):  # optimizer_s is linear in bytes and tensors, zero at zero
        per_byte = costs.optimizer_s(dev, optimizer, 1, 0)
        per_tensor = costs.optimizer_s(dev, optimizer, 0, 1)
        opt[k] = tensor_bytes * per_byte + tensor_count * per_tensor
    fixed_mem = node_memory_bytes(graph, optimizer, 1, 0.0)
    full_mem = node_memory_bytes(graph, optimizer, 1, 1.0)
    param_bytes = np.zeros(n)
    act_bytes = np.zeros(n)
    for i in range(len(nodes)):
        param_bytes[layer_of[i]] += fixed_mem[i]
        act_bytes[layer_of[i]] += full_mem[i] - fixed_mem[i]
    nets = []
    for p, nd in enumerate(nodes):
        if nd.kind == "input" or nd.out_bytes <= 0:
            continue  # every rank loads its own copy of the batch
        a = layer_of[p]
        cons = sorted({layer_of[c] for c in graph.succs[p]} - {a})
        if not cons:
            continue
        grad = nd.requires_grad and any(nodes[c].requires_grad for c in graph.succs[p])
        nets.append(StageNet(a, tuple(cons), nd.out_bytes, nd.kind == "op", grad))
    n_dev = len(ids)
    lat, spb = [], []
    for d in range(n_dev - 1):  # as CostModel.transfer_s: latency + bytes / bandwidth x scale
        link = cluster.link(ids[d], ids[d + 1])
        lat.append(link.latency_s)
        spb.append(costs.link_scale / link.bandwidth_bytes_per_s)
    ar_lat = np.zeros((n_dev, n_dev + 1))
    ar_spb = np.zeros((n_dev, n_dev + 1))
    for d in range(n_dev):
        for r in range(2, n_dev - d + 1):
            group = tuple(ids[d:d + r])
            ar_lat[d, r], ar_spb[d, r] = _linear(lambda x, g=group: costs.allreduce_s(g, int(x)))
    reps = allowed_replicas(graph.batch_size, n_dev, micro_batches, replicate)
    by_position = not _homogeneous(cluster, ids)
    layer_pins: tuple[frozenset[int], ...] = ()
    if pins:
        key_of = {dev: j for j, dev in enumerate(ids)}  # positions, or labels
        per_layer: list[set[int]] = [set() for _ in range(n)]
        for name, dev in pins.items():
            if dev not in key_of:
                raise ExplorerError(f"node {name!r} is pinned to {dev}, which is not among the "
                                    f"devices this plan may use ({', '.join(ids)})")
            per_layer[layer_of[graph.index[name]]].add(key_of[dev])
        layer_pins = tuple(frozenset(s) for s in per_layer)
    return StageCostTable(
        fixed_s=fixed, var_s=var, optimizer_s=opt, param_bytes=param_bytes,
        act_bytes=act_bytes, grad_bytes=grad_bytes, nets=tuple(nets),
        device_type=device_type,
        capacity_bytes=tuple(cluster.device(dev).memory_bytes * headroom for dev in ids),
        link_latency_s=tuple(lat), link_s_per_byte=tuple(spb), allreduce_latency_s=ar_lat,
        allreduce_s_per_byte=ar_spb, micro_batches=micro_batches, schedule=schedule,
        replicas=reps, layer_pins=layer_pins, pins_by_position=by_position)


def allowed_replicas(batch_size: int, n_devices: int, micro_batches: int,
                     replicate: bool) -> tuple[int, ...]:
    """Replica counts r whose r x micro_batches divides the batch (1 always)."""
    reps = tuple(r for r in (range(1, n_devices + 1) if replicate else (1,))
                 if batch_size <= 0 or batch_size % (r * micro_batches) == 0)
    return reps or (1,)


def choose_layers(graph: OpGraph, depth: int | None, max_layers: int, n_devices: int,
                  replicate: bool) -> tuple[list[list[int]], int | None]:
    """The layers the DP cuts: at ``depth``, or with ``depth=None`` the finest module depth
    whose layer count the DP can handle. Raises :class:`ExplorerError` when none can."""
    def fits(layers: list[list[int]]) -> bool:
        return (len(layers) <= max_layers
                and dp_cells(len(layers), n_devices, replicate) <= MAX_DP_CELLS)

    if depth is not None:
        layers = graph.layers(depth)
        if not fits(layers):
            raise ExplorerError(
                f"pipeline-dp: {len(layers):,} layers at depth={depth} are too many for the "
                f"stage DP (at most {_layer_limit(max_layers, n_devices, replicate):,} on "
                f"{n_devices} devices; its work grows as layers^2 x devices^3); pass a smaller "
                "depth to cut at coarser modules, or use min-comm for op-level placement")
        return layers, depth
    tried = []
    counts = _layer_counts(graph)
    for dp in [None, *range(graph.module_depth() - 1, 0, -1)]:
        tried.append(f"{counts[dp]:,} at depth {dp}")
        if counts[dp] <= max_layers and dp_cells(counts[dp], n_devices,
                                                 replicate) <= MAX_DP_CELLS:
            layers = graph.layers(dp)
            if fits(layers):
                return layers, dp
    raise ExplorerError(
        f"pipeline-dp: the graph has too many layers for the stage DP at every module depth "
        f"({'; '.join(tried)}; the limit is {_layer_limit(max_layers, n_devices, replicate):,} "
        f"on {n_devices} devices); use min-comm, which places ops directly")


def _layer_counts(graph: OpGraph) -> dict[int | None, int]:
    """len(graph.layers(depth)) for every depth at once: runs of equal module prefixes."""
    top = graph.module_depth()
    counts: dict[int | None, int] = dict.fromkeys([None, *range(1, top + 1)], 0)
    last: dict[int | None, object] = dict.fromkeys(counts, object())
    for n in graph.nodes:
        if n.kind != "op":
            continue
        parts = n.module_path.split(".") if n.module_path else []
        for dp in counts:
            key = n.module_path if dp is None else ".".join(parts[:dp])
            if key != last[dp]:
                counts[dp] += 1
                last[dp] = key
    return {dp: max(c, 1) for dp, c in counts.items()}


def _layer_limit(max_layers: int, n_devices: int, replicate: bool) -> int:
    lim = max_layers
    while lim > 1 and dp_cells(lim, n_devices, replicate) > MAX_DP_CELLS:
        lim = int(lim * 0.9)
    return lim


# ------------------------------------------------------------------------------------------
# shared guards for partitioners: baselines and memory


def memory_error(algorithm: str, what: str, device: str, need_bytes: float,
                 capacity_bytes: float, hint: str = "") -> MemoryExceededError:
    """A :class:`MemoryExceededError` naming the device, what it would hold and the excess."""
    over = need_bytes - capacity_bytes
    msg = (f"{algorithm}: device {device} cannot hold {what}: it needs {_size(need_bytes)} "
           f"but has {_size(capacity_bytes)} (over by {_size(over)})")
    return MemoryExceededError(msg + (f"; {hint}" if hint else ""))


def _size(nbytes: float) -> str:
    if abs(nbytes) >= GiB:
        return f"{nbytes / GiB:,.2f} GiB"
    return f"{nbytes / 2**20:,.1f} MiB"


def best_of_baselines(graph: OpGraph, cluster: Cluster, costs: CostModel, plan: Plan | None,
                      pins: Mapping[str, str] | None, optimizer: str, name: str,
                      ids: Sequence[str] | None = None, failure: str = "",
                      own_prediction: Prediction | None = None) -> Plan:
    """``plan``, unless ``single`` or ``data-parallel`` is faster per the simulator.

    For graphs up to :data:`COMPARE_MAX_NODES` nodes, simulates ``plan`` (``None``: the
    algorithm found nothing that fits), everything on the first device and the whole model
    replicated on ``ids`` (default: all devices), pins applied to each, and returns the fastest
    that fits, relabelled as ``name`` with a note saying which baseline it is. Raises
    :class:`MemoryExceededError` with the simulator's memory report when nothing fits.
    Larger graphs: returns ``plan`` unchecked (or raises with ``failure`` when it is None).
    """
    if len(graph) > COMPARE_MAX_NODES:
        if plan is None:
            raise MemoryExceededError(failure or f"{name}: no plan fits the devices' memory")
        return plan
    ids = tuple(ids or cluster.ids)
    pins = dict(pins or {})
    base = dict(algorithm=name, optimizer=optimizer)
    cands: list[tuple[str, Plan]] = []
    if plan is not None:
        cands.append(("own", plan))
    first = Plan.single(graph, ids[0], **base)
    cands.append(("single", apply_pins(graph, first, pins)))
    if len(ids) > 1:
        dp = Plan.from_assignment(graph, [ids], {i: 0 for i in range(len(graph))}, **base)
        cands.append(("data-parallel", apply_pins(graph, dp, pins)))
    best = None
    reports = []
    for label, cand in cands:
        pred = own_prediction if label == "own" and own_prediction is not None else simulate(
            graph, cand, costs)
        if not pred.fits:
            reports.append(f"{label}: {pred.memory_report()}")
            continue
        if best is None or pred.step_s < best[2] * (1 - 1e-9):
            best = (label, cand, pred.step_s)
    if best is None:
        raise MemoryExceededError(
            (failure + "; " if failure else f"{name}: no plan fits the devices' memory; ")
            + "the simulator finds " + "; ".join(reports)
            + "; use more or larger devices, a smaller batch, or SGD")
    label, chosen, step_s = best
    if label == "own":
        return chosen
    note = (f"{label} is faster than {name}'s own plan ({step_s:.4g} s per step), so this is "
            f"the {label} plan" if plan is not None else
            f"{name} found no split that fits ({failure}); this is the {label} plan")
    return chosen.with_settings(
        algorithm=name, notes=(*chosen.notes, note),
        options={**(dict(plan.options) if plan is not None else {}), "fallback": label},
        pinned=frozenset(pins))


def simulate_if_small(graph: OpGraph, plan: Plan, costs: CostModel) -> Prediction | None:
    """The simulator's prediction for graphs up to :data:`COMPARE_MAX_NODES` nodes, else None."""
    return simulate(graph, plan, costs) if len(graph) <= COMPARE_MAX_NODES else None


# ------------------------------------------------------------------------------------------
# the partitioner


@register("pipeline-dp", exact=True)
def pipeline_dp(graph: OpGraph, cluster: Cluster, costs: CostModel,
                pins: Mapping[str, str] | None = None, k: int | None = None,
                micro_batches: int | None = None, schedule: str = "1f1b",
                depth: int | None = None, replicate: bool = True,
                optimizer: str = "adam", max_layers: int = MAX_LAYERS,
                compare_baselines: bool = True) -> Plan:
    """Contiguous pipeline stages with replicas, chosen by an exact dynamic program.

    Cuts ``graph.layers(depth)`` (in topological order) into ``S <= k`` contiguous stages,
    each on a group of consecutive devices that replicate it, minimising the slowest stage's
    time: compute at batch fraction ``1 / (replicas x micro_batches)``, transfers across its
    boundaries and the all-reduce of a replicated stage's gradients, subject to every stage's
    memory including the activations of the micro-batches in flight (GPipe keeps all ``M``,
    1F1B at most ``S - stage index``). Among stage counts it picks the smallest
    ``bottleneck x (M + S - 1) / M`` (the pipeline bubble). Exact for that cost model (see
    :class:`StageCostTable`; the simulator then scores the plan). Follows PipeDream
    (Narayanan et al., SOSP 2019) and Alpa's stage construction (Zheng et al., OSDI 2022).

    Parameters
    ----------
    k : int, optional
        Number of devices to use, the cluster's first ``k`` (default: all).
    micro_batches : int, optional
        Micro-batches per step. Default: 4 when the batch divides into 4, else 1; when 4 is
        possible the DP also solves for 1 (which allows more replicas per stage) and keeps
        the better estimate. A replica count is allowed only when ``replicas x
        micro_batches`` divides the batch.
    schedule : {"1f1b", "gpipe"}
        Pipeline schedule; sets the micro-batches whose activations a stage keeps.
    depth : int, optional
        Module depth of the layers (``None``: the finest depth with at most ``max_layers``
        layers).
    replicate : bool
        Allow stages on several devices (data parallelism inside a stage). Default True.
    optimizer : str
        Optimizer whose state counts towards memory (default ``"adam"``).
    max_layers : int
        Refuse more layers than this (default 1500; fewer on many devices, see Limits).
    compare_baselines : bool
        On graphs up to 5,000 nodes, simulate the plan against ``single`` and
        ``data-parallel`` and return the fastest that fits (a note says when it is a
        baseline). Default True.

    Returns
    -------
    Plan
        Stages in pipeline order; ``options["stage_layers"]`` and ``options["replicas"]``
        describe the split, ``notes`` the DP's bottleneck and estimated step.

    Raises
    ------
    MemoryExceededError
        When no split fits, naming the device and layers of the split closest to fitting.
    ExplorerError
        When the graph has too many layers for the DP, or the pins cannot be honoured.

    Limits
    ------
    Work grows as ``layers^2 x devices^2 x stages`` (``layers^2 x devices^2`` without
    replicas) and memory as ``10 x layers^2`` floats: 1,000 layers on 8 devices take a few
    seconds. With ``depth=None`` the DP coarsens to the finest module depth under the limit;
    when every depth has too many layers, or an explicit ``depth`` does, it raises
    :class:`ExplorerError` saying so. Pins (node name -> device id) are honoured: a pinned
    node's layer goes to a stage holding its device; with identical devices the devices are
    assigned to stages after the DP, otherwise a stage's devices are positions in the
    cluster's order. Pins that no contiguous split can honour raise :class:`ExplorerError`.
    """
    if schedule not in SCHEDULES:
        raise ExplorerError(f"unknown schedule {schedule!r}; choose one of "
                            f"{', '.join(SCHEDULES)}")
    n_all = len(cluster)
    n_dev = n_all if k is None else k
    if not 1 <= n_dev <= n_all:
        raise ExplorerError(f"k={k} devices asked for, but the cluster has {n_all}")
    ids = tuple(cluster.ids[:n_dev])
    if micro_batches is None:
        m_choices = tuple(dict.fromkeys((default_micro_batches(graph), 1)))
    elif int(micro_batches) >= 1:
        m_choices = (int(micro_batches),)
    else:
        raise ExplorerError(f"micro_batches must be >= 1, not {micro_batches}")
    pins = dict(pins or {})
    layers, used_depth = choose_layers(graph, depth, max_layers, n_dev, replicate)
    plan = pred = None
    failure = ""
    base = stage_cost_table(graph, costs, ids, layers, m_choices[0], schedule, optimizer,
                            replicate, pins)
    for headroom in HEADROOMS:
        best: tuple[StageCostTable, StageSolution] | None = None
        table = base
        for m in m_choices:
            table = replace(base, micro_batches=m,
                            replicas=allowed_replicas(graph.batch_size, n_dev, m, replicate),
                            capacity_bytes=tuple(x * headroom for x in base.capacity_bytes))
            sol = solve_stages(table)
            if sol.feasible and (best is None or sol.score_s < best[1].score_s):
                best = (table, sol)
        if best is None:
            failure = _explain_infeasible(table, layers, graph, ids, pins)
            break
        options = {"k": n_dev, "micro_batches": best[0].micro_batches, "schedule": schedule,
                   "depth": used_depth, "replicate": replicate, "layers": len(layers)}
        plan = _plan_from_solution(graph, best[0], best[1], layers, ids, pins, optimizer,
                                   options)
        pred = simulate_if_small(graph, plan, costs) if compare_baselines else None
        if pred is None or pred.fits:
            break
        failure = (f"pipeline-dp: its best split does not fit the simulator's memory "
                   f"accounting ({pred.memory_report()})")
    if not compare_baselines:
        if plan is None:
            raise MemoryExceededError(failure)
        return plan
    return best_of_baselines(graph, cluster, costs, plan, pins, optimizer, "pipeline-dp", ids,
                             failure, pred)


def _plan_from_solution(graph: OpGraph, table: StageCostTable, sol: StageSolution,
                        layers: Sequence[Sequence[int]], ids: Sequence[str],
                        pins: Mapping[str, str], optimizer: str, options: dict) -> Plan:
    stage_devs: list[tuple[str, ...]] = []
    if table.pins_by_position or not pins:
        stage_devs = [tuple(ids[st.first_device:st.first_device + st.replicas])
                      for st in sol.stages]
    else:  # identical devices: each stage takes its pinned devices, then the next free ones
        layer_of = {i: j for j, layer in enumerate(layers) for i in layer}
        pin_layer = {nm: layer_of[graph.index[nm]] for nm in pins}
        pinned_of = [sorted({pins[nm] for nm in pins
                             if st.first_layer <= pin_layer[nm] < st.end_layer})
                     for st in sol.stages]
        taken = {dev for devs in pinned_of for dev in devs}
        free = [dev for dev in ids if dev not in taken]
        for st, own in zip(sol.stages, pinned_of, strict=True):
            extra = st.replicas - len(own)
            stage_devs.append(tuple(sorted(own + free[:extra], key=ids.index)))
            free = free[extra:]
    assign: dict[int, int] = {}
    for s, st in enumerate(sol.stages):
        for j in range(st.first_layer, st.end_layer):
            for i in layers[j]:
                assign[i] = s
    notes = (f"{len(sol.stages)} stages over {len(layers)} layers; DP bottleneck "
             f"{sol.bottleneck_s:.4g} s per step, estimated step {sol.score_s:.4g} s",)
    opts = {**options, "stage_layers": [[st.first_layer, st.end_layer] for st in sol.stages],
            "replicas": [st.replicas for st in sol.stages]}
    return Plan.from_assignment(graph, stage_devs, assign, micro_batches=table.micro_batches,
                                schedule=table.schedule, optimizer=optimizer,
                                algorithm="pipeline-dp", options=opts,
                                pinned=frozenset(pins), notes=notes)


def _explain_infeasible(table: StageCostTable, layers: Sequence[Sequence[int]],
                        graph: OpGraph, ids: Sequence[str], pins: Mapping[str, str]) -> str:
    """Why no split exists: the closest one to fitting, by memory, or the pins."""
    mem = solve_stages(table, objective="memory")
    if not mem.feasible:
        return (f"pipeline-dp: no contiguous split honours the pins "
                f"({', '.join(f'{k} -> {v}' for k, v in list(pins.items())[:4])}); pinned "
                "layers must go to stages in device order; change the pins or use min-comm")
    worst = max(mem.stages, key=lambda st: st.memory_bytes - st.capacity_bytes)
    devs = ids[worst.first_device:worst.first_device + worst.replicas]
    first = graph.nodes[layers[worst.first_layer][-1]].module_path or "?"
    last = graph.nodes[layers[worst.end_layer - 1][-1]].module_path or "?"
    err = memory_error(
        "pipeline-dp", f"layers {worst.first_layer}..{worst.end_layer - 1} ({first} .. {last}) "
        f"of the split that comes closest to fitting ({len(mem.stages)} stages)",
        ", ".join(devs), worst.memory_bytes, worst.capacity_bytes,
        "use more or larger devices, more micro-batches, or a smaller batch")
    return str(err)


__all__ = ["Stage", "StageCostTable", "StageNet", "StageSolution", "best_of_baselines",
           "pipeline_dp", "solve_stages", "stage_cost_table"]
