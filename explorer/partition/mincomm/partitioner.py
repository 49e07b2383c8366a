"""The min-comm partitioner: the k-way split made into a plan, checked by the simulator."""

from __future__ import annotations

from collections.abc import Mapping

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.bounds import op_devices
from explorer.partition.mincomm.parts import MinCommResult, min_comm_parts
from explorer.partition.options import Options, check_micro_batches, check_schedule
from explorer.partition.registry import register
from explorer.partition.search.fallback import (
    default_micro_batches,
    fit_headrooms,
    settle,
)
from explorer.simulate.simulator import Prediction


@register("min-comm")
def min_comm(graph: OpGraph, cluster: Cluster, costs: CostModel,
             pins: Mapping[str, str] | None = None, k: int | None = None,
             tolerance: float = 0.1, micro_batches: int | None = None,
             schedule: str = "1f1b", optimizer: str = "adam",
             compare_baselines: bool = True) -> Plan:
    """Balanced parts with the least communication and an acyclic stage graph (multilevel).

    Follows compiler-driven model parallelism (arXiv 1906.08168): node weights are compute
    seconds, edge weights transfer seconds; ``k`` parts balance compute within ``tolerance``
    while cutting the least transfer time, and parts stay in an order every edge respects, so
    the stage graph is acyclic. Coarsening by heavy-edge matching along a topological order,
    an interval split of the coarsest graph by dynamic programming, and Fiduccia-Mattheyses
    refinement while uncoarsening (moves that would create a cycle are never made); the
    even-layers split, refined the same way, competes as a second start. See
    :func:`min_comm_parts`.

    Parameters
    ----------
    k : int, optional
        Number of devices (parts), the cluster's first ``k`` (default: all).
    tolerance : float
        Allowed compute imbalance: every part holds between ``(1 - tolerance)`` and
        ``(1 + tolerance)`` times its fair share (its device's speed over the total).
        Default 0.1. Relaxed step by step, with a note, when no split meets it (an op
        heavier than a share, fewer ops than devices, pins, memory).
    micro_batches : int, optional
        Micro-batches per step, so the parts run as a pipeline. Default: 4 when the batch
        divides into 4, else 1; with ``compare_baselines`` parts for 1 micro-batch
        are tried as well (per-op overheads
        can make micro-batches cost more than the pipeline bubble saves), the faster kept.
    schedule : {"1f1b", "gpipe"}
        Pipeline schedule; sets the activations each part keeps in flight.
    optimizer, compare_baselines
        As in :class:`explorer.partition.options.Options`.

    Returns
    -------
    Plan
        One single-device stage per non-empty part, in execution order;
        ``options["cut_s"]`` is the communication per step, ``options["balanced"]`` whether
        the tolerance was met.

    Raises
    ------
    MemoryExceededError
        When no split fits the devices' memory, naming the device and the excess.
    ExplorerError
        When pins force a cycle between devices.

    Pins (node name -> device id) are honoured: a pinned node stays on its device; the order
    of parts follows the pins. Pins that force a cycle between two devices raise
    :class:`ExplorerError`. Runs in seconds on 100,000-node graphs.

    On a cluster of more than 64 devices the parts are at most the graph's op count, 1,024,
    and 20,000,000 / nodes (as many as its memory needs; :func:`explorer.partition.bounds.
    op_devices`), on the fastest devices; a note says so.

    Limits: the parts are stages of a pipeline (every edge goes to the same or a later part),
    so with one micro-batch they run one after another and the step is close to the sum of
    their compute whatever the balance; only micro-batches overlap them, and each repeats
    every op's fixed cost. On graphs whose width is the parallelism (random layered DAGs,
    launch-bound ops) the op-level placers (``m-etf``, ``pardnn``), which spread each layer
    over the devices, are several times faster.
    """
    check_schedule(schedule)
    check_micro_batches(micro_batches)
    opts = Options(k=k, optimizer=optimizer, compare_baselines=compare_baselines)
    m_default = default_micro_batches(graph) if micro_batches is None else int(micro_batches)
    m_choices = (m_default, 1) if micro_batches is None and compare_baselines and m_default > 1 \
        else (m_default,)
    pins = dict(pins or {})
    # on a large cluster, parts on the devices worth using (see explorer.partition.bounds)
    ids = opts.devices(cluster)
    chosen, bound_note = op_devices("min-comm", graph, costs, ids, pins, optimizer, 1.0)
    where, k_parts = (cluster, k) if len(chosen) == len(ids) else (cluster.subset(chosen), None)
    found: list[tuple[Plan, Prediction | None]] = []
    failure = ""
    for m in m_choices:
        def make(headroom: float, m: int = m) -> Plan:
            res = min_comm_parts(graph, where, costs, k_parts, tolerance, pins, m, schedule,
                                 optimizer, headroom)
            plan = _plan(graph, res, m, schedule, optimizer, pins, tolerance)
            return plan.with_settings(notes=(*plan.notes, bound_note)) if bound_note else plan

        plan, pred, failures = fit_headrooms(graph, costs, make, "min-comm: its split",
                                             compare_baselines)
        if plan is not None and (pred is None or pred.fits):
            found.append((plan, pred))
        failure = failure or (failures[0] if failures else "")
    plan, pred = min(found, key=lambda x: x[1].step_s if x[1] is not None else 0.0,
                     default=(None, None))
    return settle(graph, cluster, costs, "min-comm", plan, pred, failure, pins, opts)


def _plan(graph: OpGraph, res: MinCommResult, m: int, schedule: str, optimizer: str,
          pins: Mapping[str, str], tolerance: float) -> Plan:
    used = sorted(set(res.part))
    stage_of = {p: s for s, p in enumerate(used)}
    notes = [f"{len(used)} parts, communication {res.cut_s:.4g} s per step "
             f"(start: {res.start}, {res.levels} levels)"]
    if not res.balanced:
        ratio = [w / (lim / (1 + tolerance)) if lim > 0 else 1.0
                 for w, lim in zip(res.compute_s, res.limit_s, strict=True)]
        worst = max(range(len(ratio)), key=lambda p: abs(ratio[p] - 1))
        notes.append(f"no split within the {tolerance:.0%} balance tolerance was found; part "
                     f"{worst} holds {ratio[worst]:.2f} x its share")
    return Plan.from_assignment(
        graph, [(res.devices[p],) for p in used],
        {i: stage_of[p] for i, p in enumerate(res.part)}, micro_batches=m, schedule=schedule,
        optimizer=optimizer, algorithm="min-comm",
        options={"k": len(res.devices), "tolerance": tolerance, "micro_batches": m,
                 "schedule": schedule, "cut_s": res.cut_s, "balanced": res.balanced},
        pinned=frozenset(pins), notes=tuple(notes))


__all__ = ["min_comm"]
