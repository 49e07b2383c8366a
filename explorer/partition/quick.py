"""The quick baselines: partitioners that take well under a second, and the fastest that fits.

A tool opening a model with no plan yet wants a sensible first placement at once, before
anyone waits for a search: :func:`fastest_quick_baseline` tries each of ``QUICK_BASELINES``,
simulates it, and keeps the fastest plan that fits in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.partition.registry import partition
from explorer.simulate.prediction import Prediction
from explorer.simulate.simulator import simulate

#: partitioners that take well under a second on graphs of thousands of ops
QUICK_BASELINES = ("single", "data-parallel", "even-layers", "balanced-params")


@dataclass(frozen=True)
class Baseline:
    """One quick baseline's plan and its prediction."""

    name: str
    plan: Plan
    prediction: Prediction


def quick_baselines(graph: OpGraph, cluster: Cluster, costs: CostModel,
                    names: tuple[str, ...] = QUICK_BASELINES) -> list[Baseline]:
    """Each baseline of ``names`` that can place this graph on this cluster, simulated (a
    baseline that refuses the graph, e.g. data-parallel over more devices than samples,
    is left out)."""
    out = []
    for name in names:
        try:
            plan = partition(graph, cluster, costs, name)
        except ExplorerError:
            continue
        out.append(Baseline(name, plan, simulate(graph, plan, costs)))
    return out


def fastest_quick_baseline(graph: OpGraph, cluster: Cluster, costs: CostModel,
                           problem: Callable[[Plan], str] | None = None
                           ) -> Baseline | None:
    """The fastest quick baseline that fits in memory (and, given ``problem``, a check that
    says why a plan cannot be used, "" when it can, one without a problem); when none fits,
    the fastest of the others. None when no baseline places the graph.

    >>> import explorer as ex
    >>> from explorer.models.synthetic import layered_dag, roofline_costs
    >>> g = layered_dag(60, seed=0)
    >>> cl = ex.Cluster.preset("2xH100")
    >>> best = fastest_quick_baseline(g, cl, roofline_costs(g, cl))
    >>> best.name in QUICK_BASELINES and best.prediction.fits
    True
    """
    scored = [(not b.prediction.fits, bool(problem(b.plan)) if problem else False,
               b.prediction.step_s, k, b)
              for k, b in enumerate(quick_baselines(graph, cluster, costs))]
    return min(scored)[-1] if scored else None


__all__ = ["QUICK_BASELINES", "Baseline", "fastest_quick_baseline", "quick_baselines"]
