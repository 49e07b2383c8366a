"""The simulator: an event-driven replay of one training step under a plan, from the cost model.

Tasks are the forward and backward of every op for every micro-batch, tensor transfers across
stages, gradient all-reduces of replicated stages (in 25 MB buckets, overlapping the backward
like DDP), and the optimizer step. Each stage's device runs one task at a time: whenever it is
free it starts, among its ready tasks, the one that comes first in the schedule (GPipe: all
forwards, then all backwards; 1F1B: warm-up forwards, then one backward per forward, with at
most ``stages - rank`` micro-batches in flight). Each ordered pair of stages has one link that
carries one transfer at a time, overlapping compute. Replicas of a stage are symmetric, so a
stage is simulated once and its timeline shared by its devices.

Memory per device is parameters, gradients, optimizer state and buffers, plus activations by
liveness along the simulated timeline: an op's output (and what else its forward saves) lives
from its forward's start until its last forward consumer on the stage (an output sent elsewhere
is handed to the send) or the backward of a node that saved it, whichever is last; a received
tensor from the task that first needs it. Activation gradients are the buffers autograd makes:
a consumer's backward makes its inputs' gradients (a new tensor, or its own incoming gradient
handed on by views, getitem, same-size add and cat) while what it saved is still held; an op
keeps the first gradient it gets until its own backward (or until it is sent), and later ones
are added into it.

Implementation: tasks live in flat lists indexed by task id (the forwards and backwards of a
micro-batch are one block laid out from a per-op template), durations come from the cost tables
as arrays, dependencies are built from the graph's edge arrays, and memory liveness is computed
with array reductions; a priority is one integer, so the per-stage queues are heaps of ints.
The results are those of the straightforward version (``tests/test_simulate_speed.py`` holds
its predictions for many cases); a 100k-node graph simulates in well under a second.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import weakref
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Any, ClassVar

import numpy as np

from explorer.core.errors import PlanError
from explorer.core.graph import OpGraph
from explorer.core.plan import OPTIMIZER_STATE, Plan
from explorer.core.schedule import Action, Schedule
from explorer.costs.model import CostModel

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default gradient bucket

F, B, XFER, ALLREDUCE, OPT = "fwd", "bwd", "send", "allreduce", "optimizer"
_INPUT, _PARAM, _BUFFER, _OP = 0, 1, 2, 3
_KIND_CODE = {"input": _INPUT, "param": _PARAM, "buffer": _BUFFER, "op": _OP}
_LAST = 10**9  # schedule slot of the optimizer step and of weight gradients sent home
# ops whose backward hands an input the incoming gradient itself (or a view of it): see
# _GraphArrays.hands_on
_HAND_FIRST, _HAND_ALL, _GETITEM = 1, 2, 3
_HANDS_FIRST = frozenset({"aten.sub.Tensor", "aten.clone.default", "aten.alias.default",
                          "aten.contiguous.default"})
_SLICES_GRAD = frozenset({"aten.cat.default", "aten.concat.default", "aten.stack.default"})
_HANDS_ALL = frozenset({"aten.add.Tensor", "aten.add.Scalar"}) | _SLICES_GRAD


@dataclass(frozen=True)
class Interval:
    """One task on the timeline. ``lane`` is "compute" or "comm"."""

    device: str
    lane: str
    kind: str
    start_s: float
    end_s: float
    label: str
    micro_batch: int = -1


@dataclass(frozen=True)
class MemoryBreakdown:
    """A device's memory at its peak moment, by what fills it."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    buffers_bytes: int
    activations_bytes: int  # live activations and activation gradients at the peak

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.buffers_bytes + self.activations_bytes)


class _Deferred:
    """A :class:`Prediction` field's value, computed when the field is first read."""

    def build(self) -> Any:
        raise NotImplementedError


class _Timeline(_Deferred):
    """The simulated tasks a timeline is made of; :meth:`build` makes the Interval tuple.

    A step of a large graph has hundreds of thousands of tasks, and most callers never look at
    the timeline, so a :class:`Prediction` keeps this and builds its intervals on first read.
    """

    def __init__(self, sim: _Sim) -> None:
        self.kind, self.res, self.resources = sim.kind, sim.res, sim.resources
        self.start, self.end, self.label, self.mb = sim.start, sim.end, sim.label, sim.mb
        self.stages = sim.plan.stages

    def build(self) -> tuple[Interval, ...]:
        out: list[Interval] = []
        stages, resources, res = self.stages, self.resources, self.res
        start, end, label, mb = self.start, self.end, self.label, self.mb
        for t, kind in enumerate(self.kind):
            if kind == "gate":
                continue
            key = resources[res[t]]
            if key[0] == "stage":
                for d in stages[key[1]]:
                    out.append(Interval(d, "compute", kind, start[t], end[t], label[t], mb[t]))
            elif key[0] == "link":
                out.append(Interval(stages[key[1]][0], "comm", kind, start[t], end[t],
                                    f"{label[t]} -> {stages[key[2]][0]}", mb[t]))
            else:
                for d in stages[key[1]]:
                    out.append(Interval(d, "comm", kind, start[t], end[t], label[t], mb[t]))
        out.sort(key=lambda iv: (iv.device, iv.start_s))
        return tuple(out)


class _CriticalPath(_Deferred):
    """The chain of tasks that ended last and what made each one start, as labels."""

    def __init__(self, sim: _Sim, last: int) -> None:
        self.kind, self.label, self.mb, self.cause = sim.kind, sim.label, sim.mb, sim.cause
        self.last, self.many = last, sim.plan.micro_batches > 1

    def build(self) -> tuple[str, ...]:
        t, cause = self.last, self.cause
        path = []
        while t >= 0:  # each task's cause started before it did, so the walk ends
            path.append(t)
            t = cause[t]
        path.reverse()
        kind, label, mb = self.kind, self.label, self.mb
        if self.many:
            return tuple(f"{kind[t]} {label[t]}[{mb[t]}]" if mb[t] >= 0 else
                         f"{kind[t]} {label[t]}" for t in path if kind[t] != "gate")
        return tuple([kind[t] + " " + label[t] for t in path])  # (gates need micro-batches)


class _BuiltOnRead:
    """A dataclass field that may be given as a :class:`_Deferred`: the first read builds the
    value and keeps it. Any other value is stored and read back as is."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            raise AttributeError(self.name)  # no default value for the dataclass field
        value = obj.__dict__[self.name]
        if isinstance(value, _Deferred):
            value = obj.__dict__[self.name] = value.build()
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for one step of a plan.

    ``timeline`` is a tuple of :class:`Interval` sorted by device and start, and
    ``critical_path`` a tuple of task labels; for large graphs these are big, so the simulator
    builds them when they are first read.
    """

    step_s: float
    busy_s: dict[str, float]
    timeline: tuple[Interval, ...] = _BuiltOnRead()  # type: ignore[assignment]
    memory: dict[str, MemoryBreakdown]
    capacity_bytes: dict[str, int]
    transfer_bytes: int
    allreduce_bytes: int
    energy_j: float
    energy_by_device_j: dict[str, float]
    critical_path: tuple[str, ...] = _BuiltOnRead()  # type: ignore[assignment]
    bottleneck: str
    lower_bound_s: float
    algorithm: str

    @property
    def peak_bytes(self) -> dict[str, int]:
        return {d: m.total_bytes for d, m in self.memory.items()}

    @property
    def cross_device_bytes(self) -> int:
        return self.transfer_bytes + self.allreduce_bytes

    @property
    def over_memory_bytes(self) -> dict[str, int]:
        """Devices whose peak exceeds their memory, and by how many bytes."""
        return {d: self.peak_bytes[d] - c for d, c in self.capacity_bytes.items()
                if self.peak_bytes[d] > c}

    @property
    def fits(self) -> bool:
        return not self.over_memory_bytes

    @property
    def gap(self) -> float:
        """How far the step is above the lower bound, as a fraction (0.25 = 25 % slower)."""
        return self.step_s / self.lower_bound_s - 1.0 if self.lower_bound_s > 0 else 0.0

    @property
    def throughput_per_s(self) -> float:
        return 1.0 / self.step_s if self.step_s > 0 else 0.0

    def memory_report(self) -> str:
        """Which devices do not fit and by how much, in words ("" when all fit)."""
        over = self.over_memory_bytes
        return "; ".join(
            f"{d} needs {self.peak_bytes[d] / 2**20:,.1f} MiB but has "
            f"{self.capacity_bytes[d] / 2**20:,.1f} MiB (over by {b / 2**20:,.1f} MiB)"
            for d, b in over.items())


# -- cost tables as arrays --------------------------------------------------------------------

def _plain(costs: CostModel) -> bool:
    """Whether ``costs`` computes node times with CostModel's own formulas (not overridden)."""
    cls = type(costs)
    return all(getattr(cls, m) is getattr(CostModel, m)
               for m in ("fwd_s", "bwd_s", "_scaled", "_dc", "node_s", "transfer_s"))


