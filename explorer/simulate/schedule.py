"""The list schedule of a task graph: each resource runs its first ready task whenever it is free.

Whenever a resource (a stage's device, a link, an all-reduce channel) is free it starts, among
its ready tasks, the one that comes first in the schedule (by priority, then task id). Two
event loops give the same results: one for task times that only move time forward, and a
general one for negative task times and receives that arrive late.
"""

from __future__ import annotations

import bisect
import heapq

from explorer.core.errors import PlanError
from explorer.simulate.tasks import TaskGraph


def run(sim: TaskGraph) -> None:
    """List-schedule the task graph: every task's start, end, cause and the start order."""
    T = len(sim.kind)
    sim.start = [0.0] * T
    sim.end = [0.0] * T
    sim.cause = [-1] * T  # the task whose end let this one start (critical path)
    sim.order = []  # tasks in the order they start: a topological order
    if sim.forward_only and not sim.late_in:
        _run_forward(sim)
    else:
        _run_general(sim)
    if len(sim.order) != T:
        raise PlanError("the plan's schedule cannot finish (a dependency cycle); this is a "
                        "bug in the plan or simulator, please report it with the plan JSON")


def _first_tasks(sim: TaskGraph, key: list[int]) -> tuple[list[list[int]], list[bool],
                                                 list[tuple[float, int]]]:
    """Queue the tasks without dependencies and start one on each resource at time 0."""
    T = len(sim.kind)
    res, dur = sim.res, sim.dur
    queues: list[list[int]] = [[] for _ in sim.resources]
    for t in sim.first:
        queues[res[t]].append(key[t])
    busy = [False] * len(queues)
    events: list[tuple[float, int]] = []
    for r, q in enumerate(queues):
        if q:
            heapq.heapify(q)
            t = heapq.heappop(q) % T
            sim.end[t] = e = 0.0 + dur[t]
            sim.order.append(t)
            busy[r] = True
            heapq.heappush(events, (e, t))
    return queues, busy, events


def _run_forward(sim: TaskGraph) -> None:
    """The list schedule when no task takes negative time, so time only moves forward.

    Whenever a resource is free it starts its first ready task (by priority, then task
    id). With time moving forward a task starts the moment it becomes ready or its
    resource frees, so the general loop's bookkeeping reduces to: a task that becomes ready
    on an idle resource starts now, caused by the task that readied it; a freed resource
    starts its first queued task now, caused by whichever came last of its readiness and
    the task that freed the resource. A resource's next task is handled without the event
    heap when its end is the earliest event anyway.
    """
    T = len(sim.kind)
    res, dur, flat, ptr = sim.res, sim.dur, sim.succ_flat, sim.succ_ptr
    start, end, cause, order = sim.start, sim.end, sim.cause, sim.order
    deps = list(sim.ndeps)
    key = sim.key
    ready_at = [0.0] * T
    ready_from = [-1] * T
    queues, busy, events = _first_tasks(sim, key)
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


def _run_general(sim: TaskGraph) -> None:
    """The list schedule, for any task times (also negative ones), and with receives
    that arrive late.

    A rank receives a transfer in the first task that needs it, posting the receive when
    it gets to that task, the moment its previous task ends. Where the transfer's link has
    a late-receive wait (``Link.late_receive_s``) and the transfer was sent before that
    moment while its sender is computing then, the task starts no earlier than that moment
    plus the wait.
    """
    T = len(sim.kind)
    res, dur, flat, ptr = sim.res, sim.dur, sim.succ_flat, sim.succ_ptr
    start, end, cause, order = sim.start, sim.end, sim.cause, sim.order
    deps = list(sim.ndeps)
    key = sim.key
    ready_at = [0.0] * T
    ready_from = [-1] * T
    R = len(sim.resources)
    free_at = [0.0] * R
    last_on = [-1] * R
    late_in = sim.late_in
    received: set[int] = set()
    # per stage, the starts and ends of its tasks so far (they start in time order)
    starts_on: list[list[float]] = [[] for _ in range(R)]
    ends_on: list[list[float]] = [[] for _ in range(R)]

    def computing(s: int, at: float) -> bool:
        k = bisect.bisect_right(starts_on[s], at) - 1
        return k >= 0 and ends_on[s][k] > at

    queues, busy, events = _first_tasks(sim, key)
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
