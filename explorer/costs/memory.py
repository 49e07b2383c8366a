"""A quick additive memory estimate per node, for partitioners checking that a placement fits.

The simulator computes memory by liveness along the timeline; partitioners need something they
can add up while they move nodes. Each node is charged what it brings to the device it is on:
a parameter its weight, gradient and optimizer state; a buffer its bytes; an op the tensors
kept for its backward (its output when some backward saves it, plus extra saved tensors),
times the micro-batches in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

from explorer.core.graph import OpGraph
from explorer.core.plan import OPTIMIZER_STATE


def node_memory_bytes(graph: OpGraph, optimizer: str = "adam", in_flight: int = 1,
                      batch_fraction: float = 1.0) -> list[int]:
    """Bytes each node adds to its device (see the module docstring)."""
    state = OPTIMIZER_STATE[optimizer]
    saved: set[str] = {s for n in graph.nodes for s in n.saves}
    out = []
    for n in graph.nodes:
        if n.kind == "buffer":
            out.append(n.param_bytes)
        elif n.kind == "param" or n.param_bytes:
            out.append(n.param_bytes * (2 + state) if n.requires_grad or n.kind == "op"
                       else n.param_bytes)
        elif n.kind == "op":
            act = (0 if n.is_view or n.name not in saved else n.out_bytes) + n.saved_extra_bytes
            out.append(int(act * batch_fraction * in_flight))
        else:  # inputs: the batch itself
            out.append(int(n.out_bytes * batch_fraction * in_flight))
    return out


def stage_memory_bytes(graph: OpGraph, stage_of: Sequence[int], n_stages: int,
                       optimizer: str = "adam", in_flight: int = 1,
                       batch_fraction: float = 1.0) -> list[int]:
    """Sum of :func:`node_memory_bytes` per stage for a placement (stage index per node)."""
    per = node_memory_bytes(graph, optimizer, in_flight, batch_fraction)
    out = [0] * n_stages
    for i, b in enumerate(per):
        out[stage_of[i]] += b
    return out
