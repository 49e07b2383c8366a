"""Runs: stretches of a stage's list schedule that start back to back, scheduled as arrays.

Most of a stage's forwards and backwards wait only for earlier tasks of the same stage, so once
it has started one of them, the next ones in its queue order follow one after the other,
whatever the other stages do meanwhile. :class:`Runs` finds such a stretch when the event loop
(:func:`explorer.simulate.schedule.run`) starts a task and schedules it at once with array
operations, giving every task the start, end and cause the event loop would give it.

Why that holds. A stage takes next the first task in its queue order that is ready when it is
free. Let ``p`` be its first task in queue order not started yet. If all of ``p``'s
dependencies are earlier tasks of the stage, they have all started (one at a time), so they
have ended when the running task ends: ``p`` is ready then and comes first, so the stage takes
it whatever else became ready; the same for the task after ``p``, and so on. A task whose
dependency runs elsewhere (a received tensor) joins only where that dependency's end has
already been taken as an event (it ended before now), so it is as ready. A task's end is
taken early (its successors' dependencies counted when the run is made) where those successors
are on the stage, which is busy with the run until then: nothing else reads their queue. A
task with successors elsewhere keeps its event for them (a *detached* event, that does not
free the stage). Each start is its predecessor's end, summed one by one as the event loop adds
them (``np.cumsum`` adds in order), so every time is the same number; each cause is the
predecessor on the stage, as all durations in a run are positive (no other dependency ends
at that moment).
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass

import numpy as np

from explorer.simulate.arrays import ranges
from explorer.simulate.taskgraph import TaskGraph


@dataclass(frozen=True)
class Loop:
    """The event loop's state a run reads and writes (shared, never copied)."""

    start: array  # [task] "d": NaN until it starts
    end: array  # [task] "d": NaN until it starts
    cause: array  # [task] "q"
    deps: array  # [task] "q": dependencies not ended (as events) yet
    order: list[int]  # tasks in the order started
    queues: list[list[int]]  # [resource] heap of the queue keys of its ready tasks
    ready_at: array  # [task] "d": the end that made it ready
    ready_from: array  # [task] "q": the task that ended then
    events: list[tuple[float, int]]  # the heap of (end, task) events


