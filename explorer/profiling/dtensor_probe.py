"""What a tensor-parallel stage costs CPU ranks beyond the plain ops the profile times: a host
probe that runs a tensor-parallel plan for real and compares each op with its profile.

The runtime runs a tensor-parallel stage's split ops on local shards, reading split weights
through DTensors (and the vocabulary-parallel embedding on them), waits in the layout's
collectives for the other ranks of its group, and steps an optimizer over DTensor parameters.
The profile times ops on plain tensors on one rank, so none of that is in it. The probe
measures it once per host (or afresh, as the profile is): a small MLP of three Megatron blocks
with layer norms between them, split two ways over two CPU ranks, run through the runtime; per
op that reads a split weight, the measured time less the simulator's time for it (without
these costs) is what the runtime added, and the medians per kind of op are the costs
:data:`KEYS` names (``DeviceCosts.dtensor``), which the simulator adds to tensor-parallel
stages (:mod:`explorer.simulate.tensor`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from explorer.capture.tracing import capture
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.tensor_layout import megatron_layout
from explorer.costs.model import DTENSOR_KEYS, CostModel, DeviceCosts
from explorer.devices.cluster import Cluster
from explorer.profiling import host, ops
from explorer.runtime import launch
from explorer.runtime.pool import RankPool
from explorer.simulate.simulator import simulate

#: the probe's entry in the host measurement cache
PROBE_KEY = ("split-weight op, collective, optimizer and step costs on 2 CPU ranks (local "
             "shards, one fixed cost per op and direction, 1 and 2 micro-batches)")
KEYS = DTENSOR_KEYS


def probe_graph() -> OpGraph:
    """Three column/row blocks with layer norms (whole ops reading weights) between them; the
    later blocks' inputs need gradients, so their backward all-reduces too."""
    torch.manual_seed(0)
    width, hidden = 64, 256
    layers: list[nn.Module] = []
    for act in (nn.ReLU(), nn.GELU(), nn.ReLU()):
        layers += [nn.Linear(width, hidden), act, nn.Linear(hidden, width), nn.LayerNorm(width)]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    x, y = torch.randn(16, width), torch.randint(0, 10, (16,))
    return capture(model, (x,), nn.functional.cross_entropy, (y,), name="dtensor-probe")


def dtensor_costs(cluster: Cluster, cache: bool = True, pool: RankPool | None = None,
                  report: ops.Report | None = None) -> dict[str, float]:
    """The DTensor costs of this host's CPU ranks ({} with fewer than two measured CPU ranks,
    or when the probe fails): from the host measurement cache, or measured (``cache=False``
    measures afresh and replaces the entry)."""
    return host.measured_once(
        cluster, cache, PROBE_KEY, KEYS, lambda: measure_dtensor_costs(pool=pool),
        "measuring what DTensor adds to ops on CPU ranks",
        "3-block MLP split 2 ways on 2 CPU ranks, per op: measured less simulated, medians "
        "per kind of op; collectives and steps to the steps' medians at 1 and 2 "
        "micro-batches", report) or {}


def measure_dtensor_costs(steps: int = 30, warmup: int = 3, pool: RankPool | None = None
                          ) -> dict[str, float]:
    """Run the probe (a few seconds): its profile on ``pool``'s ranks where given, its
    tensor-parallel run on ranks started for it, as ``ex.run`` makes the runs predictions are
    compared with."""
    graph = probe_graph()
    dc = ops.measured(graph, Cluster.cpu(2).devices[0], progress=False, pool=pool,
                      runtime="ops")  # (its runs go one op at a time)
    return split_run_costs(graph, dc, steps, warmup)


