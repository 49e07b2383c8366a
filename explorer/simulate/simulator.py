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

A plan's per-stage memory settings (:class:`~explorer.core.plan.StageSettings`) add what they
do (:mod:`~explorer.simulate.effects`): ZeRO's reduce-scatters in place of the all-reduces (one
per micro-batch under ZeRO 2-3), an all-gather of the updated weights during the next step's
forward or, on a pipeline stage, after the optimizer step (1, 2), or of each weight before its
forward and backward uses, one op ahead (3), with the sharded bytes and the gathered copies in
memory; recomputed forwards added to the backwards that run them, their outputs not kept in
between; ops at the precision's rate and activations at autocast's sizes.

A GPU runs two timelines: its host issues each op (dispatch and kernel launch, the profile's
``DeviceCosts.host_s``) one after another without waiting, and its stream runs the kernels in
that order, each no earlier than its host issued it and its inputs are ready; the loss read at
the step's end joins them. Its stage's tasks then start no earlier than their release (the
host's issue end) and the timeline has a "host" lane. CPU ranks have one timeline.

Implementation: the graph as arrays (:mod:`~explorer.simulate.arrays`), node seconds from the
cost tables (:mod:`~explorer.simulate.seconds`), the task graph as data
(:mod:`~explorer.simulate.taskgraph`) and how it is built (:mod:`~explorer.simulate.tasks`),
its list schedule (:mod:`~explorer.simulate.schedule`), memory liveness by array reductions
(:mod:`~explorer.simulate.memory`) and the :class:`Prediction` record
(:mod:`~explorer.simulate.prediction`); this module puts them together.
The results are those of the straightforward version (``tests/simulate/test_simulate_speed.py``
holds its predictions for many cases); a 100k-node graph simulates in well under a second.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.schedule import Schedule
from explorer.costs.model import CostModel, DeviceCosts
from explorer.costs.strategies import BUCKET_BYTES
from explorer.devices.cluster import Cluster, Device, Link
from explorer.simulate.arrays import GraphArrays
from explorer.simulate.budget import check_simulation_size
from explorer.simulate.memory import memory_at_peaks
from explorer.simulate.prediction import Deferred, Interval, MemoryBreakdown, Prediction
from explorer.simulate.schedule import ISSUED, Timing, run
from explorer.simulate.seconds import Seconds, arrays_lower_bound_s, lower_bound_s, plain_costs
from explorer.simulate.segment_spans import stage_actions
from explorer.simulate.taskgraph import GATE, TaskGraph
from explorer.simulate.tasks import build_tasks

__all__ = ["BUCKET_BYTES", "Interval", "MemoryBreakdown", "Prediction", "clear_caches",
           "execution_order", "lower_bound_s", "simulate", "unit_costs"]


def simulate(graph: OpGraph, plan: Plan, costs: CostModel) -> Prediction:
    """Predict one training step of ``graph`` under ``plan`` with ``costs``.

    >>> import explorer as ex  # doctest: +SKIP
    >>> pred = ex.simulate(graph, plan, costs)  # doctest: +SKIP
    >>> pred.step_s, pred.peak_bytes, pred.bottleneck  # doctest: +SKIP
    """
    costs.check(graph)
    plan.validate(graph, costs.cluster)
    # (what a compiled backward keeps on each stage, where priced compiled)
    graph = as_run(graph, plan, costs)
    with without_cycle_collection():
        return _predict(graph, plan, costs, *_schedule(graph, plan, costs))


def as_run(graph: OpGraph, plan: Plan, costs: CostModel) -> OpGraph:
    """``graph`` as ``costs`` run it under ``plan`` (:meth:`CostModel.as_run`): where priced
    compiled, with what a compiled backward keeps on each stage, sized in 2 bytes where a
    stage computes in bf16/fp16."""
    half = any(plan.settings_of(s).precision != "fp32" for s in range(len(plan.stages)))
    return costs.as_run(graph, plan.placement, half)


@contextmanager
def without_cycle_collection() -> Iterator[None]:
    """Pause CPython's cycle collector (``gc``) for a simulation, then restore it.

    A simulation makes millions of small objects (an event tuple per task, list items) that
    form no reference cycles; each few hundred of them trigger a collection that walks the
    young objects, and the older generations' passes walk every object the process holds (the
    graph, a partitioner's state, a notebook's), which on a 100k-op graph cost a good part of
    the simulation. Reference counting frees everything as usual meanwhile.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def clear_caches() -> None:
    """Forget what the simulator keeps between calls (the arrays of the graphs it simulated
    last), so that the next simulation starts cold: for timing it."""
    GraphArrays.clear_cache()


def _schedule(graph: OpGraph, plan: Plan, costs: CostModel) -> tuple[TaskGraph, Timing]:
    """The step's tasks, list-scheduled; where replicas of a stage slow each other (measured
    contention), their ops slowed as their platform says."""
    check_simulation_size(graph, plan)  # before any task is built
    tasks = build_tasks(graph, plan, costs, _contended(plan, costs))
    return tasks, run(tasks)


def _contended(plan: Plan, costs: CostModel) -> dict[str, float]:
    """Per device of a replicated stage whose profile measured contention: how many of the
    stage's other replicas compute beside it, which is all of them, all the time (replicas run
    the same op at the same moment). What that does to each op is the device's platform's to
    say; different stages computing at once are not counted.

    The contention is measured between data-parallel replicas (each with the whole weights,
    half the batch), so it is charged between replicas only: the ranks of one tensor-parallel
    group run different shards, and what they add to each other's ops and optimizer step is
    measured on a split run of their own (``DeviceCosts.dtensor``), not estimated from the
    replicas' figure.
    """
    if not plain_costs(costs):
        return {}
    cluster = costs.cluster
    out: dict[str, float] = {}
    for s, st in enumerate(plan.stages):
        replicas = plan.replicas_of(s)
        shared = [d for d in st if costs.per_type[cluster.device(d).type_key].contention]
        if replicas > 1 and len(shared) > 1:
            out.update(dict.fromkeys(shared, float(min(replicas, len(shared)) - 1)))
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
    graph = as_run(graph, plan, costs)  # (as simulate runs it)
    with without_cycle_collection():
        tasks, timing = _schedule(graph, plan, costs)  # the order the prediction assumes
    return stage_actions(tasks, timing, len(plan.stages))


def unit_costs(graph: OpGraph, plan: Plan) -> CostModel:
    """Every op 1 s forward and 2 s backward, free links: for schedules without a profile."""
    devs = tuple(Device(d, "cpu", "unit", 2**62, 1.0, 1.0, 1.0, 0.0, 0.0, False, "", "unit")
                 for d in plan.devices)
    cl = Cluster("unit", devs, Link(0.0, float("inf"), "unit"))
    ops = [n.kind == "op" for n in graph.nodes]
    dc = DeviceCosts("cpu:unit", [1.0 * o for o in ops], [2.0 * o for o in ops],
                     ["unit"] * len(ops), 0.0)
    return CostModel(graph.fingerprint, cl, {"cpu:unit": dc})


def _predict(graph: OpGraph, plan: Plan, costs: CostModel, tasks: TaskGraph, timing: Timing
             ) -> Prediction:
    S, M = len(plan.stages), plan.micro_batches
    end_a = timing.arrays[1]
    step_s = max(timing.end, default=0.0)
    # busy time: each stage's task times summed in task order (the forward/backward block,
    # laid out per micro-batch, then the rest)
    fb = tasks.fb
    busy_stage = np.bincount(np.tile(fb.stage, M), weights=np.tile(fb.dur_s, M),
                             minlength=S).astype(np.float64).tolist()  # (floats when empty too)
    res, dur, n_fb = tasks.res, tasks.dur, fb.per_mb * M
    if len(res) > n_fb:  # (the few tasks on stages, in task order: the same sums)
        on_stage = np.flatnonzero(np.asarray(res[n_fb:], dtype=np.int64) < S) + n_fb
        for t in on_stage.tolist():
            busy_stage[res[t]] += dur[t]
    busy = {d: busy_stage[s] for s in range(S) for d in plan.stages[s]}
    host_busy = _host_busy(tasks)
    cluster = costs.cluster
    memory = memory_at_peaks(graph, plan, tasks, timing)
    for d, mb in memory.items():
        held = costs.device_costs(d).workspace_bytes
        if held:
            memory[d] = dataclasses.replace(mb, workspace_bytes=held)
    energy = {}
    for d, b in busy.items():
        dev = cluster.device(d)
        energy[d] = dev.power_w * b + dev.idle_power_w * max(step_s - b, 0.0)
    bottleneck = max(busy, key=lambda d: (busy[d], -plan.devices.index(d)))
    last = int(np.argmax(end_a)) if len(end_a) else -1  # the first task to end last
    return Prediction(
        step_s=step_s, busy_s=busy, timeline=_Timeline(tasks, timing),  # type: ignore[arg-type]
        memory=memory,
        capacity_bytes={d: cluster.device(d).memory_bytes for d in plan.devices},
        transfer_bytes=tasks.transfer_bytes, allreduce_bytes=tasks.allreduce_bytes,
        energy_j=sum(energy.values()), energy_by_device_j=energy,
        critical_path=_CriticalPath(tasks, timing, last),  # type: ignore[arg-type]
        bottleneck=bottleneck,
        lower_bound_s=arrays_lower_bound_s(tasks.arrays, costs, Seconds(costs),
                                           _half_factors(graph, plan, costs)),
        algorithm=plan.algorithm,
        host_busy_s={d: host_busy[s] for s in range(S) for d in plan.stages[s]
                     if host_busy[s] > 0.0})


def _host_busy(tasks: TaskGraph) -> list[float]:
    """[stage] the seconds its host spends issuing the step's ops (0 with one timeline)."""
    if tasks.issue_s is None:
        return [0.0] * len(tasks.plan.stages)
    return [float(tasks.issue_s[q].sum()) for q in tasks.fb.queue]  # (one queue per stage)