class Runs:
    """The runs of one task graph's schedule, made as the event loop reaches them."""

    #: fewest tasks worth a run (shorter stretches go through the event loop)
    MIN_RUN = 24
    #: tasks whose received inputs are checked at once, at first (doubling after)
    CHUNK = 64
    #: after a stretch too short for a run, the queue places not tried again (doubling while
    #: they keep failing, up to ``MAX_REST``)
    REST, MAX_REST = 32, 8192

    @staticmethod
    def worth(tasks: TaskGraph) -> bool:
        """Whether runs may cover much of the schedule: most forwards and backwards wait for
        no transfer (or 1F1B gate), the only tasks that lead into them from elsewhere."""
        n_fb = tasks.fb.per_mb * tasks.plan.micro_batches
        ptr = tasks.succ_ptr_a
        return bool(n_fb) and int(ptr[-1] - ptr[n_fb]) < n_fb // 2

    def __init__(self, tasks: TaskGraph, loop: Loop) -> None:
        fb, M = tasks.fb, tasks.plan.micro_batches
        T, n_fb, S = len(tasks.kind), fb.per_mb * M, len(fb.queue)
        self.loop, self.key = loop, tasks.key
        self.start_a = np.frombuffer(loop.start, dtype=np.float64)
        self.end_a = np.frombuffer(loop.end, dtype=np.float64)
        self.ptr_a, self.flat_a = tasks.succ_ptr_a, tasks.succ_flat_a
        self.dur_a = np.tile(fb.dur_s, M)
        self.res_a = res = np.concatenate([np.tile(fb.stage, M),
                                           np.asarray(tasks.res[n_fb:], dtype=np.int64)])
        # detached events: task -> j, its successors elsewhere far_succ[far_ptr[j]:far_ptr[j + 1]]
        # (flat lists: a list per task would make much work for the garbage collector)
        self.detached: dict[int, int] = {}
        self.far_succ: list[int] = []
        self.far_ptr: list[int] = []
        src = np.repeat(np.arange(T), np.diff(self.ptr_a))
        dst = self.flat_a
        cross = res[src] != res[dst]
        self.local_a = np.bincount(src[cross], minlength=T) == 0  # successors all on its stage
        rank = np.zeros(n_fb, dtype=np.int64)  # place in its stage's queue order
        for q in fb.queue:
            rank[q] = np.arange(len(q))
        # hard: never in a run (a dependency on its stage that is not an earlier forward or
        # backward of it, or a time not positive)
        sel = dst < n_fb
        s_, d_, x_ = src[sel], dst[sel], cross[sel]
        odd = ~x_ & ((s_ >= n_fb) | (rank[np.minimum(s_, n_fb - 1)] >= rank[d_]))
        hard = np.zeros(n_fb, dtype=bool)
        hard[d_[odd]] = True
        hard |= ~(self.dur_a > 0.0)
        # dependencies on other resources, grouped by task: checked when a run reaches it
        o = np.argsort(d_[x_], kind="stable")
        self.x_src = s_[x_][o]
        self.x_ptr = np.concatenate(([0], np.cumsum(np.bincount(d_[x_], minlength=n_fb))))
        self.x_src_l, self.x_ptr_l = _items(self.x_src), _items(self.x_ptr)
        self.rank = _items(rank)
        # stages whose other tasks (optimizer steps) all come after their forwards/backwards
        tail = np.flatnonzero(res[n_fb:] < S) + n_fb
        last_key = [tasks.key[int(q[-1])] if len(q) else -1 for q in fb.queue]
        mixed = {int(res[t]) for t in tail.tolist() if tasks.key[t] < last_key[res[t]]}
        starts = np.zeros(T, dtype=bool)  # tasks after whose start a run may follow
        self.queue_a: list[np.ndarray] = []
        self.queue: list[array] = []
        self.hard: list[array] = []
        self.ptr = [0] * S
        for s, q in enumerate(fb.queue):
            # [k] the first place at or after k whose task is hard, len(q) for none
            at = np.append(np.flatnonzero(hard[q]), len(q))
            nxt = at[np.searchsorted(at, np.arange(len(q) + 1))]
            self.queue_a.append(q)
            self.queue.append(_items(q))
            self.hard.append(_items(nxt))
            if s not in mixed and len(q) > 1:
                # a run may follow a task when a long stretch does in queue order
                far = nxt[1:] - np.arange(1, len(q) + 1) >= self.MIN_RUN
                starts[q[far]] = True
        starts[:n_fb] &= self.dur_a > 0.0  # (no other dependency of the next ends with it)
        self.starts = bytearray(starts.view(np.uint8).tobytes())  # [task] 1: try a run after it
        self.starts_a = np.frombuffer(self.starts, dtype=np.uint8)
        self.rest = [self.REST] * S

    def follow(self, r: int, u: int, e: float, now: float) -> tuple[float, int]:
        """Stage ``r`` has just started ``u``, to end at ``e``, at the event of time ``now``:
        start the run that follows it, if any. Returns the (end, task) event to wait for: the
        run's last task, or ``u`` when there is no run."""
        start, q = self.loop.start, self.queue[r]
        k, n, p = self.rank[u], len(q), self.ptr[r]
        if p != k and start[q[p]] != start[q[p]]:  # (NaN: the first not started, not ready)
            return e, u  # u came out of order: its stage has no run now
        p = self.ptr[r] = self._first_not_started(q, p, k)
        if p != k:  # u came out of order: the first task not started is not ready (so not now)
            return e, u
        p = self._first_not_started(q, k + 1, n)
        if p == n:
            return e, u
        end, x_src, v = self.loop.end, self.x_src_l, q[p]
        for x in x_src[self.x_ptr_l[v]:self.x_ptr_l[v + 1]]:
            if not end[x] < now:  # (it is not ready: no run)
                return e, u
        hard = self.hard[r]
        j = hard[p]
        while j < n and start[q[j]] == start[q[j]]:  # (started already: no stop now)
            j = hard[j + 1]
        run = self._ready_stretch(r, p, j, now) if j - p >= self.MIN_RUN else self.queue_a[r][:0]
        if len(run) < self.MIN_RUN:  # (rest a while: the next tasks have few runs after them)
            rest = self.rest[r]
            self.starts_a[self.queue_a[r][p:p + rest + len(run)]] = 0
            self.rest[r] = min(2 * rest, self.MAX_REST)
            return e, u
        self.rest[r] = self.REST
        return self.schedule_run(r, u, e, run)

    def _first_not_started(self, q: array, p: int, stop: int) -> int:
        """The first of queue places ``p`` to ``stop`` whose task has not started, else
        ``stop``."""
        start = self.loop.start
        while p < stop:
            x = start[q[p]]
            if x != x:  # (NaN: not started)
                return p
            p += 1
        return stop

    def _ready_stretch(self, r: int, p: int, j: int, now: float) -> np.ndarray:
        """The tasks not started of queue places ``p`` to ``j`` of stage ``r`` up to the
        first whose received inputs have not all ended (as events) before ``now``."""
        qa, start_a, end_a = self.queue_a[r], self.start_a, self.end_a
        x_ptr, x_src = self.x_ptr, self.x_src
        parts = []
        lo, size = p, self.CHUNK
        while lo < j:
            hi = min(j, lo + size)
            seg = qa[lo:hi]
            seg = seg[np.isnan(start_a[seg])]
            a, b = x_ptr[seg], x_ptr[seg + 1]
            if (b > a).any():
                k, idx = ranges(a, b)
                late = ~(end_a[x_src[idx]] < now)  # (NaN: not started)
                if late.any():
                    parts.append(seg[: k[late].min()])
                    break
            parts.append(seg)
            lo, size = hi, 2 * size
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def schedule_run(self, r: int, u: int, e: float, run: np.ndarray) -> tuple[float, int]:
        """Start ``run`` on stage ``r`` back to back after ``u`` (ending at ``e``)."""
        loop = self.loop
        ends = np.cumsum(np.concatenate(([e], self.dur_a[run])))
        self.start_a[run] = ends[:-1]
        self.end_a[run] = ends[1:]
        before = np.concatenate(([u], run[:-1]))  # each one's predecessor on the stage
        np.frombuffer(loop.cause, dtype=np.int64)[run] = before
        loop.order.extend(run.tolist())
        # the ends taken early (all but the last's): their successors on the stage
        k, idx = ranges(self.ptr_a[before], self.ptr_a[before + 1])
        succ = self.flat_a[idx]
        here = self.res_a[succ] == r
        k, succ = k[here], succ[here]
        deps_a = np.frombuffer(loop.deps, dtype=np.int64)
        np.subtract.at(deps_a, succ, 1)
        queue, key = loop.queues[r], self.key
        last = key[int(run[-1])]
        while queue and queue[0] <= last:  # the run's tasks that were queued already
            heapq.heappop(queue)
        ready = (deps_a[succ] == 0) & np.isnan(self.start_a[succ])
        if ready.any():  # made ready by the run: queued, with the end that made them so
            w, kw = succ[ready][::-1], k[ready][::-1]
            w, first = np.unique(w, return_index=True)
            at = kw[first]
            np.frombuffer(loop.ready_at, dtype=np.float64)[w] = ends[at]
            np.frombuffer(loop.ready_from, dtype=np.int64)[w] = before[at]
            queue.extend(map(key.__getitem__, w.tolist()))
            heapq.heapify(queue)
        # ends with successors elsewhere: detached events for those. Of several ends in the
        # run that a successor waits for, only the last one's event can make it ready (the
        # others end strictly before: all times in a run are positive), so the others are
        # counted now; likewise all of them where the run's last task (whose own event is
        # pending) is one it waits for.
        far = before[~self.local_a[before]]
        if len(far):
            k, idx = ranges(self.ptr_a[far], self.ptr_a[far + 1])
            succ = self.flat_a[idx]
            there = self.res_a[succ] != r
            k, succ = k[there], succ[there]
            w = run[-1]
            keep = np.zeros(len(succ), dtype=bool)
            keep[len(succ) - 1 - np.unique(succ[::-1], return_index=True)[1]] = True
            keep &= ~np.isin(succ, self.flat_a[self.ptr_a[w]:self.ptr_a[w + 1]])
            np.subtract.at(deps_a, succ[~keep], 1)
            k, succ = k[keep], succ[keep]
            used, k = np.unique(k, return_inverse=True)  # (k ascending: the run's order)
            far = far[used]
            if not len(far):
                return float(ends[-1]), int(run[-1])
            bounds = np.searchsorted(k, np.arange(len(far) + 1)).tolist()
            succ_l = succ.tolist()
            far_l = far.tolist()
            at = len(self.far_ptr)
            self.far_ptr.extend([b + len(self.far_succ) for b in bounds])
            self.far_succ.extend(succ_l)
            self.detached.update(zip(far_l, range(at, at + len(far_l)), strict=True))
            loop.events.extend(zip(self.end_a[far].tolist(), far_l, strict=True))
            heapq.heapify(loop.events)
        return float(ends[-1]), int(run[-1])


def _items(a: np.ndarray) -> array:
    """An int64 array as an ``array("q")``: read one item at a time as quickly as a list,
    made without a Python int per item."""
    out = array("q")
    out.frombytes(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return out
