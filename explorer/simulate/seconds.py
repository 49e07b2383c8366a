"""Cost tables as arrays: node seconds for many nodes at once, and the step's lower bound."""

from __future__ import annotations

import numpy as np

from explorer.core.graph import OpGraph
from explorer.costs.model import CostModel
from explorer.simulate.arrays import GraphArrays


def plain_costs(costs: CostModel) -> bool:
    """Whether ``costs`` computes node times with CostModel's own formulas (not overridden)."""
    cls = type(costs)
    return all(getattr(cls, m) is getattr(CostModel, m)
               for m in ("fwd_s", "bwd_s", "_scaled", "_dc", "node_s", "transfer_s"))


class Seconds:
    """Node seconds as ``costs.fwd_s`` / ``costs.bwd_s`` give them, for many nodes at once.

    ``others`` (device -> how many other replicas of its stage compute the same ops beside
    it) slows each op as the device's platform says from its measured contention
    (:meth:`explorer.platforms.Platform.op_slowdown`).
    """

    def __init__(self, costs: CostModel, others: dict[str, float] | None = None) -> None:
        self.costs = costs
        self.plain = plain_costs(costs)
        self.others = others or {}

    def on(self, which: str, idx: np.ndarray, device: str, fraction: float,
           share: float = 1.0) -> np.ndarray:
        """[len(idx)] seconds of nodes ``idx`` on ``device`` at ``fraction`` of the batch;
        ``share`` < 1: each device's part of an op split that many ways by its features
        (weights, heads, channels), which runs ``share`` of the op's work at that fraction
        with the per-op overhead unchanged. (Not the op at ``fraction x share`` of the
        batch: a split op reads ``share`` of its weights, where the same op on fewer rows
        reads them all, which is most of a small batch's time.)"""
        costs = self.costs
        if not self.plain:
            fn = costs.fwd_s if which == "fwd_s" else costs.bwd_s
            return np.array([fn(i, device, fraction * share) for i in idx.tolist()],
                            dtype=np.float64)
        dc = costs.per_type[costs.cluster.device(device).type_key]
        t = dc.at_many(which, idx, fraction)  # DeviceCosts.at, elementwise
        if share < 1.0:
            ovh = np.minimum(dc.overhead_s, t)
            t = ovh + (t - ovh) * share
        busy_others = self.others.get(device, 0.0)
        if busy_others and dc.contention:
            slow = costs.platform(device).op_slowdown(dc.array("contention")[idx], busy_others)
            if slow is not None:
                t = t * slow
        s = t * costs.compute_scale + costs.extra_op_s  # CostModel._scaled, elementwise
        return np.where(t <= 0.0, 0.0, s)

    def slowest(self, which: str, idx: np.ndarray, devices, fraction: float,
                share: float = 1.0) -> np.ndarray:
        out = None
        for dv in devices:
            s = self.on(which, idx, dv, fraction, share)
            out = s if out is None else np.maximum(out, s)
        return out if out is not None else np.zeros(len(idx))


def lower_bound_s(graph: OpGraph, costs: CostModel) -> float:
    """Total compute on the fastest device type, spread over every device: no plan beats it."""
    return arrays_lower_bound_s(GraphArrays.of(graph), costs, Seconds(costs))


def arrays_lower_bound_s(A: GraphArrays, costs: CostModel, sec: Seconds,
                         factors: dict[str, np.ndarray] | None = None) -> float:
    """:func:`lower_bound_s` on the arrays; ``factors`` (device type key -> [node] factor on
    its times) for ops in another precision."""
    cluster = costs.cluster
    reps = {d.type_key: d.id for d in cluster.devices}
    ops = np.flatnonzero(A.is_op)
    best = None
    for d in reps.values():
        if sec.plain:
            s = _per_batch(sec, costs, "fwd_s", ops, d) + _per_batch(sec, costs, "bwd_s", ops, d)
        else:
            s = np.array([costs.node_s(i, d) for i in ops.tolist()], dtype=np.float64)
        if factors is not None:
            s = s * factors[cluster.device(d).type_key][ops]
        best = s if best is None else np.minimum(best, s)
    if best is None or not len(best):
        return 0.0
    # the ops' times added in node order (an accumulation runs strictly left to right)
    return float(np.cumsum(best)[-1]) / max(len(cluster), 1)


def _per_batch(sec: Seconds, costs: CostModel, which: str, ops: np.ndarray, device: str
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
