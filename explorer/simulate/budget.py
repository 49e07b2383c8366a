"""The memory a simulation would take, estimated and bounded before its task graph is built.

The simulator makes a task per op's forward and backward and per transfer across stages, for
every micro-batch: a plan of 100,000 nodes and 1,024 micro-batches asks for some 200 million
tasks, far more memory than a machine has. :func:`check_simulation_size` counts the tasks from
the graph's arrays (without building any) and refuses a plan over
``MAX_SIMULATION_BYTES``, saying what to lower.
"""

from __future__ import annotations

import numpy as np

from explorer.core.errors import PlanError
from explorer.core.graph import OpGraph
from explorer.core.limits import MAX_SIMULATION_BYTES, SIMULATION_BYTES_PER_TASK
from explorer.core.plan import Plan
from explorer.core.units import format_bytes
from explorer.simulate.arrays import GraphArrays


def simulation_tasks(graph: OpGraph, plan: Plan, cut_edges: bool = True) -> int:
    """The tasks a simulation of ``plan`` makes, to within the handful per stage and device
    (optimizer steps, all-reduces): per micro-batch, a forward and a backward per op and a
    send each way per edge between stages (``cut_edges=False``: per edge, an upper bound that
    needs no placement)."""
    A = GraphArrays.of(graph)
    per_mb = int(A.is_op.sum()) + int(A.has_b.sum())
    if cut_edges:
        st = np.fromiter(map(plan.placement.__getitem__, A.names), dtype=np.int64,
                         count=A.n)
        per_mb += 2 * int(np.count_nonzero(st[A.e_p] != st[A.e_c]))
    else:
        per_mb += 2 * len(A.e_p)
    return per_mb * plan.micro_batches + 4 * len(plan.devices)


def check_simulation_size(graph: OpGraph, plan: Plan) -> None:
    """Refuse, before any task is built, a plan whose simulation would take more than
    ``MAX_SIMULATION_BYTES`` of memory; the message says which of micro-batches, stages and
    nodes to lower."""
    if simulation_tasks(graph, plan, cut_edges=False) * SIMULATION_BYTES_PER_TASK \
            <= MAX_SIMULATION_BYTES:
        return  # (the common case: no placement lookup)
    tasks = simulation_tasks(graph, plan)
    need = tasks * SIMULATION_BYTES_PER_TASK
    if need <= MAX_SIMULATION_BYTES:
        return
    mb = plan.micro_batches
    per_mb = max((tasks - 4 * len(plan.devices)) // mb, 1)
    fewer = max(MAX_SIMULATION_BYTES // SIMULATION_BYTES_PER_TASK // per_mb, 0)
    lower = (f"use at most {fewer} micro-batches" if fewer >= 1 else
             "coarsen the graph or use fewer stages (each edge between stages adds a send "
             "each way)")
    raise PlanError(
        f"simulating this plan would take about {format_bytes(need)} of memory "
        f"({len(graph):,} nodes, {len(plan.stages):,} stages, {mb:,} micro-batches: "
        f"{tasks:,} tasks), more than the {format_bytes(MAX_SIMULATION_BYTES)} a simulation "
        f"may use; {lower}")


__all__ = ["check_simulation_size", "simulation_tasks"]
