"""The final check on a partitioner's plan: never slower than the single and data-parallel plans.

:func:`~explorer.partition.registry.partition` applies :func:`never_slower` once to the plan of
every partitioner registered with ``guarded=True`` (all of them but the baselines themselves
and WAP, whose objective is samples per joule, not step time). It simulates the plan, the
whole model on the first device and the whole model replicated on the partitioner's devices
(the ``single`` and ``data-parallel`` plans, pins applied to each), and returns the
partitioner's plan unless a baseline that fits the devices' memory is faster by the
simulator; then that baseline, with a note saying what the partitioner found, its simulated
step, which baseline won and by how much. A simulation of a 125,000-node plan takes about a
second, so the check runs at every graph size; partitioners may still rank their own
candidates by cheaper estimates on large graphs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.simulate.simulator import Prediction, simulate

#: predictions partitioners made of the plans they return, by plan identity, so the final
#: check does not simulate a plan again (a second at 125,000 nodes); the last few are kept
_KNOWN: dict[int, tuple[Plan, Prediction]] = {}
KNOWN_KEPT = 4

#: the options by which a partitioner's caller asks for its own plan, unchecked
#: (``compare_baselines``: pipeline-dp, min-comm, pase; ``baselines``: the op-level searches)
BASELINE_SWITCHES = ("compare_baselines", "baselines")


def remember(plan: Plan, prediction: Prediction) -> Plan:
    """Record ``prediction`` as the simulator's for ``plan`` (with the graph and costs it will
    be checked with), for :func:`never_slower`; returns ``plan``."""
    _KNOWN[id(plan)] = (plan, prediction)
    while len(_KNOWN) > KNOWN_KEPT:
        del _KNOWN[next(iter(_KNOWN))]
    return plan


def _recalled(plan: Plan) -> Prediction | None:
    """The prediction :func:`remember` recorded for this very plan object, forgotten now."""
    entry = _KNOWN.pop(id(plan), None)
    return entry[1] if entry is not None and entry[0] is plan else None


def most_replicas(graph: OpGraph, k: int) -> int:
    """How many of ``k`` devices can hold a replica of the whole model: at most one per sample
    of the batch (:meth:`Plan.check_sizes`; a batch of ``b < k`` samples splits into ``b``
    replicas of one sample, which also divides it for a real run), all ``k`` when the batch
    size is unknown (0)."""
    return min(k, graph.batch_size) if graph.batch_size > 0 else k


def replicated(graph: OpGraph, ids: Sequence[str], **settings: Any) -> Plan:
    """The whole model on every device of ``ids``, the batch split among them (data parallel)."""
    return Plan.from_assignment(graph, [tuple(ids)], {i: 0 for i in range(len(graph))},
                                **settings)


def apply_pins(graph: OpGraph, plan: Plan, pins: Mapping[str, str]) -> Plan:
    """Move pinned nodes to the stage of their device (adding a stage if the plan lacks it)."""
    if not pins:
        return plan
    stages = [list(s) for s in plan.stages]
    placement = dict(plan.placement)
    for nm, dev in pins.items():
        where = next((k for k, s in enumerate(stages) if dev in s), None)
        if where is None:
            stages.append([dev])
            where = len(stages) - 1
        placement[nm] = where
    return plan.with_settings(stages=tuple(tuple(s) for s in stages), placement=placement,
                              pinned=frozenset(pins) | plan.pinned)


def baseline_plans(graph: OpGraph, ids: Sequence[str], pins: Mapping[str, str] | None,
                   **settings: Any) -> list[tuple[str, Plan]]:
    """``("single", everything on ids[0])`` and, with more than one device,
    ``("data-parallel", the model replicated on ids)`` (at most one replica per sample of the
    batch), each with the pins applied (a pinned node moves to the stage that holds its
    device, so both honour every pin)."""
    pins = dict(pins or {})
    out = [("single", apply_pins(graph, Plan.single(graph, ids[0], **settings), pins))]
    wide = ids[:most_replicas(graph, len(ids))]
    if len(wide) > 1:
        out.append(("data-parallel", apply_pins(graph, replicated(graph, wide, **settings),
                                                pins)))
    return out


def broken_pins(plan: Plan, pins: Mapping[str, str] | None) -> list[str]:
    """The pinned nodes ``plan`` does not run on their device alone (a replicated stage runs
    them on every device of the stage)."""
    return [nm for nm, dev in (pins or {}).items() if plan.devices_of(nm) != (dev,)]


def fits_within(pred: Prediction, memory_fraction: float = 1.0) -> bool:
    """Whether every device's simulated peak stays within its allowed fraction of memory."""
    return all(pred.peak_bytes[d] <= int(c * memory_fraction)
               for d, c in pred.capacity_bytes.items())