def model_dtensor_costs(graph: OpGraph, dc: DeviceCosts, report: ops.Report | None = None
                        ) -> dict[str, float]:
    """The costs of :data:`KEYS` fitted on ``graph`` itself (``dc``: its profile on one CPU
    rank): the whole graph as one stage split two ways over two CPU ranks, run for about
    :data:`MODEL_RUN_S` seconds of steps. {} where a two-way split splits nothing of it, or
    the run fails (the host probe's figures stand then).

    The host probe's small MLP tells what reading a split weight adds to an op, but the
    wait in a collective (on a shared host, mostly for the other rank to be scheduled) and
    what two ranks computing their shards at once do to each other follow the model's own
    ops and the host's moment; measured on the model, as its contention is, they do not have
    to carry over from another graph."""
    if not split_runs(graph):
        return {}
    one_rank_s = sum(dc.fwd_s) + sum(dc.bwd_s)
    steps = int(min(30, max(8, MODEL_RUN_S / max(one_rank_s, 1e-6))))
    bar = ops.RunsBar(split_runs(graph), f"timing {graph.name} split 2 ways on 2 CPU ranks "
                      f"({steps} steps a run)", False, report)
    try:
        return split_run_costs(graph, dc, steps, 3, ran=bar.update)
    except Exception:  # an optional refinement: the host probe's costs stand
        return {}
    finally:
        bar.close()


def split_runs(graph: OpGraph) -> int:
    """How many runs :func:`model_dtensor_costs` makes of ``graph`` (0: a two-way split
    splits nothing of it): :data:`SPLIT_ROUNDS` of one micro-batch, and as many of two
    where the batch splits in two."""
    if not megatron_layout(graph, 2).placements:
        return 0
    return SPLIT_ROUNDS * (2 if graph.batch_size % 2 == 0 else 1)


#: about how many seconds of steps :func:`model_dtensor_costs` runs (8 to 30 steps)
MODEL_RUN_S = 2.0


