"""What ZeRO's collectives cost CPU ranks beyond the link's time: a host probe that runs the same
data-parallel plan with and without ZeRO 3 and compares each with its prediction.

Under ZeRO the runtime issues one collective per gather group (twice per micro-batch under
ZeRO 3), per gradient bucket and per bucket of updated shards, most of them started while the
rank computes and waited for later. On CPU ranks the communication runs on a thread that shares
the rank's core, and the rank that waits sleeps and is woken: processor time and delay per
collective that the link's latency and bandwidth (measured with both ranks blocking in the
collective) do not hold. The probe measures it once per host (or afresh, as the profile is): a
small MLP of four blocks, data-parallel over two CPU ranks, run plainly and under ZeRO 3 in
turn; how much further the ZeRO 3 run's step is from its prediction than the plain run's, per
ZeRO collective on a rank's path, is ``DeviceCosts.collective_s``, which the simulator charges
the rank's processor for each (:mod:`explorer.simulate.effects`).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch
from torch import nn

from explorer.capture.tracing import capture
from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.profiling import host, ops
from explorer.runtime import launch
from explorer.runtime.pool import RankPool
from explorer.simulate.simulator import simulate

#: the probe's entry in the host measurement cache
PROBE_KEY = "ZeRO collective cost on 2 CPU ranks"
#: how many times each of the two plans runs, in turn
ROUNDS = 3


def probe_graph() -> OpGraph:
    """Four linear blocks (a gather group each under ZeRO 3) and a classifier."""
    torch.manual_seed(0)
    width, hidden = 64, 256
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width)]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    x, y = torch.randn(32, width), torch.randint(0, 10, (32,))
    return capture(model, (x,), nn.functional.cross_entropy, (y,), name="collective-probe")


def collective_costs(cluster: Cluster, cache: bool = True, pool: RankPool | None = None,
                     report: ops.Report | None = None) -> float:
    """Seconds per ZeRO collective on this host's CPU ranks (0.0 with fewer than two measured
    CPU ranks, or when the probe fails): from the host measurement cache, or measured
    (``cache=False`` measures afresh and replaces the entry)."""
    got = host.measured_once(
        cluster, cache, PROBE_KEY, ("collective_s",),
        lambda: {"collective_s": measure_collective_s(pool=pool)},
        "measuring what ZeRO's collectives cost CPU ranks",
        f"4-block MLP data-parallel on 2 CPU ranks, plain and ZeRO 3 in turn x {ROUNDS}: "
        "ZeRO 3's step error beyond the plain one's, per collective on a rank's path", report)
    return got["collective_s"] if got else 0.0


def measure_collective_s(steps: int = 8, warmup: int = 3, pool: RankPool | None = None,
                         rounds: int = ROUNDS, repeats: int = ops.REPEATS) -> float:
    """Run the probe (under a minute): its profile (``repeats`` steps a run) on ``pool``'s
    ranks where given, its runs (``rounds`` of each plan) on ranks started for them, as
    ``ex.run`` makes the runs predictions are compared with."""
    graph = probe_graph()
    two = Cluster.cpu(2)
    dev = two.devices[0]
    dc = replace(ops.measured(graph, dev, repeats, progress=False, pool=pool, runtime="ops"),
                 collective_s=0.0)  # (its runs go one op at a time)
    costs = CostModel(graph.fingerprint, two, {dev.type_key: dc})
    plain = Plan.from_assignment(graph, [tuple(two.ids)], {n.name: 0 for n in graph.nodes},
                                 optimizer="adam")
    plans = (plain, plain.with_memory(zero=3))
    steps_s: list[list[float]] = [[], []]
    for _ in range(rounds):
        for k, plan in enumerate(plans):
            steps_s[k].append(launch.run(graph, plan=plan, costs=costs, steps=steps,
                                         warmup=warmup, progress=False, runtime="ops").step_s)
    return fit(graph, plans, costs, [statistics.median(s) for s in steps_s])


def fit(graph: OpGraph, plans: tuple[Plan, Plan], costs: CostModel,
        measured_s: list[float]) -> float:
    """Seconds per collective from the two plans' measured steps (``measured_s``: plain,
    ZeRO): the ZeRO plan's error beyond the plain plan's, over the number of collectives the
    simulator charges on its path (found by pricing each at 1 ms)."""
    pred = [simulate(graph, p, costs).step_s for p in plans]
    probe = {k: replace(v, collective_s=1e-3) for k, v in costs.per_type.items()}
    on_path = (simulate(graph, plans[1], replace(costs, per_type=probe)).step_s - pred[1]) / 1e-3
    if on_path < 0.5:
        return 0.0
    extra = (measured_s[1] - pred[1]) - (measured_s[0] - pred[0])
    return max(0.0, extra / on_path)