def describe(plan: Plan) -> str:
    """A plan's shape in words: "3 stages on 3 devices, 4 micro-batches"."""
    n, d = len(plan.stages), len(plan.devices)
    words = f"{n} stage{'s' * (n != 1)} on {d} device{'s' * (d != 1)}"
    return words + (f", {plan.micro_batches} micro-batches" if plan.micro_batches > 1 else "")


def milliseconds(seconds: float) -> str:
    """Seconds as milliseconds in words: "1,639.2 ms", "3.729 ms"."""
    ms = seconds * 1e3
    return f"{ms:,.1f} ms" if ms >= 100 else f"{ms:.4g} ms"


def never_slower(graph: OpGraph, costs: CostModel, plan: Plan, name: str, ids: Sequence[str],
                 pins: Mapping[str, str] | None = None, memory_fraction: float = 1.0) -> Plan:
    """``plan``, or the fastest of the ``single`` and ``data-parallel`` plans on ``ids`` when
    the simulator finds it faster (see the module docs).

    A baseline counts only when it runs every pinned node on its device alone and fits
    ``memory_fraction`` of every device's memory; the
    partitioner's plan is kept on a tie, and when nothing fits (it is then the partitioner's
    to say why). A baseline returned keeps ``name`` as its algorithm, ``plan``'s options with
    ``"fallback"`` set to its label, and a note saying how much faster it is.
    """
    own = _recalled(plan) or simulate(graph, plan, costs)
    own_fits = fits_within(own, memory_fraction)
    best: tuple[str, Plan, float] | None = None
    left_out = []
    for label, cand in baseline_plans(graph, ids, pins, algorithm=name,
                                      optimizer=plan.optimizer):
        broken = broken_pins(cand, pins)
        if broken:
            left_out.append(f"{label} would break the pins (it runs {', '.join(broken[:3])}"
                            f"{' ...' if len(broken) > 3 else ''} on every device of a "
                            "replicated stage)")
            continue
        pred = simulate(graph, cand, costs)
        if not fits_within(pred, memory_fraction):
            over = pred.memory_report() or f"over the {memory_fraction:.0%} of memory allowed"
            left_out.append(f"{label} does not fit ({over})")
        elif best is None or pred.step_s < best[2] * (1 - 1e-9):
            best = (label, cand, pred.step_s)
    if best is None or (own_fits and own.step_s <= best[2] * (1 + 1e-9)):
        return plan
    label, chosen, step_s = best
    if own_fits:
        note = (f"{label} is faster than {name}'s own plan ({describe(plan)}): "
                f"{milliseconds(step_s)} per step against {milliseconds(own.step_s)} by the "
                f"simulator ({1 - step_s / own.step_s:.1%} less), so this is the {label} plan")
    else:
        note = (f"{name}'s own plan ({describe(plan)}, {milliseconds(own.step_s)} per step) "
                f"does not fit the devices' memory by the simulator "
                f"({own.memory_report() or 'over the memory allowed'}); the {label} plan "
                f"fits and takes {milliseconds(step_s)}, so this is the {label} plan")
    if left_out:
        note += "; " + "; ".join(left_out)
    return chosen.with_settings(notes=(*chosen.notes, note),
                                options={**plan.options, "fallback": label})


__all__ = ["BASELINE_SWITCHES", "KNOWN_KEPT", "apply_pins", "baseline_plans", "broken_pins",
           "describe", "fits_within", "milliseconds", "most_replicas", "never_slower",
           "remember", "replicated"]
