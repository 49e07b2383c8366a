"""How the graph picture shows tensor-parallel splits: each node's part in its stage's layout.

A stage with a tensor-parallel degree above 1 splits some of its layers over its tensor
devices (:mod:`explorer.core.tensor_layout`). Here each op of such a stage gets its role in
words ("column-parallel", "row-parallel", "vocab-parallel", "split" for the element-wise ops
between a column and a row linear, "replicated" for what every tensor device runs whole), with
the devices it is split over and its weight's placement, for the hover text; and a short mark
for the node's label. Nothing is computed here that the layout does not say: the layout of a
degree is asked once per graph and degree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from explorer.core.graph import OpGraph
from explorer.core.plan import Plan
from explorer.core.tensor_layout import (
    CONV_OPS,
    EMBEDDING_OPS,
    LINEAR_OPS,
    TensorLayout,
    megatron_layout,
    shard_dim,
)

#: the mark a node's label gets for each role (a module shows "tp" and the degree)
MARKS = {"column-parallel": "col", "row-parallel": "row", "vocab-parallel": "vocab",
         "split": "split", "replicated": "rep"}
#: most split groups named in a hover text; a larger mesh says how many more
SHOWN_GROUPS = 2


@dataclass(frozen=True)
class Split:
    """What the tensor devices do with one node (or a group of nodes) of a split stage."""

    #: "column-parallel", "row-parallel", "vocab-parallel", "split", "replicated"; or, for
    #: a group of ops, "N column-parallel, M replicated ..." (empty: not in a split stage)
    role: str
    #: the short mark for the label ("col", "row", "tp2"; "" for none)
    mark: str
    #: the hover text ("column-parallel over H100:0+H100:1, weight Shard(0)")
    text: str


NO_SPLIT = Split("", "", "")


def degrees_text(plan: Plan) -> str:
    """A plan's parallel degrees as ``"dp 2 x tp 2 x pp 1"``: its most replicas (of whole
    samples), its highest tensor-parallel degree and its stage count, with ``"cp 2 x "``
    before the tensor degree where a stage splits samples by context parallelism."""
    stages = range(len(plan.stages))
    tp = max((plan.tensor_of(s) for s in stages), default=1)
    cp = max((plan.context_of(s) for s in stages), default=1)
    dp = max((plan.data_replicas_of(s) for s in stages), default=1)
    context = f"cp {cp} x " if cp > 1 else ""
    return f"dp {dp} x {context}tp {tp} x pp {len(plan.stages)}"


def tensor_groups(plan: Plan, stage: int) -> list[tuple[str, ...]]:
    """The groups of devices that split a layer of ``stage`` (one per replica: device ``k``
    is in replica ``k // tensor``)."""
    devs, t = plan.stages[stage], plan.tensor_of(stage)
    return [tuple(devs[k:k + t]) for k in range(0, len(devs), t)]


def over(plan: Plan, stage: int) -> str:
    """Where a stage's layers are split, in words: "H100:0+H100:1", or with replicas
    "H100:0+H100:1, H100:2+H100:3 (2 replicas)"."""
    groups = tensor_groups(plan, stage)
    text = ", ".join("+".join(g) for g in groups[:SHOWN_GROUPS])
    if len(groups) > SHOWN_GROUPS:
        text += f" and {len(groups) - SHOWN_GROUPS} more"
    return text + (f" ({len(groups)} replicas)" if len(groups) > 1 else "")


class SplitView:
    """The split of every op of a graph under a plan, with the layouts asked once per
    degree (the graph's structure does not change while it is shown)."""

    def __init__(self, graph: OpGraph) -> None:
        self.graph = graph
        self._layouts: dict[int, TensorLayout] = {}

    def layout(self, degree: int) -> TensorLayout:
        if degree not in self._layouts:
            self._layouts[degree] = megatron_layout(self.graph, degree)
        return self._layouts[degree]

    def role(self, plan: Plan, op: int) -> tuple[str, str]:
        """(role, weight placement) of op ``op`` under ``plan`` ("" and "" outside a split
        stage; the placement is "" for an op without a split weight)."""
        node = self.graph.nodes[op]
        stage = plan.stage_of(node.name)
        degree = plan.tensor_of(stage)
        if degree <= 1:
            return "", ""
        layout = self.layout(degree)
        if node.name not in layout.split_ops:
            return "replicated", ""
        weights = [p for p in node.inputs if layout.is_sharded(p)]
        placement = layout.placement(weights[0]) if weights else ""
        dim = shard_dim(placement) if placement else None
        if node.op in EMBEDDING_OPS and dim == 0:
            return "vocab-parallel", placement
        paired = node.op in LINEAR_OPS or node.op in CONV_OPS
        if paired and dim == 0:
            return "column-parallel", placement
        if paired and dim == 1:
            return "row-parallel", placement
        return "split", placement

    def of(self, plan: Plan, ops: Sequence[int]) -> Split:
        """The split of one op, or the summary of a group of ops (a module or block)."""
        if not ops or not plan.uses_tensor_parallel:
            return NO_SPLIT
        stages = {plan.stage_of(self.graph.nodes[i].name) for i in ops}
        roles = [self.role(plan, i) for i in ops]
        if all(not r for r, _ in roles):
            return NO_SPLIT
        if len(ops) == 1:
            role, placement = roles[0]
            where = over(plan, next(iter(stages)))
            if role == "replicated":
                return Split(role, MARKS[role], f"replicated: each of {where} runs it whole")
            return Split(role, MARKS[role], f"{role} over {where}"
                         + (f", weight {placement}" if placement else ""))
        counts = Counter(r for r, _ in roles if r)
        role = ", ".join(f"{n} {r}" for r, n in sorted(counts.items()))
        split = any(r not in ("", "replicated") for r, _ in roles)
        degree = max(plan.tensor_of(s) for s in stages)
        where = "; ".join(over(plan, s) for s in sorted(stages) if plan.tensor_of(s) > 1)
        if not split:
            return Split(role, MARKS["replicated"],
                         f"{role}: each of {where} runs them whole")
        return Split(role, f"tp{degree}", f"{role} over {where}")