class _Seconds:
    """Node seconds as ``costs.fwd_s`` / ``costs.bwd_s`` give them, for many nodes at once.

    ``others`` (device -> how many other ranks of its host compute the same ops beside it:
    its stage's other replicas) slows each op by its measured contention:
    ``t x (1 + (ratio - 1) x others)``.
    """

    def __init__(self, costs: CostModel, others: dict[str, float] | None = None) -> None:
        self.costs = costs
        self.plain = _plain(costs)
        self.others = others or {}

    def on(self, which: str, idx: np.ndarray, device: str, fraction: float) -> np.ndarray:
        """[len(idx)] seconds of nodes ``idx`` on ``device`` at ``fraction`` of the batch."""
        costs = self.costs
        if not self.plain:
            fn = costs.fwd_s if which == "fwd_s" else costs.bwd_s
            return np.array([fn(i, device, fraction) for i in idx.tolist()], dtype=np.float64)
        dc = costs.per_type[costs.cluster.device(device).type_key]
        t = dc.at_many(which, idx, fraction)  # DeviceCosts.at, elementwise
        busy_others = self.others.get(device, 0.0)
        if busy_others and dc.contention:
            t = t * (1.0 + (dc._array("contention")[idx] - 1.0) * busy_others)
        s = t * costs.compute_scale + costs.extra_op_s  # CostModel._scaled, elementwise
        return np.where(t <= 0.0, 0.0, s)

    def slowest(self, which: str, idx: np.ndarray, devices, fraction: float) -> np.ndarray:
        out = None
        for dv in devices:
            s = self.on(which, idx, dv, fraction)
            out = s if out is None else np.maximum(out, s)
        return out if out is not None else np.zeros(len(idx))


def lower_bound_s(graph: OpGraph, costs: CostModel) -> float:
    """Total compute on the fastest device type, spread over every device: no plan beats it."""
    return _lower_bound(_GraphArrays.of(graph), costs, _Seconds(costs))


def _lower_bound(A: _GraphArrays, costs: CostModel, sec: _Seconds) -> float:
    cluster = costs.cluster
    reps = {d.type_key: d.id for d in cluster.devices}
    ops = np.flatnonzero(A.is_op)
    best = None
    for d in reps.values():
        if sec.plain:
            s = _per_batch(sec, costs, "fwd_s", ops, d) + _per_batch(sec, costs, "bwd_s", ops, d)
        else:
            s = np.array([costs.node_s(i, d) for i in ops.tolist()], dtype=np.float64)
        best = s if best is None else np.minimum(best, s)
    if best is None or not len(best):
        return 0.0
    # the ops' times added in node order (an accumulation runs strictly left to right)
    return float(np.cumsum(best)[-1]) / max(len(cluster), 1)


def _per_batch(sec: _Seconds, costs: CostModel, which: str, ops: np.ndarray, device: str
               ) -> np.ndarray:
    """The least time each op can take for the whole batch on ``device``, whatever pieces a
    plan cuts the batch into: min over fractions f of time(f) / f.

    Measured times are not proportional to the batch (a quarter batch may cost less than a
    quarter), so the whole batch at once is not always cheapest. Between measured fractions
    time(f) is linear, so time(f) / f is least at a measured fraction; below the smallest it
    follows the last segment down to a floor, and is least where the two meet.
    """
    best = sec.on(which, ops, device, 1.0)
    dc = costs.per_type[costs.cluster.device(device).type_key]
    if not dc.fractions:  # overhead + (t - overhead) x f: per sample, least at f = 1
        return best
    for f in dc.fractions:
        best = np.minimum(best, sec.on(which, ops, device, f) / f)
    xs = [1.0, *dc.fractions]
    y_m = dc.at_many(which, ops, xs[-1])
    y_p = dc.at_many(which, ops, xs[-2])
    slope = (y_p - y_m) / (xs[-2] - xs[-1])
    floor = np.minimum(dc.overhead_s, y_m)
    with np.errstate(divide="ignore", invalid="ignore"):
        fk = xs[-1] - (y_m - floor) / slope
        ok = (slope > 0) & (fk > 0) & (fk < xs[-1]) & (y_m > 0)
        at_k = np.where(floor > 0, floor * costs.compute_scale + costs.extra_op_s, 0.0)
        return np.where(ok, np.minimum(best, at_k / np.where(ok, fk, 1.0)), best)


# -- the graph as arrays ----------------------------------------------------------------------

class _GraphArrays:
    """Per-node attributes, the edge list, memory roots and saved tensors of a graph, as lists
    and numpy arrays.

    They depend on the graph alone, so they are kept for the last few graphs simulated (the
    partitioners simulate one graph many times). An entry serves only the same graph object
    while its nodes are equal to those it was made from, so editing a graph's nodes is noticed
    (its edges come from the graph's own cached ``preds``).
    """

    _cache: ClassVar[dict[int, tuple[Any, tuple, _GraphArrays]]] = {}
    _CACHED = 4

    @classmethod
    def of(cls, g: OpGraph) -> _GraphArrays:
        nodes = g.nodes
        hit = cls._cache.get(id(g))
        if hit is not None:
            ref, snapshot, arrays = hit
            if ref() is g and snapshot == tuple(nodes):  # (identical nodes compare quickly)
                return arrays
        arrays = cls(g)
        cache = cls._cache

        def forget(r: Any, k: int = id(g)) -> None:
            if cache.get(k, (None,))[0] is r:
                del cache[k]

        try:
            ref = weakref.ref(g, forget)
        except TypeError:
            return arrays
        cache.pop(id(g), None)
        cache[id(g)] = (ref, tuple(nodes), arrays)
        while len(cache) > cls._CACHED:
            del cache[next(iter(cache))]
        return arrays

    def __init__(self, g: OpGraph) -> None:
        nodes = g.nodes
        self.n = N = len(nodes)
        self._nodes = nodes
        self._preds, self._index = g.preds, g.index
        # one pass over the nodes (much faster than one pass per attribute on large graphs)
        cols: list[list] = [[] for _ in range(8)]
        name, kind, rg, out_bytes, param_bytes, view, extra, saves = (c.append for c in cols)
        for n in nodes:
            name(n.name)
            kind(n.kind)
            rg(n.requires_grad)
            out_bytes(n.out_bytes)
            param_bytes(n.param_bytes)
            view(n.is_view)
            extra(n.saved_extra_bytes)
            saves(n.saves)
        (self.names, self.kinds, rg_l, self.out_bytes, self.param_bytes, self._views,
         self._extra, self._saves) = cols
        self.kcode = np.fromiter(map(_KIND_CODE.__getitem__, self.kinds), dtype=np.int8,
                                 count=N)
        self.is_op = self.kcode == _OP
        self.rg = np.array(rg_l, dtype=bool)
        self.has_b = self.is_op & self.rg
        self.pbytes = np.array(self.param_bytes, dtype=np.int64)
        preds = g.preds
        lens = np.fromiter(map(len, preds), dtype=np.int64, count=N)
        self.e_p = np.fromiter(chain.from_iterable(preds), dtype=np.int64, count=int(lens.sum()))
        self.e_c = np.repeat(np.arange(N, dtype=np.int64), lens)  # by consumer, inputs in order
        self.trainable = np.flatnonzero((self.kcode != _BUFFER) & (self.pbytes != 0)).tolist()
        self.pg = np.flatnonzero((self.kcode == _PARAM) & self.rg)  # trainable weights

    @cached_property
    def grad_named(self) -> np.ndarray:
        """Whether a node's name starts with "grad " (as the labels of gradient sends do)."""
        return np.fromiter((nm.startswith("grad ") for nm in self.names), dtype=bool,
                           count=self.n)

    @cached_property
    def names_obj(self) -> np.ndarray:
        return np.array(self.names, dtype=object)

    @cached_property
    def out_b(self) -> np.ndarray:
        return np.asarray(self.out_bytes, dtype=np.int64)

    @cached_property
    def extra(self) -> np.ndarray:
        return np.array(self._extra, dtype=np.int64)

    @cached_property
    def root(self) -> list[int]:
        """For views and in-place ops, the node whose memory they share: a view's root is its
        first input's root."""
        root = list(range(self.n))
        preds = self._preds
        for i in np.flatnonzero(np.array(self._views, dtype=bool)).tolist():
            if preds[i]:
                root[i] = root[preds[i][0]]
        return root

    @cached_property
    def root_a(self) -> np.ndarray:
        return np.asarray(self.root, dtype=np.int64)

    @cached_property
    def hands_on(self) -> tuple[np.ndarray, np.ndarray]:
        """Per edge (``e_p``, ``e_c``): whether the consumer's backward hands the producer its
        own incoming gradient (or views of it) instead of making a new tensor, and whether that
        is a getitem taking one piece of a multi-output producer's gradient.

        Autograd does so for views of the same size (their backward views the gradient back),
        getitem, same-size add (and the first input of sub), clone and alias, and cat (each
        input gets a slice of the gradient)."""
        code = np.zeros(self.n, dtype=np.int8)
        multi = np.zeros(self.n, dtype=bool)
        for i, nd in enumerate(self._nodes):
            if nd.kind != "op":
                continue
            multi[i] = len(nd.shapes) > 1
            if nd.op == "getitem":
                code[i] = _GETITEM
            elif nd.op in _HANDS_ALL:
                code[i] = _HAND_ALL
            elif nd.op in _HANDS_FIRST or (nd.is_view and len(nd.shapes) == 1):
                code[i] = _HAND_FIRST
        e_p, e_c = self.e_p, self.e_c
        cc = code[e_c]
        first_in = np.ones(len(e_c), dtype=bool)  # the edge is its consumer's first input
        first_in[1:] = e_c[1:] != e_c[:-1]
        same = self.out_b[e_p] == self.out_b[e_c]
        piece = (cc == _GETITEM) & multi[e_p]
        hand = (piece | (cc == _HAND_ALL) & (same | self._cat[e_c])
                | ((cc == _HAND_FIRST) | (cc == _GETITEM)) & first_in & same)
        return hand, piece

    @cached_property
    def _cat(self) -> np.ndarray:
        return np.fromiter((nd.op in _SLICES_GRAD for nd in self._nodes), dtype=bool,
                           count=self.n)

    @cached_property
    def saved(self) -> tuple[np.ndarray, np.ndarray]:
        """(producer root, node whose backward keeps it) for every saved op or input output."""
        p, v = self.saved_any
        keep = (self.kcode[p] == _OP) | (self.kcode[p] == _INPUT)
        return p[keep], v[keep]

    @cached_property
    def saved_any(self) -> tuple[np.ndarray, np.ndarray]:
        """(saved node's root, node whose backward keeps it) for every saved tensor, views of
        weights and buffers too (a stage that receives one holds its own copy)."""
        saves = self._saves
        lens = np.fromiter(map(len, saves), dtype=np.int64, count=self.n)
        idx = np.fromiter(map(self._index.__getitem__, chain.from_iterable(saves)),
                          dtype=np.int64, count=int(lens.sum()))
        return self.root_a[idx], np.repeat(np.arange(self.n, dtype=np.int64), lens)


