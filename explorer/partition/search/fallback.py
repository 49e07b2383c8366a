"""Fallbacks every partitioner shares: a baseline when nothing else fits, memory headroom, errors.

:func:`best_of_baselines` returns the fastest of a partitioner's plan and the ``single`` and
``data-parallel`` baselines that fits, by the simulator, when its own plan does not fit (the
registry's final check, :mod:`explorer.partition.guard`, compares plans that do);
:func:`fit_headrooms` makes a plan again with less memory when the simulator finds it over
the additive estimate; :func:`memory_error` is the one error for a device that cannot hold
what a plan puts on it; :func:`cheapest_memory_settings` makes a plan that does not fit fit
with the memory settings (ZeRO, recomputation, precision) that cost least step time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from explorer.core.errors import MemoryExceededError
from explorer.core.graph import OpGraph
from explorer.core.plan import PRECISIONS, RECOMPUTE, ZERO_STAGES, Plan, StageSettings
from explorer.core.units import format_bytes
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.guard import baseline_plans, remember
from explorer.partition.options import Options
from explorer.simulate.simulator import Prediction, simulate

#: the memory settings tried, on every stage, where no plan fits: every combination (fp16
#: costs what bf16 does in the simulator, so only bf16), roughly cheapest first (ZeRO moves
#: bytes, recomputation adds forwards, bf16 changes the numerics); the simulator picks among
#: those that fit the one with the shortest step (the first on ties)
MEMORY_CHOICES = tuple(sorted(
    (StageSettings(z, r, p) for p in PRECISIONS if p != "fp16" for r in RECOMPUTE
     for z in ZERO_STAGES if (z, r, p) != (0, "none", "fp32")),
    key=lambda st: (st.precision != "fp32", RECOMPUTE.index(st.recompute), st.zero)))

#: memory headroom factors tried in turn when the simulator finds a plan over memory that the
#: additive estimate said would fit
HEADROOMS = (1.0, 0.85, 0.7)


def memory_error(algorithm: str, what: str, device: str, need_bytes: float,
                 capacity_bytes: float, hint: str = "") -> MemoryExceededError:
    """A :class:`MemoryExceededError` naming the device, what it would hold and the excess."""
    over = need_bytes - capacity_bytes
    msg = (f"{algorithm}: device {device} cannot hold {what}: it needs "
           f"{format_bytes(need_bytes)} but has {format_bytes(capacity_bytes)} (over by "
           f"{format_bytes(over)})")
    return MemoryExceededError(msg + (f"; {hint}" if hint else ""))


def default_micro_batches(graph: OpGraph) -> int:
    """4 micro-batches when the batch divides into 4, else 1."""
    return 4 if graph.batch_size >= 4 and graph.batch_size % 4 == 0 else 1


def fit_headrooms(graph: OpGraph, costs: CostModel, make: Callable[[float], Plan], what: str,
                  simulate_plans: bool) -> tuple[Plan | None, Prediction | None, list[str]]:
    """Make a plan with each of :data:`HEADROOMS` in turn until the simulator finds it fits.

    ``make(headroom)`` plans with ``headroom`` x each device's memory, raising
    :class:`MemoryExceededError` when nothing fits; that ends the tries. With
    ``simulate_plans``, each plan is simulated and a plan over
    memory is made again with the next headroom. Returns the last plan made (None when
    none was), its prediction (None when not simulated) and why each try failed, in order;
    ``what`` names the plan in those messages (``"pase: its plan"``).
    """
    plan = pred = None
    failures: list[str] = []
    for headroom in HEADROOMS:
        try:
            plan = make(headroom)
        except MemoryExceededError as exc:
            failures.append(str(exc))
            break
        pred = simulate(graph, plan, costs) if simulate_plans else None
        if pred is None or pred.fits:
            break
        failures.append(f"{what} does not fit the simulator's memory accounting "
                        f"({pred.memory_report()})")
    return plan, pred, failures


def memory_keywords(settings: StageSettings) -> dict[str, Any]:
    """``settings`` as keywords for :meth:`Plan.with_memory`."""
    return {"zero": settings.zero, "recompute": settings.recompute,
            "precision": settings.precision}


def splits_under_settings(graph: OpGraph, make: Callable[[StageSettings], Plan]
                          ) -> list[Plan]:
    """The distinct plans (stages, micro-batches, placement) ``make`` gives for each of
    :data:`MEMORY_CHOICES`, in that order; a choice where ``make`` raises
    :class:`MemoryExceededError` gives none."""
    out: dict[tuple, Plan] = {}
    for settings in MEMORY_CHOICES:
        try:
            plan = make(settings)
        except MemoryExceededError:
            continue
        out.setdefault((plan.stages, plan.micro_batches, plan.schedule,
                        tuple(plan.assignment(graph))), plan)
    return list(out.values())


def cheapest_memory_settings(graph: OpGraph, costs: CostModel, name: str,
                             plans: Sequence[Plan]) -> Plan | None:
    """Of ``plans``, each with each of :data:`MEMORY_CHOICES` on every stage, the one that
    fits with the shortest simulated step, with a note saying which settings it uses and what
    they cost in step time against the same plan without them; None when none fits. (A plan
    without a replicated stage is not tried with ZeRO, which changes nothing there.)
    """
    best: tuple[Plan, Prediction] | None = None
    tried = 0
    for settings in MEMORY_CHOICES:
        for plain in plans:
            if settings.zero and plain.data_parallel == 1:
                continue
            plan = plain.with_memory(**memory_keywords(settings))
            tried += 1
            pred = simulate(graph, plan, costs)
            if pred.fits and (best is None or pred.step_s < best[1].step_s * (1 - 1e-9)):
                best = (plan, pred)
    if best is None:
        return None
    plan, pred = best
    without_s = simulate(graph, plan.with_settings(stage_settings=()), costs).step_s
    what = "; ".join(dict.fromkeys(plan.settings_of(s).describe()
                                   for s in range(len(plan.stages))))
    cost = pred.step_s / without_s - 1.0 if without_s > 0 else 0.0
    note = (f"{name}: fits only with memory settings ({what}): {pred.step_s:.4g} s per step, "
            f"{cost:+.1%} against {without_s:.4g} s without them (which does not fit); the "
            f"fastest that fits of {tried} plans with settings tried by the simulator")
    return plan.with_settings(notes=(*plan.notes, note))


def best_of_baselines(graph: OpGraph, cluster: Cluster, costs: CostModel, plan: Plan | None,
                      pins: Mapping[str, str] | None, optimizer: str, name: str,
                      ids: Sequence[str] | None = None, failure: str = "",
                      own_prediction: Prediction | None = None) -> Plan:
    """``plan``, unless ``single`` or ``data-parallel`` is faster per the simulator.

    Simulates ``plan`` (``None``: the algorithm found nothing that fits), everything on the
    first device and the whole model replicated on ``ids`` (default: all devices), pins
    applied to each, and returns the fastest that fits (``plan`` on a tie), relabelled as
    ``name`` with a note saying which baseline it is and how fast each was. Raises
    :class:`MemoryExceededError` with the simulator's memory report when nothing fits. Any
    graph size: a simulation of a 100,000-node graph takes about a second.
    """
    ids = tuple(ids or cluster.ids)
    pins = dict(pins or {})
    cands: list[tuple[str, Plan]] = [("own", plan)] if plan is not None else []
    cands += baseline_plans(graph, ids, pins, algorithm=name, optimizer=optimizer)
    best = None
    reports = []
    own_s = None
    for label, cand in cands:
        pred = own_prediction if label == "own" and own_prediction is not None else simulate(
            graph, cand, costs)
        if not pred.fits:
            reports.append(f"{label}: {pred.memory_report()}")
            continue
        if label == "own":
            own_s = pred.step_s
        if best is None or pred.step_s < best[2] * (1 - 1e-9):
            best = (label, cand, pred.step_s)
    if best is None:
        fitted = cheapest_memory_settings(graph, costs, name, [c for _, c in cands])
        if fitted is not None:
            label = next(lb for lb, c in cands if c.stages == fitted.stages
                         and c.placement == fitted.placement)
            if label != "own":
                fitted = fitted.with_settings(
                    notes=(*fitted.notes, f"{name} found no plan that fits without memory "
                           f"settings; this is the {label} plan with them"),
                    options={**(dict(plan.options) if plan is not None else {}),
                             "fallback": label})
            return fitted.with_settings(algorithm=name, pinned=frozenset(pins))
        raise MemoryExceededError(
            (failure + "; " if failure else f"{name}: no plan fits the devices' memory; ")
            + "the simulator finds " + "; ".join(reports)
            + "; not even with ZeRO, recomputation or bf16; use more or larger devices, a "
            "smaller batch, or SGD")
    label, chosen, step_s = best
    if label == "own":
        return chosen
    own = f"{own_s:.4g} s" if own_s is not None else "over memory"
    note = (f"{label} is faster than {name}'s own plan ({step_s:.4g} s per step against "
            f"{own}), so this is the {label} plan" if plan is not None else
            f"{name} found no split that fits ({failure}); this is the {label} plan")
    return chosen.with_settings(
        algorithm=name, notes=(*chosen.notes, note),
        options={**(dict(plan.options) if plan is not None else {}), "fallback": label},
        pinned=frozenset(pins))


def settle(graph: OpGraph, cluster: Cluster, costs: CostModel, name: str, plan: Plan | None,
           prediction: Prediction | None, failure: str, pins: Mapping[str, str],
           opts: Options) -> Plan:
    """A partitioner's answer: ``plan`` when it fits (or was not simulated), to be compared
    with the baselines by the registry's final check; without ``opts.compare_baselines``,
    ``plan`` as it is (raising :class:`MemoryExceededError` with ``failure`` when it is None);
    else, when it is None or the simulator finds it over memory, :func:`best_of_baselines`
    on ``opts``' devices."""
    if not opts.compare_baselines:
        if plan is None:
            raise MemoryExceededError(failure)
        return plan
    if plan is not None and (prediction is None or prediction.fits):
        return plan if prediction is None else remember(plan, prediction)
    return best_of_baselines(graph, cluster, costs, plan, pins, opts.optimizer, name,
                             opts.devices(cluster), failure, prediction)


__all__ = ["HEADROOMS", "MEMORY_CHOICES", "best_of_baselines", "cheapest_memory_settings",
           "default_micro_batches", "fit_headrooms", "memory_error", "memory_keywords",
           "settle", "splits_under_settings"]
