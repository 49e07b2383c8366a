"""Brute force for tiny graphs: every placement of the ops on the devices, each simulated."""

from __future__ import annotations

import itertools
import random

from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan import Plan
from explorer.costs.model import CostModel
from explorer.devices.cluster import Cluster
from explorer.models.synthetic import roofline_costs
from explorer.simulate.simulator import Prediction, simulate


def brute_force(graph: OpGraph, cluster: Cluster, costs: CostModel,
                pins: dict[str, str] | None = None, **settings) -> tuple[Plan, Prediction]:
    """The fastest plan that fits, over every placement of every op on one device each.

    Parameters, buffers and inputs follow their first consumer. Each device is its own stage.
    Raises ValueError when nothing fits.
    """
    pins = pins or {}
    ops = [i for i, n in enumerate(graph.nodes) if n.kind == "op"]
    ids = cluster.ids
    stages = [(d,) for d in ids]
    best = None
    for combo in itertools.product(range(len(ids)), repeat=len(ops)):
        assign = dict(zip(ops, combo, strict=True))
        if any(ids[assign[graph.index[nm]]] != dev for nm, dev in pins.items()
               if graph.nodes[graph.index[nm]].kind == "op"):
            continue
        plan = Plan.from_assignment(graph, stages, assign, **settings)
        pred = simulate(graph, plan, costs)
        if pred.fits and (best is None or pred.step_s < best[1].step_s - 1e-12):
            best = (plan, pred)
    if best is None:
        raise ValueError("no placement fits")
    return best


def tiny_graph(seed: int, n_ops: int = 5, batch_size: int = 8) -> OpGraph:
    """A random DAG of ``n_ops`` ops with weights, skip edges and saved tensors."""
    rng = random.Random(seed)
    nodes = [OpNode("input_0", "input", "input", shapes=((batch_size, 16),),
                    out_bytes=batch_size * 64)]
    ops: list[str] = []
    for k in range(n_ops):
        srcs = rng.sample(ops, min(len(ops), rng.randint(1, 2))) if ops else ["input_0"]
        inputs = list(srcs)
        if rng.random() < 0.6:
            pb = rng.choice([256, 4096, 65536, 1 << 20])
            nodes.append(OpNode(f"w{k}", "param", "param", f"l{k}", "", (), ((pb // 4,),),
                                "float32", pb, pb, True))
            inputs.append(f"w{k}")
        flops = rng.choice([1, 10, 100, 1000]) * 10**6
        out = rng.choice([1, 16, 256]) * 4096
        nodes.append(OpNode(f"op{k}", "op", "synthetic", f"l{k}", "Synthetic", tuple(inputs),
                            ((out // 4,),), "float32", out, 0, True, flops, 2 * flops,
                            (srcs[0],) if srcs[0] != "input_0" else ()))
        ops.append(f"op{k}")
    return OpGraph(f"tiny{seed}", nodes, batch_size, "synthetic", ops[-1])


def tiny_case(seed: int, n_ops: int = 5, devices: str = "3xT4"):
    g = tiny_graph(seed, n_ops)
    cl = Cluster.preset(devices)
    return g, cl, roofline_costs(g, cl)
