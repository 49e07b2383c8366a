"""What a session opens on: the graph, cost model and plan made from what the user gives.

``Explorer(model, example_inputs)``, ``Explorer(graph, costs, plan)`` and
``Explorer.builtin(...)`` all come here (through :meth:`widgets.Session.open`):
:func:`opening` sorts the arguments out, captures the model (on fake tensors first, see
:mod:`widgets.measure`), takes roofline costs or profiles, and picks the plan to open with
(:func:`auto_plan`) when none is given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import explorer as ex
from explorer.core.errors import ExplorerError
from explorer.core.graph import OpGraph
from explorer.costs.kernels import Kernels, check_kernels_name
from explorer.devices.cluster import parse_devices
from explorer.models.builtin import BuiltinModel
from explorer.partition.quick import QUICK_BASELINES, fastest_quick_baseline
from widgets.edits import run_problem
from widgets.measure import Work, check_mode, first_graph, opening_costs


@dataclass(frozen=True)
class Opening:
    """What a session opens on, and what is left to do in the background."""

    graph: OpGraph
    costs: ex.CostModel
    plan: ex.Plan | None
    #: a line saying which plan was picked ("" when the user gave it)
    note: str = ""
    #: the capture with real weights and profile still to run (None: nothing left)
    work: Work | None = None
    #: how the model is built again (a built-in model's ``record``; None: not known)
    source: dict | None = None


def check_type(value: Any, kind: type, what: str, example: str) -> None:
    """Raise a clear error when an argument is not None and not of the expected type."""
    if value is not None and not isinstance(value, kind):
        raise ExplorerError(f"{what} must be a {kind.__name__} (e.g. {example}), not a "
                            f"{type(value).__name__}")


def auto_plan(graph: ex.OpGraph, cluster: ex.Cluster, costs: ex.CostModel
              ) -> tuple[ex.Plan | None, str]:
    """The fastest quick baseline that fits and can run
    (:func:`explorer.partition.quick.fastest_quick_baseline`), with a line saying which it
    is; (None, "") on one device (everything goes on it)."""
    if len(cluster.ids) < 2:
        return None, ""
    best = fastest_quick_baseline(graph, cluster, costs, lambda p: run_problem(graph, p))
    if best is None:
        return None, ""
    return best.plan, (f"opened with the {best.name} plan, the fastest of the quick baselines "
                       f"({', '.join(QUICK_BASELINES)}); solve for better ones under "
                       "partitioners")


def opening(model: Any, example_inputs: Any = None, cluster: Any = None, loss_fn: Any = None,
            targets: Any = None, costs: ex.CostModel | None = None,
            plan: ex.Plan | None = None, progress: bool = True,
            measure: str = "background", kernels: Kernels = "eager") -> Opening:
    """The graph, costs and plan for :meth:`widgets.Session.open` (its arguments, same
    meaning); raises :class:`ExplorerError` naming the argument that is wrong."""
    check_mode(measure)
    check_kernels_name(kernels)
    capture: Callable[[], OpGraph] | None = None
    source = model.record if isinstance(model, BuiltinModel) else None
    if isinstance(model, OpGraph):
        graph = model
        if isinstance(example_inputs, ex.CostModel) and costs is None:
            costs, example_inputs = example_inputs, None
        if isinstance(cluster, ex.Plan) and plan is None:  # open(graph, costs, plan)
            cluster, plan = None, cluster
        if example_inputs is not None:
            raise ExplorerError(f"a captured graph needs no example batch; the second "
                                f"argument is a {type(example_inputs).__name__}: give the "
                                "cost model, Explorer(graph, costs, plan)")
    else:
        if isinstance(model, BuiltinModel):
            args = (model.module, model.example_inputs, model.loss_fn, model.targets,
                    model.name)
        elif example_inputs is None:
            raise ExplorerError("give the model's example batch: Explorer(model, "
                                "example_inputs), or Explorer(graph, costs)")
        else:
            args = (model, example_inputs, loss_fn, targets, None)
        graph, fake = first_graph(*args, measure if costs is None else "now")
        if fake:
            capture = functools.partial(ex.capture, *args[:4], name=args[4])
    if kernels != "eager" and costs is not None:
        raise ExplorerError(f"kernels={kernels!r} prices the costs the explorer makes; the "
                            "costs given say how they were priced (ex.profile(graph, cluster, "
                            "kernels=...)): give one or the other")
    if isinstance(cluster, str) and costs is None:  # a device spec, as Explorer.builtin
        cluster = parse_devices(cluster, measure="later")  # (devices=...) takes it
    check_type(cluster, ex.Cluster, "cluster",
               '"cpu:2", "4xH100", ex.Cluster.cpu(2), ex.Cluster.preset(...)')
    check_type(costs, ex.CostModel, "costs", "ex.profile(graph, cluster)")
    check_type(plan, ex.Plan, "plan", "ex.partition(...) or ex.Plan.load(...)")
    work = None
    if costs is None:
        # (this machine's devices: CPU ranks measure the host in the background, not here)
        here = cluster or ex.Cluster.discover(measure="later")
        costs, work = opening_costs(graph, capture, here, measure, progress, kernels)
    note = ""
    if plan is None:
        plan, note = auto_plan(graph, costs.cluster, costs)
    return Opening(graph, costs, plan, note, work, source)