def _half_factors(graph: OpGraph, plan: Plan, costs: CostModel
                  ) -> dict[str, np.ndarray] | None:
    """Where a stage computes in bf16 or fp16, every op's time factor in that precision per
    device type, the smaller of its forward's and backward's (so the lower bound stays below
    what the plan can reach); None otherwise."""
    half = [st.precision for st in plan.stage_settings if st.precision != "fp32"]
    if not half:
        return None
    one_of_each = {d.type_key: d.id for d in costs.cluster.devices}
    return {k: np.minimum(*costs.precision_factors(graph, d, half[0]))
            for k, d in one_of_each.items()}


class _Timeline(Deferred):
    """The simulated tasks a timeline is made of; :meth:`build` makes the Interval tuple.

    A step of a large graph has hundreds of thousands of tasks, and most callers never look at
    the timeline, so a :class:`Prediction` keeps this and builds its intervals on first read.
    """

    def __init__(self, tasks: TaskGraph, timing: Timing) -> None:
        # (only what it needs: a prediction kept need not hold the whole task graph)
        self.kind, self.res, self.resources = tasks.kind, tasks.res, tasks.resources
        self.start, self.end, self.label, self.mb = timing.start, timing.end, tasks.label, tasks.mb
        self.stages = tasks.plan.stages
        self.release, self.issue_s = tasks.release, tasks.issue_s

    def build(self) -> tuple[Interval, ...]:
        out: list[Interval] = []
        stages, resources, res = self.stages, self.resources, self.res
        start, end, label, mb = self.start, self.end, self.label.list(), self.mb.list()
        issued = (self.issue_s > 0.0).tolist() if self.issue_s is not None else None
        for t, kind in enumerate(self.kind):
            if kind == GATE:
                continue
            key = resources[res[t]]
            if key[0] == "stage":
                for d in stages[key[1]]:
                    out.append(Interval(d, "compute", kind, start[t], end[t], label[t], mb[t]))
                    if issued is not None and issued[t]:
                        r = float(self.release[t])
                        out.append(Interval(d, "host", "issue", r - float(self.issue_s[t]),
                                            r, f"{kind} {label[t]}", mb[t]))
            elif key[0] == "link":
                out.append(Interval(stages[key[1]][0], "comm", kind, start[t], end[t],
                                    f"{label[t]} -> {stages[key[2]][0]}", mb[t]))
            else:
                for d in stages[key[1]]:
                    out.append(Interval(d, "comm", kind, start[t], end[t], label[t], mb[t]))
        out.sort(key=lambda iv: (iv.device, iv.start_s))
        return tuple(out)


