"""Synthetic graphs and cost tables for tests and scale benchmarks (no model, no profiling).

``layered_dag`` makes random layered DAGs; ``replicated`` tiles a captured graph's repeating
block (e.g. a transformer layer) to any size; ``random_costs`` gives every op a cost from its
FLOPs and bytes on each device, as the roofline would, so partitioners can run at 100k nodes.
"""

from __future__ import annotations

import random

from explorer.core.graph import OpGraph, OpNode
from explorer.costs.kernels import Kernels
from explorer.costs.model import CostModel, roofline
from explorer.devices.cluster import Cluster


def layered_dag(n: int, width: int = 8, fan_in: int = 2, seed: int = 0,
                param_every: int = 4, batch_size: int = 8) -> OpGraph:
    """A random DAG of ``n`` ops in layers of about ``width``; each op reads 1..fan_in ops of
    the previous layers, and every ``param_every``-th op has a weight."""
    rng = random.Random(seed)
    nodes = [OpNode("input_0", "input", "input", shapes=((batch_size, 64),),
                    out_bytes=batch_size * 64 * 4)]
    prev = ["input_0"]
    layer: list[str] = []
    k = 0
    while k < n:
        nm = f"op{k}"
        inputs = rng.sample(prev, min(len(prev), rng.randint(1, fan_in)))
        flops = rng.randint(1, 100) * 1_000_000
        out = rng.randint(1, 64) * 4096
        if param_every and k % param_every == 0:
            pname = f"w{k}"
            pb = rng.randint(1, 64) * 16384
            nodes.append(OpNode(pname, "param", "param", f"block{k // 100}", "",
                                (), ((pb // 4,),), "float32", pb, pb, True))
            inputs = [*inputs, pname]
        nodes.append(OpNode(nm, "op", "synthetic", f"block{k // 100}.op{k}", "Synthetic",
                            tuple(inputs), ((out // 4,),), "float32", out, 0, True,
                            flops, 2 * flops, (inputs[0],) if inputs[0] != "input_0" else ()))
        layer.append(nm)
        k += 1
        if len(layer) >= width or k == n:
            prev = layer + prev[:width]  # skip connections to the layer before
            layer = []
    return OpGraph(f"layered-{n}", nodes, batch_size, "synthetic", nodes[-1].name)


def replicated(block: OpGraph, n_nodes: int) -> OpGraph:
    """Tile ``block``'s ops end to end until the graph has about ``n_nodes`` nodes.

    Each copy's first op reads the previous copy's last op, so the result is a deep chain of
    blocks with the block's inner structure (branches, residuals) kept.
    """
    base = [n for n in block.nodes]
    copies = max(1, n_nodes // max(len(base), 1))
    nodes: list[OpNode] = []
    last = None
    for c in range(copies):
        rename = {n.name: f"{n.name}@{c}" for n in base}
        entry_done = False
        for n in base:
            if n.kind == "input" and c > 0:
                rename[n.name] = last  # later copies read the previous copy's output
                continue
            inputs = tuple(dict.fromkeys(rename[p] for p in n.inputs))
            if n.kind == "op" and not entry_done and last is not None and last not in inputs:
                inputs = (*inputs, last)
                entry_done = True
            saves = tuple(rename[s] for s in n.saves if s in rename)
            nodes.append(OpNode(rename[n.name], n.kind, n.op, f"copy{c}.{n.module_path}"
                                .rstrip("."), n.module_type, inputs, n.shapes, n.dtype,
                                n.out_bytes, n.param_bytes, n.requires_grad, n.fwd_flops,
                                n.bwd_flops, saves, n.saved_extra_bytes, n.is_view,
                                n.backward_scratch_bytes, n.computed_fraction))
        last = next(m.name for m in reversed(nodes) if m.kind == "op")
    return OpGraph(f"{block.name}x{copies}", nodes, block.batch_size, "synthetic",
                   nodes[-1].name)


def roofline_costs(graph: OpGraph, cluster: Cluster, kernels: Kernels = "eager") -> CostModel:
    """A cost model from FLOPs and bytes alone (no profiling), for any cluster, its ops run
    as ``kernels`` says (:func:`explorer.costs.model.roofline`)."""
    per = {}
    for d in cluster.devices:
        if d.type_key not in per:
            per[d.type_key] = roofline(graph, d, kernels=kernels)
    return CostModel(graph.fingerprint, cluster, per)
