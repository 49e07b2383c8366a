"""WAP: how many devices a workload should use, from predicted throughput and energy per step.

Seed: "Workload-aware Automatic Parallelization for Multi-GPU DNN Training" (WAP): not every
model gains from every GPU, because communication and idle time grow with the device count.
The sweep tries ``k = 1..K`` devices (on more than 64, the powers of two and ``K``); for each
``k`` it takes the fastest plan of several partitioners (data-parallel at least) on the
cluster's first ``k`` devices, simulates it, and records the step time, throughput and energy
per step (the simulator's: busy power x busy time plus idle power x idle time, over the
devices the plan uses). It then picks the ``k`` with the most samples per joule, or the
smallest ``k`` within a fraction of the best throughput, and says why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from explorer.core.errors import ExplorerError, MemoryExceededError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.bounds import FULL_SEARCH_DEVICES, powers_of_two
from explorer.partition.coarse import coarsen
from explorer.partition.registry import algorithm as lookup_algorithm
from explorer.partition.registry import partition, register
from explorer.simulate.simulator import simulate

#: the partitioners a sweep tries at every device count (data-parallel is always added)
DEFAULT_ALGORITHMS = ("data-parallel", "even-layers", "pipeline-dp", "min-comm")
OBJECTIVES = ("throughput_per_joule", "throughput")
#: graphs with more ops than this are swept on a merged stand-in (see ``wap_sweep``)
COARSE_ABOVE = 20_000


@dataclass(frozen=True)
class WapPoint:
    """The fastest plan on the first ``k`` devices and what it costs per step.

    ``throughput_per_s`` is samples per second; ``throughput_per_joule`` is samples per joule
    (throughput divided by average power). ``tried`` says, per algorithm, its step time or why
    it gave no plan. When nothing fits, ``plan`` is None and the numbers are inf / 0.
    """

    k: int
    algorithm: str
    plan: Plan | None
    step_s: float
    throughput_per_s: float
    energy_j: float
    throughput_per_joule: float
    devices_used: int
    tried: tuple[tuple[str, str], ...]
    #: the graph the point was simulated on: "ops" (the graph itself) or a merged stand-in
    #: ("N groups", see ``coarse_above``); such points carry no plan but may fit
    simulated_on: str = "ops"
    fit: bool | None = None

    @classmethod
    def of(cls, k: int, algorithm: str, plan: Plan, step_s: float, energy_j: float,
           batch_size: int, tried: tuple[tuple[str, str], ...]) -> WapPoint:
        """The point of ``plan`` (simulated on the graph itself) for a batch of
        ``batch_size`` samples."""
        return cls(k, algorithm, plan, step_s,
                   batch_size / step_s if step_s > 0 else math.inf, energy_j,
                   batch_size / energy_j if energy_j > 0 else math.inf, len(plan.devices),
                   tried)

    @property
    def fits(self) -> bool:
        return self.plan is not None if self.fit is None else self.fit

    def summary(self) -> dict[str, Any]:
        """The point as plain JSON numbers (None where nothing fits), for plan options."""
        def num(x: float) -> float | None:
            return x if self.fits and math.isfinite(x) else None

        return {"k": self.k, "algorithm": self.algorithm, "step_s": num(self.step_s),
                "throughput_per_s": num(self.throughput_per_s), "energy_j": num(self.energy_j),
                "throughput_per_joule": num(self.throughput_per_joule),
                "devices_used": self.devices_used, "fits": self.fits}


@dataclass(frozen=True)
class WapResult:
    """The sweep's curve (one point per ``k`` swept, :func:`swept_counts`), the chosen ``k``
    and why."""

    points: tuple[WapPoint, ...]
    chosen_k: int
    objective: str
    within: float
    why: str

    @property
    def chosen(self) -> WapPoint:
        return next(p for p in self.points if p.k == self.chosen_k)

    def curve(self) -> list[dict[str, Any]]:
        return [p.summary() for p in self.points]

    def table(self) -> str:
        """The curve as aligned text, the chosen ``k`` marked."""
        rows = [("k", "algorithm", "step", "samples/s", "J/step", "samples/J", "")]
        for p in self.points:
            rows.append((str(p.k), p.algorithm or "-",
                         f"{p.step_s * 1e3:.3f} ms" if p.fits else "does not fit",
                         f"{p.throughput_per_s:,.1f}", f"{p.energy_j:.3g}" if p.fits else "-",
                         f"{p.throughput_per_joule:.4g}", "<-" if p.k == self.chosen_k else ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                         for r in rows)


def wap_sweep(graph: OpGraph, cluster: Cluster, costs: CostModel,
              algorithms: Sequence[str] = DEFAULT_ALGORITHMS,
              objective: str = "throughput_per_joule", within: float = 0.05,
              pins: Mapping[str, str] | None = None, max_k: int | None = None,
              coarse_above: int | None = COARSE_ABOVE) -> WapResult:
    """Sweep ``k = 1..K`` devices (see ``max_k``) and pick how many this workload should use.

    For each ``k`` every algorithm in ``algorithms`` (``"data-parallel"`` is always included)
    plans for the cluster's first ``k`` devices; the fastest plan that fits the simulator's
    memory is the point for ``k``. Partitioners with a ``compare_baselines`` option run with it
    off, since the sweep compares against data-parallel (which is ``single`` at ``k = 1``)
    itself.

    Parameters
    ----------
    algorithms : sequence of str
        Registered partitioners to try at every ``k``.
    objective : {"throughput_per_joule", "throughput"}
        ``"throughput_per_joule"`` (default): the ``k`` with the most samples per joule, the
        smaller ``k`` on ties. ``"throughput"``: the smallest ``k`` whose throughput is
        within ``within`` of the best.
    within : float
        The fraction for ``objective="throughput"`` (default 0.05; unused otherwise).
    pins : mapping of str to str, optional
        Node name -> device id, honoured by every plan; a ``k`` whose devices do not include
        every pinned device has no plan.
    max_k : int, optional
        Largest ``k`` (default: every device of the cluster). Every ``k`` up to 64
        (:data:`~explorer.partition.bounds.FULL_SEARCH_DEVICES`) is swept; beyond, powers of
        two and ``max_k`` itself (:func:`swept_counts`), each partitioner bounding its own
        search on that many devices.
    coarse_above : int or None
        On graphs with more ops than this (default 20,000) the sweep plans and simulates a
        stand-in graph of about 2,000 merged runs of ops (:mod:`explorer.partition.coarse`:
        same seconds per run at every batch fraction, same bytes leaving each run), then
        makes the chosen plan for the real graph and simulates it there: that point of the
        curve is exact, the others are the stand-in's (``WapPoint.simulated_on``). Merging
        hides overlap inside a run, so the stand-in's step times are the same or slower
        (close on regular models, further off for pipelines on irregular graphs, whose
        runs overlap more). ``None`` sweeps the real graph always.

    Returns
    -------
    WapResult
        The curve (a :class:`WapPoint` per ``k``), the chosen ``k`` and why.

    Raises
    ------
    MemoryExceededError
        When no ``k`` has a plan that fits.

    Examples
    --------
    >>> from explorer.devices.cluster import Cluster
    >>> from explorer.models.synthetic import layered_dag, roofline_costs
    >>> g, cl = layered_dag(100), Cluster.preset("2xH100")
    >>> res = wap_sweep(g, cl, roofline_costs(g, cl), algorithms=("data-parallel",))
    >>> [p.k for p in res.points], res.chosen_k in (1, 2)
    ([1, 2], True)
    """
    names = _checked_names(algorithms, objective, within)
    top = len(cluster) if max_k is None else max_k
    if not 1 <= top <= len(cluster):
        raise ExplorerError(f"max_k={max_k}, but the cluster has {len(cluster)} devices")
    pins = dict(pins or {})
    n_ops = sum(1 for n in graph.nodes if n.kind == "op")
    if coarse_above is not None and n_ops > coarse_above:
        res = _coarse_sweep(graph, cluster, costs, names, objective, within, pins, top, n_ops)
        if res is not None:
            return res
    seen = _Predictions(graph, costs)
    points = [_sweep_point(graph, cluster.subset(cluster.ids[:k]), costs, names, pins, seen)
              for k in swept_counts(top)]
    feasible = [p for p in points if p.fits]
    if not feasible:
        reasons = "; ".join(f"k={p.k}: " + ", ".join(f"{a}: {r}" for a, r in p.tried[:2])
                            for p in points)
        raise MemoryExceededError(f"wap: no device count has a plan that fits ({reasons})")
    chosen, why = _choose(feasible, objective, within)
    return WapResult(tuple(points), chosen.k, objective, within, why)


def _checked_names(algorithms: Sequence[str], objective: str, within: float) -> list[str]:
    """The partitioners a sweep runs ("data-parallel" first, always), every option checked:
    :class:`ExplorerError` saying what is wrong."""
    if objective not in OBJECTIVES:
        raise ExplorerError(f"unknown objective {objective!r}; choose one of "
                            f"{', '.join(OBJECTIVES)}")
    if not 0 <= within < 1:
        raise ExplorerError(f"within must be a fraction in [0, 1), not {within!r}")
    names = list(dict.fromkeys(["data-parallel", *algorithms]))
    for nm in names:
        if nm == "wap":
            raise ExplorerError("wap cannot sweep over itself; leave 'wap' out of algorithms")
        lookup_algorithm(nm)  # unknown names raise, listing the known ones
    return names


def _sweep_point(graph: OpGraph, sub: Cluster, costs: CostModel, names: Sequence[str],
                 pins: Mapping[str, str], seen: _Predictions) -> WapPoint:
    """The point of the sweep on the devices of ``sub``: the fastest plan of the
    partitioners ``names`` that fits the simulator's memory (the lower energy on ties), and
    what each tried."""
    k = len(sub)
    tried: list[tuple[str, str]] = []
    best: tuple[float, float, str, Plan] | None = None
    missing = sorted({d for d in pins.values() if d not in sub.ids})
    if missing:
        tried.append(("*", f"pinned device(s) {', '.join(missing)} not among the first {k}"))
    for nm in names if not missing else ():
        opts = ({"compare_baselines": False}
                if "compare_baselines" in lookup_algorithm(nm).options else {})
        try:
            plan = partition(graph, sub, costs, nm, pins=pins, **opts)
        except ExplorerError as exc:
            tried.append((nm, f"no plan: {exc}"))
            continue
        pred = seen.simulate(plan)
        if not pred.fits:
            tried.append((nm, f"does not fit: {pred.memory_report()}"))
            continue
        tried.append((nm, f"{pred.step_s:.6g} s per step"))
        if best is None or (pred.step_s, pred.energy_j) < (best[0], best[1]):
            best = (pred.step_s, pred.energy_j, nm, plan)
    if best is None:
        return WapPoint(k, "", None, math.inf, 0.0, math.inf, 0.0, 0, tuple(tried))
    step_s, energy_j, nm, plan = best
    return WapPoint.of(k, nm, plan, step_s, energy_j, max(graph.batch_size, 1), tuple(tried))


def swept_counts(top: int) -> list[int]:
    """The device counts a sweep up to ``top`` tries: every one up to
    :data:`~explorer.partition.bounds.FULL_SEARCH_DEVICES`; beyond, the powers of two and
    ``top`` itself (13 counts at 4,096 devices)."""
    if top <= FULL_SEARCH_DEVICES:
        return list(range(1, top + 1))
    return sorted({*powers_of_two(top), top})


def _coarse_sweep(graph: OpGraph, cluster: Cluster, costs: CostModel, names: list[str],
                  objective: str, within: float, pins: dict[str, str], top: int, n_ops: int
                  ) -> WapResult | None:
    """The sweep on a merged stand-in graph, the chosen plan made and simulated on the real
    one; None when the stand-in cannot serve (pins inside one run disagree, or the chosen
    plan does not fit on the real graph), and the caller sweeps the real graph."""
    co = coarsen(graph, costs)
    small_pins = co.pins(pins)
    if small_pins is None:
        return None
    try:
        res = wap_sweep(co.graph, cluster, costs=co.costs, algorithms=names,
                        objective=objective, within=within, pins=small_pins, max_k=top,
                        coarse_above=None)
    except MemoryExceededError:
        return None
    where = f"{sum(1 for n in co.graph.nodes if n.kind == 'op')} groups"
    chosen = res.chosen
    assert chosen.plan is not None
    plan = co.expand(chosen.plan, graph)
    pred = simulate(graph, plan, costs)
    if not pred.fits:
        return None
    points = [WapPoint.of(p.k, p.algorithm, plan, pred.step_s, pred.energy_j,
                          max(graph.batch_size, 1), p.tried) if p.k == chosen.k
              else replace(p, plan=None, fit=p.fits, simulated_on=where)
              for p in res.points]
    why = (f"{res.why} (swept on a stand-in of {graph.name or 'the graph'} merged into "
           f"{where}; on all {n_ops} ops the k={chosen.k} plan takes "
           f"{pred.step_s * 1e3:.3f} ms and {pred.energy_j:.3g} J per step)")
    return WapResult(tuple(points), chosen.k, objective, within, why)


class _Predictions:
    """Simulates plans, once per distinct plan: several partitioners often return the same
    placement (all of them on one device, or data-parallel), and at 100,000 nodes a simulation
    takes about a second."""

    def __init__(self, graph: OpGraph, costs: CostModel) -> None:
        self.graph, self.costs = graph, costs
        self.done: dict[tuple, list[tuple[Mapping[str, int], Any]]] = {}

    def simulate(self, plan: Plan) -> Any:
        key = (plan.stages, plan.micro_batches, plan.schedule, plan.optimizer)
        same = self.done.setdefault(key, [])
        for placement, pred in same:
            if placement == plan.placement:
                return pred
        pred = simulate(self.graph, plan, self.costs)
        same.append((plan.placement, pred))
        return pred


def _choose(feasible: list[WapPoint], objective: str, within: float) -> tuple[WapPoint, str]:
    fastest = max(feasible, key=lambda p: (p.throughput_per_s, -p.k))
    greenest = max(feasible, key=lambda p: (p.throughput_per_joule, -p.k))
    if objective == "throughput":
        bar = (1 - within) * fastest.throughput_per_s
        chosen = next(p for p in feasible if p.throughput_per_s >= bar)
        why = (f"k={chosen.k} is the fewest devices within {within:.0%} of the best throughput: "
               f"{chosen.throughput_per_s:,.1f} samples/s ({chosen.algorithm}, "
               f"{chosen.step_s * 1e3:.3f} ms per step) against {fastest.throughput_per_s:,.1f} "
               f"at k={fastest.k}")
    else:
        chosen = greenest
        why = (f"k={chosen.k} gives the most samples per joule: "
               f"{chosen.throughput_per_joule:.4g} ({chosen.algorithm}, "
               f"{chosen.step_s * 1e3:.3f} ms and {chosen.energy_j:.3g} J per step)")
        if fastest.k != chosen.k:
            why += (f"; k={fastest.k} would be {chosen.step_s / fastest.step_s:.2f}x faster "
                    f"but use {fastest.energy_j / chosen.energy_j:.2f}x the energy per step")
        else:
            why += "; it is also the fastest"
    top = max(p.k for p in feasible)
    if chosen.k < top:
        more = next(p for p in feasible if p.k == top)
        why += (f". With all {top} devices ({more.algorithm}): {more.throughput_per_s:,.1f} "
                f"samples/s, {more.throughput_per_joule:.4g} samples/J")
    return chosen, why


@register("wap", guarded=False)  # its objective is samples per joule
def wap(graph: OpGraph, cluster: Cluster, costs: CostModel,
        pins: Mapping[str, str] | None = None,
        algorithms: Sequence[str] = DEFAULT_ALGORITHMS,
        objective: str = "throughput_per_joule", within: float = 0.05,
        max_k: int | None = None, coarse_above: int | None = COARSE_ABOVE) -> Plan:
    """The device count this workload should use (WAP), and the best plan on that many.

    Runs :func:`wap_sweep` (seed: "Workload-aware Automatic Parallelization for Multi-GPU DNN
    Training") and returns the chosen ``k``'s plan, with the curve in ``plan.options["curve"]``
    and the reasoning in ``plan.notes``. Options as in :func:`wap_sweep`: ``algorithms``
    (default data-parallel, even-layers, pipeline-dp, min-comm), ``objective``
    (``"throughput_per_joule"`` or ``"throughput"``), ``within`` (0.05), ``max_k`` and
    ``coarse_above`` (20,000: larger graphs are swept on a merged stand-in).

    WAP optimises its objective over ``k``, so with the default (samples per joule) it may
    return a plan slower than data-parallel on all devices, on purpose; ``single`` and
    data-parallel are points of its curve, so it never does worse than them on its objective.
    """
    res = wap_sweep(graph, cluster, costs, algorithms, objective, within, pins, max_k,
                    coarse_above)
    pt = res.chosen
    assert pt.plan is not None
    lines = tuple(
        f"k={p.k}: " + (f"{p.algorithm}, {p.step_s * 1e3:.3f} ms/step, "
                        f"{p.throughput_per_s:,.1f} samples/s, {p.energy_j:.3g} J/step, "
                        f"{p.throughput_per_joule:.4g} samples/J" if p.fits
                        else "no plan fits")
        for p in res.points)
    options = {"objective": objective, "within": within, "algorithms": list(algorithms),
               "k": res.chosen_k, "chosen_algorithm": pt.algorithm,
               "inner_options": dict(pt.plan.options), "curve": res.curve()}
    return pt.plan.with_settings(algorithm="wap", options=options,
                                 notes=(res.why, *lines, *pt.plan.notes))


__all__ = ["DEFAULT_ALGORITHMS", "WapPoint", "WapResult", "swept_counts", "wap", "wap_sweep"]
