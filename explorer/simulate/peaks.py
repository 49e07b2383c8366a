"""Memory events along a simulated step, and each stage's peak of them.

A tensor's life is two events on its stage's timeline: its bytes at the moment it is made
and minus its bytes when it is let go of. :class:`Events` collects them by category
(activations, weight gradients, gathered ZeRO-3 weights); :func:`stage_peaks` finds, per
stage, the first moment their running total is highest and what each category holds there.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class EventArrays(NamedTuple):
    """Memory events as arrays: the stage, the time and the bytes (a free negative)."""

    stage: np.ndarray
    time: np.ndarray
    nbytes: np.ndarray

    @classmethod
    def none(cls) -> EventArrays:
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty.astype(np.float64), empty)


class Events:
    """The activation-like tensors' lives, collected as (stage, time, bytes) events."""

    def __init__(self) -> None:
        self.stage: list[np.ndarray] = []
        self.time: list[np.ndarray] = []
        self.nbytes: list[np.ndarray] = []

    def live(self, stage: np.ndarray, made: np.ndarray, freed: np.ndarray,
             nbytes: np.ndarray) -> None:
        """Tensors of ``nbytes`` on ``stage`` held from ``made`` until ``freed`` (elementwise;
        a tensor freed before it is made is freed as it is made; empty ones are left out)."""
        keep = nbytes > 0
        if not keep.all():
            stage, made, freed, nbytes = stage[keep], made[keep], freed[keep], nbytes[keep]
        self.stage.extend((stage, stage))
        self.time.extend((made, np.maximum(freed, made)))
        self.nbytes.extend((nbytes, -nbytes))

    def arrays(self) -> EventArrays:
        if not self.stage:
            return EventArrays.none()
        return EventArrays(np.concatenate(self.stage), np.concatenate(self.time),
                           np.concatenate(self.nbytes))


def stage_peaks(stages: int, activations: EventArrays, gradients: EventArrays,
                gathered: EventArrays) -> list[tuple[int, int, int]]:
    """Per stage, the (activation, gradient, gathered-weight) bytes live at the first peak of
    their total. ``gradients`` are made in its first half and freed in its second (a gradient
    that goes negative, a ZeRO shard replacing its full gradient, needs the full sort
    order)."""
    parts = (activations, gradients, gathered)
    small = stages < 2**15
    stage = np.concatenate([p.stage for p in parts]).astype(np.int16 if small else np.int64)
    time = np.concatenate([p.time for p in parts]).astype(np.float64, copy=False)
    nbytes = np.concatenate([p.nbytes for p in parts]).astype(np.int64, copy=False)
    n_act, n_grad = len(activations.stage), len(gradients.stage)
    half = n_grad // 2
    if n_grad and (gradients.nbytes[:half] <= 0).any():
        category = np.concatenate([np.full(len(p.stage), k, dtype=np.int64)
                                   for k, p in enumerate(parts)])
        # frees sort before allocations at one time: activations and gathered weights by
        # their sign, gradients by their half
        allocation = np.concatenate([activations.nbytes > 0, np.arange(n_grad) < half,
                                     gathered.nbytes > 0]).astype(np.int64)
        return _peaks_in_order(stages, stage.astype(np.int64), time, nbytes, category,
                               allocation)
    return _peaks(stages, stage, time, nbytes, (n_act, n_act + n_grad))


def _peaks(stages: int, stage: np.ndarray, time: np.ndarray, nbytes: np.ndarray,
           bounds: tuple[int, int]) -> list[tuple[int, int, int]]:
    """Per stage, (activation, gradient, gathered-weight bytes) live at the first peak of
    their total.

    Events (stage, time, bytes) with every allocation positive and every free negative, the
    activations' first, then the gradients' from ``bounds[0]``, the gathered weights' from
    ``bounds[1]``. Sorted by (time, frees first, bytes, category) within a stage, the running
    total falls through one time's frees and then rises through its allocations, so its first
    maximum is at the last event of some time, where what is live does not depend on how that
    time's events are ordered: sorting by time alone gives the same peak, and each category's
    bytes there are the sum of its events up to that time (integers: in any order).
    """
    by_stage = np.argsort(stage, kind="stable")  # (a radix sort of small integers)
    edges = np.searchsorted(stage[by_stage], np.arange(stages + 1))
    out = []
    for s in range(stages):
        lo, hi = int(edges[s]), int(edges[s + 1])
        got = (0, 0, 0)
        if hi > lo:
            ids = by_stage[lo:hi]
            t = time[ids]
            o = np.argsort(t)
            ids, t = ids[o], t[o]
            total = np.cumsum(nbytes[ids])
            last = np.flatnonzero(np.append(t[1:] != t[:-1], True))  # each time's last event
            k = int(last[np.argmax(total[last])])
            if total[k] > 0:
                upto = ids[:k + 1]
                b = nbytes[upto]
                grads = int(b[(upto >= bounds[0]) & (upto < bounds[1])].sum())
                gathered = int(b[upto >= bounds[1]].sum())
                got = (int(total[k]) - grads - gathered, grads, gathered)
        out.append(got)
    return out


def _peaks_in_order(stages: int, stage: np.ndarray, time: np.ndarray, nbytes: np.ndarray,
                    category: np.ndarray, allocation: np.ndarray) -> list[tuple[int, int, int]]:
    """:func:`_peaks` for any signs of bytes: events in their full sort order (time, frees
    first, bytes, category)."""
    o = np.lexsort((category, nbytes, allocation, time, stage))
    stage, nbytes, category = stage[o], nbytes[o], category[o]
    bounds = np.searchsorted(stage, np.arange(stages + 1))
    out = []
    for s in range(stages):
        lo, hi = bounds[s], bounds[s + 1]
        got = (0, 0, 0)
        if hi > lo:
            b, c = nbytes[lo:hi], category[lo:hi]
            parts = [np.cumsum(np.where(c == k, b, 0)) for k in range(3)]
            total = parts[0] + parts[1] + parts[2]
            k = int(np.argmax(total))
            if total[k] > 0:
                got = tuple(int(x[k]) for x in parts)  # type: ignore[assignment]
        out.append(got)
    return out
