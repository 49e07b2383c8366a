"""Op costs in the segment runtime: what the op path adds to every op, fitted so the ops' costs
add up to what segment runs of the same plan measured.

The profile times each op inside real steps of the op path (:mod:`explorer.runtime.stage`: one
op at a time, its inputs wrapped, its outputs counted and kept, one autograd call per op's
backward), which adds tens of microseconds of the runtime's own work to every op on a CPU rank.
The segment runtime (:mod:`explorer.runtime.segments`) runs a rank's consecutive ops as one
piece of generated code with one backward, as eager PyTorch does, and pays little of it. So the
profile also runs the same single-device plan in segments at each share of the batch it times
(:func:`explorer.profiling.ops.measure`), and an op's cost in a segment is its op-path time
less what the op path adds (one number per direction and share of the batch, the same for
every op), never under the per-op dispatch cost (what the least op costs), nor over its cost
at a larger share: what the op path adds is the number that makes the ops' costs add up to the
segment runs' forward and backward (:func:`fit_extra`). The op path adds more per op at the
whole batch than at a quarter of it (tens of microseconds per forward op on a CPU rank,
about a third more at the whole batch than at a quarter on the built-in GPT): fitted per
share, the single-device plan's segment steps are what the profile predicts at every share it
timed. A segment call's own cost and a per-op cost are one number on one device (every
micro-batch runs as one segment there), so it is spread over the ops.

Where a plan's stage boundaries cut a rank's ops into more segments, what each extra segment
costs is counted with the messages that cross the cut: the message probe
(:func:`explorer.profiling.host.cpu_message_s`) runs a two-stage plan in segments against its
single-device profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from explorer.costs.model import DeviceCosts


def fit_extra(times: Sequence[float], target_s: float, floor_s: float,
              caps: Sequence[float] | None = None) -> float:
    """The seconds ``extra`` that, taken off every op's time in ``times`` (an op of time 0 is
    not one: it stays 0), leave the ops' costs adding up to ``target_s``, each cost kept
    within ``floor_s`` and its cap in ``caps`` (where given): the ``extra`` with
    ``sum(clip(t - extra, floor_s, cap)) == target_s``.

    Where no ``extra`` reaches ``target_s`` (all ops at their floor still cost more, or all at
    their caps less), the one that comes nearest. May be negative: the segments ran slower
    than the op path (a noisy host)."""
    t = np.asarray(times, dtype=np.float64)
    on = t > 0.0
    if not on.any():
        return 0.0
    t, cap = t[on], _caps(caps, len(on), floor_s)[on]
    if target_s <= float(np.minimum(floor_s, cap).sum()):  # every op at its floor, or more
        return float(t.max() - floor_s)
    if target_s >= float(cap.sum()):  # every op at its cap, or less (inf: no caps)
        return float((t - cap).min())
    # The ops' total is continuous, piecewise linear and falling in ``extra``, bent where an
    # op leaves its cap or reaches its floor: find the piece that crosses target_s among
    # those bends and solve its line. The answer depends on the ops alone, not on where a
    # search started (a bisection's last bit moves with the floor).
    def total(x: float) -> float:
        return float(np.clip(t - x, floor_s, cap).sum())

    bends = np.unique(np.concatenate([t - floor_s, (t - cap)[np.isfinite(cap)]]))
    below, above = -1, len(bends)  # total(bends[below]) >= target_s > total(bends[above])
    while above - below > 1:
        mid = (below + above) // 2
        if total(float(bends[mid])) >= target_s:
            below = mid
        else:
            above = mid
    if below >= 0 and total(float(bends[below])) == target_s:
        return float(bends[below])
    lo = float(bends[below]) if below >= 0 else -np.inf
    hi = float(bends[above]) if above < len(bends) else np.inf
    inside = 0.5 * (lo + hi) if np.isfinite(lo) and np.isfinite(hi) else (
        hi - 1.0 if np.isfinite(hi) else lo + 1.0)
    free = (t - cap < inside) & (inside < t - floor_s)  # the ops neither capped nor floored
    held = float(np.clip(t - inside, floor_s, cap)[~free].sum())
    return float((t[free].sum() + held - target_s) / free.sum())


def _caps(caps: Sequence[float] | None, n: int, floor_s: float) -> np.ndarray:
    """Each op's cap as an array (none: infinite; a cap of 0, an op the larger share did not
    time, caps nothing), at least ``floor_s``."""
    if caps is None:
        return np.full(n, np.inf)
    c = np.asarray(caps, dtype=np.float64)
    return np.where(c > 0.0, np.maximum(c, floor_s), np.inf)


def in_segments(times: Sequence[float], extra_s: float, floor_s: float,
                caps: Sequence[float] | None = None) -> list[float]:
    """Each op's cost in a segment: its op-path time in ``times`` less ``extra_s``, within
    ``floor_s`` and its cap in ``caps``; 0 where the op path gave it none."""
    t = np.asarray(times, dtype=np.float64)
    cap = _caps(caps, len(t), floor_s)
    return np.where(t > 0.0, np.clip(t - extra_s, floor_s, cap), 0.0).tolist()


@dataclass(frozen=True)
class SegmentCosts:
    """Per node, its forward and backward cost in a segment at the whole batch and at each
    smaller share of it (``[k]``: the ``k``-th share, 0 the whole batch), and what the op path
    added per op at each share (``DeviceCosts.op_path_extra_s``)."""

    fwd_at: list[list[float]]
    bwd_at: list[list[float]]
    extra_s: list[list[float]]


def fit(op_fwd_at: Sequence[Sequence[float]], op_bwd_at: Sequence[Sequence[float]],
        segment_fwd_s: Sequence[float], segment_bwd_s: Sequence[float],
        floor_s: float) -> SegmentCosts:
    """The ops' costs in segments from their op-path times at each share of the batch
    (``op_fwd_at[k]``, ``op_bwd_at[k]``, per node) and the segment runs' forward and backward
    seconds per micro-batch at the same shares (``segment_fwd_s[k]``, ``segment_bwd_s[k]``):
    per share and direction, what the op path adds (:func:`fit_extra`), each op kept within
    ``floor_s`` and its cost at the next larger share.

    The op path does all a segment does and more, so it adds nothing less than 0: segments
    measured slower than the op path ran while the host slowed down between the two runs,
    which stretches every op in proportion. Then nothing is taken off, and the op-path times
    are scaled to the segments' (within the caps)."""
    out: list[list[list[float]]] = [[], []]
    extra: list[list[float]] = [[], []]
    for d, (op_at, targets) in enumerate(((op_fwd_at, segment_fwd_s),
                                          (op_bwd_at, segment_bwd_s))):
        for k, (times, target) in enumerate(zip(op_at, targets, strict=True)):
            caps = out[d][k - 1] if k else None
            x = max(fit_extra(times, target, floor_s, caps), 0.0)
            costs = in_segments(times, x, floor_s, caps)
            if x == 0.0 and sum(costs) > 0.0:
                scale = target / sum(costs)
                costs = np.minimum(np.asarray(costs) * scale,
                                   _caps(caps, len(costs), floor_s)).tolist()
            extra[d].append(x)
            out[d].append(costs)
    return SegmentCosts(out[0], out[1], extra)


def op_path_costs(dc: DeviceCosts) -> DeviceCosts:
    """``dc``, a profile of the segment runtime, as the op path's: what the op path adds put
    back on every op (an op the fit kept at the floor comes back at the floor plus that);
    ``dc`` itself where it is the op path's. For what runs one op at a time still (a host
    probe, a tensor-parallel split run) compared with a profile of the segment runtime."""
    if dc.runtime == "ops" or not dc.op_path_extra_s:
        return dc
    fwd_x, bwd_x = dc.op_path_extra_s

    def back(times: list[float], x: float) -> list[float]:
        return [t + x if t > 0.0 else 0.0 for t in times]

    return replace(dc, runtime="ops", op_path_extra_s=[],
                   fwd_s=back(dc.fwd_s, fwd_x[0]), bwd_s=back(dc.bwd_s, bwd_x[0]),
                   fwd_at=[back(r, x) for r, x in zip(dc.fwd_at, fwd_x[1:], strict=True)],
                   bwd_at=[back(r, x) for r, x in zip(dc.bwd_at, bwd_x[1:], strict=True)],
                   overhead_s=dc.overhead_s + min(fwd_x[0], bwd_x[0]))