def split_run_costs(graph: OpGraph, dc: DeviceCosts, steps: int, warmup: int,
                    ran: Callable[[], None] | None = None) -> dict[str, float]:
    """``graph`` as one stage split two ways over two CPU ranks, run ``steps`` steps with one
    micro-batch and with two (where the batch splits; in turn, in :data:`SPLIT_ROUNDS` runs
    each) on ranks started for it, against the simulator on ``dc`` (its profile on one rank)
    without any of these costs: per kind of op the medians of the one-micro-batch runs
    (:func:`fit`), then what the predictions miss of the median steps, to the collectives
    and the step (:func:`to_step`). ``ran`` (where given) is called after each run."""
    two = Cluster.cpu(2)
    key = two.devices[0].type_key
    dc = replace(dc, type_key=key, dtensor={})
    costs = CostModel(graph.fingerprint, two, {key: dc})
    ops_ = {n.name: 0 for n in graph.nodes if n.kind == "op"}
    plan = Plan.from_assignment(graph, [tuple(two.ids)], ops_, optimizer="adam").with_tensor(2)
    plans = [plan] + ([plan.with_settings(micro_batches=2)] if graph.batch_size % 2 == 0
                      else [])
    # in turn, SPLIT_ROUNDS times: a host that speeds up or slows down over the seconds
    # this takes moves both plans' steps alike, not the difference the fit reads
    got: list[list] = [[] for _ in plans]
    for _ in range(SPLIT_ROUNDS):
        for p, ms in zip(plans, got, strict=True):
            ms.append(launch.run(graph, plan=p, costs=costs, warmup=warmup, progress=False,
                                 steps=max(5, steps // SPLIT_ROUNDS), runtime="ops"))
            if ran is not None:
                ran()
    first = got[0]
    task_s = {k: statistics.fmean(m.task_s.get(k, 0.0) for m in first)
              for k in first[0].task_s}
    value = fit(graph, plan, simulate(graph, plan, costs).timeline, task_s)
    with_value = CostModel(graph.fingerprint, two, {key: replace(dc, dtensor=value)})
    return to_step(graph, value, [(p, simulate(graph, p, with_value).step_s,
                                   statistics.fmean(m.step_s for m in ms))
                                  for p, ms in zip(plans, got, strict=True)])


#: how many times :func:`split_run_costs` runs each of its plans, in turn
SPLIT_ROUNDS = 2


def to_step(graph: OpGraph, value: dict[str, float],
            runs: list[tuple[Plan, float, float]]) -> dict[str, float]:
    """``value`` with what its predictions of the split runs miss of their measured steps
    (``runs``: plan, predicted seconds, measured seconds, a median of steps) fitted as a
    cost per collective and a cost per step: ``missed = step_s + collectives x extra``.

    A collective waits for the other ranks of its group, which on a shared host now and then
    wait to be scheduled: the per-op medians :func:`fit` takes miss that tail, and the step's
    median (what runs are compared by) does not. Runs with one and two micro-batches (twice
    the collectives, about the same work) tell the part that grows with the collectives from
    the part that does not; with one run, or where the fit would make the step's part
    negative, all of it goes to the collectives. The simulator charges the collective's once
    per op and direction, however many collectives the op runs, and the step's once per
    tensor-parallel stage."""
    points = [(sum(map(len, megatron_layout(graph, plan.tensor_of(0)).collective_ops()))
               * plan.micro_batches, measured_s - predicted_s)
              for plan, predicted_s, measured_s in runs]
    points = [(n, r) for n, r in points if n]
    if not points:
        return value
    step_s, extra = 0.0, sum(r for _, r in points) / sum(n for n, _ in points)
    if len({n for n, _ in points}) > 1:
        (n1, r1), (n2, r2) = points[0], points[-1]
        slope = (r2 - r1) / (n2 - n1)
        if r1 - slope * n1 >= 0.0:
            step_s, extra = r1 - slope * n1, slope
    return {**value, "collective_s": max(0.0, value["collective_s"] + extra),
            "step_s": max(0.0, value.get("step_s", 0.0) + step_s)}


def fit(graph: OpGraph, plan: Plan, timeline, task_s: dict[str, float]) -> dict[str, float]:
    """The costs from one run: per op, measured (``task_s``, keyed ``"fwd:i"``) less
    simulated (``timeline``'s compute intervals of the first device), medians per kind."""
    first = plan.stages[0][0]
    sim = {(iv.kind, iv.label): iv.end_s - iv.start_s for iv in timeline
           if iv.device == first and iv.lane == "compute"}
    lay = megatron_layout(graph, plan.tensor_of(0))
    extra: dict[str, list[float]] = {k: [] for k in ("fwd", "bwd", "fwd R", "bwd R", "wfwd",
                                                    "wbwd")}
    for i, n in enumerate(graph.nodes):
        reads = sum(p in lay.placements for p in n.inputs)  # split weights (DTensors) it reads
        for kind, reduced in (("fwd", lay.reduce_forward), ("bwd", lay.reduce_backward)):
            if n.kind != "op" or f"{kind}:{i}" not in task_s or not reads:
                continue
            e = task_s[f"{kind}:{i}"] - sim.get((kind, n.name), 0.0)
            if n.name in lay.split_ops:
                extra[kind + (" R" if n.name in reduced else "")].append(e)
            else:
                extra["w" + kind].append(e / reads)

    def med(xs: list[float], less: float = 0.0) -> float:
        return max(0.0, statistics.median(xs) - less) if xs else 0.0

    op_fwd, op_bwd = med(extra["fwd"]), med(extra["bwd"])
    tensors = sum(1 for n in graph.nodes if n.kind == "param")
    opt = task_s.get("optimizer:-1", 0.0) - sim.get(("optimizer", f"{plan.optimizer} step"), 0.0)
    return {"op_fwd_s": op_fwd, "op_bwd_s": op_bwd,
            "collective_s": med([e - op_fwd for e in extra["fwd R"]]
                                + [e - op_bwd for e in extra["bwd R"]]),
            "read_fwd_s": med(extra["wfwd"]), "read_bwd_s": med(extra["wbwd"]),
            "optimizer_tensor_s": max(0.0, opt / tensors), "step_s": 0.0}
