"""When the segment runtime holds what a segment's backward receives.

A stage that runs segments (:mod:`explorer.core.segments`) receives every gradient its
segment's outputs get from other stages before the segment's one backward call, and holds
them until that call ends; the op path receives each just before the op's own backward and
frees it after. The simulator groups each stage's simulated actions as the runtime does and
gives each received gradient its segment's backward span.
"""

from __future__ import annotations

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.schedule import Action, Schedule
from explorer.core.segments import segment_runs
from explorer.simulate.schedule import Timing
from explorer.simulate.taskgraph import TaskGraph


def stage_actions(tasks: TaskGraph, timing: Timing, stages: int) -> Schedule:
    """Per stage, its tasks as :class:`Action` s in the order the schedule starts them (the
    order a rank runs them in)."""
    out: Schedule = [[] for _ in range(stages)]
    kind, res, mb, node = tasks.kind.list(), tasks.res, tasks.mb.list(), tasks.node.list()
    for t in timing.order:
        r = res[t]
        if r < stages:  # the stages are resources 0 .. S-1
            out[r].append(Action(kind[t], mb[t], node[t]))
    return out


def segment_backward_spans(graph: OpGraph, plan: Plan, tasks: TaskGraph, timing: Timing
                           ) -> dict[tuple[int, int, int], tuple[float, float]]:
    """Per (stage, micro-batch, op) on a stage that runs segments: when the backward of the
    segment that holds the op starts and ends (its first backward task's start, its last's
    end). Empty where no stage runs segments."""
    S = len(plan.stages)
    if not any(tasks.segment_stages):
        return {}
    preds, succs = graph.preds, graph.succs
    kinds = [n.kind for n in graph.nodes]
    needs_grad = [n.requires_grad for n in graph.nodes]
    has_b, eff = tasks.arrays.has_b, tasks.effects
    start, end = timing.start, timing.end
    off_b, per_m = tasks.fb.bwd, tasks.fb.per_mb
    out: dict[tuple[int, int, int], tuple[float, float]] = {}
    for s, actions in enumerate(stage_actions(tasks, timing, S)):
        if not tasks.segment_stages[s]:
            continue
        # (a ZeRO 3 stage of several replicas gathers its weights a unit at a time: its
        # segments are cut where the unit changes)
        gathered = eff is not None and eff.zero[s] == 3
        for m, nodes in segment_runs(actions, s, tasks.stage, kinds, preds, needs_grad,
                                     eff.units if gathered else None, succs):
            backward = [off_b[i] + m * per_m for i in nodes if has_b[i]]
            if not backward:
                continue
            span = (min(start[t] for t in backward), max(end[t] for t in backward))
            for i in nodes:
                out[(s, m, i)] = span
    return out

