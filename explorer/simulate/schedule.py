"""The list schedule of a task graph: each resource runs its first ready task whenever it is free.

Whenever a resource (a stage's device, a link, an all-reduce channel) is free it starts, among
its ready tasks, the one that comes first in the schedule (by priority, then task id). One event
loop does it for any task times, negative ones too, and for receives that arrive late.
"""

from __future__ import annotations

import bisect
import heapq
import math
from array import array
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from explorer.core.errors import PlanError
from explorer.simulate.runs import Loop, Runs
from explorer.simulate.taskgraph import TaskGraph

#: the cause of a task that started when its host had issued it (``TaskGraph.release``)
ISSUED = -2


@dataclass(frozen=True)
class Timing:
    """When each task of a :class:`TaskGraph` runs in the list schedule, and why then."""

    # (arrays of doubles: stored without a float object per task, read by numpy without a copy)
    start: Sequence[float]  # [task] seconds from the step's start
    end: Sequence[float]  # [task] seconds from the step's start
    # [task] the task whose end let it start then; -1 for none (at time 0), ISSUED where its
    # host issued it then (two timelines)
    cause: Sequence[int]
    order: list[int]  # task ids in the order they start: a topological order

    @cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) as read-only float64 arrays."""
        out = []
        for x in (self.start, self.end):
            a = np.frombuffer(x, dtype=np.float64) if isinstance(x, array) else \
                np.asarray(x, dtype=np.float64)
            a.flags.writeable = False
            out.append(a)
        return out[0], out[1]


def run(tasks: TaskGraph) -> Timing:
    """List-schedule the task graph: every task's start, end, cause and the start order.

    Events are task ends, taken in time order (then by task id). At the end of task ``t`` its
    resource is free: it starts its first queued task. Tasks ``t`` made ready start at once on
    their resources where those are idle. A task starts at the latest of: now, when it became
    ready (the latest end among its dependencies) and when its resource became free; its cause
    (for the critical path) is the task that ended last of those.

    When no task takes negative time, time only moves forward, so a ready task's last
    dependency to end is the last one seen and the task starts now; with negative times an
    event may come before an earlier one, and every dependency's end is weighed. A resource's
    next task's end goes into the event heap and the earliest event comes out in one step
    (none of the heap's work when that is the task's own end).

    A rank receives a transfer in the first task that needs it, posting the receive when it
    gets to that task, the moment its resource became free for it. Where the task graph has
    release times (two timelines: a task starts no earlier than its host has issued it), a
    task starts no earlier than its release, its cause then :data:`ISSUED`; its resource (a
    device's stream) waits for it. Where the transfer's link
    has a late-receive wait (``Link.late_receive_s``) and the transfer was sent before that
    moment while its sender is computing then, the task starts no earlier than that moment
    plus the wait.
    """
    T = len(tasks.kind)
    res, dur, flat, ptr, key = tasks.res, tasks.dur, tasks.succ_flat, tasks.succ_ptr, tasks.key
    backward = tasks.negative_times  # whether an event may come before an earlier one
    late_in = tasks.late_in
    late = bool(late_in)
    release = tasks.release.tolist() if tasks.release is not None else None
    # runs of a stage's tasks that provably start back to back, scheduled as arrays (none
    # where receives may be late or times negative); they read and write the state below in
    # place, as typed arrays (lists are quicker to index one by one, so kept where no runs)
    with_runs = not (late or backward or release is not None) and Runs.worth(tasks)
    start = array("d", [math.nan]) * T  # (NaN until the task starts)
    end = array("d", [math.nan]) * T
    cause: MutableSequence[int] = array("q", [-1]) * T if with_runs else [-1] * T
    order: list[int] = []
    deps: MutableSequence[int] = array("q", tasks.ndeps) if with_runs else list(tasks.ndeps)
    # the latest end among a task's dependencies seen so far, and the dependency that ended then
    ready_at: MutableSequence[float] = array("d", bytes(8 * T)) if with_runs else [0.0] * T
    ready_from: MutableSequence[int] = array("q", [-1]) * T if with_runs else [-1] * T
    R = len(tasks.resources)
    free_at = [0.0] * R  # when an idle resource became free
    last_on = [-1] * R  # and the task that freed it
    received: set[int] = set()
    # per resource, the starts and ends of its tasks so far (they start in time order)
    starts_on: list[list[float]] = [[] for _ in range(R)]
    ends_on: list[list[float]] = [[] for _ in range(R)]

    def late_start(u: int, r: int, posted: float, s: float, c: int) -> tuple[float, int]:
        """When and why task ``u`` starts on resource ``r`` (``s`` and ``c`` but for late
        receives), given its receives posted at ``posted``; notes its run on ``r``."""
        for x, wait, s_send in late_in.get(u, ()):
            if x in received:
                continue
            received.add(x)  # the first of a transfer's consumers to start receives it
            if start[x] < posted and posted + wait > s:
                k = bisect.bisect_right(starts_on[s_send], posted) - 1
                if k >= 0 and ends_on[s_send][k] > posted:  # the sender computes then
                    s, c = posted + wait, x
        starts_on[r].append(s)
        ends_on[r].append(s + dur[u])
        return s, c

    # the tasks without dependencies, one started on each resource at time 0
    queues: list[list[int]] = [[] for _ in range(R)]
    for t in tasks.first:
        queues[res[t]].append(key[t])
    # runs of a stage's tasks that provably start back to back (none where receives may be
    # late or times negative)
    busy = [False] * R
    events: list[tuple[float, int]] = []
    runs = Runs(tasks, Loop(start, end, cause, deps, order, queues, ready_at, ready_from,
                            events)) if with_runs else None
    follow = runs.follow if runs is not None else None
    chained = runs.starts if runs is not None else b""
    # a run's task whose successors on other stages still wait for its end: those (its
    # stage went on without the event)
    detached = runs.detached if runs is not None else {}
    far_succ, far_ptr = (runs.far_succ, runs.far_ptr) if runs is not None else ([], [])
    for r, q in enumerate(queues):
        if q:
            heapq.heapify(q)
            t = heapq.heappop(q) % T
            s0, c0 = 0.0, -1
            if release is not None and release[t] > 0.0:
                s0, c0 = release[t], ISSUED
            if late:
                s0, c0 = late_start(t, r, 0.0, s0, c0)
            start[t] = s0
            end[t] = e = s0 + dur[t]
            cause[t] = c0
            order.append(t)
            busy[r] = True
            heapq.heappush(events, (e, t) if not (chained and chained[t]) else
                           follow(r, t, e, 0.0))

    heappush, heappop, heappushpop = heapq.heappush, heapq.heappop, heapq.heappushpop
    started = order.append
    while events:
        now, t = heappop(events)
        while True:  # the event: task t ends at time `now`
            r = res[t]
            j = detached.pop(t, -1) if detached else -1
            succ = flat[ptr[t]:ptr[t + 1]] if j < 0 else far_succ[far_ptr[j]:far_ptr[j + 1]]
            if backward:  # a dependency that ended later, seen before, still counts
                for u in succ:
                    if now >= ready_at[u]:
                        ready_at[u] = now
                        ready_from[u] = t
            touched = None
            for u in succ:
                d = deps[u] - 1
                deps[u] = d
                if not d:
                    if not backward:  # (time only moves forward: its last dependency ends now)
                        ready_at[u] = now
                        ready_from[u] = t
                    ru = res[u]
                    heappush(queues[ru], key[u])
                    if ru != r:
                        if touched is None:
                            touched = [ru]
                        else:
                            touched.append(ru)
            # the freed resource starts its first queued task, posting its receives now
            q = queues[r] if j < 0 else None
            if q:
                u = heappop(q) % T
                s = ready_at[u]
                if s >= now:
                    c = ready_from[u]
                else:
                    s, c = now, t
                if release is not None and release[u] > s:
                    s, c = release[u], ISSUED
                if late:
                    s, c = late_start(u, r, now, s, c)
                start[u] = s
                end[u] = e = s + dur[u]
                started(u)
                cause[u] = c
                if chained and chained[u]:
                    e, u = follow(r, u, e, now)
            elif j >= 0:
                u = -1
            else:
                busy[r] = False
                free_at[r] = now
                last_on[r] = t
                u = -1
            if touched is not None:  # idle resources whose queue was empty until now
                for ru in touched:
                    if busy[ru]:
                        continue
                    v = heappop(queues[ru]) % T
                    s = ready_at[v]  # (not before now: v became ready at this event)
                    if s >= free_at[ru]:
                        c = ready_from[v]
                    else:
                        s, c = free_at[ru], last_on[ru]
                    if release is not None and release[v] > s:
                        s, c = release[v], ISSUED
                    if late:
                        s, c = late_start(v, ru, free_at[ru], s, c)
                    start[v] = s
                    end[v] = ev = s + dur[v]
                    started(v)
                    cause[v] = c
                    busy[ru] = True
                    heappush(events, (ev, v) if not (chained and chained[v]) else
                             follow(ru, v, ev, now))
            if u < 0:
                break
            # the next event: u's end, or an earlier one (u's end then waits in the heap)
            now, t = heappushpop(events, (e, u)) if events else (e, u)
    if len(order) != T:
        raise PlanError("the plan's schedule cannot finish (a dependency cycle); this is a "
                        "bug in the plan or simulator, please report it with the plan JSON")
    return Timing(start, end, cause, order)