class _CriticalPath(Deferred):
    """The chain of tasks that ended last and what made each one start, as labels."""

    def __init__(self, tasks: TaskGraph, timing: Timing, last: int) -> None:
        self.kind, self.label, self.mb, self.cause = tasks.kind, tasks.label, tasks.mb, timing.cause
        self.last, self.many = last, tasks.plan.micro_batches > 1
        self.res, self.queue = tasks.res, tasks.fb.queue

    def build(self) -> tuple[str, ...]:
        t, cause = self.last, self.cause
        path = []
        while t >= 0:  # each task's cause started before it did, so the walk ends
            path.append(t)
            t = cause[t]
        path.reverse()
        # a chain that starts where a host issued its task: the host's issues up to that one
        issues = self._issued_up_to(path[0]) if path and cause[path[0]] == ISSUED else []
        kind, label, mb = self.kind, self.label, self.mb
        if self.many:
            return tuple([f"issue {kind[t]} {label[t]}[{mb[t]}]" for t in issues]
                         + [f"{kind[t]} {label[t]}[{mb[t]}]" if mb[t] >= 0 else
                            f"{kind[t]} {label[t]}" for t in path if kind[t] != GATE])
        return tuple([f"issue {kind[t]} {label[t]}" for t in issues]
                     + [kind[t] + " " + label[t] for t in path])  # (gates need micro-batches)

    def _issued_up_to(self, t: int) -> list[int]:
        """The forwards and backwards task ``t``'s host issued up to it, itself included (all
        of its stage's, for its optimizer step), in the order it issued them."""
        q = self.queue[self.res[t]]
        at = np.flatnonzero(q == t)
        return q[: int(at[0]) + 1 if len(at) else len(q)].tolist()
