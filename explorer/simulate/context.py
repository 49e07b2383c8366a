"""Context parallelism in the simulator: ring attention over a stage's context ranks.

A stage with a context degree ``c`` splits every sample's sequence ``c`` ways on top of its
replicas (the plan counts ``devices / tensor`` replicas of the step's tokens, ``c`` of them
per sample, so every token-wise op already runs its share at the stage's batch fraction).
What the split adds is attention's: each rank's queries attend to every rank's keys and
values, so the keys and values go round the ring of context ranks (``c - 1`` steps of the
rank's own block, each beside the attention of the block before it), and in the backward
they go round again while their gradients come back (Liu et al., "Ring Attention with
Blockwise Transformers", 2023; Megatron-LM's context parallelism). With causal attention
the sequence is cut in ``2c`` chunks, each rank taking one from each end (load balance), so
each rank computes ``1 / c`` of every sample's attention: the op at the stage's fraction.

The keys and values are those before a grouped-query attention repeats them (the ring
carries the model's own heads); a tensor split that divides the heads divides them too. The
ring's buffers (two blocks in flight) are not counted in memory.
"""

from __future__ import annotations

import numpy as np

from explorer.core.errors import PlanError
from explorer.core.graph import OpGraph, OpNode
from explorer.core.plan import Plan
from explorer.costs.kernels import op_kind
from explorer.costs.model import CostModel
from explorer.simulate.tensor import layouts, pipelined_s

#: ops that repeat keys and values for grouped-query attention: the ring carries their input
_REPEATS = ("aten.repeat_interleave.self_int", "aten.repeat_interleave.self_Tensor")


def is_fused_attention(node: OpNode) -> bool:
    """Whether ``node`` is an attention the ring serves: one op reading queries, keys and
    values (``F.scaled_dot_product_attention``)."""
    return node.kind == "op" and op_kind(node.op) == "attention" and len(node.inputs) >= 3


def context_group(plan: Plan, stage: int) -> tuple[str, ...]:
    """The devices of ``stage``'s first ring of context ranks (``tensor`` apart)."""
    tensor, context = plan.tensor_of(stage), plan.context_of(stage)
    return plan.stages[stage][: tensor * context: tensor]


def keys_and_values(graph: OpGraph, i: int) -> list[int]:
    """The nodes whose outputs an attention op ``i``'s ring carries: its keys and values
    (its second and third inputs), before a grouped-query repeat."""
    out = []
    for name in graph.nodes[i].inputs[1:3]:
        j = graph.index[name]
        node = graph.nodes[j]
        out.append(graph.index[node.inputs[0]] if node.op in _REPEATS else j)
    return out


def ring_bytes(graph: OpGraph, i: int, precision: str) -> int:
    """The bytes of attention op ``i``'s keys and values at the whole batch, as the ring
    carries them: in 2 bytes under bf16/fp16, in which autocast runs the attention."""
    nbytes = 0
    for j in keys_and_values(graph, i):
        node = graph.nodes[j]
        half = precision != "fp32" and node.dtype == "float32"
        nbytes += node.out_bytes // 2 if half else node.out_bytes
    return nbytes


def add_ring_attention(graph: OpGraph, plan: Plan, costs: CostModel, ops_by_stage: list,
                       frac: list[float], fwd_s: np.ndarray, bwd_s: np.ndarray) -> int:
    """Add each context-parallel stage's ring to its attention ops (the transfers beside the
    attention, :func:`~explorer.simulate.tensor.pipelined_s` over the ``c`` ring steps):
    forward the keys and values once round the ring, backward once more with their
    gradients (each at its bytes under the stage's precision, a device's share of the heads
    under a tensor split); the bytes every device sends in a step."""
    moved = 0
    split = layouts(graph, plan)
    for s in range(len(plan.stages)):
        c = plan.context_of(s)
        if c == 1:
            continue
        group, layout = context_group(plan, s), split.get(s)
        precision = plan.settings_of(s).precision
        attention = [i for i in ops_by_stage[s].tolist() if is_fused_attention(graph.nodes[i])]
        if not attention:
            raise PlanError(f"stage {s} splits samples by context parallelism, which rings "
                            "the keys and values of fused attention, and it has none (no "
                            "F.scaled_dot_product_attention): set context=1 on it, or write "
                            "the model's attention with F.scaled_dot_product_attention")
        for i in attention:
            node = graph.nodes[i]
            share = layout.degree if layout is not None and node.name in layout.split_ops else 1
            block = int(ring_bytes(graph, i, precision) * frac[s] / share)
            ring_s = costs.allgather_s(group, block * c)  # (c - 1 steps of one block)
            fwd_s[i] = pipelined_s(fwd_s[i], ring_s, c)
            if node.requires_grad:
                bwd_s[i] = pipelined_s(bwd_s[i], 2 * ring_s, c)
            passes = 3 if node.requires_grad else 1
            moved += passes * (c - 1) * block * len(plan.stages[s]) * plan.micro_batches
    return moved
