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
liveness along the simulated timeline: a tensor lives from its producer's start until its last
forward consumer, outgoing transfer, or the backward of a node that saved it, whichever is last.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

from explorer.costs import OPTIMIZER_STATE, CostModel
from explorer.errors import PlanError
from explorer.graph import OpGraph
from explorer.plan import Plan

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default gradient bucket

F, B, XFER, ALLREDUCE, OPT = "fwd", "bwd", "send", "allreduce", "optimizer"


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


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for one step of a plan."""

    step_s: float
    busy_s: dict[str, float]
    timeline: tuple[Interval, ...]
    memory: dict[str, MemoryBreakdown]
    capacity_bytes: dict[str, int]
    transfer_bytes: int
    allreduce_bytes: int
    energy_j: float
    energy_by_device_j: dict[str, float]
    critical_path: tuple[str, ...]
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


def lower_bound_s(graph: OpGraph, costs: CostModel) -> float:
    """Total compute on the fastest device type, spread over every device: no plan beats it."""
    cluster = costs.cluster
    reps = {d.type_key: d.id for d in cluster.devices}
    total = 0.0
    for i, n in enumerate(graph.nodes):
        if n.kind == "op":
            total += min(costs.node_s(i, d) for d in reps.values())
    return total / max(len(cluster), 1)


class _Sim:
    """Builds the task graph of one step and list-schedules it."""

    def __init__(self, graph: OpGraph, plan: Plan, costs: CostModel) -> None:
        self.g, self.plan, self.costs = graph, plan, costs
        self.kind: list[str] = []
        self.res: list[int] = []
        self.dur: list[float] = []
        self.prio: list[tuple] = []
        self.label: list[str] = []
        self.mb: list[int] = []
        self.nbytes: list[int] = []
        self.succ: list[list[int]] = []
        self.ndeps: list[int] = []
        self.resources: list[tuple[str, int, int]] = []  # ("stage", s, -1) / ("link", a, b)
        self._res_index: dict[tuple, int] = {}

    def resource(self, key: tuple) -> int:
        r = self._res_index.get(key)
        if r is None:
            r = self._res_index[key] = len(self.resources)
            self.resources.append(key)
        return r

    def task(self, kind: str, res: int, dur: float, prio: tuple, label: str, mb: int = -1,
             nbytes: int = 0) -> int:
        t = len(self.kind)
        self.kind.append(kind)
        self.res.append(res)
        self.dur.append(dur)
        self.prio.append(prio)
        self.label.append(label)
        self.mb.append(mb)
        self.nbytes.append(nbytes)
        self.succ.append([])
        self.ndeps.append(0)
        return t

    def dep(self, before: int, after: int) -> None:
        self.succ[before].append(after)
        self.ndeps[after] += 1

    # -- building ------------------------------------------------------------------------
    def build(self) -> None:
        g, plan, costs = self.g, self.plan, self.costs
        nodes = g.nodes
        stage = plan.assignment(g)
        self.stage = stage
        S, M = len(plan.stages), plan.micro_batches
        reps = [plan.stages[s] for s in range(S)]
        frac = [1.0 / (len(reps[s]) * M) for s in range(S)]
        self.frac = frac
        # the slowest replica sets a stage's pace
        types = [{costs.cluster.device(d).type_key: d for d in reps[s]} for s in range(S)]
        first_op = [min((i for i, n in enumerate(nodes) if n.kind == "op" and stage[i] == s),
                        default=len(nodes)) for s in range(S)]
        order = sorted(range(S), key=lambda s: first_op[s])
        active = [s for s in order if first_op[s] < len(nodes)]
        rank = {s: k for k, s in enumerate(active)}
        warm = {s: min(len(active) - rank[s], M) for s in active}
        self.stage_res = [self.resource(("stage", s, -1)) for s in range(S)]
        ops = [i for i, n in enumerate(nodes) if n.kind == "op"]
        grad_in = [n.requires_grad for n in nodes]

        def slot(s: int, kind: str, m: int) -> int:
            if plan.schedule == "gpipe":
                return m if kind == F else M + m
            w = warm.get(s, 1)
            if kind == F:
                return m if m < w else w + 2 * (m - w) + 1
            return w + 2 * m

        fwd = {}
        bwd = {}
        for m in range(M):
            for i in ops:
                s = stage[i]
                d = max(costs.fwd_s(i, dv, frac[s]) for dv in types[s].values())
                fwd[m, i] = self.task(F, self.stage_res[s], d, (slot(s, F, m), i),
                                      nodes[i].name, m)
                if nodes[i].requires_grad:
                    d = max(costs.bwd_s(i, dv, frac[s]) for dv in types[s].values())
                    bwd[m, i] = self.task(B, self.stage_res[s], d, (slot(s, B, m), -i),
                                          nodes[i].name, m)
        self.fwd, self.bwd = fwd, bwd
        self.xfer_f = xfer_f = {}
        # forward edges and activation transfers (one per tensor, micro-batch, destination)
        xfer_b: dict[tuple[int, int, int], int] = {}
        param_in: dict[tuple[int, int], int] = {}
        self.transfer_bytes = 0
        for i in ops:
            s = stage[i]
            for p in g.preds[i]:
                pn, ps = nodes[p], stage[p]
                if pn.kind == "input":
                    continue  # every rank loads its own copy of the batch
                if pn.kind in ("param", "buffer"):
                    if ps != s:
                        key = (p, s)
                        if key not in param_in:
                            param_in[key] = self._transfer(ps, s, pn.out_bytes, (0, p),
                                                           f"{pn.name} -> stage {s}")
                        for m in range(M):
                            self.dep(param_in[key], fwd[m, i])
                    continue
                for m in range(M):
                    if ps == s:
                        self.dep(fwd[m, p], fwd[m, i])
                        continue
                    key = (m, p, s)
                    if key not in xfer_f:
                        xfer_f[key] = self._transfer(ps, s, pn.out_bytes // M, (slot(s, F, m), p),
                                                     f"{pn.name}", m)
                        self.dep(fwd[m, p], xfer_f[key])
                    self.dep(xfer_f[key], fwd[m, i])
        # backward edges: a node's backward waits for its consumers' backwards
        for i in ops:
            if not grad_in[i]:
                continue
            s = stage[i]
            for m in range(M):
                self.dep(fwd[m, i], bwd[m, i])
            for c in g.succs[i]:
                if (0, c) not in bwd:
                    continue
                cs = stage[c]
                for m in range(M):
                    if cs == s:
                        self.dep(bwd[m, c], bwd[m, i])
                        continue
                    key = (m, i, cs)
                    if key not in xfer_b:
                        xfer_b[key] = self._transfer(cs, s, nodes[i].out_bytes // M,
                                                     (slot(cs, B, m), -i),
                                                     f"grad {nodes[i].name}", m)
                        self.dep(xfer_b[key], bwd[m, i])
                    self.dep(bwd[m, c], xfer_b[key])
        # 1F1B: at most `warm` micro-batches in flight on a stage
        if plan.schedule == "1f1b" and M > 1:
            done = {}
            for s in active:
                w = warm[s]
                st_ops = [i for i in ops if stage[i] == s]
                st_b = [i for i in st_ops if (0, i) in bwd]
                for m in range(w, M):
                    if not st_b:
                        break
                    gate = done.get((s, m - w))
                    if gate is None:
                        gate = done[s, m - w] = self.task("gate", self.resource(
                            ("gate", s, m - w)), 0.0, (0,), "", m - w)
                        for i in st_b:
                            self.dep(bwd[m - w, i], gate)
                    for i in st_ops:
                        self.dep(gate, fwd[m, i])
        # gradients: params consumed on other stages send their gradient home; replicated
        # stages all-reduce in buckets; then each stage steps its optimizer
        last_b: dict[int, list[int]] = defaultdict(list)  # param -> tasks its grad waits for
        for p, n in enumerate(nodes):
            if n.kind != "param" or not n.requires_grad:
                continue
            ps = stage[p]
            for c in g.succs[p]:
                if (0, c) not in bwd:
                    continue
                cs = stage[c]
                for m in range(M):
                    if cs == ps:
                        last_b[p].append(bwd[m, c])
                if cs != ps:
                    key = (p, cs)
                    if ("gp", key) not in self._res_index:
                        self._res_index[("gp", key)] = -1
                        t = self._transfer(cs, ps, n.out_bytes, (10**9, -p), f"grad {n.name}")
                        for m in range(M):
                            for c2 in g.succs[p]:
                                if stage[c2] == cs and (0, c2) in bwd:
                                    self.dep(bwd[m, c2], t)
                        last_b[p].append(t)
        self.allreduce_bytes = 0
        opt_deps: dict[int, list[int]] = defaultdict(list)
        for s in range(S):
            params = [p for p in reversed(range(len(nodes)))
                      if stage[p] == s and nodes[p].kind == "param" and nodes[p].requires_grad]
            for p in params:
                opt_deps[s].extend(last_b[p])
            if len(reps[s]) > 1 and params:
                chan = self.resource(("allreduce", s, -1))
                bucket: list[int] = []
                size = 0
                for k, p in enumerate([*params, None]):
                    if p is not None:
                        bucket.append(p)
                        size += nodes[p].out_bytes
                    if bucket and (p is None or size >= BUCKET_BYTES):
                        d = costs.allreduce_s(reps[s], size)
                        k_ = len(reps[s])
                        self.allreduce_bytes += int(2 * (k_ - 1) * size)
                        t = self.task(ALLREDUCE, chan, d, (k,), f"all-reduce {size} B", -1, size)
                        for q in bucket:
                            for before in last_b[q]:
                                self.dep(before, t)
                        opt_deps[s].append(t)
                        bucket, size = [], 0
            trainable = [p for p, n in enumerate(nodes) if stage[p] == s
                         and n.param_bytes and n.kind != "buffer"]
            pbytes = sum(nodes[p].param_bytes for p in trainable)
            if not trainable:
                continue
            d = max(costs.optimizer_s(dv, plan.optimizer, pbytes, len(trainable))
                    for dv in types[s].values())
            t = self.task(OPT, self.stage_res[s], d, (10**9,), f"{plan.optimizer} step")
            for before in opt_deps[s]:
                self.dep(before, t)
            for i in ops:
                if stage[i] == s:
                    for m in range(M):
                        self.dep(bwd.get((m, i), fwd[m, i]), t)

    def _transfer(self, a: int, b: int, nbytes: int, prio: tuple, label: str,
                  mb: int = -1) -> int:
        self.transfer_bytes += nbytes
        devs_a, devs_b = self.plan.stages[a], self.plan.stages[b]
        width = min(len(devs_a), len(devs_b))  # replicas send their shards side by side
        d = self.costs.transfer_s(devs_a[0], devs_b[0], max(nbytes // width, 1))
        return self.task(XFER, self.resource(("link", a, b)), d, prio, label, mb, nbytes)

    # -- scheduling ----------------------------------------------------------------------
    def run(self) -> None:
        n = len(self.kind)
        start = [0.0] * n
        end = [0.0] * n
        cause = [-1] * n  # the task whose end let this one start (critical path)
        ready_at = [0.0] * n
        ready_from = [-1] * n
        deps = list(self.ndeps)
        R = len(self.resources)
        queues: list[list] = [[] for _ in range(R)]
        free_at = [0.0] * R
        busy = [False] * R
        last_on = [-1] * R
        events: list[tuple[float, int]] = []
        order: list[int] = []  # tasks in the order they start: a topological order

        def try_start(r: int, now: float) -> None:
            if busy[r] or not queues[r]:
                return
            _, t = heapq.heappop(queues[r])
            s = max(now, ready_at[t], free_at[r])
            start[t] = s
            end[t] = s + self.dur[t]
            order.append(t)
            cause[t] = ready_from[t] if ready_at[t] >= free_at[r] else last_on[r]
            busy[r] = True
            heapq.heappush(events, (end[t], t))

        for t in range(n):
            if deps[t] == 0:
                heapq.heappush(queues[self.res[t]], (self.prio[t], t))
        for r in range(R):
            try_start(r, 0.0)
        done = 0
        while events:
            now, t = heapq.heappop(events)
            done += 1
            r = self.res[t]
            busy[r] = False
            free_at[r] = now
            last_on[r] = t
            touched = {r}
            for u in self.succ[t]:
                if now >= ready_at[u]:
                    ready_at[u], ready_from[u] = now, t
                deps[u] -= 1
                if deps[u] == 0:
                    ru = self.res[u]
                    heapq.heappush(queues[ru], (self.prio[u], u))
                    touched.add(ru)
            for ru in touched:
                try_start(ru, now)
        if done != n:
            raise PlanError("the plan's schedule cannot finish (a dependency cycle); this is a "
                            "bug in the plan or simulator, please report it with the plan JSON")
        self.start, self.end, self.cause, self.order = start, end, cause, order


def simulate(graph: OpGraph, plan: Plan, costs: CostModel) -> Prediction:
    """Predict one training step of ``graph`` under ``plan`` with ``costs``.

    >>> import explorer as ex  # doctest: +SKIP
    >>> pred = ex.simulate(graph, plan, costs)  # doctest: +SKIP
    >>> pred.step_s, pred.peak_bytes, pred.bottleneck  # doctest: +SKIP
    """
    costs.check(graph)
    plan.validate(graph, costs.cluster)
    sim = _Sim(graph, plan, costs)
    sim.build()
    sim.run()
    return _predict(graph, plan, costs, sim)


def execution_order(graph: OpGraph, plan: Plan, costs: CostModel | None = None
                    ) -> list[list[tuple[str, int, int]]]:
    """Per stage, the compute tasks in the order the simulated schedule starts them.

    Each task is (kind, micro-batch, node index) with kind "fwd", "bwd" or "optimizer" (node
    -1). All stages' lists are subsequences of one topological order of the step's tasks, so
    ranks that follow them with blocking receives (and non-blocking sends) cannot deadlock,
    whatever the placement. Without ``costs`` every op counts as one unit of time.
    """
    if costs is None:
        costs = unit_costs(graph, plan)
    sim = _Sim(graph, plan, costs)
    sim.build()
    sim.run()
    out: list[list[tuple[str, int, int]]] = [[] for _ in plan.stages]
    for t in sim.order:
        key = sim.resources[sim.res[t]]
        if key[0] != "stage":
            continue
        kind = sim.kind[t]
        node = -1 if kind == OPT else graph.index[sim.label[t]]
        out[key[1]].append((kind, sim.mb[t], node))
    return out


def unit_costs(graph: OpGraph, plan: Plan) -> CostModel:
    """Every op 1 s forward and 2 s backward, free links: for schedules without a profile."""
    from explorer.cluster import Cluster, Device, Link
    from explorer.costs import DeviceCosts

    devs = tuple(Device(d, "cpu", "unit", 2**62, 1.0, 1.0, 1.0, 0.0, 0.0, False, "", "unit")
                 for d in plan.devices)
    cl = Cluster("unit", devs, Link(0.0, float("inf"), "unit"))
    ops = [n.kind == "op" for n in graph.nodes]
    dc = DeviceCosts("cpu:unit", [1.0 * o for o in ops], [2.0 * o for o in ops],
                     ["unit"] * len(ops), 0.0)
    return CostModel(graph.fingerprint, cl, {"cpu:unit": dc})


def _predict(graph: OpGraph, plan: Plan, costs: CostModel, sim: _Sim) -> Prediction:
    step_s = max(sim.end, default=0.0)
    S = len(plan.stages)
    busy_stage = [0.0] * S
    intervals: list[Interval] = []
    for t, kind in enumerate(sim.kind):
        if kind == "gate":
            continue
        key = sim.resources[sim.res[t]]
        if key[0] == "stage":
            busy_stage[key[1]] += sim.dur[t]
            for d in plan.stages[key[1]]:
                intervals.append(Interval(d, "compute", kind, sim.start[t], sim.end[t],
                                          sim.label[t], sim.mb[t]))
        elif key[0] == "link":
            intervals.append(Interval(plan.stages[key[1]][0], "comm", kind, sim.start[t],
                                      sim.end[t], f"{sim.label[t]} -> "
                                      f"{plan.stages[key[2]][0]}", sim.mb[t]))
        else:
            for d in plan.stages[key[1]]:
                intervals.append(Interval(d, "comm", kind, sim.start[t], sim.end[t],
                                          sim.label[t], sim.mb[t]))
    intervals.sort(key=lambda iv: (iv.device, iv.start_s))
    busy = {d: busy_stage[s] for s in range(S) for d in plan.stages[s]}
    cluster = costs.cluster
    memory = _memory(graph, plan, sim)
    energy = {}
    for d, b in busy.items():
        dev = cluster.device(d)
        energy[d] = dev.power_w * b + dev.idle_power_w * max(step_s - b, 0.0)
    bottleneck = max(busy, key=lambda d: (busy[d], -plan.devices.index(d)))
    return Prediction(
        step_s=step_s, busy_s=busy, timeline=tuple(intervals), memory=memory,
        capacity_bytes={d: cluster.device(d).memory_bytes for d in plan.devices},
        transfer_bytes=sim.transfer_bytes, allreduce_bytes=sim.allreduce_bytes,
        energy_j=sum(energy.values()), energy_by_device_j=energy,
        critical_path=_critical_path(sim), bottleneck=bottleneck,
        lower_bound_s=lower_bound_s(graph, costs), algorithm=plan.algorithm)


def _critical_path(sim: _Sim) -> tuple[str, ...]:
    if not sim.end:
        return ()
    t = max(range(len(sim.end)), key=lambda k: sim.end[k])
    path = []
    seen = set()
    while t >= 0 and t not in seen:
        seen.add(t)
        if sim.kind[t] != "gate":
            mb = f"[{sim.mb[t]}]" if sim.mb[t] >= 0 and sim.plan.micro_batches > 1 else ""
            path.append(f"{sim.kind[t]} {sim.label[t]}{mb}")
        t = sim.cause[t]
    return tuple(reversed(path))


def _roots(graph: OpGraph) -> list[int]:
    """For views and in-place ops, the node whose memory they share."""
    root = list(range(len(graph)))
    for i, n in enumerate(graph.nodes):
        if n.is_view and graph.preds[i]:
            root[i] = root[graph.preds[i][0]]
    return root


def _memory(graph: OpGraph, plan: Plan, sim: _Sim) -> dict[str, MemoryBreakdown]:
    nodes, stage, M = graph.nodes, sim.stage, plan.micro_batches
    S = len(plan.stages)
    state_per_byte = OPTIMIZER_STATE[plan.optimizer]
    params = [0] * S
    bufs = [0] * S
    opt = [0] * S
    received_params: set[tuple[int, int]] = set()
    for i, n in enumerate(nodes):
        s = stage[i]
        if n.kind == "buffer":
            bufs[s] += n.param_bytes
        elif n.param_bytes:
            params[s] += n.param_bytes
            if n.requires_grad or n.kind == "op":
                opt[s] += n.param_bytes * state_per_byte
        if n.kind in ("param", "buffer"):
            for c in graph.succs[i]:
                if stage[c] != s and (i, stage[c]) not in received_params:
                    received_params.add((i, stage[c]))
                    params[stage[c]] += n.out_bytes  # a copy of the weight
    root = _roots(graph)
    # saved-for-backward: producer root -> nodes whose backward keeps it
    saved_by: dict[int, list[int]] = defaultdict(list)
    for v, n in enumerate(nodes):
        for nm in n.saves:
            p = root[graph.index[nm]]
            if nodes[p].kind == "op" or nodes[p].kind == "input":
                saved_by[p].append(v)
    events: list[list[tuple[float, int, int]]] = [[] for _ in range(S)]  # (time, order, bytes)

    def live(s: int, t0: float, t1: float, nbytes: int) -> None:
        if nbytes > 0:
            events[s].append((t0, 1, nbytes))
            events[s].append((max(t1, t0), 0, -nbytes))

    fwd, bwd, start, end = sim.fwd, sim.bwd, sim.start, sim.end
    for m in range(M):
        for i, n in enumerate(nodes):
            if n.kind == "op" and root[i] == i:
                s = stage[i]
                size = int(n.out_bytes * sim.frac[s])
                t0 = start[fwd[m, i]]
                t1 = end[fwd[m, i]]
                if graph.loss == n.name and (m, i) in bwd:
                    t1 = max(t1, end[bwd[m, i]])
                # consumers (through views) on this stage, and the saving nodes' backwards
                for c in _consumers(graph, i, root):
                    if stage[c] == s and (m, c) in fwd:
                        t1 = max(t1, end[fwd[m, c]])
                    elif (m, c, stage[c]) in sim.xfer_f or (m, i, stage[c]) in sim.xfer_f:
                        sent = sim.xfer_f.get((m, c, stage[c]), sim.xfer_f.get((m, i, stage[c])))
                        t1 = max(t1, end[sent])
                for v in saved_by.get(i, ()):
                    if stage[v] == s and (m, v) in bwd:
                        t1 = max(t1, end[bwd[m, v]])
                live(s, t0, t1, size)
                # its gradient lives from the first consumer backward until its own backward
                if (m, i) in bwd:
                    cons = [bwd[m, c] for c in graph.succs[i]
                            if (m, c) in bwd and stage[c] == s]
                    if cons:
                        g0 = min(start[t] for t in cons)
                        live(s, g0, end[bwd[m, i]], size)
            if n.kind == "op" and n.saved_extra_bytes and (m, i) in bwd:
                s = stage[i]
                live(s, end[fwd[m, i]], end[bwd[m, i]], int(n.saved_extra_bytes * sim.frac[s]))
            if n.kind == "input":
                for s in {stage[c] for c in graph.succs[i]}:
                    users = [c for c in graph.succs[i] if stage[c] == s]
                    t1 = max(end[fwd[m, c]] for c in users)
                    for v in saved_by.get(i, ()):
                        if stage[v] == s and (m, v) in bwd:
                            t1 = max(t1, end[bwd[m, v]])
                    t0 = min(start[fwd[m, c]] for c in users)
                    live(s, t0, t1, int(n.out_bytes * sim.frac[s]))
    # received activations: from arrival until their last use on the receiving stage
    for t, kind in enumerate(sim.kind):
        if kind != XFER or sim.mb[t] < 0:
            continue
        key = sim.resources[sim.res[t]]
        dst = key[2]
        t1 = end[t]
        for u in sim.succ[t]:
            t1 = max(t1, end[u])
        if not sim.label[t].startswith("grad "):
            nm = sim.label[t]
            p = graph.index[nm]
            for v in saved_by.get(root[p], ()):
                if stage[v] == dst and (sim.mb[t], v) in bwd:
                    t1 = max(t1, end[bwd[sim.mb[t], v]])
        live(dst, start[t], t1, int(sim.nbytes[t] * M * sim.frac[dst]))
    # parameter gradients: from the first backward that reaches a weight until the optimizer
    # step has used it (torch frees them with zero_grad(set_to_none=True))
    grad_events: list[list[tuple[float, int, int]]] = [[] for _ in range(S)]
    opt_end = [max(sim.end, default=0.0)] * S
    for t, kind in enumerate(sim.kind):
        if kind == OPT:
            opt_end[sim.resources[sim.res[t]][1]] = sim.end[t]
    for i, n in enumerate(nodes):
        if not n.param_bytes or n.kind == "buffer" or not (n.requires_grad or n.kind == "op"):
            continue
        users = [i] if n.kind == "op" else graph.succs[i]
        for s in {stage[c] for c in users}:
            starts = [start[bwd[m, c]] for c in users for m in range(M)
                      if stage[c] == s and (m, c) in bwd]
            if starts:
                size = n.param_bytes
                grad_events[s].append((min(starts), 1, size))
                grad_events[s].append((opt_end[s], 0, -size))
    act, grad_at_peak = [], []
    for s in range(S):
        merged = [(t, o, b, 0) for t, o, b in events[s]] + \
            [(t, o, b, 1) for t, o, b in grad_events[s]]
        cur = [0, 0]
        peak, at = 0, (0, 0)
        for _, _, b, cat in sorted(merged):
            cur[cat] += b
            if cur[0] + cur[1] > peak:
                peak, at = cur[0] + cur[1], (cur[0], cur[1])
        act.append(at[0])
        grad_at_peak.append(at[1])
    out = {}
    for s in range(S):
        mb = MemoryBreakdown(params[s], grad_at_peak[s], opt[s], bufs[s], act[s])
        for d in plan.stages[s]:
            out[d] = mb
    return out


def _consumers(graph: OpGraph, i: int, root: list[int]) -> list[int]:
    """Consumers of node i, looking through views of it."""
    out, stack = [], list(graph.succs[i])
    while stack:
        c = stack.pop()
        out.append(c)
        if graph.nodes[c].is_view and root[c] == root[i]:
            stack.extend(graph.succs[c])
    return out