class _Sim:
    """Builds the task graph of one step and list-schedules it."""

    def __init__(self, graph: OpGraph, plan: Plan, costs: CostModel,
                 others: dict[str, float] | None = None) -> None:
        self.g, self.plan, self.costs = graph, plan, costs
        self.others = others
        # per task
        self.kind: list[str] = []
        self.res: list[int] = []
        self.dur: list[float] = []
        self.enc: list[int] = []  # the schedule priority (a tuple once) as one order-keeping int
        self.label: list[str] = []
        self.mb: list[int] = []
        self.nbytes: list[int] = []
        self.node: list[int] = []  # the op of a forward or backward, the producer of a transfer
        self.resources: list[tuple[str, int, int]] = []  # ("stage", s, -1) / ("link", a, b)
        self._res_index: dict[tuple, int] = {}

    def resource(self, key: tuple) -> int:
        r = self._res_index.get(key)
        if r is None:
            r = self._res_index[key] = len(self.resources)
            self.resources.append(key)
        return r

    def task(self, kind: str, res: int, dur: float, enc: int, label: str, mb: int = -1,
             nbytes: int = 0, node: int = -1) -> int:
        t = len(self.kind)
        self.kind.append(kind)
        self.res.append(res)
        self.dur.append(dur)
        self.enc.append(enc)
        self.label.append(label)
        self.mb.append(mb)
        self.nbytes.append(nbytes)
        self.node.append(node)
        return t

    def prio(self, slot: int, x: int | None = None) -> int:
        """The priority tuple ``(slot,)`` or ``(slot, x)`` as an int that orders the same."""
        return slot * self.W if x is None else slot * self.W + x + self.N + 1

    # -- building ------------------------------------------------------------------------
    def build(self) -> None:
        g, plan, costs = self.g, self.plan, self.costs
        A = self.arrays = _GraphArrays.of(g)
        N = self.N = A.n
        self.W = W = 2 * N + 2  # (slot, x) with -N < x < N  ->  slot * W + x + N + 1
        names, out_b = A.names, A.out_bytes
        succs = g.succs
        if type(plan).assignment is Plan.assignment:  # the same list, faster
            stage = list(map(plan.placement.__getitem__, names))
        else:
            stage = plan.assignment(g)
        self.stage = stage
        st = self.st = np.asarray(stage, dtype=np.int64)
        S, M = len(plan.stages), plan.micro_batches
        reps = [plan.stages[s] for s in range(S)]
        frac = [1.0 / (len(reps[s]) * M) for s in range(S)]
        self.frac = frac
        # the slowest replica sets a stage's pace
        types = [{costs.cluster.device(d).type_key: d for d in reps[s]} for s in range(S)]
        is_op, has_b = A.is_op, A.has_b
        ops_arr = np.flatnonzero(is_op)
        st_ops = st[ops_arr]
        ops_by_stage = [ops_arr[st_ops == s] for s in range(S)]
        first_op = [int(o[0]) if len(o) else N for o in ops_by_stage]
        order = sorted(range(S), key=lambda s: first_op[s])
        active = [s for s in order if first_op[s] < N]
        rank = {s: k for k, s in enumerate(active)}
        warm = {s: min(len(active) - rank[s], M) for s in active}
        self.stage_res = [self.resource(("stage", s, -1)) for s in range(S)]  # = range(S)
        if plan.schedule == "gpipe":
            slot_f = [list(range(M)) for _ in range(S)]
            slot_b = [[M + m for m in range(M)] for _ in range(S)]
        else:
            slot_f, slot_b = [], []
            for s in range(S):
                w = warm.get(s, 1)
                slot_f.append([m if m < w else w + 2 * (m - w) + 1 for m in range(M)])
                slot_b.append([w + 2 * m for m in range(M)])

        # forwards and backwards: per micro-batch, every op's forward then its backward
        nb = has_b[ops_arr]
        width = 1 + nb.astype(np.int64)
        off_ops = np.cumsum(width) - width
        per_m = self.per_m = int(width.sum())
        off_f = np.full(N, -1, dtype=np.int64)
        off_f[ops_arr] = off_ops
        off_b = np.full(N, -1, dtype=np.int64)
        off_b[ops_arr[nb]] = off_ops[nb] + 1
        self.off_f, self.off_b = off_f, off_b
        tpl_node = np.empty(per_m, dtype=np.int64)
        tpl_node[off_ops] = ops_arr
        tpl_node[off_ops[nb] + 1] = ops_arr[nb]
        tpl_isb = np.zeros(per_m, dtype=bool)
        tpl_isb[off_ops[nb] + 1] = True
        tpl_stage = st[tpl_node]
        sec = self.seconds = _Seconds(costs, self.others)
        fwd_d = np.zeros(N)
        bwd_d = np.zeros(N)
        for s in range(S):
            idx = ops_by_stage[s]
            if len(idx):
                fwd_d[idx] = sec.slowest("fwd_s", idx, types[s].values(), frac[s])
                idx = idx[has_b[idx]]
                bwd_d[idx] = sec.slowest("bwd_s", idx, types[s].values(), frac[s])
        if costs.message_s:
            _message_time(A, st, S, fwd_d, bwd_d, costs.message_s)
        tpl_node_l = tpl_node.tolist()
        self.kind = np.array([F, B], dtype=object)[tpl_isb.view(np.int8)].tolist() * M
        self.res = tpl_stage.tolist() * M
        self.fb_stage = tpl_stage
        self.fb_dur = np.where(tpl_isb, bwd_d[tpl_node], fwd_d[tpl_node])
        self.dur = self.fb_dur.tolist() * M
        self.label = A.names_obj[tpl_node].tolist() * M
        self.node = tpl_node_l * M
        self.mb = np.repeat(np.arange(M), per_m).tolist()
        self.nbytes = [0] * (per_m * M)
        x = np.where(tpl_isb, -tpl_node, tpl_node) + (N + 1)
        sf, sb = np.asarray(slot_f, dtype=np.int64), np.asarray(slot_b, dtype=np.int64)
        enc_fb = np.concatenate([np.where(tpl_isb, sb[tpl_stage, m], sf[tpl_stage, m]) * W + x
                                 for m in range(M)])
        self.enc = [0] * len(enc_fb)  # (kept as enc_fb; the tasks below append theirs)

        # dependencies: blocks of (src, dst) arrays, and pairs collected one by one
        src_parts: list[np.ndarray] = []
        dst_parts: list[np.ndarray] = []
        py_src: list[int] = []
        py_dst: list[int] = []

        def edges(src: np.ndarray, dst: np.ndarray, m_src: int = 0, m_dst: int = 0) -> None:
            src_parts.append(src + m_src * per_m if m_src else src)
            dst_parts.append(dst + m_dst * per_m if m_dst else dst)

        self.transfer_bytes = 0
        self.late_xfer: list[tuple[int, float]] = []
        self._links: dict[int, tuple] = {}
        e_p, e_c = A.e_p, A.e_c
        same = st[e_p] == st[e_c]
        op_c = is_op[e_c]
        # forward edges and activation transfers (one per tensor, micro-batch, destination)
        sel = op_c & is_op[e_p] & same
        fs, fd = off_f[e_p[sel]], off_f[e_c[sel]]
        for m in range(M):
            edges(fs, fd, m, m)
        # a weight or buffer used on another stage is sent there once; an activation once per
        # micro-batch. Transfers are made in the order their first consumer (by node, then
        # input) meets them.
        sel = op_c & (A.kcode[e_p] != _INPUT) & ~same
        cp, ci = e_p[sel], e_c[sel]
        xf_parts = []  # received activations, for memory
        if len(cp):
            keys = cp * S + st[ci]
            uk, k_edge, sizes, base = self._first_seen(keys, np.where(is_op[cp], M, 1))
            up, us = uk // S, uk % S
            u_act = is_op[up]
            k_task = np.repeat(np.arange(len(uk)), sizes)
            m_task = np.arange(len(k_task)) - np.repeat(base - base[0], sizes)
            tp, ts, t_act = up[k_task], us[k_task], u_act[k_task]
            enc = np.where(t_act, sf[ts, m_task], 0) * W + tp + (N + 1)
            labels = A.names_obj[tp]
            for j in np.flatnonzero(~t_act).tolist():
                labels[j] = f"{names[tp[j]]} -> stage {ts[j]}"
            ob = A.out_b[tp]
            self._transfers(st[tp], ts, np.where(t_act, ob // M, ob), enc, labels.tolist(),
                            np.where(t_act, m_task, -1), np.where(t_act, tp, -1))
            # edges: producer's forward -> transfer -> consumer's forward (a weight's one
            # transfer feeds every micro-batch)
            e_base, e_act = base[k_edge], u_act[k_edge]
            fi = off_f[ci]
            ab = base[u_act]
            for m in range(M):
                edges(np.where(e_act, e_base + m, e_base), fi, 0, m)
                edges(off_f[up[u_act]], ab + m, m)
            xa = np.flatnonzero(t_act)
            xf_parts.append((base[0] + xa, ts[xa], tp[xa], m_task[xa],
                             ~A.grad_named[tp[xa]], A.out_b[tp[xa]] // M))
        # backward edges: a node's backward waits for its consumers' backwards
        bops = ops_arr[nb]
        for m in range(M):
            edges(off_f[bops], off_b[bops], m, m)
        both = has_b[e_p] & has_b[e_c]
        sel = both & same
        bs, bd = off_b[e_c[sel]], off_b[e_p[sel]]
        for m in range(M):
            edges(bs, bd, m, m)
        # activation gradients sent back, once per micro-batch, made in the order of (node,
        # consumer)
        sel = both & ~same
        bi_, bc_ = e_p[sel], e_c[sel]
        if len(bi_):
            o = np.lexsort((bc_, bi_))
            bi_, bc_ = bi_[o], bc_[o]
            keys = bi_ * S + st[bc_]
            uk, k_edge, sizes, base = self._first_seen(keys, np.full(len(keys), M))
            ui, us = uk // S, uk % S
            k_task = np.repeat(np.arange(len(uk)), M)
            m_task = np.tile(np.arange(M), len(uk))
            tp, ts = ui[k_task], us[k_task]
            enc = sb[ts, m_task] * W - tp + (N + 1)
            labels = np.repeat(np.array([f"grad {names[i]}" for i in ui.tolist()], dtype=object),
                               M).tolist()
            self._transfers(ts, st[tp], A.out_b[tp] // M, enc, labels, m_task, tp)
            for m in range(M):
                edges(base + m, off_b[ui], 0, m)
                edges(off_b[bc_], base[k_edge] + m, m)
            xf_parts.append((base[0] + np.arange(len(k_task)), st[tp], tp, m_task,
                             np.zeros(len(tp), dtype=bool), A.out_b[tp] // M))
        self.xf = tuple(np.concatenate([x[k] for x in xf_parts]) if xf_parts else
                        np.zeros(0, dtype=np.int64) for k in range(6))
        # 1F1B: at most `warm` micro-batches in flight on a stage
        if plan.schedule == "1f1b" and M > 1:
            for s in active:
                w = warm[s]
                fo = off_f[ops_by_stage[s]]
                bo = off_b[ops_by_stage[s][has_b[ops_by_stage[s]]]]
                if not len(bo):
                    continue
                for m in range(w, M):
                    gate = self.task("gate", self.resource(("gate", s, m - w)), 0.0,
                                     self.prio(0), "", m - w)
                    edges(bo, np.full(len(bo), gate), m - w)
                    edges(np.full(len(fo), gate), fo, 0, m)
        # gradients: params consumed on other stages send their gradient home; replicated
        # stages all-reduce in buckets; then each stage steps its optimizer
        is_pg = np.zeros(N, dtype=bool)
        is_pg[A.pg] = True
        sent_home: dict[int, list[int]] = {}  # param -> its gradients sent from other stages
        sel = is_pg[e_p] & has_b[e_c] & ~same
        gp_, gc_ = e_p[sel], e_c[sel]
        if len(gp_):
            o = np.lexsort((gc_, gp_))
            gp_, gc_ = gp_[o], gc_[o]
            keys = gp_ * S + st[gc_]
            uk, k_edge, _, base = self._first_seen(keys, np.ones(len(keys), dtype=np.int64))
            up, us = uk // S, uk % S
            self._transfers(us, st[up], A.out_b[up], _LAST * W - up + (N + 1),
                            [f"grad {names[p]}" for p in up.tolist()],
                            np.full(len(up), -1), up)
            for m in range(M):
                edges(off_b[gc_], base[k_edge], m)
            for p, t in zip(up.tolist(), base.tolist(), strict=True):
                sent_home.setdefault(p, []).append(t)
        self.allreduce_bytes = 0
        pg = A.pg
        trainable_bytes = [0] * S
        trainable_count = [0] * S
        for i in A.trainable:
            trainable_bytes[stage[i]] += A.param_bytes[i]
            trainable_count[stage[i]] += 1
        for s in range(S):
            params = pg[st[pg] == s][::-1].tolist()
            before_opt = [t for p in params for t in sent_home.get(p, ())]
            d_opt = max(costs.optimizer_s(dv, plan.optimizer, trainable_bytes[s],
                                          trainable_count[s]) * self._opt_slowed(dv)
                        for dv in types[s].values())
            if len(reps[s]) > 1 and params:
                has_b_l, off_b_l = has_b.tolist(), off_b.tolist()
                chan = self.resource(("allreduce", s, -1))
                # the first bucket also waits for the slowest replica to catch up
                lag = self._replica_lag(s, reps[s], M, d_opt)
                bucket: list[int] = []
                size = 0
                for k, p in enumerate([*params, None]):
                    if p is not None:
                        bucket.append(p)
                        size += out_b[p]
                    if bucket and (p is None or size >= BUCKET_BYTES):
                        d = costs.allreduce_s(reps[s], size) + lag
                        lag = 0.0
                        k_ = len(reps[s])
                        self.allreduce_bytes += int(2 * (k_ - 1) * size)
                        t = self.task(ALLREDUCE, chan, d, self.prio(k), f"all-reduce {size} B",
                                      -1, size)
                        for q in bucket:
                            for c in succs[q]:
                                if has_b_l[c] and stage[c] == s:
                                    bc = off_b_l[c]
                                    for m in range(M):
                                        py_src.append(bc + m * per_m)
                                        py_dst.append(t)
                            for x_ in sent_home.get(q, ()):
                                py_src.append(x_)
                                py_dst.append(t)
                        before_opt.append(t)
                        bucket, size = [], 0
            if not trainable_count[s]:
                continue
            t = self.task(OPT, self.stage_res[s], d_opt, self.prio(_LAST),
                          f"{plan.optimizer} step")
            py_src.extend(before_opt)
            py_dst.extend([t] * len(before_opt))
            last = np.where(off_b[ops_by_stage[s]] >= 0, off_b[ops_by_stage[s]],
                            off_f[ops_by_stage[s]])
            for m in range(M):
                edges(last, np.full(len(last), t), m)
        # successor lists and dependency counts
        T = len(self.kind)
        src = np.concatenate([*src_parts, np.asarray(py_src, dtype=np.int64)])
        dst = np.concatenate([*dst_parts, np.asarray(py_dst, dtype=np.int64)])
        # grouped by task (a stable sort is quick here: the blocks come mostly in order; the
        # order among a task's successors does not matter)
        self.succ_flat_a = dst[np.argsort(src, kind="stable")]
        self.succ_ptr_a = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=T))])
        # successors of t: succ_flat[succ_ptr[t]:succ_ptr[t + 1]]
        self.succ_flat, self.succ_ptr = self.succ_flat_a.tolist(), self.succ_ptr_a.tolist()
        # per forward/backward task, the transfers it receives that can arrive late:
        # [(transfer, wait, sending stage)]
        self.late_in: dict[int, list[tuple[int, float, int]]] = {}
        n_fb = per_m * M
        for x, wait in self.late_xfer:
            s_send = self.resources[self.res[x]][1]
            for u in self.succ_flat[self.succ_ptr[x]:self.succ_ptr[x + 1]]:
                if u < n_fb:
                    self.late_in.setdefault(u, []).append((x, wait, s_send))
        ndeps = np.bincount(dst, minlength=T)
        self.ndeps = ndeps.tolist()
        self.first = np.flatnonzero(ndeps == 0).tolist()  # tasks ready at the start
        # the queues order tasks by (priority, task id): one int, priority * T + id
        fb = len(enc_fb)
        if fb and int(enc_fb.max()) < 2**62 // T:
            self.key = (enc_fb * T + np.arange(fb)).tolist()
        else:
            self.key = [e * T + t for t, e in enumerate(enc_fb.tolist())]
        self.key += [e * T + t for t, e in enumerate(self.enc[fb:], fb)]
        del self.enc
        # whether every task takes no negative time (then time only moves forward)
        self.forward_only = bool((fwd_d >= 0.0).all() and (bwd_d >= 0.0).all()
                                 and (np.asarray(self.dur[fb:], dtype=np.float64) >= 0.0).all())

    def _opt_slowed(self, device: str) -> float:
        """How much slower ``device``'s optimizer step runs beside its stage's other replicas
        on its host (they step the same parameters at the same moment):
        ``1 + (ratio - 1) x others``, with the profile's measured ratio
        (``DeviceCosts.optimizer_contention``)."""
        others = (self.others or {}).get(device, 0.0)
        if not others:
            return 1.0
        ratio = self.costs.per_type[self.costs.cluster.device(device).type_key] \
            .optimizer_contention
        return 1.0 + (ratio - 1.0) * others

    def _replica_lag(self, s: int, devices: list[str], M: int, opt_s: float) -> float:
        """How long stage ``s``'s gradient all-reduce waits, on average, for its slowest
        replica beyond the replicas' common pace: where the profile measured how far two
        replicas' busy time wanders apart (``DeviceCosts.replica_spread``), that fraction of
        the stage's busy time, scaled from two replicas to ``len(devices)`` as the expected
        largest of that many normal samples is to the largest of two."""
        costs = self.costs
        spread = max(costs.per_type[dv.type_key].replica_spread
                     for dv in (costs.cluster.device(d) for d in devices))
        if spread <= 0.0:
            return 0.0
        busy = M * float(self.fb_dur[self.fb_stage == s].sum()) + opt_s
        return spread * busy * _expected_max_normal(len(devices)) / _expected_max_normal(2)

    def _first_seen(self, keys: np.ndarray, sizes: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Distinct ``keys`` in the order they first occur, each making ``sizes`` tasks (the
        size at its first occurrence) from the next free task id on.

        Returns the keys in that order, each key's place in it per occurrence, the sizes, and
        each key's first task id.
        """
        uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        o = np.argsort(first)
        rank = np.empty(len(o), dtype=np.int64)
        rank[o] = np.arange(len(o))
        size = sizes[first[o]]
        return uniq[o], rank[inv.reshape(-1)], size, len(self.kind) + np.cumsum(size) - size

    def _transfers(self, a: np.ndarray, b: np.ndarray, nbytes: np.ndarray, enc: np.ndarray,
                   label: list[str], mb: np.ndarray, node: np.ndarray) -> None:
        """Transfer tasks from stage ``a[k]`` to ``b[k]`` of ``nbytes[k]`` bytes, in order.

        Each ordered pair of stages is one link (a resource, made at its first transfer).
        Replicated stages send their shards side by side: a transfer takes as long as
        ``costs.transfer_s`` between the first devices for its bytes over the narrower side.
        """
        S = len(self.plan.stages)
        stages, costs = self.plan.stages, self.costs
        self.transfer_bytes += int(nbytes.sum())
        link = a * S + b
        uniq, first, inv = np.unique(link, return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
        lres, lsrc, ldst, lwidth, llat, lbw, llate = [], [], [], [], [], [], []
        for k in np.argsort(first).tolist():  # (resources in order of first use)
            sa, sb_ = divmod(int(uniq[k]), S)
            src, dst = stages[sa][0], stages[sb_][0]
            lk = costs.cluster.link(src, dst)
            lres.append((k, self.resource(("link", sa, sb_))))
            lsrc.append((k, src))
            ldst.append((k, dst))
            lwidth.append((k, min(len(stages[sa]), len(stages[sb_]))))
            llat.append((k, lk.latency_s if src != dst else 0.0))
            lbw.append((k, lk.bandwidth_bytes_per_s if src != dst else np.inf))
            llate.append((k, lk.late_receive_s if src != dst else 0.0))

        def per_link(pairs: list, dtype: Any) -> np.ndarray:
            out = np.empty(len(pairs), dtype=dtype)
            for k, v in pairs:
                out[k] = v
            return out

        res = per_link(lres, np.int64)[inv]
        n = np.maximum(nbytes // per_link(lwidth, np.int64)[inv], 1)
        if _plain(costs):  # CostModel.transfer_s: latency + bytes / bandwidth x link_scale
            src_is_dst = (per_link(lsrc, object) == per_link(ldst, object))[inv]
            dur = per_link(llat, np.float64)[inv] + n / per_link(lbw, np.float64)[inv] \
                * costs.link_scale
            dur = np.where(src_is_dst, 0.0, dur).tolist()
        else:
            srcs, dsts = per_link(lsrc, object)[inv], per_link(ldst, object)[inv]
            dur = [costs.transfer_s(x, y, k) for x, y, k in
                   zip(srcs.tolist(), dsts.tolist(), n.tolist(), strict=True)]
        count = len(a)
        # activations and their gradients (sent while the ranks compute) whose receive may be
        # posted late: (task, wait)
        late = per_link(llate, np.float64)[inv]
        for k in np.flatnonzero((late > 0) & (np.asarray(mb) >= 0)).tolist():
            self.late_xfer.append((len(self.kind) + k, float(late[k])))
        self.kind.extend([XFER] * count)
        self.res.extend(res.tolist())
        self.dur.extend(dur)
        self.enc.extend(np.asarray(enc).tolist())
        self.label.extend(label)
        self.mb.extend(np.asarray(mb).tolist())
        self.nbytes.extend(np.asarray(nbytes).tolist())
        self.node.extend(np.asarray(node).tolist())

    # -- scheduling ----------------------------------------------------------------------
    def run(self) -> None:
        T = len(self.kind)
        self.start = [0.0] * T
        self.end = [0.0] * T
        self.cause = [-1] * T  # the task whose end let this one start (critical path)
        self.order = []  # tasks in the order they start: a topological order
        if self.forward_only and not self.late_in:
            self._run_forward()
        else:
            self._run_general()
        if len(self.order) != T:
            raise PlanError("the plan's schedule cannot finish (a dependency cycle); this is a "
                            "bug in the plan or simulator, please report it with the plan JSON")

    def _first_tasks(self, key: list[int]) -> tuple[list[list[int]], list[bool],
                                                     list[tuple[float, int]]]:
        """Queue the tasks without dependencies and start one on each resource at time 0."""
        T = len(self.kind)
        res, dur = self.res, self.dur
        queues: list[list[int]] = [[] for _ in self.resources]
        for t in self.first:
            queues[res[t]].append(key[t])
        busy = [False] * len(queues)
        events: list[tuple[float, int]] = []
        for r, q in enumerate(queues):
            if q:
                heapq.heapify(q)
                t = heapq.heappop(q) % T
                self.end[t] = e = 0.0 + dur[t]
                self.order.append(t)
                busy[r] = True
                heapq.heappush(events, (e, t))
        return queues, busy, events

    def _run_forward(self) -> None:
        """The list schedule when no task takes negative time, so time only moves forward.

        Whenever a resource is free it starts its first ready task (by priority, then task
        id). With time moving forward a task starts the moment it becomes ready or its
        resource frees, so the general loop's bookkeeping reduces to: a task that becomes ready
        on an idle resource starts now, caused by the task that readied it; a freed resource
        starts its first queued task now, caused by whichever came last of its readiness and
        the task that freed the resource. A resource's next task is handled without the event
        heap when its end is the earliest event anyway.
        """
        T = len(self.kind)
        res, dur, flat, ptr = self.res, self.dur, self.succ_flat, self.succ_ptr
        start, end, cause, order = self.start, self.end, self.cause, self.order
        deps = list(self.ndeps)
        key = self.key
        ready_at = [0.0] * T
        ready_from = [-1] * T
        queues, busy, events = self._first_tasks(key)
        heappush, heappop = heapq.heappush, heapq.heappop
        while events:
            now, t = heappop(events)
            while True:  # the event: task t ends at time `now`
                r = res[t]
                touched = None
                for u in flat[ptr[t]:ptr[t + 1]]:
                    d = deps[u] - 1
                    deps[u] = d
                    if not d:
                        ready_at[u] = now
                        ready_from[u] = t
                        ru = res[u]
                        heappush(queues[ru], key[u])
                        if ru != r:
                            if touched is None:
                                touched = [ru]
                            else:
                                touched.append(ru)
                if touched is not None:  # idle resources whose queue was empty until now
                    for ru in touched:
                        if busy[ru]:
                            continue
                        u = heappop(queues[ru]) % T
                        start[u] = now
                        end[u] = e = now + dur[u]
                        order.append(u)
                        cause[u] = t
                        busy[ru] = True
                        heappush(events, (e, u))
                q = queues[r]
                if not q:
                    busy[r] = False
                    break
                u = heappop(q) % T
                start[u] = now
                end[u] = e = now + dur[u]
                order.append(u)
                cause[u] = ready_from[u] if ready_at[u] >= now else t
                if events:
                    h = events[0]
                    if e > h[0] or (e == h[0] and u > h[1]):
                        heappush(events, (e, u))
                        break
                now, t = e, u  # u's end is the next event

    def _run_general(self) -> None:
        """The list schedule, for any task times (also negative ones), and with receives
        that arrive late.

        A rank receives a transfer in the first task that needs it, posting the receive when
        it gets to that task, the moment its previous task ends. Where the transfer's link has
        a late-receive wait (``Link.late_receive_s``) and the transfer was sent before that
        moment while its sender is computing then, the task starts no earlier than that moment
        plus the wait.
        """
        T = len(self.kind)
        res, dur, flat, ptr = self.res, self.dur, self.succ_flat, self.succ_ptr
        start, end, cause, order = self.start, self.end, self.cause, self.order
        deps = list(self.ndeps)
        key = self.key
        ready_at = [0.0] * T
        ready_from = [-1] * T
        R = len(self.resources)
        free_at = [0.0] * R
        last_on = [-1] * R
        late_in = self.late_in
        received: set[int] = set()
        # per stage, the starts and ends of its tasks so far (they start in time order)
        starts_on: list[list[float]] = [[] for _ in range(R)]
        ends_on: list[list[float]] = [[] for _ in range(R)]

        def computing(s: int, at: float) -> bool:
            k = bisect.bisect_right(starts_on[s], at) - 1
            return k >= 0 and ends_on[s][k] > at

        queues, busy, events = self._first_tasks(key)
        if late_in:
            for t in order:
                starts_on[res[t]].append(start[t])
                ends_on[res[t]].append(end[t])
        heappush, heappop = heapq.heappush, heapq.heappop
        while events:
            now, t = heappop(events)
            r = res[t]
            busy[r] = False
            free_at[r] = now
            last_on[r] = t
            touched = [r]
            for u in flat[ptr[t]:ptr[t + 1]]:
                if now >= ready_at[u]:
                    ready_at[u], ready_from[u] = now, t
                deps[u] -= 1
                if deps[u] == 0:
                    ru = res[u]
                    heappush(queues[ru], key[u])
                    touched.append(ru)
            for ru in touched:
                if busy[ru] or not queues[ru]:
                    continue
                u = heappop(queues[ru]) % T
                s = max(now, ready_at[u], free_at[ru])
                c = ready_from[u] if ready_at[u] >= free_at[ru] else last_on[ru]
                if u in late_in:  # the first of a transfer's consumers to start receives it
                    posted = free_at[ru]
                    for x, wait, s_send in late_in[u]:
                        if x in received:
                            continue
                        received.add(x)
                        if start[x] < posted and posted + wait > s \
                                and computing(s_send, posted):
                            s, c = posted + wait, x
                if late_in:  # (what computing() looks up)
                    starts_on[ru].append(s)
                    ends_on[ru].append(s + dur[u])
                start[u] = s
                end[u] = s + dur[u]
                order.append(u)
                cause[u] = c
                busy[ru] = True
                heappush(events, (end[u], u))


@functools.cache
def _expected_max_normal(k: int) -> float:
    """E[max of k independent standard normal samples] (0.564 for 2, 1.029 for 4, 1.424 for
    8): the integral of x k phi(x) Phi(x)^(k-1) over x."""
    from scipy.special import ndtr

    x = np.linspace(-10.0, 10.0, 20001)
    density = k * np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi) * ndtr(x) ** (k - 1)
    return float(np.sum(x * density) * (x[1] - x[0]))


def _message_time(A: _GraphArrays, st: np.ndarray, S: int, fwd_d: np.ndarray,
                  bwd_d: np.ndarray, message_s: float) -> None:
    """Charge each device's processor for the activations and gradients it sends and
    receives, where the runtime does it: an op's output goes once to each other stage that
    uses it (at the end of its forward) and is received by its first consumer there; the
    gradient comes back once per such stage, sent by the backward of the earliest consumer
    there (the last to run) and received by the producer's backward."""
    e_p, e_c = A.e_p, A.e_c
    for is_b in (False, True):
        sel = st[e_p] != st[e_c]
        sel &= (A.has_b[e_p] & A.has_b[e_c]) if is_b else (A.is_op[e_p] & A.is_op[e_c])
        p, c = e_p[sel], e_c[sel]
        if not len(p):
            continue
        # edges come by consumer in node order: a key's first edge has its first consumer
        _, first = np.unique(p * S + st[c], return_index=True)
        d = bwd_d if is_b else fwd_d
        np.add.at(d, p[first], message_s)
        np.add.at(d, c[first], message_s)


def simulate(graph: OpGraph, plan: Plan, costs: CostModel) -> Prediction:
    """Predict one training step of ``graph`` under ``plan`` with ``costs``.

    >>> import explorer as ex  # doctest: +SKIP
    >>> pred = ex.simulate(graph, plan, costs)  # doctest: +SKIP
    >>> pred.step_s, pred.peak_bytes, pred.bottleneck  # doctest: +SKIP
    """
    costs.check(graph)
    plan.validate(graph, costs.cluster)
    return _predict(graph, plan, costs, _schedule(graph, plan, costs))


def _schedule(graph: OpGraph, plan: Plan, costs: CostModel) -> _Sim:
    """The step's tasks, list-scheduled; where replicas of a stage share a host (measured
    contention), their ops slowed by it."""
    sim = _Sim(graph, plan, costs, _contended(plan, costs))
    sim.build()
    sim.run()
    return sim


def _contended(plan: Plan, costs: CostModel) -> dict[str, float]:
    """Per device of a replicated stage whose profile measured contention (CPU ranks of one
    host): how many of the stage's other replicas compute beside it, which is all of them,
    all the time.

    Replicas run the same op at the same moment, the case the profile measures. Different
    stages computing at once run different ops, and are not slowed by it: in GPipe and
    two-stage plans of all four built-in models, each rank's measured busy time matched one
    rank's op times (see README, accuracy).
    """
    if not _plain(costs):
        return {}
    cluster = costs.cluster
    out: dict[str, float] = {}
    for st in plan.stages:
        shared = [d for d in st if costs.per_type[cluster.device(d).type_key].contention]
        if len(shared) > 1:
            out.update(dict.fromkeys(shared, float(len(shared) - 1)))
    return out


def execution_order(graph: OpGraph, plan: Plan, costs: CostModel | None = None) -> Schedule:
    """Per stage, the compute tasks as :class:`Action` s in the order the simulated schedule
    starts them.

    Each action is a "fwd", "bwd" or "optimizer" (micro-batch and node -1) task. All stages'
    lists are subsequences of one topological order of the step's tasks, so ranks that follow
    them with blocking receives (and non-blocking sends) cannot deadlock, whatever the
    placement. Without ``costs`` every op counts as one unit of time.
    """
    if costs is None:
        costs = unit_costs(graph, plan)
    sim = _schedule(graph, plan, costs)  # the order the prediction assumes, contention too
    S = len(plan.stages)
    out: Schedule = [[] for _ in plan.stages]
    kind, res, mb, node = sim.kind, sim.res, sim.mb, sim.node
    for t in sim.order:
        r = res[t]
        if r < S:  # the stages are resources 0 .. S-1
            out[r].append(Action(kind[t], mb[t], node[t]))
    return out


def unit_costs(graph: OpGraph, plan: Plan) -> CostModel:
    """Every op 1 s forward and 2 s backward, free links: for schedules without a profile."""
    from explorer.costs.model import DeviceCosts
    from explorer.devices.cluster import Cluster, Device, Link

    devs = tuple(Device(d, "cpu", "unit", 2**62, 1.0, 1.0, 1.0, 0.0, 0.0, False, "", "unit")
                 for d in plan.devices)
    cl = Cluster("unit", devs, Link(0.0, float("inf"), "unit"))
    ops = [n.kind == "op" for n in graph.nodes]
    dc = DeviceCosts("cpu:unit", [1.0 * o for o in ops], [2.0 * o for o in ops],
                     ["unit"] * len(ops), 0.0)
    return CostModel(graph.fingerprint, cl, {"cpu:unit": dc})


def _predict(graph: OpGraph, plan: Plan, costs: CostModel, sim: _Sim) -> Prediction:
    S, M = len(plan.stages), plan.micro_batches
    end_a = np.asarray(sim.end)
    step_s = max(sim.end, default=0.0)
    # busy time: each stage's task times summed in task order (the forward/backward block,
    # laid out per micro-batch, then the rest)
    busy_stage = np.bincount(np.tile(sim.fb_stage, M), weights=np.tile(sim.fb_dur, M),
                             minlength=S).astype(np.float64).tolist()  # (floats when empty too)
    res, dur = sim.res, sim.dur
    for t in range(len(sim.fb_stage) * M, len(res)):
        if res[t] < S:
            busy_stage[res[t]] += dur[t]
    busy = {d: busy_stage[s] for s in range(S) for d in plan.stages[s]}
    cluster = costs.cluster
    memory = _memory(graph, plan, sim, end_a)
    energy = {}
    for d, b in busy.items():
        dev = cluster.device(d)
        energy[d] = dev.power_w * b + dev.idle_power_w * max(step_s - b, 0.0)
    bottleneck = max(busy, key=lambda d: (busy[d], -plan.devices.index(d)))
    last = int(np.argmax(end_a)) if len(end_a) else -1  # the first task to end last
    return Prediction(
        step_s=step_s, busy_s=busy, timeline=_Timeline(sim),  # type: ignore[arg-type]
        memory=memory,
        capacity_bytes={d: cluster.device(d).memory_bytes for d in plan.devices},
        transfer_bytes=sim.transfer_bytes, allreduce_bytes=sim.allreduce_bytes,
        energy_j=sum(energy.values()), energy_by_device_j=energy,
        critical_path=_CriticalPath(sim, last),  # type: ignore[arg-type]
        bottleneck=bottleneck, lower_bound_s=_lower_bound(sim.arrays, costs, _Seconds(costs)),
        algorithm=plan.algorithm)


def _memory(graph: OpGraph, plan: Plan, sim: _Sim, end_a: np.ndarray
            ) -> dict[str, MemoryBreakdown]:
    A = sim.arrays
    stage, st, M = sim.stage, sim.st, plan.micro_batches
    N, S, per_m = A.n, len(plan.stages), sim.per_m
    is_op, has_b, kcode = A.is_op, A.has_b, A.kcode
    off_f, off_b = sim.off_f, sim.off_b
    e_p, e_c = A.e_p, A.e_c
    start, end = sim.start, sim.end
    start_a = np.asarray(start)
    frac = np.asarray(sim.frac)
    out_b = A.out_b
    state_per_byte = OPTIMIZER_STATE[plan.optimizer]
    params = [0] * S
    bufs = [0] * S
    opt = [0] * S
    kinds, rg, param_bytes = A.kinds, A.rg, A.param_bytes
    for i in np.flatnonzero(A.pbytes).tolist():
        s = stage[i]
        if kinds[i] == "buffer":
            bufs[s] += param_bytes[i]
        else:
            params[s] += param_bytes[i]
            if rg[i] or kinds[i] == "op":
                opt[s] += param_bytes[i] * state_per_byte
    # a copy of each weight or buffer on every other stage that reads it
    sel = ((kcode[e_p] == _PARAM) | (kcode[e_p] == _BUFFER)) & (st[e_c] != st[e_p])
    for p, s in set(zip(e_p[sel].tolist(), st[e_c[sel]].tolist(), strict=True)):
        params[s] += A.out_bytes[p]
    root = A.root_a
    # saved-for-backward: (producer root, node whose backward keeps it)
    sv_p_a, sv_v_a = A.saved

    # activation memory events: stage, time and bytes (an allocation positive, a free negative)
    ev_s: list[np.ndarray] = []
    ev_t: list[np.ndarray] = []
    ev_b: list[np.ndarray] = []

    def live(s: np.ndarray, t0: np.ndarray, t1: np.ndarray, nbytes: np.ndarray) -> None:
        keep = nbytes > 0
        if not keep.all():
            s, t0, t1, nbytes = s[keep], t0[keep], t1[keep], nbytes[keep]
        ev_s.extend((s, s))
        ev_t.extend((t0, np.maximum(t1, t0)))
        ev_b.extend((nbytes, -nbytes))

    def size_on(nbytes: np.ndarray, s: np.ndarray) -> np.ndarray:
        return (nbytes * frac[s]).astype(np.int64)

    # activations of ops that own their memory: from the forward's start until the last
    # forward consumer (through views), saving backward or the loss's backward. An output sent
    # to another stage is handed to the send when its forward ends (the runtime's accounting).
    rops = np.flatnonzero(is_op & (root == np.arange(N)))
    if len(rops):
        rs = st[rops]
        size = size_on(out_b[rops], rs)
        pos = np.full(N, -1, dtype=np.int64)  # root op -> its place in rops
        pos[rops] = np.arange(len(rops))
        owner = root[e_p]
        sel = pos[owner] >= 0
        own, con = owner[sel], e_c[sel]
        fsel = (st[own] == st[con]) & is_op[con]
        # (owner, base, step): a task besides the owner's forward that may end the
        # activation's life; micro-batch m's is base + m * step
        parts = [(own[fsel], off_f[con[fsel]], per_m)]
        loss = graph.index.get(graph.loss, -1) if graph.loss else -1
        if loss >= 0 and pos[loss] >= 0 and has_b[loss]:
            parts.append((np.array([loss]), off_b[[loss]], per_m))
        sel = (pos[sv_p_a] >= 0) & (st[sv_v_a] == st[sv_p_a]) & has_b[sv_v_a]
        parts.append((sv_p_a[sel], off_b[sv_v_a[sel]], per_m))
        at_all = pos[np.concatenate([p[0] for p in parts])]
        base_all = np.concatenate([p[1] for p in parts])
        step_all = np.concatenate([np.full(len(p[0]), p[2], dtype=np.int64) for p in parts])
        for m in range(M):
            t1 = end_a[off_f[rops] + m * per_m]
            np.maximum.at(t1, at_all, end_a[base_all + m * step_all])
            live(rs, start_a[off_f[rops] + m * per_m], t1, size)
    # extra tensors saved for the backward (masks, statistics): made by the forward, kept
    # until the backward
    extra = A.extra
    xs_ = np.flatnonzero(has_b & (extra != 0))
    if len(xs_):
        for m in range(M):
            live(st[xs_], start_a[off_f[xs_] + m * per_m], end_a[off_b[xs_] + m * per_m],
                 size_on(extra[xs_], st[xs_]))
    # activation gradients, as autograd and the runtime hold them. A consumer's backward
    # makes the gradient of each op it reads: a new tensor, or the consumer's own incoming
    # gradient handed on (views, getitem, same-size add, cat: see _GraphArrays.hands_on). Per
    # op and stage, the first gradient made (in schedule order) is kept until the op's own
    # backward (for an op on another stage: until it is sent, after the backward of its last
    # consumer here); later ones are added into it and live for their backward only; a
    # handed-on gradient keeps its buffer alive until the receiving op's backward.
    sel = has_b[e_p] & has_b[e_c]
    local_grad = np.zeros(N, dtype=bool)  # ops whose gradient is made on their own stage
    if sel.any():
        hand_a, piece_a = A.hands_on
        gp, gc = e_p[sel], e_c[sel]
        hand, piece = hand_a[sel], piece_a[sel]
        new = ~hand
        gs = st[gc]  # the stage that makes (and holds) the gradient
        local = st[gp] == gs
        local_grad[gp[local]] = True
        _, ginv = np.unique(gp * S + gs, return_inverse=True)
        n_g = int(ginv.max()) + 1
        shared = np.flatnonzero(np.bincount(ginv, minlength=n_g)[ginv] > 1)
        sh_g = ginv[shared]
        far = np.flatnonzero(~local)
        p_size = size_on(out_b[gp], gs)
        hi = np.flatnonzero(hand)
        uc, h_inv = np.unique(gc[hi], return_inverse=True)
        uc_s, uc_size = st[uc], size_on(out_b[uc], st[uc])
        for m in range(M):
            tb = off_b[gc] + m * per_m
            b0, b1 = start_a[tb], end_a[tb]
            # the first of several consumers' backwards (a zero-length one before a longer one
            # that starts at the same time: it ran first)
            first = np.ones(len(gp), dtype=bool)
            if len(shared):
                o = np.lexsort((b1[shared], b0[shared], sh_g))
                head = np.ones(len(o), dtype=bool)
                head[1:] = sh_g[o][1:] != sh_g[o][:-1]
                first[shared] = False
                first[shared[o[head]]] = True
                first |= piece
            t_end = end_a[off_b[gp] + m * per_m]
            if len(far):  # sent home after the backward of the last consumer here
                sent = np.full(n_g, -np.inf)
                np.maximum.at(sent, ginv[far], b1[far])
                t_end[far] = sent[ginv[far]]
            k = new & first
            live(gs[k], b0[k], t_end[k], p_size[k])
            k = new & ~first
            live(gs[k], b0[k], b1[k], p_size[k])
            if len(hi):
                t1 = np.full(len(uc), -np.inf)
                f = first[hi]
                np.maximum.at(t1, h_inv[f], t_end[hi[f]])
                k = np.isfinite(t1)
                live(uc_s[k], end_a[off_b[uc[k]] + m * per_m], t1[k], uc_size[k])
    # graph inputs: from their first consumer's forward until their last use on each stage
    saved_by: dict[int, list[int]] = {}
    sel = kcode[sv_p_a] == _INPUT
    for p, v in zip(sv_p_a[sel].tolist(), sv_v_a[sel].tolist(), strict=True):
        saved_by.setdefault(p, []).append(v)
    off_f_l, off_b_l, has_b_l = off_f.tolist(), off_b.tolist(), has_b.tolist()
    py_s: list[int] = []
    py_t0: list[float] = []
    py_t1: list[float] = []
    py_b: list[int] = []
    succs = graph.succs
    for i in np.flatnonzero(kcode == _INPUT).tolist():
        users_by_stage: dict[int, list[int]] = {}
        for c in succs[i]:
            users_by_stage.setdefault(stage[c], []).append(c)
        for m in range(M):
            mo = m * per_m
            for s, users in users_by_stage.items():
                t1 = max(end[off_f_l[c] + mo] for c in users)
                for v in saved_by.get(i, ()):
                    if stage[v] == s and has_b_l[v]:
                        t1 = max(t1, end[off_b_l[v] + mo])
                t0 = min(start[off_f_l[c] + mo] for c in users)
                py_s.append(s)
                py_t0.append(t0)
                py_t1.append(t1)
                py_b.append(int(A.out_bytes[i] * sim.frac[s]))
    if py_s:
        live(np.asarray(py_s, dtype=np.int64), np.asarray(py_t0), np.asarray(py_t1),
             np.asarray(py_b, dtype=np.int64))
    # received activations and activation gradients: from the first task that needs them on
    # the receiving stage (it receives them) until their last use there: the tasks waiting
    # for them and, for activations, the backwards of the nodes that saved the tensor. A
    # gradient for an op that also gets gradients on its own stage is added into those (one
    # buffer), and of several received for one op and micro-batch the first is kept
    x_id, x_dst, x_node, x_m, x_fwd, x_nbytes = sim.xf
    if len(x_id):
        t1 = end_a[x_id]
        t0 = np.full(len(x_id), np.inf)
        lo, hi = sim.succ_ptr_a[x_id], sim.succ_ptr_a[x_id + 1]
        k, idx = _ranges(lo, hi)
        np.maximum.at(t1, k, end_a[sim.succ_flat_a[idx]])
        np.minimum.at(t0, k, start_a[sim.succ_flat_a[idx]])
        t0 = np.where(np.isfinite(t0), t0, end_a[x_id])
        sv_p_any, sv_v_any = A.saved_any
        sv_order = np.argsort(sv_p_any, kind="stable")
        sv_p_s, sv_v_s = sv_p_any[sv_order], sv_v_any[sv_order]
        xr = root[x_node]
        lo = np.where(x_fwd, np.searchsorted(sv_p_s, xr, side="left"), 0)
        hi = np.where(x_fwd, np.searchsorted(sv_p_s, xr, side="right"), 0)
        k, idx = _ranges(lo, hi)
        v = sv_v_s[idx]
        ok = (st[v] == x_dst[k]) & has_b[v]
        k, v = k[ok], v[ok]
        np.maximum.at(t1, k, end_a[off_b[v] + x_m[k] * per_m])
        keep = x_fwd | ~local_grad[x_node]
        gk = np.flatnonzero(~x_fwd & keep)
        if len(gk):  # one received gradient per op and micro-batch
            _, at = np.unique(x_node[gk] * M + x_m[gk], return_index=True)
            keep[gk] = False
            keep[gk[at]] = True
        live(x_dst[keep], t0[keep], t1[keep],
             (x_nbytes[keep] * M * frac[x_dst[keep]]).astype(np.int64))
    # parameter gradients: from the first backward that reaches a weight until the optimizer
    # step has used it (torch frees them with zero_grad(set_to_none=True))
    opt_end = [max(end, default=0.0)] * S
    for t in range(len(sim.kind) - 1, -1, -1):
        if sim.kind[t] == OPT:
            opt_end[sim.res[t]] = end[t]
        elif sim.kind[t] != ALLREDUCE:
            break  # the optimizer steps are the last tasks (with the all-reduces)
    pbytes = A.pbytes
    holds = (pbytes != 0) & (kcode != _BUFFER) & (rg | is_op)
    own_ops = np.flatnonzero(holds & is_op)
    sel = holds[e_p] & ~is_op[e_p]
    g_node = np.concatenate([own_ops, e_p[sel]])
    g_user = np.concatenate([own_ops, e_c[sel]])
    sel = has_b[g_user]
    g_node, g_user = g_node[sel], g_user[sel]
    g_s_ = st[g_user]
    g_ev_s = g_ev_t = g_ev_b = np.zeros(0, dtype=np.int64)
    if len(g_node):
        first_b = start_a[off_b[g_user]]
        for m in range(1, M):
            first_b = np.minimum(first_b, start_a[off_b[g_user] + m * per_m])
        gk, inv = np.unique(g_node * S + g_s_, return_inverse=True)
        g0 = np.full(len(gk), np.inf)
        np.minimum.at(g0, inv, first_b)
        gs, gsize = gk % S, pbytes[gk // S]
        g_ev_s = np.concatenate([gs, gs])
        g_ev_t = np.concatenate([g0, np.asarray(opt_end)[gs]])
        g_ev_b = np.concatenate([gsize, -gsize])
    # each stage's peak of activations plus gradients, and what fills it
    es = np.concatenate([*ev_s, g_ev_s]).astype(np.int64)
    et = np.concatenate([*ev_t, g_ev_t]).astype(np.float64)
    eb = np.concatenate([*ev_b, g_ev_b]).astype(np.int64)
    cat = np.concatenate([np.zeros(len(es) - len(g_ev_s), dtype=np.int64),
                          np.ones(len(g_ev_s), dtype=np.int64)])
    # each event sorts by (time, order, bytes, category) within its stage, order 0 for frees
    # and 1 for allocations; the peak is the first maximum of the running total
    if len(g_ev_s) and (g_ev_b[: len(g_ev_b) // 2] <= 0).any():
        order = np.concatenate([eb[: len(es) - len(g_ev_s)] > 0,  # (activations: bytes > 0)
                                np.arange(len(g_ev_s)) < len(g_ev_s) // 2])
        peaks = _peaks_in_order(S, es, et, eb, cat, order.astype(np.int64))
    else:
        peaks = _peaks(S, es, et, eb, cat)
    out = {}
    for s in range(S):
        act, grads = peaks[s]
        mb = MemoryBreakdown(params[s], grads, opt[s], bufs[s], act)
        for d in plan.stages[s]:
            out[d] = mb
    return out


def _ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges ``lo[k]:hi[k]``, every (k, index) pair, as two arrays."""
    counts = hi - lo
    k = np.repeat(np.arange(len(lo)), counts)
    idx = np.arange(len(k)) - np.repeat(np.cumsum(counts) - counts, counts) + lo[k]
    return k, idx


def _peaks(S: int, es: np.ndarray, et: np.ndarray, eb: np.ndarray, cat: np.ndarray
           ) -> list[tuple[int, int]]:
    """Per stage, (activation bytes, gradient bytes) live at the first peak of their total.

    Events (stage, time, bytes, category) with every allocation positive and every free
    negative. Sorted by (time, frees first, bytes, category) within a stage, the running total
    falls through one time's frees and then rises through its allocations, so its first maximum
    is at the last event of some time, where what is live does not depend on how that time's
    events are ordered: sorting by time alone gives the same peak.
    """
    o = np.argsort(et)
    o = o[np.argsort(es[o].astype(np.int16 if S < 2**15 else np.int64), kind="stable")]
    es, et, eb, cat = es[o], et[o], eb[o], cat[o]
    c0 = np.cumsum(np.where(cat == 0, eb, 0))
    c1 = np.cumsum(np.where(cat == 0, 0, eb))
    last = np.ones(len(es), dtype=bool)  # the last event of each (stage, time)
    last[:-1] = (es[1:] != es[:-1]) | (et[1:] != et[:-1])
    bounds = np.searchsorted(es, np.arange(S + 1))
    out = []
    for s in range(S):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        act = grads = 0
        if hi > lo:
            ends = lo + np.flatnonzero(last[lo:hi])
            b0 = c0[lo - 1] if lo else 0
            b1 = c1[lo - 1] if lo else 0
            tot = (c0[ends] - b0) + (c1[ends] - b1)
            k = int(np.argmax(tot))
            if tot[k] > 0:
                act, grads = int(c0[ends[k]] - b0), int(c1[ends[k]] - b1)
        out.append((act, grads))
    return out


def _peaks_in_order(S: int, es: np.ndarray, et: np.ndarray, eb: np.ndarray, cat: np.ndarray,
                    order: np.ndarray) -> list[tuple[int, int]]:
    """:func:`_peaks` for any signs of bytes: events in their full sort order."""
    o = np.lexsort((cat, eb, order, et, es))
    es, eb, cat = es[o], eb[o], cat[o]
    bounds = np.searchsorted(es, np.arange(S + 1))
    out = []
    for s in range(S):
        lo, hi = bounds[s], bounds[s + 1]
        act = grads = 0
        if hi > lo:
            b, c = eb[lo:hi], cat[lo:hi]
            c0 = np.cumsum(np.where(c == 0, b, 0))
            c1 = np.cumsum(np.where(c == 1, b, 0))
            tot = c0 + c1
            k = int(np.argmax(tot))
            if tot[k] > 0:
                act, grads = int(c0[k]), int(c1[k])
        out.append((act, grads))
    return out
